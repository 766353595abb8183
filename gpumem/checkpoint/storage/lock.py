"""One job per checkpoint directory: an advisory lock that rank 0 holds while a Checkpointer is
open.

Two jobs writing one directory would delete each other's saves in flight (each start removes stale
``.tmp-*`` directories) and race on ``latest``. The usual way it happens: a rescheduled job (a new
Kubernetes pod, a requeued Slurm job) starts while the preempted one is still flushing its final
checkpoint inside its grace period. The new job then waits for the lock and restores the checkpoint
the old one has just committed. ``flock`` locks are released by the kernel when their holder exits,
however it exits, so a crash never leaves a stale lock; on network file systems Linux maps them to
POSIX record locks. A file system without locking gets a warning, and no lock.

The lock file lives in a directory that may be hostile, so it is opened relative to the root's
descriptor with ``O_NOFOLLOW``, and only if it is a regular file with one link: a ``.lock`` that
is a symbolic link (dangling or not), a hard link to someone's file, a directory, a FIFO or a
device is refused as damage, and nothing outside the directory is created, truncated or written.
Where the root cannot be written (EROFS, EACCES) the open fails with that errno, and the
Checkpointer opens the directory read-only instead.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import warnings

from ..errors import CheckpointCorruptError, CheckpointStateError
from .safe_fs import Dir, close_fd, describe, io_error, read_error, release_fd

LOCK_FILE = ".lock"
# directories (device, inode) a Checkpointer of this process holds (waiting on them never ends)
_HELD: set[tuple[int, int]] = set()
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# the root cannot be written: the Checkpointer then opens it read-only, without a lock
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class DirLock:
    """Exclusive lock on the directory ``root`` (waits up to ``timeout_s`` for another job to
    release it).

    Raises:
        CheckpointStateError: held by this process already, or not released in time.
        CheckpointCorruptError: ``.lock`` is not a lock file this directory made (see the module
            docs); nothing was written.
        CheckpointIOError: the lock file cannot be opened; ``errno`` in ``READ_ONLY_ERRNOS`` when
            the directory cannot be written.
    """

    def __init__(self, root: Dir, timeout_s: float):
        self.key = root.identity()
        if self.key in _HELD:
            raise CheckpointStateError(
                f"{root.path} is already used by another open Checkpointer of this "
                "process; close() it first (two writers would delete each other's saves)"
            )
        path = self.path = root.path / LOCK_FILE
        self.fd: int | None = _open_lock(root, path)
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                        warnings.warn(
                            f"{root.path}: the file system does not support locks "
                            f"({exc.strerror}); make sure only one job writes this directory",
                            RuntimeWarning,
                            stacklevel=3,
                        )
                        self._forget()
                        return
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise io_error(exc, path, "locking") from None
                if time.monotonic() >= deadline:
                    raise CheckpointStateError(
                        f"{root.path} is in use by another job ({_holder(self.fd)}) "
                        f"and was not released within {timeout_s:g} s; stop that job, "
                        "wait for it to finish its final save, or use another "
                        "directory (Checkpointer(..., lock_timeout_s=...) waits longer)"
                    )
                time.sleep(0.1)
        except BaseException:
            self._forget()
            raise
        try:  # who holds it, for the message of a job that waits; best effort (a full disk)
            os.ftruncate(self.fd, 0)
            os.pwrite(
                self.fd,
                json.dumps(
                    {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
                ).encode()
                + b"\n",
                0,
            )
        except OSError:
            pass
        _HELD.add(self.key)

    def release(self) -> None:
        """Idempotent; also happens when the process exits.

        Raises:
            CheckpointIOError: closing the lock file failed; the lock is released all the same
                (Linux releases the descriptor, and with it the flock, whatever close() says).
        """
        fd, self.fd = self.fd, None  # forgotten first: never closed twice (``close_fd``)
        if fd is not None:
            _HELD.discard(self.key)
            close_fd(fd, self.path)  # closing the last descriptor of the open file drops the flock

    def _forget(self) -> None:
        """Close the descriptor on the way out of a failed or lockless open: a close failure
        then must not hide why (nothing of ours was written to it)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            release_fd(fd, self.path)


def _open_lock(root: Dir, path: os.PathLike) -> int:
    """The lock file's descriptor: created if missing, opened only if it is a regular file with
    one link (checked before opening, so no FIFO or device is opened, and after)."""
    try:
        before = root.lstat(LOCK_FILE)
        if before is not None:
            _check_lock_file(before, path)
        fd = os.open(LOCK_FILE, _FLAGS, 0o644, dir_fd=root.fd)
    except OSError as exc:
        raise read_error(exc, path, "opening the directory lock") from None
    try:
        after = os.fstat(fd)
        _check_lock_file(after, path)
        if before is not None and (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise CheckpointCorruptError(f"{path} was replaced while it was opened", path=str(path))
    except BaseException:
        release_fd(fd, path)
        raise
    return fd


def _check_lock_file(st: os.stat_result, path: os.PathLike) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        what = describe(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"{st.st_nlink} links"
        raise CheckpointCorruptError(
            f"{path} is not the lock file of this directory ({what}); nothing was written to "
            "it: remove it and open the Checkpointer again",
            path=str(path),
        )


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])} on {str(info['host'])[:100]}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "holder unknown"
