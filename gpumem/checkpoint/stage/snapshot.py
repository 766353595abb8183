"""One save's snapshot: the copy of its tensors into the host arena, and the hand-off to the writes.

Two threads copy. The caller's thread (inside save()) copies what must be copied before save()
returns: everything in blocking and streaming mode, only buffers/RNG/extras in overlap mode. In
overlap mode a copier thread (a Checkpointer's long-lived ``Worker``) copies the deferred tensors
(parameters, optimizer state) beside the next forward/backward, and the optimizer's pre-step hook
waits for it (``fence``: on CUDA the optimizer's stream is ordered after the copy instead).
Where no core is free for that copy (torch computes on every core, ``workers.copy_beside_training``)
an overlap save of host tensors copies them at once on the caller's thread with every core, the
chunk CRCs computed by the copy itself, and only the writes run beside training.

The writes (``storage.commit``, on the persist thread) consume the snapshot batch by batch:
``wait_ready(b)`` returns once batch b is staged, ``release(b)`` hands its slot back. In
streaming mode the caller and the persist thread form a two-slot pipeline: the caller copies
batch b+1 while batch b is written and checksummed; a slot is reused only after both. Overlap
mode over host tensors copied beside training, and blocking mode over host tensors, with several
batches pipeline the same way, every batch resident: batch b is written beside the copy of b+1,
so the write hides the copy instead of following it. Blocking mode computes no checksum before
the whole state is staged, so no checksum thread takes a core from the copy the caller waits
for (the writes take little CPU: DMA from the arena). An overlap save
copied at once (no core free) keeps its copy alone, writing only after it: there the stall is
the training loop's, and each file written beside the copy lengthened it.

Any failure on either side is recorded once (``fail``), wakes the other side and reaches the
caller through Checkpointer.wait()/save()/close().
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..capture.codec import TensorTable
from ..stats import SaveStats
from ..workers import background_threads, copy_beside_training
from .host_copy import HostViews, cold_bytes, copy_pieces, zero_padding
from .pieces import StagingPlan
from .spill import SpillControl, spill_at_fence


class Mode(str, enum.Enum):
    """How a save copies its tensors into host memory (a ``str``: ``Mode.OVERLAP == "overlap"``).

    Attributes:
        OVERLAP: buffers, RNG states and extras before save() returns, parameters and optimizer
            state after, beside the next forward/backward, fenced by the optimizer's pre-step
            hook.
        BLOCKING: everything before save() returns.
        STREAMING: the state is larger than the staging budget and streams through two slots,
            batch b written while batch b+1 is copied; save() returns once all is copied.
    """

    OVERLAP = "overlap"
    BLOCKING = "blocking"
    STREAMING = "streaming"


class Snapshot:
    """The copy of one save's tensors into ``arena`` by ``plan`` (see the module docstring).

    Args:
        table: the tensors (``capture.codec.TensorTable``); ``deferred`` marks what overlap mode
            copies after save() returns.
        plan: where each piece goes (``plan.StagingPlan``).
        arena: the host arena (or staging slot) the plan is laid out in.
        mode: OVERLAP, BLOCKING or STREAMING.
        chunk: CRC32C chunk bytes (device pieces are checksummed as they are copied).
        stats: the save's SaveStats, whose copy figures this fills in.
        t0: when save() was entered (``time.perf_counter``).
        copier: the worker that runs the overlap copy (``workers.Worker``).
        side_stream: the CUDA stream of the background copy (None: no CUDA state).
        zero_gaps: False when this plan's alignment gaps are known to be zero in this arena.
        views: byte views of CPU tensors kept from the previous save (``HostViews``).
    """

    def __init__(
        self,
        table: TensorTable,
        plan: StagingPlan,
        arena: Any,
        mode: Mode | str,
        *,
        chunk: int,
        stats: SaveStats,
        t0: float,
        copier: Any,
        side_stream: Any = None,
        zero_gaps: bool = True,
        views: HostViews | None = None,
    ):
        mode = Mode(mode)
        self.table, self.plan, self.arena, self.mode = table, plan, arena, mode
        self.chunk, self.stats, self.t0 = chunk, stats, t0
        self.side_stream = side_stream
        self._copier = copier
        # streaming reuses slots with other layouts, so it always zeroes
        self.zero_gaps = zero_gaps or mode is Mode.STREAMING
        # overlap mode over host tensors with no core free for a background copy: copied at
        # once on the caller's thread with every core, CRCs included (workers.py says why);
        # only the writes then run beside training
        self.copy_now = copies_at_once(table, mode is Mode.OVERLAP)
        # batch by batch, each written as soon as it is staged (``pipelines``): the write hides
        # the copy instead of following it. On a 2.8 GB/s disk (865 MiB, 2 cores) a blocking
        # save's time to durable went from 1.19x to 1.04x a raw write, its stall from 1.01x to
        # 1.08x the floor copy; copied at once in a training loop, the stall per save rose from
        # 10.5 to 14.3 ms, so that copy stays alone.
        self.batched = mode is Mode.STREAMING or (
            len(plan.batch_sizes) > 1 and pipelines(table, mode is Mode.OVERLAP)
        )
        self.gaps_zero = False  # set once every batch's gaps are zero in the arena (not streaming)
        self.views = views if views is not None else HostViews()
        # overlap mode: whether this rank copies tensors after save() returns, i.e. whether the
        # optimizer hook must wait (a replicated save's rank that owns no parameter or optimizer
        # state has nothing to copy later and never waits)
        self.defers = (
            mode is Mode.OVERLAP
            and not self.copy_now
            and any(table.deferred[p.index] for p in plan.pieces)
        )
        # the one CUDA device of the deferred tensors (None: none, or several), for fence()
        self.fence_device: int | None = None
        if self.defers and table.has_cuda:
            devices = {
                table.tensors[p.index].device for p in plan.pieces if table.deferred[p.index]
            }
            one = next(iter(devices)) if len(devices) == 1 else None
            self.fence_device = one.index if one is not None and one.type == "cuda" else None
        # the native threads of the work done beside training, the cores training leaves free
        # (workers.py): overlap mode's copier, and the checksums and writes of overlap and
        # blocking saves (both run after save() returns); None (streaming, which save() waits
        # for): all
        self.threads: int | None = None if mode is Mode.STREAMING else background_threads()
        self.spill: SpillControl | None = None  # the device spill (overlap mode, opt-in)
        self.copy_event: Any = None  # the background copy's completion event, once enqueued
        self.enqueued = threading.Event()  # set once the background copy is enqueued (or failed)
        self.staged = threading.Event()
        self.error: BaseException | None = None
        self.caller_failed = False
        self.finished = False  # finish() ran: the arena is no longer used
        self._cond = threading.Condition()
        self._ready = 0  # batches fully staged
        self._released = 0  # batches written (their slot may be reused)
        self._copied: threading.Event | None = None  # set by the overlap copier when it is finished
        self._sync_event: Any = None
        self._save_event: Any = None
        self._fence_events: tuple[Any, Any] | None = None  # (before, after) the fence's waits

    @property
    def beside_training(self) -> bool:
        """Whether the checksums and writes run while training goes on (after save() returns):
        every mode but streaming, which save() waits for."""
        return self.mode is not Mode.STREAMING

    # ------------------------------------------------------------------ the caller's thread

    def run_caller(self) -> None:
        """The part of save() that runs on the caller's thread; a failure is recorded (``fail``)
        and flagged in ``caller_failed``, never raised."""
        plan, deferred = self.plan, self.table.deferred
        try:
            if self.mode is Mode.OVERLAP and not self.copy_now:
                self._zero_all_gaps()
                # buffers/RNG on the compute stream: ordered before the next forward mutates them
                sync = [p for p in plan.pieces if not deferred[p.index]]
                self.stats.cold_bytes += cold_bytes(self.arena, plan, sync)
                self._sync_event = copy_pieces(
                    self.arena, plan, sync, self.table.tensors, self.chunk, views=self.views
                )
                self._save_event = _record_event() if self.table.has_cuda else None
                copied = threading.Event()
                self._copier.submit(lambda: self._copier_main(copied))
                self._copied = copied  # only once submitted: finish() waits for it
                return
            self._produce(None, None, None, None)
        except BaseException as exc:
            self.caller_failed = True
            self.fail(exc)

    def _produce(
        self, want: Any, stream: Any, wait_event: Any, sync_event: Any, threads: int | None = None
    ) -> None:
        """Copy the pieces ``want`` selects (None: all). Streaming: batch after batch, each marked
        ready once complete, so the persist thread writes batch b while batch b+1 is copied (a
        slot is reused only once written); overlap and blocking mode over host tensors do the
        same with every slot resident. Otherwise (CUDA state, one batch) nothing is written
        before the copy ends, so all batches
        go in one group: one native call (one fan-out over the threads instead of one per
        batch)."""
        # finish() may drop self.table on failure: keep what is needed here
        plan, tensors = self.plan, self.table.tensors
        batches = range(len(plan.batch_sizes))
        groups = [[b] for b in batches] if self.batched else [list(batches)]
        if self.mode is Mode.BLOCKING or self.copy_now:  # overlap zeroed them in save(),
            self._zero_all_gaps()  # streaming does it per slot
        for g, group in enumerate(groups):
            with self._cond:
                while group[0] - self._released >= plan.slots and self.error is None:
                    self._cond.wait()
                if self.error is not None:
                    return
            if self.mode is Mode.STREAMING:
                zero_padding(self.arena, plan, group[0])
            pieces = plan.batch_pieces(group[0]) if self.batched else plan.pieces
            if want is not None:
                pieces = [p for p in pieces if want(p)]
            self.stats.cold_bytes += cold_bytes(self.arena, plan, pieces)
            t = time.perf_counter()
            ev = copy_pieces(
                self.arena,
                plan,
                pieces,
                tensors,
                self.chunk,
                stream=stream,
                wait_event=wait_event,
                views=self.views,
                spill=self.spill if stream is not None else None,  # the copier's deferred part
                threads=threads,
                # beside training (overlap): one pass over memory for the copy and the CRCs
                checksum=self.mode is Mode.OVERLAP,
            )
            # host pieces are copied by now; the device ones are ordered before ev
            self.copy_event = ev
            self.enqueued.set()
            if ev is not None:  # the copies must be complete before the state counts as staged
                self._synchronized(ev, t)
            if g == 0 and sync_event is not None:
                sync_event.synchronize()
            with self._cond:
                self._ready = group[-1] + 1
                self._cond.notify_all()
        self._mark_staged()

    def _synchronized(self, ev: Any, t: float) -> None:
        """Wait for a device copy enqueued at ``t`` and account its time."""
        ev.synchronize()
        self.stats.d2h_s += time.perf_counter() - t
        copy_s, crc_s = ev.device_times()
        self.stats.copy_device_s += copy_s
        self.stats.crc_device_s += crc_s

    def _zero_all_gaps(self) -> None:
        """Zero every batch's alignment gaps unless they are known to be zero already."""
        if self.zero_gaps:
            for b in range(len(self.plan.batch_sizes)):
                zero_padding(self.arena, self.plan, b)
        self.gaps_zero = True

    def _copier_main(self, copied: threading.Event) -> None:
        deferred = self.table.deferred
        try:
            self._produce(
                lambda p: deferred[p.index],
                self.side_stream,
                self._save_event,
                self._sync_event,
                self.threads,
            )
        except BaseException as exc:
            self.fail(exc)
        finally:
            copied.set()

    # ------------------------------------------------------------------ the optimizer's hook

    def wait_staged(self) -> None:
        self.staged.wait()

    def fence(self) -> bool:
        """For the optimizer pre-step hook: order the calling thread's CUDA stream after the
        background copy instead of blocking the CPU until the copy completes. The optimizer's
        kernels queue behind it, so no parameter changes before it was read (the device CRCs
        included), while the host goes on enqueueing. Waits on the CPU only until the copy is
        enqueued (host pieces are copied by then). With a device spill buffer (``spill``) the
        copies not yet enqueued are copied into it device to device instead, as far as they fit
        (spill.py). False when it cannot: the deferred tensors live on several devices or the
        host only, or on a device that is not the caller's current one, or the copy failed; the
        caller then waits for ``staged``."""
        if self.fence_device is None:
            return False
        current = torch.cuda.current_device()
        if self.spill is not None and self.error is None and current == self.fence_device:
            stream = torch.cuda.current_stream()
            before = _timing_event()
            if spill_at_fence(self.spill, stream) is not None:
                if self._sync_event is not None:
                    stream.wait_event(self._sync_event)
                self._fence_events = (before, _timing_event())
                self.stats.spill_bytes = self.spill.spill_bytes
                return True
        self.enqueued.wait()
        ev = self.copy_event
        if ev is None or self.error is not None or current != self.fence_device:
            return False
        stream = torch.cuda.current_stream()
        before = _timing_event()
        if self._sync_event is not None:  # buffers copied by save() itself, on its stream
            stream.wait_event(self._sync_event)
        ev.wait(stream)  # the copies and the device CRCs: both read the parameters
        self._fence_events = (before, _timing_event())
        return True

    def _account_fence(self) -> None:
        """``stats.fence_s``: how long the fenced stream stood still at the fence (CUDA events
        around its waits), once the stream has passed it."""
        fence, self._fence_events = self._fence_events, None
        if fence is not None:
            fence[1].synchronize()
            self.stats.fence_s += fence[0].elapsed_time(fence[1]) / 1e3

    # ------------------------------------------------------------------ the writes' side

    def wait_ready(self, b: int) -> int:
        """Wait until batch ``b`` is staged; returns how many batches are. Raises the save's
        failure, should there be one."""
        with self._cond:
            while self._ready <= b and self.error is None:
                self._cond.wait()
            ready = self._ready
        if self.error is not None:
            raise self.error
        return ready

    def release(self, end: int) -> None:
        """Batches below ``end`` are written: their slots may be reused."""
        with self._cond:
            self._released = end
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Record the save's failure (the first one counts) and wake whoever waits on it."""
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()
        if self.spill is not None:  # a fence waiting for the copier to stop gives up
            self.spill.finish()
        self.enqueued.set()
        self.staged.set()

    def finish(self) -> None:
        """Once the writes are done: account the fence, wait for the copier, and drop every
        reference to the caller's tensors (and the CRC tensors, in the manifest by now or not
        needed). Done before the save counts as done: once wait() returns the interpreter may
        exit, and a daemon thread still freeing tensors then is killed inside torch
        (std::terminate, SIGABRT)."""
        with contextlib.suppress(Exception):  # a statistic: never the reason a save fails
            self._account_fence()
        if self._copied is not None:
            self._copied.wait()
        self.table = TensorTable()
        for p in self.plan.pieces:
            p.crc = None
        self.staged.set()
        self.finished = True

    def _mark_staged(self) -> None:
        if not self.staged.is_set():
            self.stats.staged_s = time.perf_counter() - self.t0
            self.staged.set()


def copies_at_once(table: TensorTable, overlap: bool) -> bool:
    """Whether an overlap save of ``table`` copies at once on the caller's thread: host tensors
    with no core free for a copy beside training (``workers.copy_beside_training``)."""
    return overlap and not table.has_cuda and not copy_beside_training()


def pipelines(table: TensorTable, overlap: bool) -> bool:
    """Whether a save's data files are written beside the copy of the next (a snapshot in
    ``batched`` mode when the state fits): host tensors, in blocking mode or in overlap mode
    copied beside training. Only then do its files pay to be small (``pieces.segment_for``);
    an overlap save copied at once writes after its copy, where each file only adds its
    creation and sync to the CPU the save takes from training. CUDA state is copied in one
    native call and written after it."""
    return not table.has_cuda and not copies_at_once(table, overlap)


def fence_hook(snapshot: Callable[[], Snapshot | None]) -> Callable[..., None]:
    """An optimizer pre-step hook for overlap mode: before the step mutates parameters and
    optimizer state, wait for the background copy of the save in flight (``snapshot()``), or
    on CUDA fence the optimizer's stream after it (``Snapshot.fence``); the wait is counted in
    its ``hook_wait_s``."""

    def wait_for_snapshot(opt: Any, args: Any, kwargs: Any) -> None:
        snap = snapshot()
        if snap is not None and snap.defers and not snap.staged.is_set():
            t = time.perf_counter()
            if not snap.fence():  # CUDA: the optimizer's kernels queue behind the copy instead
                snap.wait_staged()
            snap.stats.hook_wait_s += time.perf_counter() - t

    return wait_for_snapshot


def _timing_event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _record_event() -> Any:
    ev = torch.cuda.Event()
    ev.record()
    return ev
