"""Replay a job over capacity tick by tick under a policy: the reference for the predictions.

The world and the policy are kept apart, as in the Can't Be Late simulator (``sky_spot``): the
engine owns the availability (per tick, for many lanes at once: the windows of a trace, or
sample paths of a capacity model), the checkpoint mechanics and the bill; a :class:`Policy` sees
only what a controller could see at each tick and returns where to run the next one:
``NONE`` (wait, free), ``SPOT`` (the preemptible source) or ``RELIABLE`` (on-demand, reserved, a
high tier).

Tick semantics follow ``sky_spot`` exactly, so that its published results reproduce: at tick k
the gap [k-1, k) that ran is billed and credited (``gap - remaining restart``), the availability
of [k, k+1) is observed (a spot job whose source is gone is preempted at the boundary), the
policy decides, and starting on a source other than the current one costs a restart R (R plus
the source's queue wait) that is paid before any work. On top of that, the checkpoint mechanics
(``sky_spot`` has none: its progress is never lost):

* work proceeds in cycles of the interval tau of work then a stall C (the checkpoint's copy); the
  checkpoint taken at the end of a cycle's work is durable P after its stall began (P >= C);
* a preemption rolls progress back to the last durable checkpoint, unless the job's final save
  (``CapacityJob.final_save_s``) fits the source's notice: then nothing is lost (the guard saved
  it);
* a switch the policy chooses while running loses the same, unless the policy switches at a
  checkpoint (``Policy.switch_at_checkpoint``): it then saves first, paying P before the restart;
* ``interval_s == 0`` with C = P = 0 is ``sky_spot``'s model: every second of work is kept.

Outcomes per lane: wall hours (inf when the horizon ends first), cost, work lost, checkpoints,
preemptions, deadline met.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

NONE, SPOT, RELIABLE = 0, 1, 2
HORIZON_FACTOR = 20.0  # a lane still running after this multiple of its work does not finish
MAX_HORIZON_TICKS = 400_000


@dataclass(frozen=True)
class CapacityJob:
    """What is replayed: W hours of work on ``gpus`` GPUs with its checkpoint costs.

    Attributes:
        work_h: failure-free work (hours), W.
        deadline_h: wall-clock deadline from the start (hours), or None.
        stall_s: training stall per checkpoint, C.
        persist_s: time from a checkpoint's start until it is durable, P (>= C).
        restart_s: restart after a preemption or a switch, R (restore + start-up).
        final_save_s: time the final save on notice takes (from the calibration); None: no
            guard, a preemption always rolls back to the last durable checkpoint.
        max_interval_s: the longest interval any policy keeps, for failures no trace shows.
    """

    work_h: float
    gpus: int = 1
    deadline_h: float | None = None
    stall_s: float = 0.0
    persist_s: float = 0.0
    restart_s: float = 0.0
    final_save_s: float | None = None
    max_interval_s: float = 3600.0

    def __post_init__(self) -> None:
        if not (self.work_h > 0 and math.isfinite(self.work_h)):
            raise ValueError(f"work must be a positive number of hours, got {self.work_h}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus must be a whole number >= 1, got {self.gpus!r}")
        if self.deadline_h is not None:
            if not (self.deadline_h > 0 and math.isfinite(self.deadline_h)):
                raise ValueError(
                    f"deadline must be a positive number of hours, got {self.deadline_h}"
                )
            if self.deadline_h < self.work_h:
                raise ValueError(
                    f"deadline {self.deadline_h:g} h is shorter than the work {self.work_h:g} h: "
                    "no capacity can meet it; give a later deadline or more GPUs"
                )
        for name in ("stall_s", "persist_s", "restart_s", "max_interval_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v}")
        if self.persist_s < self.stall_s:
            raise ValueError(
                f"persist_s {self.persist_s:g} < stall_s {self.stall_s:g}: a checkpoint is durable "
                "only after it was taken"
            )
        if self.final_save_s is not None and not (self.final_save_s >= 0):
            raise ValueError(f"final_save_s must be >= 0 s, got {self.final_save_s}")

    @property
    def work_s(self) -> float:
        return self.work_h * 3600.0

    @property
    def deadline_s(self) -> float:
        return math.inf if self.deadline_h is None else self.deadline_h * 3600.0


@dataclass(frozen=True)
class Sources:
    """What the policy may run on, as the engine sees it."""

    spot_price: float  # dollars per GPU-hour (a priced trace overrides it per tick)
    reliable_price: float
    spot_restart_s: float  # R + the spot source's queue wait
    reliable_restart_s: float
    notice_fits: bool  # the job's final save fits the spot source's notice
    spot_mtbf_s: float  # mean run before a preemption, as a user would read it off the trace


@dataclass(frozen=True)
class Run:
    """One job on one pair of sources under one policy: a block of lanes in a replay."""

    job: CapacityJob
    sources: Sources
    policy: Policy


@dataclass(frozen=True)
class Lanes:
    """Per-lane parameters of a replay (arrays), so that many runs share one tick loop."""

    work_s: np.ndarray
    deadline_s: np.ndarray
    stall_s: np.ndarray
    persist_s: np.ndarray
    restart_spot_s: np.ndarray
    restart_reliable_s: np.ndarray
    notice_fits: np.ndarray
    tau_spot: np.ndarray
    tau_reliable: np.ndarray
    switch_at_checkpoint: np.ndarray
    price_spot: np.ndarray
    price_reliable: np.ndarray
    gpus: np.ndarray

    @classmethod
    def of(cls, runs: list[Run]) -> Lanes:
        """One row per run (shape runs x 1): it broadcasts over the run's lanes."""

        def rep(values: list[float] | list[bool]) -> np.ndarray:
            return np.asarray(values)[:, None]

        taus = [r.policy.intervals(r.job, r.sources) for r in runs]
        return cls(
            work_s=rep([r.job.work_s for r in runs]),
            deadline_s=rep([r.job.deadline_s for r in runs]),
            stall_s=rep([r.job.stall_s for r in runs]),
            persist_s=rep([r.job.persist_s for r in runs]),
            restart_spot_s=rep([r.sources.spot_restart_s for r in runs]),
            restart_reliable_s=rep([r.sources.reliable_restart_s for r in runs]),
            notice_fits=rep([r.sources.notice_fits for r in runs]),
            tau_spot=rep([t[0] for t in taus]),
            tau_reliable=rep([t[1] for t in taus]),
            switch_at_checkpoint=rep([r.policy.switch_at_checkpoint for r in runs]),
            price_spot=rep([r.sources.spot_price for r in runs]),
            price_reliable=rep([r.sources.reliable_price for r in runs]),
            gpus=rep([r.job.gpus for r in runs]),
        )


@dataclass
class TickState:
    """What a controller can see at a tick: arrays of runs x lanes (``t`` is shared), with each
    run's job and sources in ``lanes`` (runs x 1, broadcasting)."""

    t: float
    gap_s: float
    lanes: Lanes
    progress: np.ndarray  # work done (s), after any rollback this tick
    durable: np.ndarray  # work covered by a durable checkpoint (s)
    cluster: np.ndarray  # where the job runs now (NONE after a preemption)
    has_spot: np.ndarray  # spot can run during the next tick
    restart_left: np.ndarray  # restart seconds still to pay


class Policy(Protocol):
    """Where to run each tick, and how often to checkpoint on each source."""

    name: str
    switch_at_checkpoint: bool

    def intervals(self, job: CapacityJob, sources: Sources) -> tuple[float, float]:
        """(interval on spot, interval on the reliable source), seconds of work."""
        ...

    def decide(self, s: TickState) -> np.ndarray:
        """Requested source per lane (NONE, SPOT or RELIABLE); only this policy's lanes are
        used, but it may compute over all (vectorised)."""
        ...


@dataclass(frozen=True)
class Outcome:
    """Per-lane results of one run (arrays), with their means."""

    wall_h: np.ndarray  # inf: did not finish within the horizon
    cost: np.ndarray
    lost_h: np.ndarray
    checkpoints: np.ndarray
    preemptions: np.ndarray
    met: np.ndarray  # finished by the deadline
    spot_h: np.ndarray
    reliable_h: np.ndarray
    interval_s: tuple[float, float]

    def mean_hours(self) -> float:
        return float(self.wall_h.mean())

    def mean_cost(self) -> float:
        return float(self.cost.mean())

    def miss_rate(self) -> float:
        return float(1.0 - self.met.mean())


def _work_done(y: np.ndarray, tau: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Work in y seconds of running at interval tau and stall c (tau 0 or inf: all of it)."""
    cycles = (tau + c > 0) & np.isfinite(tau)
    t = np.where(cycles, tau, 0.0)  # inf never enters the arithmetic
    safe = np.where(cycles, t + c, 1.0)
    n = np.floor(y / safe)
    return np.where(cycles, n * t + np.minimum(y - n * safe, t), y)


def _checkpoints(
    y: np.ndarray, tau: np.ndarray, c: np.ndarray, p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(work covered by durable checkpoints, checkpoints started) after y seconds of running;
    tau 0 with C 0 keeps every second (``sky_spot``), tau inf keeps nothing."""
    cycles = (tau + c > 0) & np.isfinite(tau)
    t = np.where(cycles, tau, 0.0)  # inf never enters the arithmetic
    safe = np.where(cycles, t + c, 1.0)
    started = np.where(cycles, np.maximum(np.floor((y - t) / safe) + 1, 0.0), 0.0)
    durable = np.where(cycles, np.maximum(np.floor((y - t - p) / safe) + 1, 0.0), 0.0)
    work = np.where(cycles, durable * t, np.where(tau + c > 0, 0.0, y))
    return work, started


def replay(
    runs: list[Run],
    unavailable_at: Callable[[int], np.ndarray],
    per_run: int,
    gap_s: float,
    spot_price_at: Callable[[int], np.ndarray | float] | None = None,
    horizon_ticks: int | None = None,
) -> list[Outcome]:
    """Replay each run over the same ``per_run`` availability lanes, tick by tick (module doc).

    Args:
        unavailable_at: tick -> bool array over ``per_run`` lanes (True: spot cannot run).
        spot_price_at: tick -> spot dollars per GPU-hour (array over the lanes, or a scalar);
            default each run's constant price.
        horizon_ticks: stop after this many ticks (default: HORIZON_FACTOR x the longest work,
            or the latest deadline).
    """
    g, shape = float(gap_s), (len(runs), per_run)
    ln = Lanes.of(runs)
    if horizon_ticks is None:
        dl = ln.deadline_s[np.isfinite(ln.deadline_s)]
        span = max(HORIZON_FACTOR * float(ln.work_s.max()), float(dl.max()) if len(dl) else 0.0)
        horizon_ticks = min(MAX_HORIZON_TICKS, math.ceil(span / g) + 2)
    policies = {id(r.policy): r.policy for r in runs}
    owner = np.asarray([id(r.policy) for r in runs])[:, None]
    masks = [(pol, owner == key) for key, pol in policies.items()]
    cl = np.full(shape, NONE, dtype=np.int8)
    restart, y, base, started = (np.zeros(shape) for _ in range(4))
    tau = np.full(shape, math.inf)  # no checkpoint cycle before the first start
    done = np.zeros(shape, dtype=bool)
    finish = np.full(shape, math.inf)
    cost, lost, ckpts, preempt, spot_t, rel_t = (np.zeros(shape) for _ in range(6))
    for k in range(horizon_ticks + 1):
        has = ~unavailable_at(k)[None, :]  # the same availability for every run's lanes
        running = cl != NONE
        # bill and credit the gap [k-1, k) that ran
        sp = ln.price_spot if spot_price_at is None else spot_price_at(k - 1)
        on_spot, on_rel = cl == SPOT, cl == RELIABLE
        cost += np.where(on_spot, sp, np.where(on_rel, ln.price_reliable, 0.0))
        spot_t += on_spot
        rel_t += on_rel
        y = y + np.where(running, np.maximum(g - restart, 0.0), 0.0)
        restart = np.where(running, np.maximum(restart - g, 0.0), restart)
        progress = base + _work_done(y, tau, ln.stall_s)
        kept, now_started = _checkpoints(y, tau, ln.stall_s, ln.persist_s)
        ckpts += now_started - started
        started = now_started
        durable = base + kept
        newly = ~done & (progress >= ln.work_s - 1e-6)
        finish[newly] = k * g
        done |= newly
        if done.all():
            break
        # a spot job whose source is gone is preempted at this boundary
        hit = on_spot & ~has & ~done
        keep = np.where(ln.notice_fits, progress, durable)
        lost += np.where(hit, progress - keep, 0.0)
        preempt += hit
        progress = np.where(hit, keep, progress)
        durable = np.where(hit, keep, durable)
        base = np.where(hit, keep, base)
        y = np.where(hit, 0.0, y)
        started = np.where(hit, 0.0, started)
        cur = np.where(hit | done, NONE, cl).astype(np.int8)
        has_all = np.broadcast_to(has, shape)
        state = TickState(k * g, g, ln, progress, durable, cur, has_all, restart)
        req = np.full(shape, NONE, dtype=np.int8)
        for pol, mask in masks:
            req = np.where(mask, np.asarray(pol.decide(state), dtype=np.int8), req)
        req = np.where(done | ((req == SPOT) & ~has), NONE, req).astype(np.int8)
        # a start on another source (or a stop) ends the current run
        change = (req != cur) & ((req != NONE) | (cur != NONE))
        leaving = change & (cur != NONE)
        keep = np.where(ln.switch_at_checkpoint, progress, durable)
        lost += np.where(leaving, progress - keep, 0.0)
        base = np.where(leaving, keep, np.where(change, progress, base))
        y = np.where(change, 0.0, y)
        started = np.where(change, 0.0, started)
        r_new = np.where(req == SPOT, ln.restart_spot_s, ln.restart_reliable_s)
        r_new = r_new + np.where(leaving & ln.switch_at_checkpoint, ln.persist_s, 0.0)
        restart = np.where(change & (req != NONE), r_new, restart)
        tau = np.where(change, np.where(req == SPOT, ln.tau_spot, ln.tau_reliable), tau)
        cl = req
    unit = g / 3600.0 * ln.gpus
    outs = []
    for i, r in enumerate(runs):
        outs.append(
            Outcome(
                wall_h=finish[i] / 3600.0,
                cost=cost[i] * unit[i],
                lost_h=lost[i] / 3600.0,
                checkpoints=ckpts[i],
                preemptions=preempt[i],
                met=finish[i] <= ln.deadline_s[i] + 1e-6,
                spot_h=spot_t[i] * g / 3600.0,
                reliable_h=rel_t[i] * g / 3600.0,
                interval_s=r.policy.intervals(r.job, r.sources),
            )
        )
    return outs


__all__ = [
    "NONE",
    "RELIABLE",
    "SPOT",
    "CapacityJob",
    "Lanes",
    "Outcome",
    "Policy",
    "Run",
    "Sources",
    "TickState",
    "replay",
]
