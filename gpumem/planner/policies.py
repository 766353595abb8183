"""Capacity policies: where a job runs each tick, and how often it checkpoints on each source.

* ``on-demand``: the reliable source only.
* ``spot``: spot whenever it can be had, else wait (no deadline guard).
* ``uniform-progress``: Can't Be Late's Uniform Progress (Wu et al., NSDI 2024) as its
  simulator's baseline implements it: spot while it can be had; when it cannot, the reliable
  source only if progress is behind the line W·t/D; once on the reliable source stay while
  behind (t + 2R)·W/D; and the reliable source whenever the remaining work plus one restart no
  longer fits the ticks left. It knows nothing of checkpoints: the job checkpoints at one fixed
  interval, Young/Daly's for the MTBF read off the trace (what ``economics()`` does).
* ``gpumem``: the same line, plus what the others ignore: the cost of a checkpoint.
  - it switches at a checkpoint: a change of source saves first (paying P), so a switch loses
    no work;
  - its deadline guard counts the work a preemption could still take back (nothing when the
    final save fits the notice; else the work since the last durable checkpoint and one tick),
    the save before a switch, and the restart a tick on spot would still spend, not only one
    restart;
  - its interval follows the source: on spot Young/Daly for that source's preemptions that come
    without a saved final step (none when the final save fits the notice), on the reliable
    source only the job's floor for failures no trace shows (``CapacityJob.max_interval_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpumem.planner.capacity_replay import NONE, RELIABLE, SPOT, CapacityJob, Sources, TickState
from gpumem.planner.economics import young_daly


def fixed_interval(job: CapacityJob, sources: Sources) -> float:
    """One interval for the whole run, as a user sets it from the trace's MTBF: Young/Daly,
    at least P, at most the job's floor (tau 0 when checkpoints are free: ``sky_spot``'s model)."""
    if job.stall_s == 0 and job.persist_s == 0:
        return 0.0
    if not 0 < sources.spot_mtbf_s < math.inf:
        return job.max_interval_s
    return min(max(young_daly(job.stall_s, sources.spot_mtbf_s), job.persist_s), job.max_interval_s)


class _OneInterval:
    """A policy that knows nothing of checkpoints: one interval on every source."""

    switch_at_checkpoint = False

    def intervals(self, job: CapacityJob, sources: Sources) -> tuple[float, float]:
        tau = fixed_interval(job, sources)
        return tau, tau


@dataclass(frozen=True)
class OnDemandOnly(_OneInterval):
    name: str = "on-demand"

    def decide(self, s: TickState) -> np.ndarray:
        return np.full_like(s.cluster, RELIABLE)


@dataclass(frozen=True)
class SpotOnly(_OneInterval):
    name: str = "spot"

    def decide(self, s: TickState) -> np.ndarray:
        return np.where(s.has_spot, SPOT, NONE).astype(np.int8)


def _behind(s: TickState, ahead_s: float | np.ndarray = 0.0) -> np.ndarray:
    """Progress behind the uniform-progress line W·(t + ahead)/D (> 0: behind)."""
    ln = s.lanes
    return (s.t + ahead_s) * ln.work_s / ln.deadline_s - s.progress


def _line_decision(s: TickState, r_s: np.ndarray) -> np.ndarray:
    """Uniform Progress's choice before its deadline guard (module doc)."""
    has = s.has_spot
    dec = np.where(_behind(s) > 0, np.where(has, SPOT, RELIABLE), np.where(has, SPOT, NONE))
    stay = (s.cluster == RELIABLE) & (~has | (_behind(s, 2 * r_s) >= 0))
    return np.where(stay, RELIABLE, dec)


def _guarded(s: TickState, need_s: np.ndarray, r_s: np.ndarray) -> np.ndarray:
    """The reliable source when ``need_s`` no longer fits the whole ticks left; else spot when
    it can be had, else the line's choice. No deadline: spot when it can be had."""
    ln = s.lanes
    left = np.floor((ln.deadline_s - s.t) / s.gap_s)
    need = np.ceil(need_s / s.gap_s)
    out = np.where(need >= left, RELIABLE, np.where(s.has_spot, SPOT, _line_decision(s, r_s)))
    return np.where(np.isfinite(ln.deadline_s), out, np.where(s.has_spot, SPOT, NONE))


@dataclass(frozen=True)
class UniformProgress(_OneInterval):
    name: str = "uniform-progress"

    def decide(self, s: TickState) -> np.ndarray:
        r_s = s.lanes.restart_reliable_s
        return _guarded(s, s.lanes.work_s - s.progress + r_s, r_s)


@dataclass(frozen=True)
class GpumemPolicy:
    name: str = "gpumem"
    switch_at_checkpoint: bool = True

    def intervals(self, job: CapacityJob, sources: Sources) -> tuple[float, float]:
        if job.stall_s == 0 and job.persist_s == 0:
            return 0.0, 0.0
        floor = job.max_interval_s
        if sources.notice_fits or not 0 < sources.spot_mtbf_s < math.inf:
            return floor, floor
        yd = young_daly(job.stall_s, sources.spot_mtbf_s)
        return min(max(yd, job.persist_s), floor), floor

    def decide(self, s: TickState) -> np.ndarray:
        ln = s.lanes
        # what a preemption in the next tick could take back: nothing when the final save fits
        # the notice or every second is kept; else the work since the last durable checkpoint
        # and the tick's own
        exposed = (s.cluster == SPOT) & ~ln.notice_fits & (ln.tau_spot > 0)
        at_risk = np.where(exposed, s.progress - s.durable + s.gap_s, 0.0)
        switch = ln.restart_reliable_s + np.where(s.cluster != NONE, ln.persist_s, 0.0)
        # a tick on spot that starts (or is still restarting) does less than a tick of work:
        # decide now whether the deadline still holds after it
        idle = np.where(s.cluster == SPOT, s.restart_left, ln.restart_spot_s)
        need = ln.work_s - s.progress + at_risk + switch + np.minimum(idle, s.gap_s)
        return _guarded(s, need, ln.restart_reliable_s)


POLICIES = {p.name: p for p in (OnDemandOnly(), SpotOnly(), UniformProgress(), GpumemPolicy())}

__all__ = [
    "POLICIES",
    "GpumemPolicy",
    "OnDemandOnly",
    "SpotOnly",
    "UniformProgress",
    "fixed_interval",
]
