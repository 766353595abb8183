"""CheckpointerConfig: every setting of a Checkpointer, validated once, in one place, one style.

Each argument is checked when the config is made (``__post_init__``): a bad value raises
CheckpointStateError naming the argument, the value and the valid range, before anything is
created on disk or in memory. The stages take the values from here; nothing re-checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .errors import CheckpointStateError
from .stage.pieces import DEFAULT_CHUNK, MIN_CHUNK
from .storage.location import ObjectURL, check_root, url_scheme

MIN_BUDGET = 64 << 20  # the default staging budget's floor
MAX_STEP = 2**63 - 1  # steps are stored as JSON integers and read back as int64-sized values


def default_staging_bytes() -> int:
    """GPUMEM_STAGING_BYTES, else a quarter of the memory available now (at least 64 MiB): the
    host's ``MemAvailable``, or a container's memory limit less its usage where that is lower."""
    from gpumem._env import env_int
    from gpumem.device import host_available_bytes

    value = env_int("GPUMEM_STAGING_BYTES")
    if value is not None:
        return value
    return max(MIN_BUDGET, host_available_bytes() // 4)


@dataclass(frozen=True)
class CheckpointerConfig:
    """The settings of a Checkpointer (its constructor's arguments; see ``Checkpointer``).

    Attributes:
        directory: where ``step-<N>`` directories and the ``latest`` pointer live.
            An ``s3://bucket/prefix`` text is an object store as the root itself
            (``storage.s3.object_backend``): each rank uploads its shards there, restore reads them
            back by ranged GETs.
        keep: how many checkpoints to keep (the newest ones); None keeps all.
        staging_bytes: cap on host staging memory. None: ``default_staging_bytes()``, resolved
            when the config is made. A larger state streams through the budget in chunks.
        overlap: copy parameters and optimizer state in the background (see ``checkpointer``
            for the assumption); False always copies before save() returns.
        chunk_bytes: CRC32C granularity (power of two, >= 4096). None: 1 MiB, or for DTensor
            state a 64th of the byte-weighted median block size (between 4 KiB and 1 MiB): a
            resharding restore reads whole chunks, so at most one partial chunk at each end of
            each overlap is read beyond what it needs.
        alignment: extent alignment in the data files (power of two, at most the chunk).
        direct_io: write data files with O_DIRECT from the page-aligned arena: no second copy
            into the page cache (less CPU taken from training, no cache pollution). File systems
            that refuse O_DIRECT get buffered writes.
        segment_bytes: size of each data file when the state fits the budget. A save of host
            tensors, blocking or overlap copied beside training, writes file b while it copies
            batch b+1, in files of at most an eighth of the state (at least 16 MiB), so time to
            durable ~ the first file's copy + the write; an overlap save copied at once (no core
            free beside training) writes whole segments once its copy is done, as each file
            written beside that copy lengthened the stall of the training loop; when streaming,
            file b is written while batch b+1 is copied. CUDA state is written once staged.
        lock_timeout_s: rank 0 holds a lock on ``directory`` while the Checkpointer is open, so two
            jobs never write it at once; a new job waits this long for an old one (e.g. a preempted
            pod still flushing its final save) to release it, then raises CheckpointStateError.
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
        collective_timeout_s: save() and restore() are collectives; a rank that does not join
            one within this many seconds (save() called on rank 0 only, say) makes it raise
            CheckpointStateError on every rank that did, naming the missing ranks. Rank 0's
            wait for the directory lock (``lock_timeout_s``) does not count: the other ranks
            wait for its result first. With ``remote=`` on node-local directories, close()
            waits at most this long for the other ranks' uploads once its own is done.
        read_only: open the directory for restore only: no lock is taken (a job writing it is
            not waited for), nothing is cleaned up, save() is refused. Without it, a directory
            that cannot be written (read-only mount, no write permission) is opened this way
            too, with a warning.
        coalesce: for a checkpoint every step: save() never waits for the writer. Each save
            snapshots into host memory (two staging slots: twice the host memory); while an
            older step is being written, a newer snapshot replaces the one waiting to be written
            instead of making save() wait (``SaveStats.superseded_by`` / ``supersedes`` say
            which steps were written and which were not). ``wait()``, ``close()`` and a
            PreemptionGuard persist the last snapshot. A state that streams (larger than half
            the staging budget) falls back to waiting. Single process only (see
            ``stage.coalesce``).
        device_spill_bytes: for CUDA state in overlap mode whose D2H copy takes longer than the
            forward/backward beside it: a device buffer of this fixed size (allocated once at
            the first such save; never "whatever is free", so the next forward cannot run out of
            memory because of it). At the optimizer fence the parameters not yet copied to host
            are copied into it device to device, in copy order as far as they fit, and drained
            to host afterwards; the step waits for the rest (``SaveStats.spill_bytes``,
            ``fence_s``). 0 (default): off.
        remote: an ``s3://bucket/prefix`` root: the tiers (``gpumem.checkpoint.tiers``). Each
            step committed in ``directory`` (the local tier, e.g. node-local NVMe) is uploaded
            there in the background, and restore() takes the newest step of either tier. One
            upload at a time; of the steps committed while one runs only the newest is uploaded
            next. Several ranks need a ``directory`` they all share. None: local only.
        endpoint_url: the S3 endpoint of ``remote`` or of an s3:// ``directory`` (MinIO, a
            local server); None: from the AWS environment (``AWS_ENDPOINT_URL``) or AWS itself.
        local: ``directory`` by another name, as tiers spell it (give one of the two).
        replicas: with node-local directories (each node its own disk), on how many nodes each
            rank's data files are kept (its own and the next ``replicas - 1``); a step survives
            the loss of ``replicas - 1`` nodes. At most the number of nodes; 1: no copies.

    Raises:
        CheckpointStateError: an argument of the wrong type or outside its range, naming it.
    """

    directory: Path
    keep: int | None = 3
    staging_bytes: int | None = None
    overlap: bool = True
    chunk_bytes: int | None = None
    alignment: int = 4096
    direct_io: bool = True
    segment_bytes: int = 256 << 20
    lock_timeout_s: float = 120.0
    replicated: bool = False
    collective_timeout_s: float = 60.0
    read_only: bool = False
    coalesce: bool = False
    device_spill_bytes: int = 0
    remote: str | None = None
    endpoint_url: str | None = None
    local: Any = None
    replicas: int = 1
    url: str | None = field(default=None, init=False)  # an s3:// directory: the store itself

    def __post_init__(self) -> None:
        if self.local is not None:  # the tiers' spelling: Checkpointer(local=..., remote=...)
            if self.directory is not None:
                raise CheckpointStateError("give directory or local (the same argument), not both")
            object.__setattr__(self, "directory", self.local)
        if isinstance(self.directory, str) and url_scheme(self.directory) == "s3":
            self._object_root(self.directory)
        try:  # any bytes the OS accepts; another URL is refused, never taken as a local path
            if self.url is None:
                object.__setattr__(self, "directory", check_root(self.directory))
        except TypeError:
            raise CheckpointStateError(
                f"directory={self.directory!r} must be a path (str, bytes or os.PathLike)"
            ) from None
        if self.keep is not None and not is_int(self.keep, 1):
            raise CheckpointStateError(
                f"keep={self.keep!r}: keep at least 1 checkpoint (a positive int), or None for all"
            )
        chunk = self.chunk_bytes
        if chunk is not None and (not is_int(chunk, 1) or chunk & (chunk - 1)):
            _refuse("chunk_bytes", chunk, "must be a power of two (an int), or None")
        if not is_int(self.alignment, 1) or self.alignment & (self.alignment - 1):
            _refuse("alignment", self.alignment, "must be a power of two (an int)")
        largest = DEFAULT_CHUNK if chunk is None else chunk
        smallest = MIN_CHUNK if chunk is None else chunk  # the automatic chunk's floor
        if largest < MIN_CHUNK or self.alignment > smallest:
            raise CheckpointStateError(
                f"chunk_bytes={chunk} must be >= {MIN_CHUNK} and >= alignment={self.alignment}"
            )
        if not is_int(self.segment_bytes, 1):
            _refuse("segment_bytes", self.segment_bytes, "must be a positive int")
        if self.staging_bytes is not None and not is_int(self.staging_bytes, 1):
            _refuse("staging_bytes", self.staging_bytes, "must be a positive int (bytes), or None")
        if self.staging_bytes is None:
            object.__setattr__(self, "staging_bytes", default_staging_bytes())
        assert self.staging_bytes is not None
        if self.staging_bytes < 2 * largest:
            raise CheckpointStateError(
                f"staging_bytes={self.staging_bytes} is below two chunks ({2 * largest} bytes); "
                "raise it"
            )
        if not _seconds(self.lock_timeout_s, zero=True):
            _refuse(
                "lock_timeout_s", self.lock_timeout_s, "must be a finite number of seconds >= 0"
            )
        for name in ("overlap", "direct_io", "replicated", "read_only", "coalesce"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, getattr(self, name), "must be True or False")
        if not is_int(self.device_spill_bytes, 0):
            _refuse(
                "device_spill_bytes", self.device_spill_bytes, "must be an int >= 0 (0: no spill)"
            )
        if not is_int(self.replicas, 1):
            _refuse("replicas", self.replicas, "must be an int >= 1 (1: no copies on other nodes)")
        if self.replicas > 1 and self.read_only:
            _refuse(
                "replicas",
                self.replicas,
                "is for node-local directories written by this job: not with read_only=True",
            )
        self._check_remote()
        if not _seconds(self.collective_timeout_s, zero=False):
            _refuse(
                "collective_timeout_s",
                self.collective_timeout_s,
                "must be a positive, finite number of seconds",
            )

    def _object_root(self, text: str) -> None:
        """``directory`` is an ``s3://`` root: saved to and restored from the store directly."""
        from .storage.s3.object_files import ObjectPath

        try:
            url = str(ObjectURL.parse(text))
        except CheckpointStateError as exc:
            raise CheckpointStateError(f"directory={exc}") from None
        if self.remote is not None:
            raise CheckpointStateError(
                f"directory={text!r} is an object store already; remote= is the store behind a "
                "local directory (Checkpointer('/nvme/ckpt', remote=...)): give one of the two"
            )
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "directory", ObjectPath(url))

    def _check_remote(self) -> None:
        if self.remote is not None:
            if not isinstance(self.remote, str):
                _refuse("remote", self.remote, "must be an s3://BUCKET/PREFIX text, or None")
            try:
                ObjectURL.parse(self.remote)
            except CheckpointStateError as exc:
                raise CheckpointStateError(f"remote={exc}") from None
            if self.read_only:
                raise CheckpointStateError(
                    f"remote={self.remote!r} with read_only=True: a restore from the remote is "
                    "fetched into the local directory, which must be writable; drop read_only"
                )
        url = self.endpoint_url
        if url is not None and not (
            isinstance(url, str) and url.startswith(("http://", "https://")) and len(url) > 8
        ):
            _refuse("endpoint_url", url, "must be an http:// or https:// URL, or None")
        if url is not None and self.remote is None and self.url is None:
            _refuse("endpoint_url", url, "is for an s3:// directory or remote=, neither is given")


def is_int(value: Any, lo: int) -> bool:
    """``value`` is an int (a bool is not one) of at least ``lo``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def check_positive(name: str, value: Any) -> None:
    """An optional byte count: None or a positive int."""
    if value is not None and not is_int(value, 1):
        raise CheckpointStateError(f"{name}={value!r} must be a positive int or None")


def check_step(step: Any) -> None:
    """A step save() can store."""
    if not is_int(step, 0) or step > MAX_STEP:
        raise CheckpointStateError(f"step={step!r} must be an int in [0, 2**63 - 1]")


def _seconds(value: Any, zero: bool) -> bool:
    """A finite number of seconds, >= 0 (``zero``) or > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (value >= 0 if zero else value > 0) and value < math.inf


def _refuse(name: str, value: Any, rule: str) -> NoReturn:
    raise CheckpointStateError(f"{name}={value!r} {rule}")
