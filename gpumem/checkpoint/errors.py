"""Errors and warnings of gpumem.checkpoint.

Every failure a caller can act on is a ``CheckpointError``; the subclasses say which kind. Messages
name the file, the tensor or the key at fault and, where there is one, the fix.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every checkpoint failure."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is damaged, truncated, incomplete or hostile.

    Attributes:
        path: the file at fault (or the checkpoint directory), when known.
        tensor: the tensor whose bytes failed verification, when known.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class CheckpointIOError(CheckpointError, OSError):
    """Writing or reading a checkpoint failed at the operating-system level (disk full,
    permissions).

    It is also an ``OSError`` carrying the original ``errno`` and ``filename``.
    """

    def __init__(self, message: str, *, errno: int | None = None, filename: str | None = None):
        CheckpointError.__init__(self, message)
        self.errno = errno
        self.filename = filename
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror

    @classmethod
    def wrap(cls, exc: OSError, doing: str) -> CheckpointIOError:
        """Wrap an ``OSError`` raised while ``doing`` something, keeping errno and filename."""
        what = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in doing else ""
        err = cls(f"{doing} failed: {what}{where}", errno=exc.errno, filename=exc.filename)
        err.__cause__ = exc
        return err


class CheckpointStateError(CheckpointError):
    """The objects given to save() or restore() cannot be stored or do not match the checkpoint
    (unsupported value types, missing or unexpected keys, shape mismatch, another world size)."""


class CheckpointFallbackWarning(UserWarning):
    """restore() skipped a damaged checkpoint (or a stale ``latest`` pointer) and used an older
    one."""


class CheckpointPointerWarning(UserWarning):
    """A save was committed (its ``step-<N>`` directory is in place and restore() finds it), but
    the ``latest`` pointer could not be moved to it; ``SaveStats.latest_error`` says why."""


class CheckpointBranchWarning(UserWarning):
    """A save of a step lower than committed ones moved those to ``abandoned/`` (training went
    back)."""
