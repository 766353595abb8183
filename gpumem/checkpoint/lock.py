"""One job per checkpoint directory: an advisory lock that rank 0 holds while a Checkpointer is
open.

Two jobs writing one directory would delete each other's saves in flight (each start removes stale
``.tmp-*`` directories) and race on ``latest``. The usual way it happens: a rescheduled job (a new
Kubernetes pod, a requeued Slurm job) starts while the preempted one is still flushing its final
checkpoint inside its grace period. The new job then waits for the lock and restores the checkpoint
the old one has just committed. ``flock`` locks are released by the kernel when their holder exits,
however it exits, so a crash never leaves a stale lock; on network file systems Linux maps them to
POSIX record locks. A file system without locking gets a warning, and no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path

from .errors import CheckpointStateError

LOCK_FILE = ".lock"
_HELD: set[str] = (
    set()
)  # directories a Checkpointer of this process holds (waiting on them would never end)


class DirLock:
    """Exclusive lock on ``directory`` (waits up to ``timeout_s`` for another job to release it)."""

    def __init__(self, directory: Path, timeout_s: float):
        self.key = os.path.realpath(directory)
        if self.key in _HELD:
            raise CheckpointStateError(
                f"{directory} is already used by another open Checkpointer of this "
                "process; close() it first (two writers would delete each other's saves)"
            )
        path = directory / LOCK_FILE
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                        warnings.warn(
                            f"{directory}: the file system does not support locks "
                            f"({exc.strerror}); make sure only one job writes this directory",
                            RuntimeWarning,
                            stacklevel=3,
                        )
                        os.close(self.fd)
                        self.fd = None
                        return
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                if time.monotonic() >= deadline:
                    raise CheckpointStateError(
                        f"{directory} is in use by another job ({_holder(self.fd)}) "
                        f"and was not released within {timeout_s:g} s; stop that job, "
                        "wait for it to finish its final save, or use another "
                        "directory (Checkpointer(..., lock_timeout_s=...) waits longer)"
                    )
                time.sleep(0.1)
        except BaseException:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(
            self.fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            ).encode()
            + b"\n",
            0,
        )
        _HELD.add(self.key)

    def release(self) -> None:
        """Idempotent; also happens when the process exits."""
        if self.fd is not None:
            _HELD.discard(self.key)
            os.close(self.fd)  # closing the last descriptor of the open file drops the flock
            self.fd = None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])} on {str(info['host'])[:100]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
