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
  (``Job.final_save_s``) fits the source's notice: then nothing is lost (the guard saved it);
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
class Job:
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


@dataclass
class TickState:
    """What a controller can see at a tick (arrays over lanes; ``t`` is shared)."""

    t: float
    gap_s: float
    job: Job
    sources: Sources
    progress: np.ndarray  # work done (s), after any rollback this tick
    durable: np.ndarray  # work covered by a durable checkpoint (s)
    cluster: np.ndarray  # where the job runs now (NONE after a preemption)
    has_spot: np.ndarray  # spot can run during the next tick
    restart_left: np.ndarray  # restart seconds still to pay


class Policy(Protocol):
    """Where to run each tick, and how often to checkpoint on each source."""

    name: str
    switch_at_checkpoint: bool

    def intervals(self, job: Job, sources: Sources) -> tuple[float, float]:
        """(interval on spot, interval on the reliable source), seconds of work."""
        ...

    def decide(self, s: TickState) -> np.ndarray:
        """Requested source per lane (NONE, SPOT or RELIABLE)."""
        ...


@dataclass(frozen=True)
class Outcome:
    """Per-lane results of a replay (arrays), with their means as properties."""

    wall_h: np.ndarray  # inf: did not finish within the horizon
    cost: np.ndarray
    lost_h: np.ndarray
    checkpoints: np.ndarray
    preemptions: np.ndarray
    met: np.ndarray  # finished by the deadline
    spot_h: np.ndarray
    reliable_h: np.ndarray
    interval_s: tuple[float, float]

    @property
    def finished(self) -> np.ndarray:
        return np.isfinite(self.wall_h)

    def mean_hours(self) -> float:
        return float(self.wall_h.mean())

    def mean_cost(self) -> float:
        return float(self.cost.mean())

    def miss_rate(self) -> float:
        return float(1.0 - self.met.mean())


def _work_done(y: np.ndarray, tau: np.ndarray, c: float) -> np.ndarray:
    """Work in y seconds of running at interval tau and stall c (tau 0: all of it)."""
    cyc = tau + c
    safe = np.where(cyc > 0, cyc, 1.0)
    n = np.floor(y / safe)
    cycled = n * tau + np.minimum(y - n * safe, tau)
    return np.where((cyc > 0) & np.isfinite(tau), cycled, y)


def _durable(y: np.ndarray, tau: np.ndarray, c: float, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(work covered by durable checkpoints, checkpoints started) after y seconds of running."""
    cyc = tau + c
    finite = np.isfinite(tau) & (cyc > 0)
    safe = np.where(finite, cyc, 1.0)
    started = np.where(finite, np.floor(np.maximum(y - tau, -1.0) / safe) + 1, 0.0)
    started = np.maximum(started, 0.0)
    done = np.where(finite, np.floor(np.maximum(y - tau - p, -1.0) / safe) + 1, 0.0)
    done = np.maximum(done, 0.0)
    work = np.where(finite, done * tau, np.where(cyc > 0, 0.0, y))  # tau 0, C 0: all durable
    return work, started


def replay(
    job: Job,
    sources: Sources,
    policy: Policy,
    unavailable_at: Callable[[int], np.ndarray],
    lanes: int,
    gap_s: float,
    spot_price_at: Callable[[int], np.ndarray | float] | None = None,
    horizon_ticks: int | None = None,
) -> Outcome:
    """Run ``lanes`` copies of ``job`` tick by tick (module doc).

    Args:
        unavailable_at: tick -> bool array over lanes (True: spot cannot run that tick).
        spot_price_at: tick -> spot dollars per GPU-hour (array or scalar); default constant.
        horizon_ticks: stop after this many ticks (default: HORIZON_FACTOR x the work or the
            deadline, whichever is longer).
    """
    g, w = float(gap_s), job.work_s
    if horizon_ticks is None:
        span = max(HORIZON_FACTOR * w, job.deadline_s if job.deadline_h else 0.0)
        horizon_ticks = min(MAX_HORIZON_TICKS, math.ceil(span / g) + 2)
    tau_spot, tau_rel = policy.intervals(job, sources)
    c, p_s = job.stall_s, job.persist_s
    cl = np.full(lanes, NONE, dtype=np.int8)
    restart = np.zeros(lanes)
    y = np.zeros(lanes)  # seconds run since the last start
    base = np.zeros(lanes)  # progress kept at the last start
    tau = np.zeros(lanes)
    done = np.zeros(lanes, dtype=bool)
    finish = np.full(lanes, math.inf)
    cost, lost, ckpts, preempt = (np.zeros(lanes) for _ in range(4))
    spot_ticks, rel_ticks = np.zeros(lanes), np.zeros(lanes)
    price_unit = g / 3600.0 * job.gpus
    for k in range(horizon_ticks + 1):
        has = ~unavailable_at(k)
        running = cl != NONE
        # bill and credit the gap [k-1, k) that ran
        sp = sources.spot_price if spot_price_at is None else spot_price_at(k - 1)
        cost += np.where(cl == SPOT, sp, np.where(cl == RELIABLE, sources.reliable_price, 0.0))
        spot_ticks += cl == SPOT
        rel_ticks += cl == RELIABLE
        avail_s = np.where(running, np.maximum(g - restart, 0.0), 0.0)
        restart = np.where(running, np.maximum(restart - g, 0.0), restart)
        y_prev, y = y, y + avail_s
        progress = base + _work_done(y, tau, c)
        durable, started = _durable(y, tau, c, p_s)
        _, started_prev = _durable(y_prev, tau, c, p_s)
        ckpts += np.where(running, started - started_prev, 0.0)
        durable = base + durable
        newly = ~done & (progress >= w - 1e-6)
        finish = np.where(newly, k * g, finish)
        done |= newly
        if done.all():
            cl[:] = NONE
            break
        # a spot job whose source is gone is preempted at this boundary
        hit = (cl == SPOT) & ~has & ~done
        keep = progress if sources.notice_fits else durable
        lost += np.where(hit, progress - keep, 0.0)
        preempt += hit
        base = np.where(hit, keep, base)
        progress = np.where(hit, keep, progress)
        durable = np.where(hit, keep, durable)
        y = np.where(hit, 0.0, y)
        cur = np.where(hit | done, NONE, cl).astype(np.int8)
        state = TickState(k * g, g, job, sources, progress, durable, cur, has, restart)
        req = np.asarray(policy.decide(state), dtype=np.int8)
        req = np.where(done, NONE, np.where((req == SPOT) & ~has, NONE, req)).astype(np.int8)
        # a start on another source (or a stop) ends the current run
        change = (req != cur) & ((req != NONE) | (cur != NONE))
        leaving = change & (cur != NONE)
        keep = progress if policy.switch_at_checkpoint else durable
        lost += np.where(leaving, progress - keep, 0.0)
        base = np.where(leaving, keep, np.where(change & (cur == NONE), progress, base))
        y = np.where(change, 0.0, y)
        r_new = np.where(req == SPOT, sources.spot_restart_s, sources.reliable_restart_s)
        if policy.switch_at_checkpoint:
            r_new = r_new + np.where(leaving, job.persist_s, 0.0)
        restart = np.where(change & (req != NONE), r_new, restart)
        tau = np.where(change, np.where(req == SPOT, tau_spot, tau_rel), tau)
        cl = req
    met = finish <= job.deadline_s + 1e-6
    return Outcome(
        wall_h=finish / 3600.0,
        cost=cost * price_unit,
        lost_h=lost / 3600.0,
        checkpoints=ckpts,
        preemptions=preempt,
        met=met,
        spot_h=spot_ticks * g / 3600.0,
        reliable_h=rel_ticks * g / 3600.0,
        interval_s=(tau_spot, tau_rel),
    )


__all__ = ["NONE", "RELIABLE", "SPOT", "Job", "Outcome", "Policy", "Sources", "TickState", "replay"]
