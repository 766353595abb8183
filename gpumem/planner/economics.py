"""Preemption economics: how often to checkpoint on spot capacity, and what preemptions cost.

* Young/Daly interval: τ = sqrt(2 · C · MTBF) where C is the training stall per checkpoint
  (Young 1974; Daly 2006 first order). The persist time P (writing the snapshot out in the
  background) bounds how soon the next checkpoint can start: τ ≥ P.
* Expected waste fraction ≈ C/τ + (τ/2 + R)/MTBF: stalls, plus on each failure half an interval
  of lost work and the restart time R.
* Loss per preemption: with no checkpoint, the whole elapsed run (expected: half of it); with
  interval τ, the work since the last durable checkpoint (τ/2 + P on average, the snapshot being
  durable only after it persisted) plus the restart.
* Realised loss of a run: hours lost × GPUs × price. The motivating scenario — 64 H100 preempted
  after 47 h of an un-checkpointed run at ~$3/GPU-h — is 47 · 64 · 3 = $9,024.

Example:
    >>> e = economics(n_gpus=64, price_per_gpu_hour=3.0, mtbf_hours=24, stall_s=2, persist_s=60)
    >>> e.interval_s, e.waste_fraction
    >>> realised_loss(n_gpus=64, hours_lost=47, price_per_gpu_hour=3.0)
    9024.0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Economics:
    """Checkpoint interval and expected costs, seconds and dollars."""

    mtbf_s: float
    stall_s: float
    persist_s: float
    restart_s: float
    interval_s: float
    young_daly_s: float
    waste_fraction: float
    loss_per_preemption_no_ckpt: float
    loss_per_preemption_with_ckpt: float
    expected_cost_no_ckpt: float
    expected_cost_with_ckpt: float
    run_hours: float
    n_gpus: int
    price_per_gpu_hour: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def table(self) -> str:
        gph = self.n_gpus * self.price_per_gpu_hour
        lines = [
            (
                f"checkpoint every {self.interval_s / 60:.1f} min (Young/Daly "
                f"sqrt(2*C*MTBF) = {self.young_daly_s / 60:.1f} min; "
                f"C = {self.stall_s:g} s stall, persist {self.persist_s:g} s, "
                f"MTBF {self.mtbf_s / 3600:.1f} h)"
            ),
            (
                f"expected time wasted: {self.waste_fraction:.2%} "
                f"(= ${self.waste_fraction * self.run_hours * gph:,.0f} "
                f"over a {self.run_hours:g} h run on {self.n_gpus} GPUs "
                f"at ${self.price_per_gpu_hour:g}/GPU-h)"
            ),
            (
                f"loss per preemption: ${self.loss_per_preemption_no_ckpt:,.0f} "
                "without checkpoints (half the run on average) "
                f"vs ${self.loss_per_preemption_with_ckpt:,.0f} with them"
            ),
            (
                f"expected preemption cost of the run: ${self.expected_cost_no_ckpt:,.0f} "
                f"without vs ${self.expected_cost_with_ckpt:,.0f} with (stalls included)"
            ),
        ]
        return "\n".join(lines)


def young_daly(stall_s: float, mtbf_s: float) -> float:
    """Optimal checkpoint interval sqrt(2 · C · MTBF), in seconds."""
    if stall_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need stall_s >= 0 and mtbf > 0, got stall_s={stall_s}, mtbf_s={mtbf_s}")
    return math.sqrt(2.0 * stall_s * mtbf_s)


def economics(
    *,
    n_gpus: int,
    price_per_gpu_hour: float,
    mtbf_hours: float | None = None,
    preemption_rate: float | None = None,
    stall_s: float = 1.0,
    persist_s: float = 60.0,
    restart_s: float = 300.0,
    run_hours: float = 24.0,
) -> Economics:
    """Checkpoint interval and costs for a job on preemptible capacity.

    Args:
        mtbf_hours: mean time between preemptions of the job; or
        preemption_rate: preemptions per hour (= 1 / MTBF).
        stall_s: training stall per checkpoint (the Young/Daly cost C).
        persist_s: time to make a snapshot durable in the background (bounds the interval).
        restart_s: time to restart and reload after a preemption.

    Raises:
        ValueError: missing or non-positive rates, negative times.
    """
    if (mtbf_hours is None) == (preemption_rate is None):
        raise ValueError("give exactly one of mtbf_hours or preemption_rate (per hour)")
    if preemption_rate is not None:
        if preemption_rate <= 0:
            raise ValueError(f"preemption_rate must be > 0 per hour, got {preemption_rate}")
        mtbf_hours = 1.0 / preemption_rate
    assert mtbf_hours is not None
    for name, v in (
        ("mtbf_hours", mtbf_hours),
        ("run_hours", run_hours),
        ("price_per_gpu_hour", price_per_gpu_hour),
        ("n_gpus", n_gpus),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    for name, v in (("stall_s", stall_s), ("persist_s", persist_s), ("restart_s", restart_s)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0 seconds, got {v}")
    mtbf = mtbf_hours * 3600.0
    yd = young_daly(stall_s, mtbf)
    tau = max(yd, persist_s, 1e-9)
    waste = min(1.0, stall_s / tau + (tau / 2 + persist_s + restart_s) / mtbf)
    rate = n_gpus * price_per_gpu_hour / 3600.0  # dollars per second of the whole job
    run_s = run_hours * 3600.0
    loss_no = (run_s / 2 + restart_s) * rate
    loss_with = (tau / 2 + persist_s + restart_s) * rate
    n_preempt = run_s / mtbf
    # without checkpoints every preemption throws away the progress so far: expected half a
    # run each time, capped by the run itself; with them, the waste fraction of the run
    cost_no = (
        min(n_preempt, 1.0) * loss_no + max(0.0, n_preempt - 1.0) * min(mtbf / 2, run_s / 2) * rate
    )
    cost_with = waste * run_s * rate
    return Economics(
        mtbf,
        stall_s,
        persist_s,
        restart_s,
        tau,
        yd,
        waste,
        loss_no,
        loss_with,
        cost_no,
        cost_with,
        run_hours,
        n_gpus,
        price_per_gpu_hour,
    )


def realised_loss(*, n_gpus: int, hours_lost: float, price_per_gpu_hour: float) -> float:
    """Dollars lost when ``hours_lost`` of work on ``n_gpus`` must be redone."""
    if n_gpus <= 0 or hours_lost < 0 or price_per_gpu_hour < 0:
        raise ValueError("n_gpus must be positive, hours_lost and price non-negative")
    return n_gpus * hours_lost * price_per_gpu_hour
