"""The checkpoint directory as an open Checkpointer holds it: opened, locked, cleaned, agreed on.

Rank 0 opens (or creates) the directory, takes its lock (one job per directory, ``lock``) and
removes what crashed saves left; where the directory cannot be written it is opened read-only,
without a lock, with a warning. The other ranks hear rank 0's result before they go on (through
the store, waiting as long as rank 0 may wait for the lock), so every rank fails alike, and
refuses save() alike, or a later collective would hang. They open the directory themselves on
first use (rank 0 may be creating it while they start).
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
import weakref
from pathlib import Path

from ..capture.training_state import Capture
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointStateError,
)
from ..group import Group
from ..stage.snapshot import Snapshot
from .commit import Commit, CommitOptions
from .directory import (
    clean_stale,
    list_checkpoints,
    load_info,
    open_step,
    read_latest,
    step_dirs,
)
from .format import LATEST, CheckpointInfo
from .lock import READ_ONLY_ERRNOS, DirLock
from .nodes.topology import Nodes
from .safe_fs import Dir

# what rank 0 tells the others after opening the directory (else: the errno that made it
# read-only, 0 for read_only=True)
_FAILED, _WRITABLE = -2, -1


class Root:
    """The checkpoint directory of one Checkpointer (see the module docstring).

    Args:
        path: the directory.
        group: the ranks of the job.
        read_only: the caller asked to open it for restore only.
        lock_timeout_s: how long rank 0 waits for another job's lock.
        collective_timeout_s: how long the other ranks wait for rank 0's word beyond that.

    Attributes:
        read_only: why save() is refused (None: it is not).

    Raises:
        CheckpointError: the directory cannot be opened (on rank 0: why; on the others: that
            rank 0 could not).
    """

    def __init__(
        self,
        path: Path,
        group: Group,
        *,
        read_only: bool,
        lock_timeout_s: float,
        collective_timeout_s: float,
        nodes: Nodes | None = None,
    ):
        self.path, self.group = path, group
        # node-local directories: each node's leader opens and locks its own
        self._leader = nodes.leader() if nodes is not None and nodes.local else None
        self.read_only: str | None = "opened with read_only=True" if read_only else None
        self._errno: int | None = None  # why it cannot be written (None: asked for)
        self._lock: DirLock | None = None
        self._dir: Dir | None = None
        failure: Exception | None = None
        if group.rank == (self._leader or 0):
            try:
                self._open(lock_timeout_s)
            except Exception as exc:  # raised below, once every rank has heard of it
                failure = exc
        if group.world_size > 1:
            failure = self._agree(failure, lock_timeout_s + collective_timeout_s)
        if failure is not None:
            with contextlib.suppress(CheckpointError):  # the failure is what to raise
                self.close()
            raise failure

    def _open(self, lock_timeout_s: float) -> None:
        """Rank 0: open (or create) the directory, take its lock, clean up after crashed saves;
        where the directory cannot be written, open it read-only, without a lock, and say so."""
        if self.read_only is not None:
            self._dir = Dir.open(self.path)
            return
        self._dir = Dir.open(self.path, create=True)
        try:
            self._lock = DirLock(self._dir, lock_timeout_s)
        except CheckpointIOError as exc:
            if exc.errno not in READ_ONLY_ERRNOS:
                raise
            self.read_only = (
                f"{self.path} cannot be written ({os.strerror(exc.errno or 0)}), so it was "
                "opened read-only, without the directory lock"
            )
            warnings.warn(
                f"{self.read_only}: restore() works, save() is refused",
                RuntimeWarning,
                stacklevel=4,
            )
            self._errno = exc.errno or errno.EACCES
            return
        weakref.finalize(self, self._lock.release)
        clean_stale(self._dir)  # after taking the lock: a live job's saves stay

    def _agree(self, failure: Exception | None, timeout_s: float) -> Exception | None:
        """Rank 0's result on every rank: the failure to raise here, or None."""
        code = _FAILED if failure is not None else _WRITABLE
        if failure is None and self.read_only is not None:
            code = self._errno or 0
        try:
            if self._leader is None:
                what = f"whether it opened {self.path}"
                code = self.group.from_rank0("open", code, timeout_s, what)
            else:  # each rank hears its own node's leader
                code = self.group.all_gather([code])[self._leader][0]
        except CheckpointError as exc:
            failure = failure or exc
        if code == _FAILED and failure is None:
            failure = CheckpointError(
                f"rank 0 could not open {self.path} (its error is raised there)"
            )
        elif code >= 0 and self.read_only is None:
            self.read_only = "opened read-only by rank 0"
            self._errno = code or None
        return failure

    @property
    def dir(self) -> Dir:
        """The directory's descriptor, opened on first use on ranks other than 0 (rank 0 may be
        creating the directory while they start)."""
        if self._dir is None:
            self._dir = Dir.open(self.path)
        return self._dir

    @property
    def opened(self) -> Dir | None:
        """The descriptor if it is open already (rank 0 always; others after first use)."""
        return self._dir

    def maybe(self) -> Dir | None:
        """The descriptor, or None where the directory does not exist (yet: on a rank other than
        0, it may be created while this one starts)."""
        try:
            return self.dir
        except CheckpointIOError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return None

    def list(self) -> list[CheckpointInfo]:
        """The committed checkpoints with intact manifests, oldest first."""
        root = self.maybe()
        return list_checkpoints(root) if root is not None else []

    def candidates(self) -> DirCandidates | None:
        """The committed steps for a restore; None where the directory does not exist."""
        root = self.maybe()
        return DirCandidates(root, self.path) if root is not None else None

    def commit(
        self, options: CommitOptions, step: int, captured: Capture, snapshot: Snapshot
    ) -> Commit:
        """The ``commit.Commit`` of one save into this directory."""
        return Commit(options, self.opened, step, captured, snapshot)

    def check_writable(self) -> None:
        """Raise why save() is refused, if it is."""
        if self.read_only is None:
            return
        if self._errno is None:  # asked for: read_only=True
            raise CheckpointStateError(
                f"{self.path} was {self.read_only}: save() is refused; open a Checkpointer "
                "without read_only=True to save"
            )
        raise CheckpointIOError(
            f"{self.read_only}: save() is refused; make it writable (remount, fix its "
            "permissions) or save into another directory",
            errno=self._errno,
            filename=str(self.path),
        )

    def close(self) -> None:
        """Release the lock and close the directory (both, whatever fails; idempotent).

        Raises:
            CheckpointIOError: closing the lock file failed (``DirLock.release``).
        """
        try:
            if self._lock is not None:
                self._lock.release()
        finally:
            if self._dir is not None:
                self._dir.close()


class DirCandidates:
    """The committed ``step-<N>`` directories of an open root as a restore walks them
    (``backend.Candidates``)."""

    def __init__(self, root: Dir, path: Path):
        self.root, self.path = root, path

    def names(self) -> list[str]:
        return [n for _, n in step_dirs(self.root)]

    def open(self, name: str) -> Dir:
        return open_step(self.root, name)

    def gone(self, name: str) -> bool:
        return self.root.lstat(name) is None

    def check_pointer(self) -> None:
        """Cross-check ``latest`` (restore does not depend on it): a stale, damaged or
        unreadable pointer gets a warning."""
        try:
            ptr = read_latest(self.root)
            if ptr is None:
                return
            with open_step(self.root, ptr["path"]) as step:
                info = load_info(step)
            if info.manifest_crc32c != ptr["manifest_crc32c"] or info.step != ptr["step"]:
                raise CheckpointCorruptError(
                    f"{self.root.path / LATEST} names {ptr['path']} with another manifest CRC "
                    "(stale)"
                )
        except CheckpointError as exc:
            warnings.warn(
                f"ignoring the latest pointer: {exc}; scanning {self.path}",
                CheckpointFallbackWarning,
                stacklevel=5,  # Checkpointer.restore, through NewestRestore, restore, _names
            )
