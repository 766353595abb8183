"""Where a profiled run is and how high its memory stands: phase, step, module calls, peaks.

The session (``session.py``) sorts storages into categories as the hooks report them; this
module keeps what the levels make of it: the steps and their peaks per phase, the region's peak
snapshot, the running module calls (frames) and their high-water marks, the timeline and the
module spans. ``after_op`` runs after every op in exact mode, so it is written for speed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpumem.profiler import fsdp_tp
from gpumem.profiler.categories import BACKWARD, FORWARD, OPTIMIZER, OPTIMIZER_PHASE, TEMPORARY
from gpumem.profiler.records import PHASE_CODE, Frame, PeakRecord, ProbeView, StepAcc

if TYPE_CHECKING:
    from gpumem.profiler.communication import CommAccount
    from gpumem.profiler.modes import ExactMode, LightMode
    from gpumem.profiler.samples import SampleRecorder
    from gpumem.profiler.tracker import Entry, StorageTracker

_graph_task_id = torch._C._current_graph_task_id


class LevelsHost(Protocol):
    """What the levels read of the session and tell it (``Profile``)."""

    tracker: StorageTracker
    comm: CommAccount
    strategy: ExactMode | LightMode
    allocator: Any
    """The CUDA allocator probe, or None."""

    def backward_done(self, step: StepAcc) -> None: ...


class Levels:
    """The steps, peaks, running module calls and timeline of one profile."""

    def __init__(self, host: LevelsHost, timeline: bool) -> None:
        self.host = host
        self.record_timeline = timeline
        self.steps: list[StepAcc] = [StepAcc(0)]
        self.peak = PeakRecord()
        self.fwd: list[Frame] = []
        self.bwd: list[Frame] = []
        self.spans: list[tuple[str, str, int, int, int]] = []  # (fqn, phase, t0, t1, step)
        self.timeline: tuple[list[int], list[int], list[int], list[int], list[int]] = (
            [],
            [],
            [],
            [],
            [],
        )
        self.recorder: SampleRecorder | None = None  # a k-block profile's (runner.py)
        self.in_step = False
        self.in_zero_grad = 0
        self._tail: str | None = None
        self.closed = False
        self.bw_tasks: set[int] = set()
        # after_op's memory: the last timeline sample, and the highest level already handed to
        # the peaks and the running frames in the current phase and step
        self._tl_level, self._tl_phase, self._tl_step = -1, "", -1
        self._mark, self._mark_phase, self._mark_step = -1, "", None
        # the highest level less communication already handed to the running frames
        self._fmark = -1

    def phase(self) -> str:
        if self.in_step or self.in_zero_grad:
            return OPTIMIZER_PHASE
        if _graph_task_id() != -1:
            return BACKWARD
        # after a backward pass or an optimizer step, until the next forward (grad clipping,
        # zero_grad, logging) belongs to the phase that just ended
        return self._tail or FORWARD

    def where(self) -> str:
        """The innermost running module."""
        if self.fwd:
            return self.fwd[-1].fqn
        return self.bwd[-1].fqn if self.bwd else ""

    def probe_view(self) -> ProbeView:
        """What the CUDA allocator probe reads at a boundary: running frames, phase, step."""
        return ProbeView([*self.fwd, *self.bwd], self.phase(), self.steps[-1])

    def after_op(self, level: int | None = None) -> None:
        """Called after every op (exact mode) or hook boundary (light mode): peaks and timeline.

        Runs once per aten op, so it does as little as it can: the peaks and the step's snapshot
        only change when the level rises above ``_mark`` (the highest level already handed to
        them) or the phase or step changes, the running frames' high-water marks (levels less
        communication) only when that rises above ``_fmark``; of the forward frames only the
        innermost is updated (it hands its mark to its parent on exit).
        """
        host = self.host
        if level is None:
            level = host.tracker.level
        if self.in_step or self.in_zero_grad:
            phase = OPTIMIZER_PHASE
        else:
            task = _graph_task_id()
            if task != -1:
                phase = BACKWARD
                if task not in self.bw_tasks:
                    self._backward_start(task)
            else:
                # after a backward pass or an optimizer step, until the next forward (grad
                # clipping, zero_grad, logging) belongs to the phase that just ended
                phase = self._tail or FORWARD
        step = self.steps[-1]
        comm = host.comm.total
        if self.record_timeline and (
            level != self._tl_level or phase is not self._tl_phase or step.index != self._tl_step
        ):
            self._tl_level, self._tl_phase, self._tl_step = level, phase, step.index
            ts, lv, ph, st, cm = self.timeline
            ts.append(time.perf_counter_ns())
            lv.append(level)
            ph.append(PHASE_CODE[phase])
            st.append(step.index)
            cm.append(comm)
            if self.recorder is not None:
                self._sample(level, comm, phase, step)
        work = level - comm
        if work > self._fmark:
            self._fmark = work
            if self.fwd:  # the innermost only: it hands its mark to its parent on exit
                top = self.fwd[-1]
                if work > top.hwm:
                    top.hwm = work
            for f in self.bwd:
                if work > f.hwm:
                    f.hwm = work
        if level <= self._mark and phase is self._mark_phase and step is self._mark_step:
            return
        self._mark, self._mark_phase, self._mark_step = level, phase, step
        pp = step.phase_peak[phase]
        if pp is None or level > pp:
            step.phase_peak[phase] = level
        if level > step.peak.bytes or step.peak.event < 0:
            step.peak = self._snap(level, phase, step)
        if level > self.peak.bytes or self.peak.event < 0:
            self.peak = step.peak

    def _sample(self, level: int, comm: int, phase: str, step: StepAcc) -> None:
        assert self.recorder is not None
        tr = self.host.tracker
        n_opt = len(step.opt_new) if self.in_step else 0
        frames = (self.fwd, self.bwd)
        self.recorder.sample(level, comm, phase, step, frames, tr.by_category, tr.events, n_opt)

    def _snap(self, level: int, phase: str, step: StepAcc) -> PeakRecord:
        return PeakRecord(
            level,
            self.host.strategy.snap_categories(level),
            self.host.tracker.events,
            phase,
            step.index,
            len(step.opt_new) if self.in_step else 0,
        )

    def reclassify(self, e: Entry, category: str, module: str) -> None:
        """Change an entry's category; snapshots taken at this very event follow it."""
        old = e.category
        if old == category:
            return
        tracker = self.host.tracker
        tracker.reclassify(e, category, module)
        if e.died is None:
            for snap in {id(s): s for s in (self.peak, self.steps[-1].peak)}.values():
                if snap.event == tracker.events:
                    snap.at[old] -= e.nbytes
                    snap.at[category] += e.nbytes
            if self.recorder is not None:
                self.recorder.reclassified(tracker.events, old, category, e.nbytes)

    def move_scratch(self, step: StepAcc, state: dict[int, str]) -> None:
        """What the optimizer step created and did not keep (not in ``state``) is temporary,
        not optimizer state, in the step's peak snapshots and samples too."""
        for snap in {id(s): s for s in (self.peak, step.peak)}.values():
            if snap.phase == OPTIMIZER_PHASE and snap.step == step.index:
                moved = sum(
                    e.nbytes
                    for e in step.opt_new[: snap.n_opt_new]
                    if id(e) not in state and (e.died is None or e.died > snap.event)
                )
                snap.at[OPTIMIZER] -= moved
                snap.at[TEMPORARY] += moved
        if self.recorder is not None:
            self.recorder.move_scratch(step, state)

    def optimizer_done(self) -> None:
        self.in_step = False
        self._tail = OPTIMIZER_PHASE
        self.closed = True

    # -- module calls --------------------------------------------------------------------------
    def open_step(self) -> None:
        """A forward starts: after a closed step it opens the next one."""
        if self.closed:
            step = StepAcc(len(self.steps))
            step.communication = {k: v for k, v in self.host.comm.live.items() if v > 0}
            self.steps.append(step)
            self.closed = False
        self._tail = None

    def new_frame(self, fqn: str, in_backward: bool) -> Frame:
        host = self.host
        host.strategy.boundary()  # light: the interval before the call is the running frames'
        level = host.strategy.level_now() - host.comm.total
        frame = Frame(fqn, level, host.tracker.events, in_backward, time.perf_counter_ns())
        if level < self._fmark:  # the new frame has seen only ``level`` so far
            self._fmark = level
        host.strategy.frame_opened()
        if host.allocator is not None:
            host.allocator.enter(self.probe_view(), frame, sample=host.strategy.samples_allocator)
        return frame

    def forward_exit(self, fqn: str) -> Frame | None:
        self.host.strategy.boundary()
        for i in range(len(self.fwd) - 1, -1, -1):
            if self.fwd[i].fqn == fqn:
                frames = self.fwd[i:]
                del self.fwd[i:]
                self.close_forwards(frames)
                return frames[0]
        return None

    def close_forwards(self, frames: list[Frame]) -> None:
        """Close forward frames innermost first; each hands its high-water mark to its parent
        (``after_op`` only updates the innermost running frame)."""
        for i in range(len(frames) - 1, -1, -1):
            f = frames[i]
            parent = frames[i - 1] if i else (self.fwd[-1] if self.fwd else None)
            if parent is not None and f.hwm > parent.hwm:
                parent.hwm = f.hwm
            self._close_frame(f, backward_call=False)
            if parent is not None and f.alloc is not None and parent.alloc is not None:
                # closing f took the last interval's allocator peak; a parent closed in the same
                # batch (after a BaseException) is no longer running and must get it from f
                parent.alloc[2] = max(parent.alloc[2], f.alloc[2])
                parent.alloc[3] = max(parent.alloc[3], f.alloc[3])

    def _close_frame(self, f: Frame, backward_call: bool) -> None:
        """Record a finished module call: its temporary high-water mark (under the forward or
        backward call it was), allocator deltas and timeline span. A forward that runs inside
        backward (checkpoint recompute) counts as a forward call in the backward phase."""
        host = self.host
        step = self.steps[-1]
        if host.strategy.measures_temporary():
            temps = step.bwd_temp if backward_call else step.fwd_temp
            temp = max(0, f.hwm - f.level - f.kept)
            if temp > temps.get(f.fqn, -1):
                temps[f.fqn] = temp
            if self.recorder is not None and f.fqn == "":
                self.recorder.root_call(step.index, backward_call, f)
        phase = BACKWARD if f.in_backward else FORWARD
        if host.allocator is not None:
            host.allocator.exit(self.probe_view(), f, sample=host.strategy.samples_allocator)
        if self.record_timeline:
            self.spans.append((f.fqn, phase, f.t0, time.perf_counter_ns(), step.index))

    def backward_exit(self, frame: Frame) -> None:
        self.host.strategy.boundary()
        if frame in self.bwd:
            self.bwd.remove(frame)
            self._close_frame(frame, backward_call=True)

    def _backward_start(self, task: int) -> None:
        self.bw_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._backward_task_done(task)
        )

    def _backward_task_done(self, task: int, deferred: bool = False) -> None:
        if not deferred and fsdp_tp.final_callback_pending(self.host.comm.units):
            # FSDP queued its end-of-backward callback (the last reduce-scatters) after ours:
            # the pass ends after it. Once only: FSDP's may belong to an outer graph task.
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._backward_task_done(task, deferred=True)
            )
            return
        self.bw_tasks.discard(task)
        if not self.bw_tasks:
            self.backward_end()

    def backward_end(self) -> None:
        """A backward pass finished: close open module frames; the session reads the
        gradients."""
        for f in reversed(self.bwd):
            self._close_frame(f, backward_call=True)
        self.bwd.clear()
        self.bw_tasks.clear()
        step = self.steps[-1]
        step.backwards += 1
        self._tail = BACKWARD
        self.host.backward_done(step)
