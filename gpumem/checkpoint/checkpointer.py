"""The Checkpointer: near-zero-stall save, background persist, verified restore with fallback.

The façade of the checkpoint stages; it validates its arguments (``settings``), holds what lives as
long as it does (the directory and its lock, the staging memory, the background threads) and
passes each save and restore through the stages in order:

- ``save()``: capture (``capture.training_state``: the objects become a tree and tensors) ->
  stage (``stage.staging`` and ``stage.snapshot``: the tensors are copied into host memory) ->
  storage (``storage.commit``: written, checksummed, committed, on the persist thread);
- ``restore()``: restore (``restore.candidates``: the newest checkpoint that verifies, read,
  checked against the objects and loaded all or nothing, the same on every rank).

Overlap mode and what it assumes: parameters and optimizer state are copied *after* save()
returns, while the next forward/backward runs; a pre-hook on ``optimizer.step()`` waits for the
copy, so they are never mutated mid-copy. That holds when only the optimizer step mutates them.
It does not hold for code that updates parameters in place outside ``optimizer.step()`` before the
next step (an EMA written into the model, manual weight surgery, a second optimizer over the same
parameters that is not the one passed to save()); use ``Checkpointer(..., overlap=False)`` or
``save(..., blocking=True)`` there. Buffers (BatchNorm running statistics), RNG states, scheduler,
scaler, extras and stateful objects are always captured before save() returns.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import warnings
import weakref
from typing import Any

from .capture.training_state import Capture, TrainingState, capture
from .errors import CheckpointError, CheckpointStateError
from .factory import open_storage
from .group import Group
from .lifecycle import LIVE, close_after, stop_workers
from .optimizer_hooks import OptimizerHooks, prepare_first_save, prepare_quietly
from .restore.candidates import StagedRestore
from .save import Save
from .save_setup import SaveSetup
from .settings import CheckpointerConfig, check_positive, check_step
from .stage.snapshot import Snapshot
from .stage.staging import Staging
from .stats import SaveStats
from .storage.backend import StorageRoot
from .storage.format import CheckpointInfo
from .workers import Worker


class Checkpointer:
    """Save training state in the background; restore the newest checkpoint that verifies.

    Args:
        directory: where ``step-<N>`` directories and the ``latest`` pointer live (``local=``),
            or an ``s3://bucket/prefix`` store that each rank saves to directly.
        keep: how many checkpoints to keep (the newest ones); None keeps all.
        staging_bytes: cap on host staging memory; None: ``default_staging_bytes()``.
        overlap, chunk_bytes, alignment, direct_io, segment_bytes, lock_timeout_s, replicated,
            collective_timeout_s, read_only, coalesce, device_spill_bytes, remote (the tiers),
            endpoint_url, replicas: see ``CheckpointerConfig``, which documents and checks each.

    Sharded state (FSDP2 ``fully_shard``, tensor parallel, 2-D meshes): pass the wrapped model and
    its optimizer as they are. Each rank writes the blocks of its local shards (a replicated
    block by one rank); restore reshards to whatever layout the objects have now, on any world
    size (see ``restore.sharded`` and docs/checkpoint.md, "Sharded training").

    Raises:
        CheckpointStateError: an argument is invalid (naming it), or the directory is locked by
            another job beyond ``lock_timeout_s``.
        CheckpointError: the directory cannot be opened.

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
        directory: str | bytes | os.PathLike | None = None,
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
        remote: str | None = None,
        endpoint_url: str | None = None,
        local: str | bytes | os.PathLike | None = None,
        replicas: int = 1,
    ):
        arguments = {k: v for k, v in locals().items() if k != "self"}  # the config's fields
        cfg = self.config = CheckpointerConfig(**arguments)  # checks every one of them
        self.directory = cfg.directory
        self._group = Group(float(cfg.collective_timeout_s))
        if coalesce and self._group.world_size > 1:
            raise CheckpointStateError(
                f"coalesce=True is single-process only (this job has {self._group.world_size} "
                "ranks, which would have to agree on which saves to skip); use coalesce=False"
            )
        self._staging = Staging.from_config(cfg)
        self._job: Save | None = None
        # background threads of every save (persist, overlap copy), started once: see Worker
        self._workers = (Worker("gpumem-ckpt-persist"), Worker("gpumem-ckpt-copy"))
        weakref.finalize(self, stop_workers, self._workers)
        self._lock = threading.RLock()
        self._hooks = OptimizerHooks()  # overlap's fences, restore()'s prepare-ahead
        self._last_save: tuple[int, dict[str, Any]] | None = None
        self._closed = False
        self.last_restore: StagedRestore | None = None  # a sharded one says what it read
        self.history: collections.deque[SaveStats] = collections.deque(maxlen=256)  # newest last
        try:
            storage = open_storage(cfg, self._group)  # the backend, picked by factory
        except BaseException:
            stop_workers(self._workers)
            raise
        self._root: StorageRoot = storage.root  # a directory or an s3:// store
        self.tiers = storage.tiers
        self._restore = storage.restore
        in_flight = functools.partial(_snapshot_in_flight, weakref.ref(self))
        parts = (self._staging, self._hooks, *self._workers, storage.root, storage.options)
        self._saving = SaveSetup(cfg.overlap, *parts, in_flight)  # _workers: persister, copier
        LIVE.add(self)

    # ------------------------------------------------------------------ what it holds

    @property
    def read_only(self) -> str | None:
        """Why save() is refused (None: it is not): the directory is opened read-only."""
        return self._root.read_only

    @property
    def staging_bytes(self) -> int:
        """The host staging budget in bytes."""
        return self._staging.budget

    @property
    def staging_locked(self) -> bool | None:
        """None until the staging arena is allocated; False: pre-faulted only (RLIMIT_MEMLOCK)."""
        return self._staging.locked

    @property
    def last_save(self) -> tuple[int, dict[str, Any]] | None:
        """(step, objects) of the most recent save(); PreemptionGuard saves the same objects."""
        return self._last_save

    @property
    def in_flight(self) -> Save | None:
        """The save not yet durable, if any."""
        return self._job if self._job is not None and not self._job.done.is_set() else None

    @property
    def rank(self) -> int:
        return self._group.rank

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints with intact manifests, oldest first (data not read; see
        verify())."""
        return self._root.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None."""
        infos = self.list()
        return infos[-1] if infos else None

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
        new_staging_bytes: int | None = None,
    ) -> SaveStats:
        """Snapshot the state at ``step`` and persist it in the background.

        Returns once the state is safe from further training (overlap mode: once buffers are
        copied; parameters and optimizer state follow in the background, fenced by the optimizer
        pre-step hook). A previous save still in flight is waited for first (back-pressure); its
        error, if any, is raised here. Returns the SaveStats of this save (filled in as it goes).

        ``new_staging_bytes`` bounds the host memory this save may allocate: a state larger
        than the staging arena that exists (none before the first save or ``prepare()``)
        streams through a buffer of at most that size instead (PreemptionGuard's final save
        passes ``preemption.FINAL_SAVE_STAGING``). None: up to ``staging_bytes``.
        """
        t0 = time.perf_counter()
        check_step(step)
        check_positive("new_staging_bytes", new_staging_bytes)
        state = TrainingState(model, optimizer, scheduler, scaler, stateful, extra, rng)
        with self._lock:
            self._check_open()
            self._root.check_writable()
            if self._staging.coalescer is None:
                self._wait_previous()
            else:  # no back-pressure: only earlier failures are raised here
                self._raise_job_error()
            captured = self._capture(step, state)
            job = self._saving.stage_and_commit(
                step, captured, state, blocking, t0, new_staging_bytes, self._wait_previous
            )
            self._job = job
            self._last_save = (step, state.objects())
            self.history.append(job.stats)
            job.run()
            self.tiers.submit(job)  # uploaded once committed locally, with a remote tier
            self._staging.copied(job.snapshot)
            job.stats.save_s = time.perf_counter() - t0
            if job.snapshot.caller_failed:  # a failure on this thread is raised here, not later
                job.done.wait()
                self._raise_job_error()
            return job.stats

    def _capture(self, step: int, state: TrainingState) -> Capture:
        g = self._group
        return capture(
            step, state, replicated=self.config.replicated, rank=g.rank, world=g.world_size
        )

    def prepare(
        self, model: Any = None, optimizer: Any = None, nbytes: int | None = None, background=True
    ) -> int:
        """Allocate the host staging arena ahead of the first save() and start faulting it in
        and locking it (or pre-faulting it) on a native background thread, in chunks, without
        the GIL; a first save() without it copies into fresh memory and pays its page faults.

        The arena is sized from ``model`` and ``optimizer``, clamped to ``staging_bytes``; an
        optimizer without state yet (AdamW makes ``exp_avg``/``exp_avg_sq`` in its first
        ``step()``) is sized after that step (a one-shot post-step hook), so call this once
        before training, or pass ``nbytes``. ``background=False`` allocates on this thread and
        waits for the fault-in. A later save() reuses the arena without waiting for the
        fault-in (it copies beside it; ``SaveStats.cold_bytes``) and grows it if need be.

        Returns:
            The staging bytes being prepared now (0: none, the arena is big enough or is sized
            after the optimizer's first step).

        Raises:
            CheckpointError: a background failure of a previous save or prepare(); this
                allocation's failure is raised by the next save() or wait() (by prepare() itself
                with ``background=False``).
        """
        self._check_open()
        check_positive("nbytes", nbytes)
        if nbytes is None and model is None and optimizer is None:
            raise CheckpointStateError("prepare() needs a model, an optimizer or nbytes")
        if nbytes is None and optimizer is not None and len(optimizer.state) == 0:
            later = functools.partial(_prepare_later, weakref.ref(self), model)
            self._hooks.prepare_ahead(optimizer, later)
            return 0
        return self._prepare(model, optimizer, nbytes, background)

    def _prepare(self, model: Any, optimizer: Any, nbytes: int | None = None, bg=True) -> int:
        with self._lock:
            self._check_open()
            if nbytes is None:  # what a save of these objects stages (replicated: this share)
                state = TrainingState(model=model, optimizer=optimizer)
                nbytes = self._staging.arena_bytes(self._capture(0, state).table)
            return self._staging.prepare(nbytes, bg)

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
        ``verify_loaded`` also checks the tensors where they now live (on a GPU with the Triton
        CRC32C kernel), at the cost of one more read of the state.

        A checkpoint restores on any world size and layout (``elastic`` is deprecated and has no
        effect). DTensor state (FSDP2, tensor parallel) is read block by block into the layout
        the objects have now, each rank reading and verifying only the chunks its shards overlap
        (``restore.sharded``). Plain state saved by another number of ranks must be replicated
        (``replicated=True`` at save time, or checked against every rank's manifest): rank r
        takes saved rank r mod N's tree (for pipeline stages, the next saved rank with the same
        model keys), its own parts (RNG states, ``stateful``, ``extra``) included: a sampler
        partitioned by rank must re-partition itself, and ranks mapped to one saved rank draw
        the same random numbers unless reseeded (or pass ``rng=False``).

        Then (unless read-only) the first save's staging arena is prepared as ``prepare()``
        does for these objects, so the first save() finds warm memory.

        Returns the restored step, or None when the directory holds no checkpoint at all.

        Raises:
            CheckpointCorruptError: every checkpoint (or the one named by ``path``) is damaged.
            CheckpointStateError: the checkpoint does not fit the objects (keys, shapes).
        """
        if elastic is not None:
            warnings.warn(
                "restore(elastic=...) is deprecated and has no effect: restore reshards to any "
                "world size by default",
                DeprecationWarning,
                stacklevel=2,
            )
        self._check_open()
        self.wait()
        self._group.join("restore()")
        self.tiers.before_restore(path)  # a newer remote step is fetched first
        step, staged = self._restore(
            TrainingState(model, optimizer, scheduler, scaler, stateful, extra, rng),
            self._group,
            self._staging.restore_buffer,
            path=path,
            verify_loaded=verify_loaded,
        )
        self.last_restore = staged or self.last_restore
        prepare_first_save(self, model, optimizer)
        return step

    # ------------------------------------------------------------------ wait / close

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save in flight is durable (False on timeout); raise its failure, once
        (here, or in the next save() or close()): a CheckpointError."""
        job = self._job
        if job is not None and not job.done.wait(timeout):
            return False
        self._raise_job_error()
        with self._lock:
            return self._staging.join_prepare(timeout)

    def _wait_previous(self) -> None:
        """save()'s back-pressure: the save in flight is durable (its failure raised) and a
        prepare() allocation is done (its failure raised), not the arena's fault-in, which the
        copy goes ahead beside."""
        job = self._job
        if job is not None:
            job.done.wait()
        self._raise_job_error()
        self._staging.join_prepare(None, resident=False)

    def _raise_job_error(self) -> None:
        err = self._job.take_error() if self._job is not None else None
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for the save in flight, release hooks, staging memory and the directory; raise if
        the save failed, else if closing the directory's lock file failed (CheckpointIOError:
        the lock is released all the same, and every committed step stays committed)."""
        if self._closed:
            return
        try:
            self.wait()
        except BaseException:
            _release(self, failing=True)
            raise
        _release(self, failing=False)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        close_after(self, exc_type is not None)
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")


def _prepare_later(ref: weakref.ref[Checkpointer], model: Any, optimizer: Any) -> None:
    """prepare() once the optimizer has stepped (its state exists if it keeps any)."""
    ck = ref()
    if ck is not None and not ck._closed:
        prepare_quietly(ck._prepare, model, optimizer)


def _snapshot_in_flight(ref: weakref.ref[Checkpointer]) -> Snapshot | None:
    """What overlap's fence waits for: the snapshot of the save in flight, if any."""
    job = ck._job if (ck := ref()) is not None else None
    return job.snapshot if job is not None else None


def _release(ckpt: Checkpointer, failing: bool) -> None:
    """What close() gives back, every part even when one fails; a failure to close the lock is
    raised unless the save's own failure is on its way (then it is a warning)."""
    ckpt._closed = True
    ckpt.tiers.close()
    stop_workers(ckpt._workers)
    ckpt._hooks.remove()
    ckpt._staging.close()
    LIVE.discard(ckpt)
    try:
        ckpt._root.close()
    except CheckpointError as exc:
        if not failing:
            raise
        warnings.warn(str(exc), RuntimeWarning, stacklevel=3)  # the save's failure comes first
