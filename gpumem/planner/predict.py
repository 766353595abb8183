"""Expected wall time, cost and deadline risk of a job on capacity under a policy.

Two answers to one question, kept apart on purpose:

* :func:`replay_windows` is the reference: the job replayed from every tick of a real trace (the
  trace read as a cycle, so every start has a whole future), the mean over those windows.
* :func:`predict` is the model the planner prints: the capacity's :class:`Availability` (its
  run-length distributions, or exponential runs from rates) sampled into ``lanes`` independent
  paths, each started at a random moment, and the same job and policy run over them. It needs no
  trace (rates suffice), sees only the run lengths (not their order), and is what
  ``gpumem plan`` prints in well under a second. ``benchmarks/bench_capacity.py`` measures how
  far it is from the replay on every shared trace.

Example:
    >>> from gpumem.planner.capacity import Capacity
    >>> from gpumem.planner.capacity_replay import CapacityJob
    >>> spot = Capacity.from_rates("spot", 1.0, preemptions_per_day=2, mean_outage_h=1)
    >>> od = Capacity.on_demand(3.0)
    >>> p = predict(CapacityJob(24, deadline_h=36), spot, od, "gpumem")
    >>> p.expected_hours < 36
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpumem.planner.capacity import Capacity
from gpumem.planner.capacity_replay import (
    HORIZON_FACTOR,
    MAX_HORIZON_TICKS,
    CapacityJob,
    Outcome,
    Policy,
    Run,
    Sources,
    replay,
)
from gpumem.planner.policies import POLICIES

DEFAULT_LANES = 512
DEFAULT_SEED = 0
PREDICTION_TICKS_PER_WORK = 300  # a rates-only capacity's tick: the work in about this many


@dataclass(frozen=True)
class Prediction:
    """Expected outcome of one (capacity pair, policy) for a job.

    Attributes:
        expected_hours / expected_cost: means over the lanes (inf when some lane never finishes).
        miss_probability: share of lanes that miss the deadline (or never finish).
        interval_s: checkpoint interval on (spot, reliable), seconds of work.
        lanes: how many paths (or trace windows) the means are over.
        method: "model" (sampled availability) or "replay" (trace windows).
    """

    policy: str
    spot: str | None
    reliable: str | None
    expected_hours: float
    expected_cost: float
    miss_probability: float
    interval_s: tuple[float, float]
    expected_preemptions: float
    expected_lost_hours: float
    spot_hours: float
    reliable_hours: float
    lanes: int
    method: str

    @classmethod
    def of(
        cls, out: Outcome, policy: str, spot: Capacity | None, rel: Capacity | None, method: str
    ) -> Prediction:
        return cls(
            policy=policy,
            spot=None if spot is None else spot.name,
            reliable=None if rel is None else rel.name,
            expected_hours=out.mean_hours(),
            expected_cost=out.mean_cost(),
            miss_probability=out.miss_rate(),
            interval_s=out.interval_s,
            expected_preemptions=float(out.preemptions.mean()),
            expected_lost_hours=float(out.lost_h.mean()),
            spot_hours=float(out.spot_h.mean()),
            reliable_hours=float(out.reliable_h.mean()),
            lanes=len(out.cost),
            method=method,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["interval_s"] = list(self.interval_s)
        return d


def sources_for(job: CapacityJob, spot: Capacity | None, reliable: Capacity | None) -> Sources:
    """What the engine and the policy know of the two sources for this job."""
    notice = None if spot is None else spot.notice_s
    fits = job.final_save_s is not None and notice is not None and job.final_save_s <= notice
    return Sources(
        spot_price=math.inf if spot is None else spot.price_per_gpu_hour,
        reliable_price=math.inf if reliable is None else reliable.price_per_gpu_hour,
        spot_restart_s=job.restart_s + (0.0 if spot is None else spot.queue_wait_s),
        reliable_restart_s=job.restart_s + (0.0 if reliable is None else reliable.queue_wait_s),
        notice_fits=fits,
        spot_mtbf_s=math.inf if spot is None else spot.availability.mtbf_s,
    )


def _policy(policy: str | Policy, spot: Capacity | None, reliable: Capacity | None) -> Policy:
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
        policy = POLICIES[policy]
    needs_spot = policy.name not in ("on-demand",)
    needs_rel = policy.name not in ("spot",)
    if needs_spot and spot is None:
        raise ValueError(f"policy {policy.name} needs a spot (preemptible) capacity")
    if needs_rel and reliable is None:
        raise ValueError(f"policy {policy.name} needs a reliable capacity (on-demand, a tier)")
    if reliable is not None and reliable.preemptible:
        raise ValueError(f"{reliable.name} is preemptible: it cannot be the fallback source")
    return policy


Option = tuple[CapacityJob, "str | Policy"]


def _runs(options: list[Option], spot: Capacity | None, reliable: Capacity | None) -> list[Run]:
    return [
        Run(job, sources_for(job, spot, reliable), _policy(pol, spot, reliable))
        for job, pol in options
    ]


def replay_windows(
    options: list[Option],
    spot: Capacity,
    reliable: Capacity | None,
    starts: np.ndarray | None = None,
) -> list[Prediction]:
    """The reference: each (job, policy) replayed from every tick of ``spot``'s trace, read as
    a cycle (module doc); one prediction per option, in order."""
    if spot.trace is None:
        raise ValueError(f"{spot.name} has no trace to replay (it was built from rates)")
    runs = _runs(options, spot, reliable)
    tr = spot.trace
    n = tr.ticks
    starts = np.arange(n) if starts is None else np.asarray(starts, dtype=np.int64)
    u, prices = tr.unavailable, tr.prices

    def unavailable_at(k: int) -> np.ndarray:
        return u[(starts + k) % n]

    price_at = None
    if prices is not None:

        def price_at(k: int) -> np.ndarray:
            return prices[(starts + max(k, 0)) % n]

    outs = replay(runs, unavailable_at, len(starts), tr.gap_s, price_at)
    return [
        Prediction.of(o, r.policy.name, spot, reliable, "replay")
        for o, r in zip(outs, runs, strict=True)
    ]


def predict_options(
    options: list[Option],
    spot: Capacity | None,
    reliable: Capacity | None,
    *,
    lanes: int = DEFAULT_LANES,
    seed: int = DEFAULT_SEED,
    horizon_h: float | None = None,
) -> list[Prediction]:
    """The model's expectation for each (job, policy) over the same sampled paths (module doc):
    deterministic for a given ``seed``; every option sees the same paths, so their differences
    are the policies', not the draw's.

    Args:
        horizon_h: stop the paths here (lanes unfinished by then never finish: their hours are
            inf and they miss the deadline); default long enough for spot-only runs to finish.
    """
    runs = _runs(options, spot, reliable)
    if spot is None:
        gap = max(60.0, max(j.work_s for j, _ in options) / PREDICTION_TICKS_PER_WORK)
        outs = replay(runs, lambda k: np.ones(1, dtype=bool), 1, gap)
        return [
            Prediction.of(o, r.policy.name, spot, reliable, "model")
            for o, r in zip(outs, runs, strict=True)
        ]
    avail = spot.availability
    gap = avail.gap_s
    longest = max(runs, key=lambda r: r.job.work_s).job
    if spot.trace is None:  # rates: a tick that keeps the run short
        gap = max(avail.gap_s, longest.work_s / PREDICTION_TICKS_PER_WORK)
        avail = type(avail)(gap, mean_up=avail.mtbf_s / gap, mean_down=avail.mean_outage_s / gap)
    if horizon_h is None:
        horizon = _horizon_ticks(longest, gap)
    else:
        horizon = math.ceil(horizon_h * 3600.0 / gap)
    paths = avail.sample(lanes, horizon + 2, np.random.default_rng(seed))
    outs = replay(runs, lambda k: paths[:, min(k, horizon + 1)], lanes, gap, horizon_ticks=horizon)
    return [
        Prediction.of(o, r.policy.name, spot, reliable, "model")
        for o, r in zip(outs, runs, strict=True)
    ]


def predict(
    job: CapacityJob,
    spot: Capacity | None,
    reliable: Capacity | None,
    policy: str | Policy,
    **kw: Any,
) -> Prediction:
    """:func:`predict_options` for one job and one policy."""
    return predict_options([(job, policy)], spot, reliable, **kw)[0]


def _horizon_ticks(job: CapacityJob, gap: float) -> int:
    """The replay's horizon (``HORIZON_FACTOR`` x the work, at least the deadline), so that a
    path that never finishes is cut where a trace window is: the two agree on "never"."""
    span = HORIZON_FACTOR * job.work_s
    if math.isfinite(job.deadline_s):
        span = max(span, job.deadline_s)
    return int(min(math.ceil(span / gap) + 2, MAX_HORIZON_TICKS))


__all__ = ["Option", "Prediction", "predict", "predict_options", "replay_windows", "sources_for"]
