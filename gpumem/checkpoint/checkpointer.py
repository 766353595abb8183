"""The Checkpointer: near-zero-stall save, background persist, verified restore with fallback.

Overlap mode and what it assumes: parameters and optimizer state are copied *after* save()
returns, while the next forward/backward runs; a pre-hook on ``optimizer.step()`` waits for the
copy, so they are never mutated mid-copy. That holds when only the optimizer step mutates them.
It does not hold for code that updates parameters in place outside ``optimizer.step()`` before the
next step (an EMA written into the model, manual weight surgery, a second optimizer over the same
parameters that is not the one passed to save()); use ``Checkpointer(..., overlap=False)`` or
``save(..., blocking=True)`` there. Buffers (BatchNorm running statistics), RNG states, scheduler,
scaler, extras and stateful objects are always captured before save() returns.

Replicated mode (``replicated=True``, for DDP): the model, optimizer, scheduler and scaler state
every rank holds alike is written once in total, each tensor by one owner rank (see
``replicated.py``); each rank copies, checksums and writes only what it owns plus its own state.

Restore is a transaction: every candidate checkpoint is read into fresh host memory, verified,
decoded and checked against the objects (``validate.py``) before anything is loaded, then loaded
all or nothing (``state.apply``). One rule for errors: content that fails to decode or validate,
whatever raised, is CheckpointCorruptError for that step and restore() falls back to the next
older one; an operating-system error is CheckpointIOError and is raised; a checkpoint that does
not fit the objects is CheckpointStateError and is raised.
"""

from __future__ import annotations

import atexit
import collections
import errno
import math
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from ._dist import Group
from .coalesce import Coalescer
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointStateError,
)
from .format import CheckpointInfo
from .job import SaveJob, SaveStats, Worker, default_versions
from .lock import READ_ONLY_ERRNOS, DirLock
from .options import Mode, SaveOptions
from .safe_fs import Dir
from .snapshot import HostViews, LayoutCache

_MIN_BUDGET = 64 << 20
DEFAULT_CHUNK = 1 << 20  # CRC32C granularity unless chunk_bytes says otherwise
_PIPELINE_SEGMENT = 16 << 20  # smallest data file an overlap save splits its state into
MAX_STEP = 2**63 - 1  # steps are stored as JSON integers and read back as int64-sized values
_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _is_int(value: Any, lo: int) -> bool:
    """``value`` is an int (a bool is not one) of at least ``lo``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def default_staging_bytes() -> int:
    """GPUMEM_STAGING_BYTES, else a quarter of the memory available now (at least 64 MiB): the
    host's ``MemAvailable``, or a container's memory limit less its usage where that is lower."""
    from gpumem._env import env_int
    from gpumem.device import host_available_bytes

    value = env_int("GPUMEM_STAGING_BYTES")
    if value is not None:
        return value
    return max(_MIN_BUDGET, host_available_bytes() // 4)


class Checkpointer:
    """Save training state in the background; restore the newest checkpoint that verifies.

    Args:
        directory: where ``step-<N>`` directories and the ``latest`` pointer live.
        keep: how many checkpoints to keep (the newest ones); None keeps all.
        staging_bytes: cap on host staging memory. None: the state's size up to
            ``default_staging_bytes()``. A larger state streams through the budget in chunks.
        overlap: copy parameters and optimizer state in the background (see the module docs for
            the assumption); False always copies before save() returns.
        chunk_bytes: CRC32C granularity (power of two, >= 4096). None: 1 MiB, or for DTensor
            state a 64th of the byte-weighted median block size (between 4 KiB and 1 MiB): a
            resharding restore reads whole chunks, so at most one partial chunk at each end of
            each overlap is read beyond what it needs.
        segment_bytes: size of each data file when the state fits the budget. A blocking save
            writes the files once the whole state is staged (a write beside the copy would slow
            the copy the caller waits for), so time to durable ~ copy + write; an overlap save
            of host tensors writes file b while it copies batch b+1, in files of at most an
            eighth of the state (at least 16 MiB); when streaming, file b is written while batch
            b+1 is copied.
        lock_timeout_s: rank 0 holds a lock on ``directory`` while the Checkpointer is open, so two
            jobs never write it at once; a new job waits this long for an old one (e.g. a preempted
            pod still flushing its final save) to release it, then raises CheckpointStateError.
        direct_io: write data files with O_DIRECT from the page-aligned arena: no second copy
            into the page cache (less CPU taken from training, no cache pollution). File systems
            that refuse O_DIRECT get buffered writes.
        read_only: open the directory for restore only: no lock is taken (a job writing it is
            not waited for), nothing is cleaned up, save() is refused. Without it, a directory
            that cannot be written (read-only mount, no write permission) is opened this way
            too, with a warning.
        replicated: the model, optimizer, scheduler and scaler state is the same on every rank
            (DDP): write each of its tensors once in total instead of once per rank. Every rank
            computes the same owner for each tensor (largest first, to the rank with the fewest
            bytes so far) and stages, checksums and writes only the tensors it owns plus its own
            RNG states, ``extra`` and ``stateful`` objects: storage and per-rank write time drop
            about world-size times, and so does the copy in blocking mode. In overlap mode the
            optimizer hook waits only on ranks that still copy something they own. The save
            checks that every rank captured the same structure (a mismatch fails it on every
            rank with CheckpointStateError); values are taken from the owner, not compared. Any
            Checkpointer restores such a checkpoint, on any world size. DTensor state (FSDP2,
            tensor parallel) is written once per block anyway and is not affected by it.
        coalesce: for a checkpoint every step: save() never waits for the writer. Each save
            snapshots into host memory (two staging slots: twice the host memory); while an
            older step is being written, a newer snapshot replaces the one waiting to be written
            instead of making save() wait (``SaveStats.superseded_by`` / ``supersedes`` say
            which steps were written and which were not). ``wait()``, ``close()`` and a
            PreemptionGuard persist the last snapshot. A state that streams (larger than half
            the staging budget) falls back to waiting. Single process only (see coalesce.py).
        device_spill_bytes: for CUDA state in overlap mode whose D2H copy takes longer than the
            forward/backward beside it: a device buffer of this fixed size (allocated once at
            the first such save; never "whatever is free", so the next forward cannot run out of
            memory because of it). At the optimizer fence the parameters not yet copied to host
            are copied into it device to device, in copy order as far as they fit, and drained
            to host afterwards; the step waits for the rest (``SaveStats.spill_bytes``,
            ``fence_s``). 0 (default): off.
        collective_timeout_s: save() and restore() are collectives; a rank that does not join
            one within this many seconds (save() called on rank 0 only, say) makes it raise
            CheckpointStateError on every rank that did, naming the missing ranks. Rank 0's
            wait for the directory lock (``lock_timeout_s``) does not count: the other ranks
            wait for its result first.

    Sharded state (FSDP2 ``fully_shard``, tensor parallel, 2-D meshes): pass the wrapped model and
    its optimizer as they are. Each rank writes the blocks of its local shards (a replicated
    block by one rank); restore reshards to whatever layout the objects have now, on any world
    size (see ``targets`` and docs/checkpoint.md, "Sharded training").

    Example:
        >>> ckpt = gpumem.Checkpointer("ckpts", keep=3)                       # doctest: +SKIP
        >>> start = ckpt.restore(model=model, optimizer=opt) or 0             # doctest: +SKIP
        >>> for step in range(start, steps):                                  # doctest: +SKIP
        ...     train_step()
        ...     if step % 100 == 0:
        ...         ckpt.save(step, model=model, optimizer=opt)
        >>> ckpt.close()                                                      # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | bytes | os.PathLike,
        keep: int | None = 3,
        staging_bytes: int | None = None,
        *,
        overlap: bool = True,
        chunk_bytes: int | None = None,
        alignment: int = 4096,
        direct_io: bool = True,
        segment_bytes: int = 256 << 20,
        lock_timeout_s: float = 120.0,
        replicated: bool = False,
        collective_timeout_s: float = 60.0,
        read_only: bool = False,
        coalesce: bool = False,
        device_spill_bytes: int = 0,
    ):
        if keep is not None and not _is_int(keep, 1):
            raise CheckpointStateError(
                f"keep={keep!r}: keep at least 1 checkpoint (a positive int), or None for all"
            )
        if chunk_bytes is not None and (
            not _is_int(chunk_bytes, 1) or chunk_bytes & (chunk_bytes - 1)
        ):
            raise CheckpointStateError(
                f"chunk_bytes={chunk_bytes!r} must be a power of two (an int), or None"
            )
        if not _is_int(alignment, 1) or alignment & (alignment - 1):
            raise CheckpointStateError(f"alignment={alignment!r} must be a power of two (an int)")
        largest = DEFAULT_CHUNK if chunk_bytes is None else chunk_bytes
        smallest = 4096 if chunk_bytes is None else chunk_bytes  # the automatic chunk's floor
        if largest < 4096 or alignment > smallest:
            raise CheckpointStateError(
                f"chunk_bytes={chunk_bytes} must be >= 4096 and >= alignment={alignment}"
            )
        if not _is_int(segment_bytes, 1):
            raise CheckpointStateError(f"segment_bytes={segment_bytes!r} must be a positive int")
        if staging_bytes is not None and not _is_int(staging_bytes, 1):
            raise CheckpointStateError(
                f"staging_bytes={staging_bytes!r} must be a positive int (bytes), or None"
            )
        budget = default_staging_bytes() if staging_bytes is None else staging_bytes
        if budget < 2 * largest:
            raise CheckpointStateError(
                f"staging_bytes={budget} is below two chunks ({2 * largest} bytes); raise it"
            )
        if (
            isinstance(lock_timeout_s, bool)
            or not isinstance(lock_timeout_s, (int, float))
            or not 0 <= lock_timeout_s < math.inf
        ):
            raise CheckpointStateError(
                f"lock_timeout_s={lock_timeout_s!r} must be a finite number of seconds >= 0"
            )
        for name, value in (
            ("overlap", overlap),
            ("direct_io", direct_io),
            ("replicated", replicated),
            ("read_only", read_only),
            ("coalesce", coalesce),
        ):
            if not isinstance(value, bool):
                raise CheckpointStateError(f"{name}={value!r} must be True or False")
        try:
            self.directory = Path(os.fsdecode(directory))  # any bytes the OS accepts
        except TypeError:
            raise CheckpointStateError(
                f"directory={directory!r} must be a path (str, bytes or os.PathLike)"
            ) from None
        self.keep, self.staging_bytes, self.overlap = keep, budget, overlap
        self.chunk_bytes, self.alignment, self.direct_io = chunk_bytes, alignment, direct_io
        self.segment_bytes = segment_bytes
        self.replicated = replicated
        if not _is_int(device_spill_bytes, 0):
            raise CheckpointStateError(
                f"device_spill_bytes={device_spill_bytes!r} must be an int >= 0 (0: no spill)"
            )
        self.device_spill_bytes = device_spill_bytes
        self._spill_buffer: Any = None  # made at the first save that can spill
        timeout = collective_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < math.inf
        ):
            raise CheckpointStateError(
                f"collective_timeout_s={timeout!r} must be a positive, finite number of seconds"
            )
        self._group = Group(float(timeout))
        if coalesce and self._group.world_size > 1:
            raise CheckpointStateError(
                f"coalesce=True is single-process only (this job has {self._group.world_size} "
                "ranks, which would have to agree on which saves to skip); use coalesce=False"
            )
        self._coalescer: Coalescer | None = Coalescer() if coalesce else None
        self._arena: Any = None
        self._prep: _Prepare | None = None  # a staging allocation started by prepare()
        self.staging_locked: bool | None = (
            None  # None until allocated; False: pre-faulted only (RLIMIT_MEMLOCK)
        )
        self._side_stream: Any = None
        self._job: SaveJob | None = None
        # background threads of every save (persist, overlap copy), started once: see Worker
        self._workers = (Worker("gpumem-ckpt-persist"), Worker("gpumem-ckpt-copy"))
        weakref.finalize(self, _stop_workers, self._workers)
        self._lock = threading.RLock()
        self._hooked: dict[int, Any] = {}
        self._last_save: tuple[int, dict[str, Any]] | None = None
        self._plans = (
            LayoutCache()
        )  # the last save's layout, reused while the tensors keep their sizes
        # (arena, layout id) whose alignment gaps are known to be zero: only that layout's pieces
        # were written into that arena since it zeroed them, so a save with the same layout skips it
        self._zero_gaps: tuple[Any, int] | None = None
        self._views: HostViews | None = (
            None  # the last save's byte views of CPU tensors (see HostViews)
        )
        self._closed = False
        self.last_restore: Any = None  # the last sharded restore (bytes_read, bytes_needed)
        self.history: collections.deque[SaveStats] = collections.deque(maxlen=256)  # newest last
        self._dir_lock: DirLock | None = None
        self._root: Dir | None = None  # the directory's descriptor: see _root_dir()
        self._read_only_errno: int | None = None  # why it cannot be written (None: asked for)
        # why save() is refused (None: it is not): the directory is opened read-only
        self.read_only: str | None = "opened with read_only=True" if read_only else None
        failure: Exception | None = None
        if self._group.rank == 0:
            try:
                self._open_root(lock_timeout_s)
            except Exception as exc:  # raised below, once every rank has heard of it
                failure = exc
        if self._group.world_size > 1:
            # every rank fails alike, and refuses save() alike, or a later collective would hang.
            # Rank 0 may wait lock_timeout_s for a job being replaced: the other ranks wait that
            # long for its word, and the collective deadline only after it
            code = _FAILED if failure is not None else _WRITABLE
            if failure is None and self.read_only is not None:
                code = self._read_only_errno or 0
            try:
                code = self._group.from_rank0(
                    "open", code, lock_timeout_s + timeout, f"whether it opened {self.directory}"
                )
            except CheckpointError as exc:
                failure = failure or exc
            if code == _FAILED and failure is None:
                failure = CheckpointError(
                    f"rank 0 could not open {self.directory} (its error is raised there)"
                )
            elif code >= 0 and self.read_only is None:
                self.read_only = "opened read-only by rank 0"
                self._read_only_errno = code or None
        if failure is not None:
            _stop_workers(self._workers)
            raise failure
        _LIVE.add(self)

    def _open_root(self, lock_timeout_s: float) -> None:
        """Rank 0: open (or create) the directory, take its lock, clean up after crashed saves;
        where the directory cannot be written, open it read-only, without a lock, and say so."""
        from .persist import clean_stale

        if self.read_only is not None:
            self._root = Dir.open(self.directory)
            return
        self._root = Dir.open(self.directory, create=True)
        try:
            self._dir_lock = DirLock(self._root, lock_timeout_s)
        except CheckpointIOError as exc:
            if exc.errno not in READ_ONLY_ERRNOS:
                raise
            self.read_only = (
                f"{self.directory} cannot be written ({os.strerror(exc.errno or 0)}), so it was "
                "opened read-only, without the directory lock"
            )
            warnings.warn(
                f"{self.read_only}: restore() works, save() is refused",
                RuntimeWarning,
                stacklevel=3,
            )
            self._read_only_errno = exc.errno or errno.EACCES
            return
        weakref.finalize(self, self._dir_lock.release)
        clean_stale(self._root)  # after taking the lock: a live job's saves stay

    def _root_dir(self) -> Dir:
        """The directory's descriptor, opened on first use on ranks other than 0 (rank 0 may be
        creating the directory while they start)."""
        if self._root is None:
            self._root = Dir.open(self.directory)
        return self._root

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        stateful: dict[str, Any] | None = None,
        rng: bool = True,
        blocking: bool = False,
    ) -> SaveStats:
        """Snapshot the state at ``step`` and persist it in the background.

        Returns once the state is safe from further training (overlap mode: once buffers are
        copied; parameters and optimizer state follow in the background, fenced by the optimizer
        pre-step hook). A previous save still in flight is waited for first (back-pressure); its
        error, if any, is raised here.

        Returns:
            The SaveStats of this save (filled in as it progresses).
        """
        from .state import capture

        t0 = time.perf_counter()
        if not _is_int(step, 0) or step > MAX_STEP:
            raise CheckpointStateError(f"step={step!r} must be an int in [0, 2**63 - 1]")
        with self._lock:
            self._check_open()
            self._check_writable()
            if self._coalescer is None:
                self.wait()
            else:  # no back-pressure: only earlier failures are raised here
                self._raise_job_error()
            kwargs = {
                "model": model,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "scaler": scaler,
                "extra": extra,
                "stateful": stateful,
                "rng": rng,
            }
            tree, table = capture(step, **kwargs)
            table, replication = self._share(table)
            chunk = self._chunk_for(table)
            segment = self.segment_bytes
            if self.overlap and not blocking and optimizer is not None and not table.has_cuda:
                # overlap mode over host tensors writes each data file beside the copy of the
                # next (job.py): eight or more files make the copy before the first write short
                total = sum(t.numel() * t.element_size() for t in table.tensors)
                segment = min(segment, max(_PIPELINE_SEGMENT, total // 8 // chunk * chunk))
            plan = self._plans.plan(
                table.tensors,
                table.names,
                self.staging_bytes,
                self.alignment,
                chunk,
                segment,
            )
            if plan.streaming and self._coalescer is not None:
                self.wait()  # one slot streams through the whole budget: no second one
            if plan.streaming:
                mode = Mode.STREAMING
            elif self.overlap and not blocking and optimizer is not None:
                mode = Mode.OVERLAP
            else:
                mode = Mode.BLOCKING
            if mode is Mode.OVERLAP:
                self._hook(optimizer)
            slot, victim = (0, None) if self._coalescer is None else self._coalescer.choose()
            try:
                arena = self._staging_slot(slot, victim, plan.arena_bytes)
            except BaseException:
                if victim is not None:  # it was not superseded after all
                    victim.stats.superseded_by = None
                raise
            zeroed = self._zero_gaps == (arena, plan.layout_id)  # HostArena compares by identity
            self._zero_gaps = None  # until this job has zeroed (or kept) the gaps of its layout
            self._views = HostViews(self._views)
            options = SaveOptions(
                root_path=self.directory,
                chunk=chunk,
                alignment=self.alignment,
                direct=self.direct_io,
                group=self._group,
                keep=self.keep,
                versions=default_versions(),
                workers=self._workers,
                side_stream=self._stream_for(table.has_cuda),
            )
            job = SaveJob(
                options,
                root=self._root,
                step=step,
                tree=tree,
                table=table,
                plan=plan,
                arena=arena,
                mode=mode,
                t0=t0,
                zero_gaps=not zeroed,
                views=self._views,
                replication=replication,
            )
            if self._coalescer is not None:
                job.coalescer = self._coalescer
                self._coalescer.add(job, slot, victim)
            if mode is Mode.OVERLAP and self.device_spill_bytes and job.fence_device is not None:
                job.spill = self._spill_control(job.fence_device)
            self._job = job
            self._last_save = (step, kwargs)
            self.history.append(job.stats)
            job.run_caller()
            if job.gaps_zero and not job.caller_failed and plan.layout_id:
                self._zero_gaps = (arena, plan.layout_id)
            job.stats.save_s = time.perf_counter() - t0
            if job.caller_failed:  # a failure on this thread is raised here, not later
                job.done.wait()
                self._raise_job_error()
            return job.stats

    def _chunk_for(self, table: Any) -> int:
        """The CRC32C chunk of a save: ``chunk_bytes``, or by default 1 MiB, and for DTensor
        blocks a 64th of their byte-weighted median size, a power of two between 4 KiB and
        1 MiB (replicated saves keep 1 MiB: every rank must use the same)."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        if not table.sharded or self.replicated:
            return DEFAULT_CHUNK
        sizes = sorted(
            t.numel() * t.element_size()
            for t, layout in zip(table.tensors, table.layouts, strict=True)
            if layout is not None
        )
        half, acc, median = sum(sizes) / 2, 0, sizes[-1]
        for n in sizes:
            acc += n
            if acc >= half:
                median = n
                break
        chunk = 4096
        while chunk * 2 <= median // 64 and chunk < DEFAULT_CHUNK:
            chunk *= 2
        return chunk

    def _share(self, table: Any) -> tuple[Any, Any]:
        """(the tensors this rank writes, its Replication or None): all of them unless
        replicated."""
        if not self.replicated:
            return table, None
        from .replicated import split

        return split(table, self._group.rank, self._group.world_size)

    def prepare(
        self,
        model: Any = None,
        optimizer: Any = None,
        nbytes: int | None = None,
        background: bool = True,
    ) -> int:
        """Allocate and lock (or pre-fault) the host staging arena ahead of the first save().

        Allocating and faulting in the staging memory costs seconds per GB; without prepare() the
        first save() pays it on the training loop's critical path. prepare() sizes the arena from
        ``model`` (parameters and buffers) and ``optimizer`` (its state, as far as it exists now),
        or from an explicit ``nbytes``, clamped to ``staging_bytes``, and allocates it on a
        background thread. A later save() reuses it, waiting for the allocation only if it is
        still running; it never allocates twice, and grows the arena as before if the state
        became larger than prepared.

        Note: optimizers such as AdamW create their state (``exp_avg``, ``exp_avg_sq``) in their
        first ``step()``. Before that the optimizer contributes nothing to the size, so call
        prepare() after the first optimizer step, or pass ``nbytes`` (e.g. 3x the parameter bytes
        for AdamW), to size the arena right.

        Args:
            model, optimizer: the objects that will be passed to save().
            nbytes: explicit staging size in bytes (overrides the objects).
            background: False allocates before returning.

        Returns:
            The staging size in bytes that is being prepared (0: the current arena is big enough).

        Raises:
            CheckpointError: a background failure of a previous save or prepare(); a failure of
                this allocation is raised by the next save() or wait() (by prepare() itself when
                ``background=False``).
        """
        with self._lock:
            self._check_open()
            if nbytes is not None:
                if not _is_int(nbytes, 1):
                    raise CheckpointStateError(f"nbytes={nbytes!r} must be a positive int")
                size = nbytes
            else:
                if model is None and optimizer is None:
                    raise CheckpointStateError("prepare() needs a model, an optimizer or nbytes")
                size = self._state_arena_bytes(model, optimizer)
            size = min(size, self.staging_bytes)
            self._join_prepare(
                None
            )  # a previous prepare() finishes first; its error is raised here
            if self._arena is not None and self._arena.nbytes >= size:
                return 0
            from gpumem.arena import current_cuda_device

            # pinned on this thread's GPU: the worker thread's current device is always 0
            prep = _Prepare(size, current_cuda_device())
            self._prep = prep
            if background:
                prep.thread = threading.Thread(
                    target=prep.run, name="gpumem-ckpt-prepare", daemon=True
                )
                prep.thread.start()
            else:
                prep.run()
                self._join_prepare(None)
            return size

    def _state_arena_bytes(self, model: Any, optimizer: Any) -> int:
        """Arena bytes a save of ``model``/``optimizer`` (plus RNG states) needs, with one chunk
        of slack for the small extras (scheduler, scaler, user state) save() may add."""
        from .snapshot import plan_layout
        from .state import capture

        _, table = capture(0, model=model, optimizer=optimizer, rng=True)
        table, _ = self._share(table)  # replicated: this rank's share
        plan = plan_layout(
            table.tensors,
            table.names,
            self.staging_bytes,
            self.alignment,
            self._chunk_for(table),
            self.segment_bytes,
        )
        return plan.arena_bytes + DEFAULT_CHUNK

    def _join_prepare(self, timeout: float | None) -> bool:
        """Wait for a prepare() allocation; install its arena; raise its error (once).
        Returns False on timeout."""
        prep = self._prep
        if prep is None:
            return True
        if prep.thread is not None:
            prep.thread.join(timeout)
            if prep.thread.is_alive():
                return False
        self._prep = None
        if prep.error is not None:
            err = prep.error
            if not isinstance(err, CheckpointError):
                wrapped = CheckpointError(
                    f"allocating {prep.nbytes} bytes of host staging memory in prepare() failed: "
                    f"{type(err).__name__}: {err}; lower staging_bytes or free host memory"
                )
                wrapped.__cause__ = err
                err = wrapped
            raise err
        arena = prep.arena
        if arena is not None:
            if self._arena is not None and self._arena.nbytes >= arena.nbytes:
                # a save grew the arena meanwhile (cannot happen under the lock; be safe)
                arena.close()
            else:
                job = self._job
                if self._arena is not None and (job is None or job.done.is_set()):
                    self._arena.close()
                    self._arena = None
                if self._arena is None:
                    self._arena, self.staging_locked = arena, prep.locked
                else:  # the in-flight save still uses the old arena: install at the next save()
                    self._prep = prep
                    prep.thread = None
        return True

    def _ensure_arena(self, nbytes: int) -> Any:
        from ._core import HostArena

        self._join_prepare(None)  # save() already waited for the previous job, so this installs it
        if self._arena is None or self._arena.nbytes < nbytes:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            self._arena = HostArena(max(nbytes, 1))
            # Fault every page in once and lock it: later saves copy into warm memory, as a copy
            # into preallocated buffers would, instead of re-faulting pages that reclaim took back
            # while the arena sat idle between saves. Pinned arenas are locked by the driver.
            self.staging_locked = True if self._arena.pinned else self._arena.lock()
        return self._arena

    def _staging_slot(self, slot: int, victim: Any, nbytes: int) -> Any:
        """The arena of staging slot ``slot`` (1: coalesce's spare), once ``victim``, the save
        it supersedes, has finished copying into it."""
        if victim is not None:
            victim.staged.wait()
        if slot == 0:
            return self._ensure_arena(nbytes)
        assert self._coalescer is not None
        return self._coalescer.spare(nbytes)

    def _spill_control(self, device: int) -> Any:
        """A SpillControl over the device spill buffer on ``device`` (made once, fixed size);
        waves of a quarter of it (at least 16 MiB) bound what is in flight at the fence."""
        import torch

        from .spill import SpillControl

        buf = self._spill_buffer
        if buf is None or buf.device != torch.device("cuda", device):
            buf = self._spill_buffer = torch.empty(
                self.device_spill_bytes, dtype=torch.uint8, device=torch.device("cuda", device)
            )
        return SpillControl(buf, max(16 << 20, self.device_spill_bytes // 4))

    def _stream_for(self, has_cuda: bool) -> Any:
        if self._side_stream is None and has_cuda:
            import torch

            self._side_stream = torch.cuda.Stream(
                priority=-1
            )  # ahead of training kernels (see snapshot._crc_stream)
        return self._side_stream

    def _hook(self, optimizer: Any) -> None:
        if id(optimizer) in self._hooked:
            return
        ref = weakref.ref(self)

        def wait_for_snapshot(opt: Any, args: Any, kwargs: Any) -> None:
            ckpt = ref()
            job = ckpt._job if ckpt is not None else None
            if job is not None and job.defers and not job.staged.is_set():
                t = time.perf_counter()
                if not job.fence():  # CUDA: the optimizer's kernels queue behind the copy instead
                    job.wait_staged()
                job.stats.hook_wait_s += time.perf_counter() - t

        self._hooked[id(optimizer)] = optimizer.register_step_pre_hook(wait_for_snapshot)

    # ------------------------------------------------------------------ wait / close

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save in flight is durable. Returns False on timeout.

        Raises:
            CheckpointError: the background save failed (raised once: here, or by the next
                save()/close()).
        """
        job = self._job
        if job is not None and not job.done.wait(timeout):
            return False
        self._raise_job_error()
        with self._lock:
            return self._join_prepare(timeout)

    def _raise_job_error(self) -> None:
        job = self._job
        if job is None:
            return
        err = job.take_error()
        if err is None and self._coalescer is not None:
            err = self._coalescer.take_error(job)
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for the save in flight, release hooks and staging memory; raise if it failed."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            _stop_workers(self._workers)
            for handle in self._hooked.values():
                handle.remove()
            self._hooked.clear()
            prep, self._prep = self._prep, None
            if prep is not None:
                if prep.thread is not None:
                    prep.thread.join()
                if prep.arena is not None:
                    prep.arena.close()
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            if self._coalescer is not None:
                self._coalescer.close()
            self._spill_buffer = None
            if self._dir_lock is not None:
                self._dir_lock.release()
            if self._root is not None:
                self._root.close()
            _LIVE.discard(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:  # do not hide the original exception behind a save error
            try:
                self.close()
            except CheckpointError as err:
                print(
                    f"gpumem: checkpoint save failed while handling another error: {err}",
                    file=sys.stderr,
                )
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def _check_writable(self) -> None:
        if self.read_only is None:
            return
        if self._read_only_errno is None:  # asked for: read_only=True
            raise CheckpointStateError(
                f"{self.directory} was {self.read_only}: save() is refused; open a "
                "Checkpointer without read_only=True to save"
            )
        raise CheckpointIOError(
            f"{self.read_only}: save() is refused; make it writable (remount, fix its "
            "permissions) or save into another directory",
            errno=self._read_only_errno,
            filename=str(self.directory),
        )

    # ------------------------------------------------------------------ listing

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints with intact manifests, oldest first (data not read; see
        verify())."""
        from .persist import list_checkpoints

        try:
            root = self._root_dir()
        except CheckpointIOError as exc:
            if exc.errno != errno.ENOENT:  # a rank started before rank 0 created it
                raise
            return []
        return list_checkpoints(root)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None."""
        infos = self.list()
        return infos[-1] if infos else None

    @property
    def last_save(self) -> tuple[int, dict[str, Any]] | None:
        """(step, objects) of the most recent save(); PreemptionGuard saves the same objects."""
        return self._last_save

    @property
    def in_flight(self) -> SaveJob | None:
        return self._job if self._job is not None and not self._job.done.is_set() else None

    @property
    def rank(self) -> int:
        return self._group.rank

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        stateful: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        rng: bool = True,
        path: str | os.PathLike | None = None,
        verify_loaded: bool = False,
        elastic: bool | None = None,
    ) -> int | None:
        """Load the newest valid checkpoint into the objects, in place.

        Every byte is verified before any object is touched; a damaged newer checkpoint is skipped
        with a CheckpointFallbackWarning. ``extra``, if a dict, is updated with the saved extras.
        ``verify_loaded`` also checks the tensors after they are loaded, where they now live (on a
        GPU with the Triton CRC32C kernel): damage in the host-to-device copy or device memory is
        then caught too, at the cost of one more read of the state.

        A checkpoint restores on any world size and layout (resharding is the default; the
        ``elastic`` argument is deprecated and has no effect). DTensor state (FSDP2, tensor
        parallel) is read block by block into whatever layout the objects have now: each rank
        reads only the chunks overlapping its own shards and verifies each one's CRC32C, into
        host staging, and copies into the objects only once every rank has verified its part.
        Plain model and optimizer state saved by another number of ranks must be replicated:
        saved with ``replicated=True`` (declared at save time), or else checked against every
        rank's manifest first (DDP saves every rank's full copy). Rank r takes saved rank
        r mod N's tree and plain state (for pipeline stages, the next saved rank with the same
        model keys). The rank's own parts (RNG states, ``stateful``, ``extra``) come from that
        saved rank too: a sampler partitioned by rank must re-partition itself, and ranks mapped
        to one saved rank draw the same random numbers unless reseeded (or pass ``rng=False``).

        Returns:
            The restored step, or None when the directory holds no checkpoint at all.

        Raises:
            CheckpointCorruptError: every checkpoint (or the one named by ``path``) is damaged.
            CheckpointStateError: the checkpoint does not fit the objects (keys, shapes, world
                size).
        """
        from .persist import open_step, step_dirs
        from .restore import open_checkpoint
        from .restore import verify_loaded as check_loaded
        from .state import apply, capture
        from .targets import has_dtensors

        if elastic is not None:
            warnings.warn(
                "restore(elastic=...) is deprecated and has no effect: restore reshards to any "
                "world size by default",
                DeprecationWarning,
                stacklevel=2,
            )
        self._check_open()
        self.wait()
        g = self._group
        g.join("restore()")
        objects = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "scaler": scaler,
            "stateful": stateful,
        }
        dtensors = has_dtensors(model, optimizer)
        names: list[str | None] = [None]  # None: the caller's path
        root = None
        if path is None:
            try:
                root = self._root_dir()
            except CheckpointIOError as exc:
                if exc.errno != errno.ENOENT:  # a rank started before rank 0 created it
                    raise
            names = [n for _, n in step_dirs(root)] if root is not None else []
            if root is not None:
                self._check_pointer(root)
        failures: list[CheckpointError] = []
        for name in names:
            label = os.fsdecode(path) if name is None else str(self.directory / name)
            status, err, sharded = _OK, None, None
            try:
                with open_checkpoint(path) if name is None else open_step(root, name) as step:
                    where = step.path
                    info, tree, shard, sharded = self._read_candidate(
                        step, dtensors, extra, rng, objects
                    )
            except Exception as exc:
                status, err = _outcome(exc, label)
            agreed = g.all_reduce(status, "min")
            if agreed == _RAISE:
                raise (
                    err
                    if err is not None
                    else CheckpointError(
                        f"{label}: another rank cannot restore it (its error is raised there)"
                    )
                )
            if agreed == _OK:

                def agree(ok: bool) -> bool:
                    return g.all_reduce(int(ok), "min") == 1

                try:
                    if sharded is not None:
                        sharded.apply(extra=extra, rng=rng, agree=agree)
                    else:
                        apply(tree, **objects, extra=extra, rng=rng, agree=agree)
                except CheckpointCorruptError as exc:
                    err = exc
                else:
                    if sharded is not None:
                        self.last_restore = sharded
                        if verify_loaded:
                            sharded.verify_loaded()
                    elif verify_loaded:
                        _, table = capture(info.step, **objects, rng=False)
                        check_loaded(where, shard, table)
                    return info.step
            failures.append(
                err or CheckpointCorruptError(f"{label}: damaged on another rank", path=label)
            )
            if path is None:
                warnings.warn(
                    f"skipping damaged checkpoint {os.path.basename(label)}: {failures[-1]}",
                    CheckpointFallbackWarning,
                    stacklevel=2,
                )
        if not failures:
            return None
        if len(failures) == 1:
            raise failures[0]
        raise CheckpointCorruptError(
            f"all {len(failures)} checkpoints in "
            f"{self.directory} are damaged; newest: {failures[0]}",
            path=str(self.directory),
        )

    def _restore_staging(self, nbytes: int) -> Any:
        """Host staging for a sharded restore: the staging arena when one is allocated and
        large enough (pinned on CUDA machines: prepare() before restore() gets that), else
        fresh host memory, faulted in by the reads themselves (allocating and locking an arena
        here would fault it in first, a pass over memory the reads do anyway)."""
        self._join_prepare(None)
        if self._arena is not None and self._arena.nbytes >= nbytes:
            return self._arena.view(0, nbytes)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def _read_candidate(
        self, step: Dir, dtensors: bool, extra: Any, rng: bool, objects: dict[str, Any]
    ) -> tuple[CheckpointInfo, Any, Any, Any]:
        """Read, verify and decode one checkpoint into host memory and check it against the
        objects (nothing is loaded): (info, tree, shard manifest, None), or for DTensor state on
        either side (info, None, None, the staged ShardedRestore). Raises what is wrong."""
        from .persist import load_info
        from .restore import check_replicated, restore_tree
        from .targets import ShardedRestore
        from .validate import check_targets

        g = self._group
        info = load_info(step)
        if info.sharded or dtensors:  # block by block into the objects' layout
            sharded = ShardedRestore(
                step, info, g.rank, g.world_size, self._restore_staging, **objects
            ).prepare(extra=extra, rng=rng)
            return info, None, None, sharded
        src = g.rank
        if info.world_size != g.world_size:
            if not info.replicated:  # replicated=True declared it at save time
                check_replicated(step, info, g.world_size)
            src = g.rank % info.world_size
        tree, shard = restore_tree(step, info, src)
        check_targets(tree, **objects, extra=extra, rng=rng)
        return info, tree, shard, None

    def _check_pointer(self, root: Dir) -> None:
        """Cross-check ``latest`` (restore does not depend on it): a stale, damaged or unreadable
        pointer gets a warning."""
        from .persist import LATEST, load_info, open_step, read_latest

        try:
            ptr = read_latest(root)
            if ptr is None:
                return
            with open_step(root, ptr["path"]) as step:
                info = load_info(step)
            if info.manifest_crc32c != ptr["manifest_crc32c"] or info.step != ptr["step"]:
                raise CheckpointCorruptError(
                    f"{root.path / LATEST} names {ptr['path']} with another manifest CRC (stale)"
                )
        except CheckpointError as exc:
            warnings.warn(
                f"ignoring the latest pointer: {exc}; scanning {self.directory}",
                CheckpointFallbackWarning,
                stacklevel=3,
            )


# what rank 0 tells the others after opening the directory (else: the errno that made it
# read-only, 0 for read_only=True)
_FAILED, _WRITABLE = -2, -1

# restore()'s per-candidate outcome, agreed over the ranks with a MIN: the worst one wins
_RAISE, _DAMAGED, _OK = 0, 1, 2


def _outcome(exc: Exception, where: str) -> tuple[int, CheckpointError]:
    """What a failure to read or check a candidate checkpoint means: damage (fall back to an
    older one) or an error to raise. The one rule: whatever the content made fail is damage;
    the operating system's errors and a checkpoint that does not fit the objects are raised."""
    if isinstance(exc, CheckpointCorruptError):
        return _DAMAGED, exc
    if isinstance(exc, CheckpointError):
        return _RAISE, exc
    if isinstance(exc, MemoryError):
        err: CheckpointError = CheckpointIOError(
            f"{where}: out of memory while reading it; free memory and restore again",
            errno=errno.ENOMEM,
            filename=where,
        )
        return _RAISE, err
    if isinstance(exc, OSError):
        from .safe_fs import io_error

        return _RAISE, io_error(exc, exc.filename or where, "reading")
    err = CheckpointCorruptError(
        f"{where}: its state fails to decode or validate ({type(exc).__name__}: {str(exc)[:300]})",
        path=where,
    )
    err.__cause__ = exc
    return _DAMAGED, err


class _Prepare:
    """One staging allocation started by Checkpointer.prepare()."""

    def __init__(self, nbytes: int, device: int | None = None):
        self.nbytes, self.device = nbytes, device
        self.thread: threading.Thread | None = None
        self.arena: Any = None
        self.locked: bool | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from ._core import HostArena

        arena = None
        try:
            arena = HostArena(max(self.nbytes, 1), device=self.device)
            self.locked = True if arena.pinned else arena.lock()
            self.arena = arena
        except BaseException as exc:
            if arena is not None:
                arena.close()
            self.error = exc


def _stop_workers(workers: tuple[Worker, ...]) -> None:
    for w in workers:
        w.stop()


@atexit.register
def _close_all_at_exit() -> None:
    """Interpreter exit: finish every save in flight; a failed one is reported loudly and the
    process exits non-zero (an async failure must never look like success)."""
    failed = False
    for ckpt in list(_LIVE):
        try:
            ckpt.close()
        except CheckpointError as exc:
            failed = True
            print(f"\ngpumem: CHECKPOINT SAVE FAILED at exit: {exc}\n", file=sys.stderr, flush=True)
    if failed:
        sys.stdout.flush()
        os._exit(1)
