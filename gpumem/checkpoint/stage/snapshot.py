"""One save in flight: the copy into the arena, the background persist and the commit.

Two threads share a job. The caller's thread (inside save()) copies what must be copied before
save() returns: everything in blocking and streaming mode, only buffers/RNG/extras in overlap mode.
A copier thread copies the deferred tensors in overlap mode. The persist thread writes one data
file per batch (up to four at once) and commits; a checksum thread hashes host-staged bytes. The
copier and persist threads are a Checkpointer's two long-lived Workers, so only its first save()
waits for threads to start. In blocking mode writes and checksums start only once the whole
state is staged, so they never take cores or memory bandwidth from the copy the caller waits
for. In streaming mode the caller and the persist thread form a two-slot pipeline: the caller
copies batch b+1 while batch b is written and checksummed; a slot is reused only after both.
Overlap mode over host tensors with several batches pipelines the same way, every batch
resident: nobody waits for its copy, so writing batch b beside the copy of b+1 only makes the
checkpoint durable sooner. Any
failure on either side is recorded, wakes the other side and reaches the caller through
Checkpointer.wait()/save()/close().
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import persist
from .codec import TensorTable
from .consistency import (
    check_agreement,
    check_complete,
    check_layout,
    global_fields,
    layout_blob,
    sections,
)
from .errors import (
    CheckpointBranchWarning,
    CheckpointError,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
)
from .format import DTYPE_NAMES, MAIN_MANIFEST, data_file_name, shard_manifest_name
from .options import Mode, SaveOptions
from .replicated import Replication, check_signatures, signature
from .safe_fs import Dir
from .snapshot import (
    ArenaLayout,
    HostViews,
    checksum_cpu_pieces,
    copy_pieces,
    tensor_crcs,
    zero_padding,
)
from .spill import SpillControl, spill_at_fence


@dataclass
class SaveStats:
    """What one save cost. ``stall_s`` is what training lost: save() time plus optimizer-hook waits.

    Attributes:
        step: the step saved.
        nbytes: tensor bytes this rank staged (with replicated=True, its share).
        mode: "overlap", "blocking" or "streaming".
        save_s: time save() blocked the caller (including back-pressure from the previous save).
        hook_wait_s: time optimizer.step() waited for the background copy (overlap mode), on the
            host: with CUDA state only until the copy was enqueued (the fence then makes the
            optimizer's stream wait instead).
        fence_s: how long the optimizer's CUDA stream stood still at that fence (CUDA events;
            0 without a fence, or when the copy had completed before the stream got there).
        spill_bytes: bytes the fence copied into the device spill buffer (``device_spill_bytes``;
            0: none).
        staged_s: from save() entry until every tensor was in host memory.
        d2h_s: of that, the time from enqueuing the first device-to-host copy until the copies
            and the device CRCs completed (0 without CUDA tensors); ``nbytes / d2h_s`` is the
            snapshot's D2H throughput.
        copy_device_s, crc_device_s: on the device (CUDA events), from the point the snapshot's
            streams started until the copies, and the CRCs, completed (they run side by side).
        durable_s: from save() entry until the checkpoint was committed.
        set_aside: checkpoints of an abandoned branch this save moved to ``abandoned/`` (it
            saved a step lower than committed ones; see ``persist.set_aside_newer``).
        committed: the step's directory was renamed into place: the checkpoint is durable and
            restore() finds it, whatever happens to ``latest`` afterwards.
        latest_error: why the ``latest`` pointer was not moved to this step although it was
            committed (empty: it was, or the save did not get that far).
        superseded_by: with ``coalesce=True``, the step whose snapshot replaced this one before
            it was written (None: not superseded; such a save is never committed).
        supersedes: with ``coalesce=True``, the step this save replaced (None: none).
    """

    step: int
    nbytes: int
    mode: str
    save_s: float = 0.0
    hook_wait_s: float = 0.0
    staged_s: float = 0.0
    d2h_s: float = 0.0
    fence_s: float = 0.0
    spill_bytes: int = 0
    copy_device_s: float = 0.0
    crc_device_s: float = 0.0
    durable_s: float = 0.0
    set_aside: tuple[str, ...] = ()
    committed: bool = False
    latest_error: str = ""
    superseded_by: int | None = None
    supersedes: int | None = None

    @property
    def stall_s(self) -> float:
        return self.save_s + self.hook_wait_s

    @property
    def status(self) -> str:
        """ "committed", "committed; latest not updated (why)", or "not committed" (yet, or
        because the save failed: wait() says which)."""
        if self.superseded_by is not None:
            return f"superseded by step {self.superseded_by} (not written)"
        if not self.committed:
            return "not committed"
        if self.latest_error:
            return f"committed; latest not updated ({self.latest_error})"
        return "committed"


_WRITERS = 4  # data files written at once outside streaming mode


class Worker:
    """A daemon thread, started on first use, that runs submitted calls one after another.

    save() hands its background work (persist, overlap copy) to a Checkpointer's workers rather
    than to new threads: Thread.start() returns only once the new thread has run, and a thread
    that goes on running Python keeps the GIL from the starter for up to the switch interval
    (5 ms), which save() would spend waiting. A submitted call must not raise.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._queue = (
                queue.SimpleQueue()
            )  # each thread its own: a stopping one takes nothing new
            self._thread = threading.Thread(
                target=_serve, args=(self._queue,), name=self.name, daemon=True
            )
            self._thread.start()
        self._queue.put(fn)

    def stop(self) -> None:
        """Let the thread end once the calls submitted so far have run."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None


def _serve(calls: queue.SimpleQueue) -> None:
    while (fn := calls.get()) is not None:
        fn()
        # Let go of the job at once, while its Checkpointer still holds it: released later, at
        # stop() say, this could be its last reference, and freeing it here during interpreter
        # exit is what _persist_main's cleanup guards against.
        del fn


class SaveJob:
    """One save: the copy into the arena (the caller's thread and, in overlap mode, the copier
    thread) and the persist and commit (the persist thread); see the module docstring."""

    def __init__(
        self,
        options: SaveOptions,
        *,
        root: Dir | None,
        step: int,
        tree: dict[str, Any],
        table: TensorTable,
        plan: ArenaLayout,
        arena: Any,
        mode: Mode | str,
        t0: float,
        zero_gaps: bool = True,
        views: HostViews | None = None,
        replication: Replication | None = None,
    ):
        o = self.options = options
        mode = Mode(mode)
        self.root, self.step, self.tree, self.table, self.plan = root, step, tree, table, plan
        self.root_path = o.root_path  # for messages; ranks other than 0 open ``root`` on first use
        # replicated save: what this rank owns and records (see replicated.py)
        self.replication = replication
        self.arena, self.mode, self.t0 = arena, mode, t0
        self.chunk, self.alignment, self.direct = o.chunk, o.alignment, o.direct
        self.group, self.keep, self.versions, self.side_stream = (
            o.group,
            o.keep,
            o.versions,
            o.side_stream,
        )
        # False: the caller knows this plan's alignment gaps are still zero in this arena (see
        # Checkpointer.save); streaming reuses slots with other layouts, so it always zeroes
        self.zero_gaps = zero_gaps or mode is Mode.STREAMING
        # batch by batch, each written as soon as it is staged: streaming mode, and overlap mode
        # over host tensors with several batches, whose copy no caller waits for (unless the
        # next optimizer step comes first): its write then hides the copy instead of following
        # it. Blocking mode keeps the copy alone, as the caller waits for it.
        self.batched = mode is Mode.STREAMING or (
            mode is Mode.OVERLAP and not table.has_cuda and len(plan.batch_sizes) > 1
        )
        self.gaps_zero = False  # set once every batch's gaps are zero in the arena (not streaming)
        self.views = views if views is not None else HostViews()  # byte views of the CPU tensors
        self.stats = SaveStats(step, sum(p.nbytes for p in plan.pieces), mode.value)
        # overlap mode: whether this rank copies tensors after save() returns, i.e. whether the
        # optimizer hook must wait (a replicated save's rank that owns no parameter or optimizer
        # state has nothing to copy later and never waits)
        self.defers = mode is Mode.OVERLAP and any(table.deferred[p.index] for p in plan.pieces)
        # the one CUDA device of the deferred tensors (None: none, or several), for fence()
        self.fence_device: int | None = None
        if self.defers and table.has_cuda:
            devices = {
                table.tensors[p.index].device for p in plan.pieces if table.deferred[p.index]
            }
            one = next(iter(devices)) if len(devices) == 1 else None
            self.fence_device = one.index if one is not None and one.type == "cuda" else None
        self.copy_event: Any = None  # the background copy's completion event, once enqueued
        self.enqueued = threading.Event()  # set once the background copy is enqueued (or failed)
        self.error: BaseException | None = None
        self.reported = False
        self.caller_failed = False
        self.committed: Path | None = None
        self._committed_name: str | None = None
        self._tmp: Dir | None = None  # the open temporary directory of this save
        self._shared_blocks = False  # several ranks write one DTensor block (check_layout)
        self._cond = threading.Condition()
        self._ready = 0  # batches fully staged
        self._released = 0  # batches written (their slot may be reused)
        self._persister, self._copier = o.workers
        self._persist_started = False
        self._copied: threading.Event | None = None  # set by the overlap copier when it is finished
        self._sync_event: Any = None
        self._save_event: Any = None
        # coalesce=True: the Coalescer; its claim() says, when the persist thread gets to this
        # save, whether to write it (False: a newer save superseded it)
        self.coalescer: Any = None
        self._fence_events: tuple[Any, Any] | None = None  # (before, after) the fence's waits
        self.spill: SpillControl | None = None  # the device spill (overlap mode, opt-in)
        self.staged = threading.Event()
        self.done = threading.Event()

    # ------------------------------------------------------------------ caller side

    def run_caller(self) -> None:
        """The part of save() that runs on the caller's thread."""
        plan, deferred = self.plan, self.table.deferred
        try:
            if self.mode is Mode.OVERLAP:
                self._zero_all_gaps()
                # buffers/RNG on the compute stream: ordered before the next forward mutates them
                sync = [p for p in plan.pieces if not deferred[p.index]]
                self._sync_event = copy_pieces(
                    self.arena, plan, sync, self.table.tensors, self.chunk, views=self.views
                )
                self._save_event = _record_event() if self.table.has_cuda else None
                copied = threading.Event()
                self._copier.submit(lambda: self._copier_main(copied))
                self._copied = copied  # only once submitted: the persist thread waits for it
                self._start_persist()
                return
            if self.mode is Mode.STREAMING:  # the persist thread writes batch b while b+1 is copied
                self._start_persist()
            self._produce(None, None, None, None)
            self._start_persist()  # outside streaming it would only wait for the copy
        except BaseException as exc:
            self.caller_failed = True
            self._fail(exc)
            self._start_persist()  # the persist thread still runs, to tell the other ranks

    def _start_persist(self) -> None:
        if not self._persist_started:
            self._persist_started = True
            self._persister.submit(self._persist_main)

    def _produce(self, want: Any, stream: Any, wait_event: Any, sync_event: Any) -> None:
        """Copy the pieces ``want`` selects (None: all). Streaming: batch after batch, each marked
        ready once complete, so the persist thread writes batch b while batch b+1 is copied (a
        slot is reused only once written); overlap mode over host tensors does the same with
        every slot resident. Otherwise nothing is written before the copy ends, so all batches
        go in one group: one native call (one fan-out over the threads instead of one per
        batch)."""
        # the persist thread may drop self.table on failure: keep what is needed here
        plan, tensors = self.plan, self.table.tensors
        batches = range(len(plan.batch_sizes))
        groups = [[b] for b in batches] if self.batched else [list(batches)]
        if not self.batched and self.mode is not Mode.OVERLAP:  # overlap zeroed them in save()
            self._zero_all_gaps()
        for g, group in enumerate(groups):
            with self._cond:
                while group[0] - self._released >= plan.slots and self.error is None:
                    self._cond.wait()
                if self.error is not None:
                    return
            if self.batched and self.mode is not Mode.OVERLAP:
                zero_padding(self.arena, plan, group[0])
            pieces = plan.batch_pieces(group[0]) if self.batched else plan.pieces
            if want is not None:
                pieces = [p for p in pieces if want(p)]
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
        """Wait for a device snapshot enqueued at ``t`` and account its time."""
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
                lambda p: deferred[p.index], self.side_stream, self._save_event, self._sync_event
            )
        except BaseException as exc:
            self._fail(exc)
        finally:
            copied.set()

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

    # ------------------------------------------------------------------ persist thread

    def _persist_main(self) -> None:
        try:
            if self.coalescer is None or self.coalescer.claim(self):
                self._persist()
        except BaseException as exc:
            self._fail(exc)
        finally:
            if self.coalescer is not None:
                self.coalescer.release(self)
            with contextlib.suppress(Exception):  # a statistic: never the reason a save fails
                self._account_fence()
            if self._copied is not None:
                self._copied.wait()
            # Drop the references to the caller's tensors as soon as they are no longer needed,
            # and before done is set: once wait() returns the interpreter may exit, and a daemon
            # thread still freeing tensors then is killed inside torch (std::terminate, SIGABRT).
            self.table = TensorTable()
            for p in self.plan.pieces:  # CRC tensors too (in the manifest by now, or not needed)
                p.crc = None
            if self._tmp is not None:
                self._tmp.close()
            self.staged.set()
            self.done.set()

    def _persist(self) -> None:
        g, plan = self.group, self.plan
        ok, local_error = 1, None
        tmp_name = persist.tmp_name(self.step)
        where = self.root_path / tmp_name
        if g.rank == 0:
            try:
                assert self.root is not None  # rank 0 opened it in the constructor
                # what a failed save could not remove is removed now (the lock is ours and no
                # other save is in flight)
                persist.clean_stale(self.root)
                self._tmp = persist.prepare_tmp(self.root, self.step)
            except OSError as exc:
                local_error, ok = CheckpointIOError.wrap(exc, f"creating {where}"), 0
        # One collective tells every rank whether rank 0 created the directory, whether all ranks
        # save the same step and sections and declared the same replicated state, before anything
        # is written. Rank 0 created the directory already: a rank that never joins (save() called
        # on some ranks only) makes join() raise on every rank that did, naming it. A sharded save
        # then all-gathers every rank's block layout, which every rank checks (check_layout) before
        # writing: the commit then needs only each rank's shard manifest CRC and size.
        try:
            sig = signature(self.tree, self.replication, self.chunk)
        except Exception as exc:
            local_error, ok, sig = exc, 0, signature(self.tree, None, self.chunk)
        blob = layout_blob(self.table)
        try:
            g.join(f"save(step={self.step})")
            gathered = g.all_gather([ok, self.step, sections(self.tree), len(blob), *sig])
            sizes = [row[3] for row in gathered]
            blobs = g.all_gather_bytes(blob, sizes) if any(sizes) else []
        except CheckpointError:
            self._discard(tmp_name)
            raise
        bad = [r for r, row in enumerate(gathered) if not row[0]]
        if bad:
            self._discard(tmp_name)
            raise local_error or CheckpointIOError(
                f"rank(s) {bad} failed before writing (rank 0 "
                f"creates {where}); step {self.step} was not saved"
            )
        try:
            check_agreement([row[1:3] for row in gathered])
            check_signatures([row[4:] for row in gathered])
            self._shared_blocks = check_layout(blobs) if blobs else False
        except CheckpointError:
            self._discard(tmp_name)
            raise
        files: dict[str, int] = {}
        # Batch b is written as soon as it is staged; its checksums are computed beside the write
        # (the disk is the bottleneck there), never beside the caller's copy (see _checksum_main).
        crc_done = [threading.Event() for _ in plan.batch_sizes]
        crc_thread = threading.Thread(
            target=self._checksum_main,
            args=(crc_done,),
            daemon=True,
            name=f"gpumem-ckpt-crc-{self.step}",
        )
        crc_thread.start()
        try:
            tmp = self._open_tmp(tmp_name)
            if not self.batched:
                # Writing beside the copy takes memory bandwidth from it (~10-30 % on a small
                # host), and the copy is what training waits for; the write starts once it ends.
                # Then the files are written concurrently: the disk queue never drains while one
                # file's fdatasync waits, so the whole write takes about what one large file takes.
                self.staged.wait()
                if self.error is not None:
                    raise self.error
                files.update(self._write_all(tmp, range(len(plan.batch_sizes))))
                for ev in crc_done:
                    ev.wait()
                if self.error is not None:
                    raise self.error
            n, b = (len(plan.batch_sizes) if self.batched else 0), 0
            while b < n:
                with self._cond:
                    while self._ready <= b and self.error is None:
                        self._cond.wait()
                    ready = self._ready
                if self.error is not None:
                    raise self.error
                # Batch b alone while later ones are still being copied (the write hides the
                # copy); once the rest is staged too, the rest at once: one file's fdatasync then
                # never leaves the disk queue empty while the next file waits to be written.
                todo = range(b, n if ready == n else b + 1)
                files.update(self._write_all(tmp, todo))
                for c in todo:  # a slot is reused only once its checksums are taken too
                    crc_done[c].wait()
                if self.error is not None:
                    raise self.error
                b = todo[-1] + 1
                with self._cond:
                    self._released = b
                    self._cond.notify_all()
            shard_crc = persist.write_manifest(
                tmp, shard_manifest_name(g.rank), self._shard_body(files)
            )
        except BaseException as exc:
            self._fail(exc)
            local_error, ok, shard_crc = exc, 0, 0
        crc_thread.join()
        gathered = g.all_gather([ok, shard_crc, self.stats.nbytes, int(self.table.sharded)])
        bad = [r for r, row in enumerate(gathered) if not row[0]]
        if bad:
            self._discard(tmp_name)  # nobody writes any more: free the space a failed save took
            raise (
                _as_error(local_error, self.step)
                if local_error
                else CheckpointIOError(
                    f"rank(s) {bad} failed to write their "
                    f"shards; step {self.step} was not committed"
                )
            )
        ok = 1
        if g.rank == 0:
            try:
                self._commit(tmp, gathered)
            except BaseException as exc:
                local_error, ok = exc, 0
                # not committed: its space is freed now, not at the next start (a full disk
                # would stay full); a step moved aside to be replaced goes back into place
                assert self.root is not None
                persist.clean_stale(self.root)
        if g.all_reduce(ok, "min") == 0:
            # every rank raises rank 0's reason (a sharded save it found incomplete, say)
            text = ""
            if local_error is not None:
                state = isinstance(local_error, CheckpointStateError)
                text = (_STATE if state else "") + str(local_error)
            reason = g.broadcast_text(text, 0)
            if local_error is not None:
                raise _as_error(local_error, self.step)
            if reason.startswith(_STATE):
                raise CheckpointStateError(reason[len(_STATE) :])
            raise CheckpointIOError(f"rank 0 failed to commit step {self.step}: {reason}")
        if not self.stats.durable_s:  # ranks other than 0: durable once rank 0 committed
            self.stats.durable_s = time.perf_counter() - self.t0
        self.stats.committed = True
        if g.rank == 0 and self._committed_name is not None:
            # cleanup, after the other ranks know the step is committed: they do not wait for it
            self._retain(self._committed_name)

    def _open_tmp(self, name: str) -> Dir:
        """The temporary directory: rank 0 created it; the others open it (and, on first use,
        the root) once rank 0 said it exists."""
        if self._tmp is None:
            if self.root is None:
                self.root = Dir.open(self.root_path)
            self._tmp = self.root.sub(name)
        return self._tmp

    def _discard(self, tmp_name: str) -> None:
        """Rank 0: remove a failed save's temporary directory (best effort: the next save or
        start retries)."""
        if self.group.rank == 0 and self.root is not None:
            self.root.discard_tree(tmp_name)

    def _write_batch(self, tmp: Dir, b: int) -> tuple[str, int]:
        """Write batch b's slot as data file b (fdatasync'ed); returns (file name, size)."""
        name, size = data_file_name(self.group.rank, b), self.plan.batch_sizes[b]
        buf = self.arena.view(self.plan.slot_base(b), size) if size else None
        tmp.write_pieces(name, [(0, buf)] if buf is not None else [], size, self.direct)
        return name, size

    def _write_all(self, tmp: Dir, batches: range) -> list[tuple[str, int]]:
        """The given batches written by up to _WRITERS plain threads (an executor would refuse
        work at interpreter exit, when a save in flight must still finish); one batch is written
        on the calling thread."""
        n = len(batches)
        if n == 1:
            return [self._write_batch(tmp, batches[0])]
        results: list[tuple[str, int] | None] = [None] * n
        errors: list[BaseException] = []
        todo = iter(range(n))
        lock = threading.Lock()

        def worker() -> None:
            while not errors:
                with lock:
                    b = next(todo, None)
                if b is None:
                    return
                try:
                    results[b] = self._write_batch(tmp, batches[b])
                except BaseException as exc:
                    errors.append(exc)

        threads = [
            threading.Thread(target=worker, name=f"gpumem-ckpt-write-{self.step}", daemon=True)
            for _ in range(max(1, min(n, _WRITERS)))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [r for r in results if r is not None]

    def _checksum_main(self, crc_done: list[threading.Event]) -> None:
        """Checksum host-staged pieces batch by batch. Outside streaming mode this starts only once
        the whole state is staged: the copy is what training waits for (save() or the optimizer
        hook) and on a small machine a concurrent CRC would take cores from it; the CRC then runs
        beside the disk write, which is slower than both."""
        plan = self.plan
        try:
            if not self.batched:
                self.staged.wait()
            for b in range(len(plan.batch_sizes)):
                with self._cond:
                    while self._ready <= b and self.error is None:
                        self._cond.wait()
                if self.error is not None:
                    return
                checksum_cpu_pieces(self.arena, plan, plan.batch_pieces(b), self.chunk)
                crc_done[b].set()
        except BaseException as exc:
            self._fail(exc)
        finally:
            for ev in crc_done:
                ev.set()

    def _shard_body(self, files: dict[str, int]) -> dict[str, Any]:
        crcs = tensor_crcs(self.plan, len(self.table.tensors))
        extents: list[list[list[Any]]] = [[] for _ in self.table.tensors]
        for p in self.plan.pieces:
            extents[p.index].append([data_file_name(self.group.rank, p.batch), p.offset, p.nbytes])
        tensors = [
            {
                "name": name,
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "nbytes": t.numel() * t.element_size(),
                "crc32c": crcs[i],
                "extents": extents[i],
            }
            for i, (name, t) in enumerate(zip(self.table.names, self.table.tensors, strict=True))
        ]
        body = {
            "format": "gpumem-checkpoint-shard",
            "rank": self.group.rank,
            "world_size": self.group.world_size,
            "step": self.step,
            "chunk_bytes": self.chunk,
            "alignment": self.alignment,
            "files": files,
            "tensors": tensors,
        }
        if self.replication is not None:
            body.update(replicated=True, owners=self.replication.owners)
        if self.table.sharded:
            body["meshes"] = global_fields(self.table, tensors)
        body["state"] = self.tree  # last (the large part), after the fields that describe the shard
        return body

    def _commit(self, tmp: Dir, gathered: list[list[int]]) -> None:
        body: dict[str, Any] = {
            "format": "gpumem-checkpoint",
            "step": self.step,
            "world_size": self.group.world_size,
            "created": time.time(),
            "versions": self.versions,
            "shards": [
                {"rank": r, "file": shard_manifest_name(r), "crc32c": crc, "nbytes": n}
                for r, (_, crc, n, _) in enumerate(gathered)
            ],
        }
        if self.replication is not None:
            body["replicated"] = True
        if any(row[3] for row in gathered):
            body["sharded"] = True
            if self._shared_blocks:  # the tiling was checked before writing (check_layout)
                check_complete(tmp, [row[1] for row in gathered])
        crc = persist.write_manifest(tmp, MAIN_MANIFEST, body)
        assert self.root is not None
        done = persist.commit(self.root, tmp, self.step, crc)
        # committed: from here on nothing fails the save (the pointer and retention are cleanup)
        self.committed = self.root_path / done.name
        self.stats.committed = True
        self.stats.durable_s = time.perf_counter() - self.t0
        if done.set_aside:
            self.stats.set_aside = tuple(done.set_aside)
            names = ", ".join(os.path.basename(p) for p in done.set_aside)
            warnings.warn(
                f"step {self.step} is lower than committed checkpoints, so training "
                "went back (a rollback, or a new run in an old run's directory): "
                f"moved {names} to {os.path.dirname(done.set_aside[0])} so "
                "that restore() and retention follow the new branch. If your step "
                "counter restarts (per epoch), pass a global step to save() instead.",
                CheckpointBranchWarning,
                stacklevel=1,
            )
        if done.pointer_error is not None:
            err = done.pointer_error
            self.stats.latest_error = f"{err.strerror or err} ({err.filename or 'latest'})"
            warnings.warn(
                f"step {self.step} is committed ({self.committed}), but the latest pointer "
                f"was not updated: {self.stats.latest_error}. restore() does not need it (it "
                "takes the newest step that verifies); the next save moves it.",
                CheckpointPointerWarning,
                stacklevel=1,
            )
        self._committed_name = done.name  # retention runs once every rank knows (_persist)

    def _retain(self, committed: str) -> None:
        """Rank 0, after the commit: remove checkpoints beyond ``keep`` (cleanup: a failure is a
        warning, and the next save tries again)."""
        assert self.root is not None
        try:
            persist.apply_retention(self.root, self.keep, committed)
        except OSError as exc:
            warnings.warn(
                f"step {self.step} is committed, but removing checkpoints beyond keep="
                f"{self.keep} failed ({exc.strerror or exc}); they stay on disk, and the next "
                "save tries again",
                RuntimeWarning,
                stacklevel=1,
            )

    # ------------------------------------------------------------------ shared

    def _mark_staged(self) -> None:
        if not self.staged.is_set():
            self.stats.staged_s = time.perf_counter() - self.t0
            self.staged.set()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()
        if self.spill is not None:  # a fence waiting for the copier to stop gives up
            self.spill.finish()
        self.enqueued.set()
        self.staged.set()

    def take_error(self) -> CheckpointError | None:
        """The job's failure as a CheckpointError, once (later calls return None)."""
        if self.error is None or self.reported:
            return None
        self.reported = True
        return _as_error(self.error, self.step)


_STATE = "CheckpointStateError: "  # how broadcast_text marks a state error (vs. an I/O one)


def _as_error(exc: BaseException, step: int) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return CheckpointIOError.wrap(exc, f"saving step {step}")
    err = CheckpointError(f"saving step {step} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _timing_event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _record_event() -> Any:
    ev = torch.cuda.Event()
    ev.record()
    return ev


def default_versions() -> dict[str, str]:
    import platform

    from gpumem import __version__

    return {
        "gpumem": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pid": str(os.getpid()),
    }
