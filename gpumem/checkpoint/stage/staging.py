"""Staging: the host and device memory a Checkpointer's saves copy into, and the choices that
depend on it.

``Staging`` owns every resource a snapshot needs beyond the tensors themselves, made once and
reused by every save: the host arena (allocated on first need or ahead of time by ``prepare``,
faulted in and locked, or pre-faulted, by a native thread while saves already use it),
coalescing's second slot, the fixed device spill buffer, the background copy's CUDA stream, the
plan cache, the CPU tensors' byte views and which arena's alignment gaps are known to be zero.
``snapshot()`` plans a save (``plan``), chooses its copy mode and slot, and returns the
``Snapshot`` that copies it; a restore borrows the arena for its staging (``restore_buffer``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpumem.arena import HostArena, current_cuda_device

from ..capture.codec import TensorTable
from ..errors import CheckpointError
from ..stats import SaveStats
from .coalesce import Coalescer
from .host_copy import HostViews
from .pieces import DEFAULT_CHUNK, PlanCache, StagingPlan, crc_chunk, plan_staging, segment_for
from .snapshot import Mode, Snapshot
from .spill import SpillControl


class Staging:
    """The staging resources of one Checkpointer (see the module docstring).

    Args:
        budget: the host staging cap in bytes (``CheckpointerConfig.staging_bytes``).
        alignment, chunk_bytes, segment_bytes: the plan's settings (``CheckpointerConfig``).
        replicated: the saves are replicated (the CRC chunk stays at its default).
        spill_bytes: the device spill buffer's size (0: no spill).
        coalesce: keep a second staging slot and let newer snapshots supersede waiting ones.
    """

    def __init__(
        self,
        budget: int,
        *,
        alignment: int,
        chunk_bytes: int | None,
        segment_bytes: int,
        replicated: bool,
        spill_bytes: int,
        coalesce: bool,
    ):
        self.budget, self.alignment, self.chunk_bytes = budget, alignment, chunk_bytes
        self.segment_bytes, self.replicated, self.spill_bytes = (
            segment_bytes,
            replicated,
            spill_bytes,
        )
        self.coalescer: Coalescer | None = Coalescer() if coalesce else None
        self.arena: Any = None
        self._spare: Any = None  # coalescing's second slot
        self._prep: _Prepare | None = None  # a staging allocation started by prepare()
        self._spill_buffer: Any = None  # made at the first save that can spill
        self._side_stream: Any = None
        self._plans = PlanCache()  # the last save's plan, reused while tensors keep their sizes
        # (arena, layout id) whose alignment gaps are known to be zero: only that layout's pieces
        # were written into that arena since it zeroed them, so a save with the same layout skips it
        self._zero_gaps: tuple[Any, int] | None = None
        self._views: HostViews | None = None  # the last save's byte views of CPU tensors
        self._user: Snapshot | None = None  # the last snapshot copied into slot 0's arena

    @classmethod
    def from_config(cls, cfg: Any) -> Staging:
        """The staging of a Checkpointer with ``cfg`` (a ``config.CheckpointerConfig``)."""
        return cls(
            cfg.staging_bytes,
            alignment=cfg.alignment,
            chunk_bytes=cfg.chunk_bytes,
            segment_bytes=cfg.segment_bytes,
            replicated=cfg.replicated,
            spill_bytes=cfg.device_spill_bytes,
            coalesce=cfg.coalesce,
        )

    # ------------------------------------------------------------------ a save's snapshot

    def plan(
        self, table: TensorTable, pipelined: bool, new_memory: int | None = None
    ) -> StagingPlan:
        """The staging plan of a save of ``table`` (``pipelined``: a save that writes each data
        file beside the copy of the next, ``snapshot.pipelines``). ``new_memory``: at
        most this many bytes of staging memory that is not allocated yet (PreemptionGuard's
        final save): a state larger than the arena there is then streams through at most that
        much (or through the arena, if larger) instead of allocating all of it."""
        chunk = crc_chunk(table, self.chunk_bytes, self.replicated)
        segment = segment_for(table, self.segment_bytes, chunk, pipelined)
        budget = self.budget
        if new_memory is not None:
            self._join_thread(None)  # a prepared arena counts as there
            have = self.arena.nbytes if self.arena is not None else 0
            budget = min(budget, max(have, new_memory, 2 * chunk))
        return self._plans.plan(table.tensors, table.names, budget, self.alignment, chunk, segment)

    def snapshot(
        self,
        table: TensorTable,
        plan: StagingPlan,
        mode: Mode,
        *,
        stats: SaveStats,
        t0: float,
        copier: Any,
    ) -> tuple[Snapshot, int, Any]:
        """The Snapshot of a save in the arena slot it gets: (snapshot, slot, the waiting save
        it supersedes or None; both for the coalescer)."""
        slot, victim = (0, None) if self.coalescer is None else self.coalescer.choose()
        try:
            arena = self._slot(slot, victim, plan.arena_bytes)
        except BaseException:
            if victim is not None:  # it was not superseded after all
                victim.stats.superseded_by = None
            raise
        zeroed = self._zero_gaps == (arena, plan.layout_id)  # HostArena compares by identity
        self._zero_gaps = None  # until this save has zeroed (or kept) the gaps of its layout
        self._views = HostViews(self._views)
        snap = Snapshot(
            table,
            plan,
            arena,
            mode,
            chunk=plan.chunk,
            stats=stats,
            t0=t0,
            copier=copier,
            side_stream=self._stream_for(table.has_cuda),
            zero_gaps=not zeroed,
            views=self._views,
        )
        if slot == 0:
            self._user = snap
        if mode is Mode.OVERLAP and self.spill_bytes and snap.fence_device is not None:
            snap.spill = self._spill_control(snap.fence_device)
        return snap, slot, victim

    def copied(self, snap: Snapshot) -> None:
        """After the caller's part of ``snap``: its arena's alignment gaps are known to be zero."""
        if snap.gaps_zero and not snap.caller_failed and snap.plan.layout_id:
            self._zero_gaps = (snap.arena, snap.plan.layout_id)

    def _slot(self, slot: int, victim: Any, nbytes: int) -> Any:
        """The arena of staging slot ``slot`` (1: coalescing's spare), once ``victim``, the save
        it supersedes, has finished copying into it."""
        if victim is not None:
            victim.staged.wait()
        if slot == 0:
            return self._ensure_arena(nbytes)
        if self._spare is None or self._spare.nbytes < nbytes:
            if self._spare is not None:
                self._spare.close()
            self._spare = _allocate(nbytes)
        return self._spare

    def _ensure_arena(self, nbytes: int) -> Any:
        # the previous save was waited for, so this installs a prepared arena (its allocation
        # only: its pages may still be faulting in, and the copy goes ahead beside that)
        self._join_thread(None)
        if self.arena is None or self.arena.nbytes < nbytes:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            self.arena = _allocate(nbytes)
        return self.arena

    @property
    def allocated(self) -> bool:
        """Whether an arena exists or a prepare() allocation is under way."""
        return self.arena is not None or self._prep is not None

    @property
    def locked(self) -> bool | None:
        """The arena's residency: None until allocated and faulted in; False: pre-faulted only
        (RLIMIT_MEMLOCK); True: locked (or pinned)."""
        return self.arena.locked if self.arena is not None else None

    def _spill_control(self, device: int) -> SpillControl:
        """A SpillControl over the device spill buffer on ``device`` (made once, fixed size);
        waves of a quarter of it (at least 16 MiB) bound what is in flight at the fence."""
        buf = self._spill_buffer
        if buf is None or buf.device != torch.device("cuda", device):
            buf = self._spill_buffer = torch.empty(
                self.spill_bytes, dtype=torch.uint8, device=torch.device("cuda", device)
            )
        return SpillControl(buf, max(16 << 20, self.spill_bytes // 4))

    def _stream_for(self, has_cuda: bool) -> Any:
        if self._side_stream is None and has_cuda:
            # ahead of training kernels (see device_copy._crc_stream)
            self._side_stream = torch.cuda.Stream(priority=-1)
        return self._side_stream

    # ------------------------------------------------------------------ ahead of time

    def arena_bytes(self, table: TensorTable) -> int:
        """Arena bytes a save of ``table`` needs, with one chunk of slack for the small extras
        (scheduler, scaler, user state) a save may add."""
        chunk = crc_chunk(table, self.chunk_bytes, self.replicated)
        plan = plan_staging(
            table.tensors, table.names, self.budget, self.alignment, chunk, self.segment_bytes
        )
        return plan.arena_bytes + DEFAULT_CHUNK

    def prepare(self, size: int, background: bool) -> int:
        """Allocate (on a thread with ``background``) an arena of ``size`` bytes, clamped to the
        budget, unless the current one is large enough; returns the size prepared (0: none)."""
        size = min(size, self.budget)
        self.join_prepare(None)  # a previous prepare() finishes first; its error is raised here
        if self.arena is not None and self.arena.nbytes >= size:
            return 0
        # pinned on this thread's GPU: the worker thread's current device is always 0
        prep = self._prep = _Prepare(size, current_cuda_device())
        if background:
            prep.thread = threading.Thread(target=prep.run, name="gpumem-ckpt-prepare", daemon=True)
            prep.thread.start()
        else:
            prep.run()
            self.join_prepare(None)
        return size

    def join_prepare(self, timeout: float | None, resident: bool = True) -> bool:
        """Wait for a prepare() allocation and (``resident``) for the arena's pages to be
        faulted in; install a prepared arena; raise its error (once). Returns False on timeout.
        While a save in flight still uses the current arena, a larger prepared one is installed
        at a later call instead."""
        if not self._join_thread(timeout):
            return False
        return not resident or self.arena is None or self.arena.wait_ready(timeout)

    def _join_thread(self, timeout: float | None) -> bool:
        """join_prepare's first part: the allocation (not the faulting in)."""
        prep = self._prep
        if prep is None:
            return True
        if prep.thread is not None:
            prep.thread.join(timeout)
            if prep.thread.is_alive():
                return False
        self._prep = None
        if prep.error is not None:
            raise prep.failure()
        arena = prep.arena
        if arena is None:
            return True
        if self.arena is not None and self.arena.nbytes >= arena.nbytes:
            arena.close()  # a save grew the arena meanwhile (cannot happen under the lock)
        elif self.arena is not None and self._user is not None and not self._user.finished:
            self._prep, prep.thread = prep, None  # install at the next save()
        else:
            if self.arena is not None:
                self.arena.close()
            self.arena = arena
        return True

    # ------------------------------------------------------------------ restore, close

    def restore_buffer(self, nbytes: int) -> torch.Tensor:
        """Host staging for a sharded restore: the arena when one is allocated and large enough
        (pinned on CUDA machines: prepare() before restore() gets that), else fresh host memory,
        faulted in by the reads themselves (allocating and locking an arena here would fault it
        in first, a pass over memory the reads do anyway)."""
        self._join_thread(None)
        if self.arena is not None and self.arena.nbytes >= nbytes:
            return self.arena.view(0, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def close(self) -> None:
        prep, self._prep = self._prep, None
        if prep is not None:
            if prep.thread is not None:
                prep.thread.join()
            if prep.arena is not None:
                prep.arena.close()
        for arena in (self.arena, self._spare):
            if arena is not None:
                arena.close()
        self.arena = self._spare = self._spill_buffer = None


def _allocate(nbytes: int, device: int | None = None) -> Any:
    """A host arena of ``nbytes`` whose pages a native thread faults in and locks (pre-faults
    only under RLIMIT_MEMLOCK) from its end while the first copy, if one comes before that is
    done, fills it from its start (``HostArena.prefault``): later saves copy into warm memory, as
    a copy into preallocated buffers would, instead of re-faulting pages that reclaim took back
    while the arena sat idle between saves, and no save waits for all of it. Pinned arenas are
    locked by the driver."""
    arena = HostArena(max(nbytes, 1), device=device)
    try:
        arena.prefault()
    except BaseException:
        arena.close()
        raise
    return arena


class _Prepare:
    """One staging allocation started by Staging.prepare()."""

    def __init__(self, nbytes: int, device: int | None = None):
        self.nbytes, self.device = nbytes, device
        self.thread: threading.Thread | None = None
        self.arena: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.arena = _allocate(self.nbytes, self.device)
        except BaseException as exc:
            self.error = exc

    def failure(self) -> BaseException:
        """The allocation's error as the caller sees it."""
        err = self.error
        assert err is not None
        if isinstance(err, CheckpointError):
            return err
        wrapped = CheckpointError(
            f"allocating {self.nbytes} bytes of host staging memory in prepare() failed: "
            f"{type(err).__name__}: {err}; lower staging_bytes or free host memory"
        )
        wrapped.__cause__ = err
        return wrapped
