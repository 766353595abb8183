"""Preemption economics: how often to checkpoint on spot capacity, and what preemptions cost.

The model: preemptions arrive at random (a Poisson process with mean time between them M, the
MTBF), the job needs T seconds of work, and a preemption throws away everything since the last
durable checkpoint and costs a restart R.

* Interval: Young/Daly τ = sqrt(2 · C · M), where C is the training stall per checkpoint
  (Young 1974; Daly 2006 first order), at least the persist time P (one checkpoint in flight at
  a time) and at most the run.
* Expected completion time, one formula for both cases. Work is done in segments of s = τ + C
  seconds (work plus stall); a segment is repeated until it runs s seconds without a preemption.
  The number of preemptions per segment is geometric with mean e^{s/M} − 1, each costing the
  time run so far (its mean is M − s / (e^{s/M} − 1)), plus R, plus P (the last checkpoint is
  durable only P after it was taken), so a segment takes (M + R + P) · (e^{s/M} − 1) in
  expectation and the run T/τ of them.
  - without checkpoints the run is one segment, s = T, C = P = 0: (M + R) · (e^{T/M} − 1), which
    is (e^{T/M} − 1) · M for R = 0. A run whose expected time exceeds 100 × T (or overflows)
    "does not finish in expectation": it is reported as such, not as a number.
  - with checkpoints, for τ ≪ M this is T · (1 + C/τ + (τ/2 + P + R)/M) to first order, the
    classic waste fraction.
* Expected time = failure-free time + expected preemptions × loss per preemption, exactly; the
  table prints these parts, and its headline is made from the same fields.
* Realised loss of a run: hours lost × GPUs × price. The motivating scenario, 64 H100 preempted
  after 47 h of an un-checkpointed run at ~$3/GPU-h, is 47 · 64 · 3 = $9,024.

The defaults below are the planner's stated guesses where nothing was measured; they live here
only (``gpumem calibrate`` measures C, P and the restore part of R).

Example:
    >>> e = economics(n_gpus=64, price_per_gpu_hour=3.0, mtbf_hours=6, run_hours=168,
    ...               stall_s=1, persist_s=60, restart_s=300)
    >>> e.finishes_without, round(e.expected_hours_with, 1)
    (False, 172.5)
    >>> realised_loss(n_gpus=64, hours_lost=47, price_per_gpu_hour=3.0)
    9024.0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# what the planner assumes where nothing was measured or given (seconds)
DEFAULT_STALL_S = 1.0
DEFAULT_PERSIST_S = 60.0
DEFAULT_RESTART_S = 300.0
# the part of a restart a calibration cannot measure: requeue, container start, imports, model
# build, process-group set-up (R = measured restore + this)
DEFAULT_STARTUP_S = 300.0
DEFAULT_RUN_HOURS = 24.0
DEFAULT_PRICE_PER_GPU_HOUR = 3.0
# beyond this multiple of the run, an expected time is no plan: "does not finish in expectation"
NO_FINISH_FACTOR = 100.0


@dataclass(frozen=True)
class Economics:
    """Checkpoint interval, expected completion time and cost, with and without checkpoints.

    Times in seconds or hours as named, money in dollars. ``*_without`` fields are None when the
    run does not finish in expectation without checkpoints (``finishes_without`` False).
    """

    mtbf_s: float
    stall_s: float
    persist_s: float
    restart_s: float
    interval_s: float
    young_daly_s: float
    run_hours: float
    n_gpus: int
    price_per_gpu_hour: float
    expected_hours_with: float
    expected_preemptions_with: float
    loss_per_preemption_with_s: float
    finishes_without: bool
    expected_hours_without: float | None
    expected_preemptions_without: float | None
    loss_per_preemption_without_s: float

    @property
    def dollars_per_hour(self) -> float:
        return self.n_gpus * self.price_per_gpu_hour

    @property
    def failure_free_hours_with(self) -> float:
        """The run plus its checkpoint stalls, had nothing been preempted."""
        return self.run_hours * (1 + self.stall_s / self.interval_s)

    @property
    def waste_fraction(self) -> float:
        """Expected time beyond the run, with checkpoints, as a share of the run."""
        return self.expected_hours_with / self.run_hours - 1

    @property
    def cost_failure_free(self) -> float:
        return self.run_hours * self.dollars_per_hour

    @property
    def expected_cost_with(self) -> float:
        return self.expected_hours_with * self.dollars_per_hour

    @property
    def expected_cost_without(self) -> float | None:
        h = self.expected_hours_without
        return None if h is None else h * self.dollars_per_hour

    @property
    def expected_saving(self) -> float | None:
        """What checkpoints save in expectation (None: without them the run does not finish)."""
        c = self.expected_cost_without
        return None if c is None else c - self.expected_cost_with

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in (
            "waste_fraction",
            "failure_free_hours_with",
            "cost_failure_free",
            "expected_cost_with",
            "expected_cost_without",
            "expected_saving",
        ):
            d[name] = getattr(self, name)
        return d

    def headline(self) -> str:
        """One sentence: the interval and what checkpoints buy, from the table's own numbers."""
        with_ = (
            f"checkpointing every {_minutes(self.interval_s)}, the {self.run_hours:g} h run is "
            f"expected to take {self.expected_hours_with:,.1f} h and cost "
            f"${self.expected_cost_with:,.0f} ({self.waste_fraction:.2%} over the "
            f"failure-free ${self.cost_failure_free:,.0f})"
        )
        if not self.finishes_without:
            return f"{with_}; without checkpoints it does not finish in expectation"
        return (
            f"{with_}; without checkpoints {self.expected_hours_without:,.1f} h and "
            f"${self.expected_cost_without:,.0f}: checkpoints save ${self.expected_saving:,.0f}"
        )

    def table(self) -> str:
        rate = f"${self.price_per_gpu_hour:g}/GPU-h"
        lines = [
            f"preemption economics: {self.run_hours:g} h of training on {self.n_gpus} GPUs at "
            f"{rate}, preempted at random with MTBF {self.mtbf_s / 3600:.3g} h",
            f"  checkpoint every {_minutes(self.interval_s)} (Young/Daly sqrt(2*C*MTBF) = "
            f"{_minutes(self.young_daly_s)}, at least the persist time; stall C "
            f"{_minutes(self.stall_s)}, persist P {_minutes(self.persist_s)}, restart R "
            f"{_minutes(self.restart_s)})",
            f"  {'':<21}{'failure-free':>14}{'preemptions':>13}{'lost each':>12}"
            f"{'expected time':>15}{'expected cost':>15}",
            self._row(
                "with checkpoints",
                self.failure_free_hours_with,
                self.expected_preemptions_with,
                self.loss_per_preemption_with_s,
                self.expected_hours_with,
            ),
        ]
        if self.finishes_without:
            assert self.expected_hours_without is not None
            assert self.expected_preemptions_without is not None
            lines.append(
                self._row(
                    "without checkpoints",
                    self.run_hours,
                    self.expected_preemptions_without,
                    self.loss_per_preemption_without_s,
                    self.expected_hours_without,
                )
            )
        else:
            lines.append(
                f"  {'without checkpoints':<21}{self.run_hours:>12,.1f} h"
                f"  does not finish in expectation (more than {NO_FINISH_FACTOR:g}x the run: "
                f"e^(T/MTBF) = e^{self.run_hours * 3600 / self.mtbf_s:.3g})"
            )
        lines.append(f"  {self.headline()}")
        return "\n".join(lines)

    def _row(self, name: str, free_h: float, n: float, loss_s: float, hours: float) -> str:
        loss = f"{_minutes(loss_s)}"
        return (
            f"  {name:<21}{free_h:>12,.1f} h{n:>13,.2f}{loss:>12}"
            f"{hours:>13,.1f} h{'$' + format(hours * self.dollars_per_hour, ',.0f'):>15}"
        )


def _minutes(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def young_daly(stall_s: float, mtbf_s: float) -> float:
    """Optimal checkpoint interval sqrt(2 · C · MTBF), in seconds."""
    if not (stall_s >= 0 and mtbf_s > 0) or math.isinf(stall_s) or math.isinf(mtbf_s):
        raise ValueError(f"need stall_s >= 0 and mtbf > 0, got stall_s={stall_s}, mtbf_s={mtbf_s}")
    return math.sqrt(2.0 * stall_s * mtbf_s)


def expected_time_s(
    work_s: float,
    *,
    mtbf_s: float,
    segment_s: float,
    stall_s: float = 0.0,
    lost_s: float = 0.0,
    restart_s: float = 0.0,
) -> float:
    """Expected wall time to do ``work_s`` in segments of ``segment_s`` work, each followed by a
    ``stall_s`` checkpoint that becomes durable ``lost_s`` later, under preemptions at random
    with mean ``mtbf_s`` and a ``restart_s`` restart after each (module doc). ``inf`` where the
    exponential overflows."""
    seg = min(segment_s, work_s)
    try:
        per_segment = (mtbf_s + restart_s + lost_s) * math.expm1((seg + stall_s) / mtbf_s)
    except OverflowError:
        return math.inf
    return work_s / seg * per_segment


def _loss_per_preemption_s(segment_s: float, mtbf_s: float, extra_s: float) -> float:
    """Mean time run before a preemption that lands inside a segment, plus ``extra_s``."""
    x = segment_s / mtbf_s
    if x > 700:  # e^x overflows; the preemption comes after M on average
        return mtbf_s + extra_s
    return mtbf_s - segment_s / math.expm1(x) + extra_s


def economics(
    *,
    n_gpus: int,
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
    mtbf_hours: float | None = None,
    preemption_rate: float | None = None,
    stall_s: float = DEFAULT_STALL_S,
    persist_s: float = DEFAULT_PERSIST_S,
    restart_s: float = DEFAULT_RESTART_S,
    run_hours: float = DEFAULT_RUN_HOURS,
) -> Economics:
    """Checkpoint interval, expected completion time and cost of a job on preemptible capacity.

    Args:
        mtbf_hours: mean time between preemptions of the job; or
        preemption_rate: preemptions per hour (= 1 / MTBF).
        stall_s: training stall per checkpoint (the Young/Daly cost C).
        persist_s: time from the start of a checkpoint until it is durable, P (at least C).
        restart_s: time to restart and reload after a preemption, R.
        run_hours: failure-free length of the run.

    Raises:
        ValueError: missing or non-positive rates, negative or non-finite times, P < C.
    """
    if (mtbf_hours is None) == (preemption_rate is None):
        raise ValueError("give exactly one of mtbf_hours or preemption_rate (per hour)")
    if preemption_rate is not None:
        _positive("preemption_rate", preemption_rate)
        mtbf_hours = 1.0 / preemption_rate
    assert mtbf_hours is not None
    for name, v in (
        ("mtbf_hours", mtbf_hours),
        ("run_hours", run_hours),
        ("price_per_gpu_hour", price_per_gpu_hour),
        ("n_gpus", n_gpus),
    ):
        _positive(name, v)
    for name, v in (("stall_s", stall_s), ("persist_s", persist_s), ("restart_s", restart_s)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v}")
    if persist_s < stall_s:
        raise ValueError(
            f"persist_s {persist_s:g} is shorter than stall_s {stall_s:g}: a checkpoint is durable "
            "only after it was taken, so the persist time is at least the stall"
        )
    mtbf, run_s = mtbf_hours * 3600.0, run_hours * 3600.0
    yd = young_daly(stall_s, mtbf)
    tau = min(max(yd, persist_s, 1e-6), run_s)
    with_s = expected_time_s(
        run_s, mtbf_s=mtbf, segment_s=tau, stall_s=stall_s, lost_s=persist_s, restart_s=restart_s
    )
    without_s = expected_time_s(run_s, mtbf_s=mtbf, segment_s=run_s, restart_s=restart_s)
    finishes = without_s <= NO_FINISH_FACTOR * run_s
    seg = tau + stall_s
    return Economics(
        mtbf_s=mtbf,
        stall_s=stall_s,
        persist_s=persist_s,
        restart_s=restart_s,
        interval_s=tau,
        young_daly_s=yd,
        run_hours=run_hours,
        n_gpus=n_gpus,
        price_per_gpu_hour=price_per_gpu_hour,
        expected_hours_with=with_s / 3600.0,
        expected_preemptions_with=run_s / tau * math.expm1(seg / mtbf),
        loss_per_preemption_with_s=_loss_per_preemption_s(seg, mtbf, persist_s + restart_s),
        finishes_without=finishes,
        expected_hours_without=without_s / 3600.0 if finishes else None,
        expected_preemptions_without=math.expm1(run_s / mtbf) if finishes else None,
        loss_per_preemption_without_s=_loss_per_preemption_s(run_s, mtbf, restart_s),
    )


def _positive(name: str, v: float) -> None:
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive finite number, got {v}")


def realised_loss(*, n_gpus: int, hours_lost: float, price_per_gpu_hour: float) -> float:
    """Dollars lost when ``hours_lost`` of work on ``n_gpus`` must be redone."""
    if n_gpus <= 0 or hours_lost < 0 or price_per_gpu_hour < 0:
        raise ValueError("n_gpus must be positive, hours_lost and price non-negative")
    return n_gpus * hours_lost * price_per_gpu_hour


@dataclass(frozen=True)
class RealisedLoss:
    """One preemption at hour ``hours`` of a run: what it costs without and with checkpoints."""

    hours: float
    n_gpus: int
    price_per_gpu_hour: float
    interval_s: float
    without_checkpoint: float
    with_checkpoint_at_most: float

    def to_dict(self) -> dict[str, float]:
        return {
            "hours": self.hours,
            "without_checkpoint": self.without_checkpoint,
            "with_checkpoint_at_most": self.with_checkpoint_at_most,
            "interval_s": self.interval_s,
        }

    def line(self) -> str:
        return (
            f"one preemption at hour {self.hours:g} on {self.n_gpus} GPUs at "
            f"${self.price_per_gpu_hour:g}/GPU-h: ${self.without_checkpoint:,.0f} lost without a "
            f"checkpoint ({self.hours:g} h of work), at most ${self.with_checkpoint_at_most:,.0f} "
            f"with one every {self.interval_s / 60:.1f} min"
        )


def realised(
    *,
    hours: float,
    n_gpus: int,
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
    stall_s: float = DEFAULT_STALL_S,
    persist_s: float = DEFAULT_PERSIST_S,
    restart_s: float = DEFAULT_RESTART_S,
    mtbf_hours: float | None = None,
) -> RealisedLoss:
    """What one preemption at hour ``hours`` costs: all of it without a checkpoint; with
    checkpoints at most one interval of work plus the persist and restart times (the interval
    is Young/Daly's when an MTBF is given, else the persist time, the shortest possible)."""
    if mtbf_hours is not None:
        interval_s = max(young_daly(stall_s, 3600.0 * mtbf_hours), persist_s)
    else:
        interval_s = persist_s
    at_most_h = min(hours, (interval_s + persist_s + restart_s) / 3600.0)
    return RealisedLoss(
        hours=hours,
        n_gpus=n_gpus,
        price_per_gpu_hour=price_per_gpu_hour,
        interval_s=interval_s,
        without_checkpoint=realised_loss(
            n_gpus=n_gpus, hours_lost=hours, price_per_gpu_hour=price_per_gpu_hour
        ),
        with_checkpoint_at_most=realised_loss(
            n_gpus=n_gpus, hours_lost=at_most_h, price_per_gpu_hour=price_per_gpu_hour
        ),
    )
