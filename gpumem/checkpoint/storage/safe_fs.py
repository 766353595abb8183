"""File access inside a checkpoint root that a hostile directory cannot redirect, block or abuse.

A checkpoint directory is input: it may have been downloaded, untarred or shared. So the root is
opened once (it may be a symbolic link: that is the user's choice) and everything inside it is
reached relative to a directory descriptor: directories are opened with ``O_DIRECTORY |
O_NOFOLLOW``, files are created with ``O_EXCL | O_NOFOLLOW`` and read only if they are regular
files of the size expected (``gpumem.reader`` checks the type before opening, so a FIFO or device
is never opened, and again after), renames and removals never follow a link. A symbolic link, a
FIFO, a device or a directory where a file belongs is hostile content: ``hostile`` turns it into
``CheckpointCorruptError`` naming the path. Every other operating-system error stays what it is,
``CheckpointIOError`` with errno and path (``io_error``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gpumem.reader import read_file, read_spans
from gpumem.writer import write_file

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointIOError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# errors that mean "this name is not the plain file or directory we made": content, not the OS
_HOSTILE_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EISDIR)
_MAX_DEPTH = 8  # abandoned/<time>/step-N/file is the deepest tree a checkpoint root holds
_T = TypeVar("_T")


def describe(mode: int) -> str:
    """What a non-regular directory entry is, for messages."""
    for test, what in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def unexpected_file_error() -> type[OSError]:
    from gpumem.reader import UnexpectedFileError

    return UnexpectedFileError


def read_error(exc: OSError, path: Path | str, doing: str) -> CheckpointError:
    """The CheckpointError for an OSError met while reading ``path``: a missing file, a symbolic
    link, a FIFO or device, a directory where a file belongs, or a file of another size than
    recorded is damage (CheckpointCorruptError); anything else (EACCES, EIO, ENOMEM) is the
    operating system's (CheckpointIOError, errno and path kept)."""
    if isinstance(exc, unexpected_file_error()):
        return CheckpointCorruptError(f"{path}: {exc.strerror}", path=str(path))
    if exc.errno == errno.ENOENT:
        return CheckpointCorruptError(f"{path}: missing", path=str(path))
    if exc.errno in _HOSTILE_ERRNOS:
        return CheckpointCorruptError(
            f"{path}: not the plain file or directory a checkpoint holds ({exc.strerror}): refused",
            path=str(path),
        )
    return io_error(exc, path, doing)


def io_error(exc: OSError, path: Path | str, doing: str) -> CheckpointIOError:
    """``exc`` as a CheckpointIOError naming ``path`` (the full path, not the name relative to
    a directory descriptor), errno kept and the OSError chained."""
    err = CheckpointIOError(
        f"{doing} {path} failed: {exc.strerror or exc}", errno=exc.errno, filename=str(path)
    )
    err.__cause__ = exc
    return err


def retried(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)`` again while it fails with EINTR. CPython retries most calls
    itself (PEP 475), but not mkdir, rename, unlink or rmdir, which a network or FUSE file
    system may interrupt: a signal is no reason to fail a save."""
    while True:
        try:
            return call(*args, **kwargs)
        except InterruptedError:
            continue


@contextlib.contextmanager
def naming(path: Path | str, call: str = "", path2: Path | str | None = None) -> Iterator[None]:
    """An OSError raised inside names the full ``path`` (and ``path2``, a rename's target) and
    the ``call`` that failed: a call through a directory descriptor reports the name relative
    to it, or none at all (fsync), and a message must say which file failed, and how."""
    try:
        yield
    except OSError as exc:
        if not isinstance(exc, CheckpointError):
            exc.filename = str(path)
            if path2 is not None:
                exc.filename2 = str(path2)
            if call and exc.strerror:
                exc.strerror = f"{exc.strerror} ({call})"
        raise


def close_fd(fd: int, path: Path | str) -> None:
    """Close ``fd``, which the caller has forgotten already: Linux releases a descriptor even
    when close() fails (EIO, a write-back error reported late), so it must never be closed again
    (the number may belong to another file by then). EINTR is no failure: the descriptor is
    released and nothing was lost (CPython's own file objects ignore it too).

    Raises:
        CheckpointIOError: close() failed (errno and ``path`` kept).
    """
    try:
        os.close(fd)
    except InterruptedError:
        pass
    except OSError as exc:
        raise io_error(exc, path, "closing") from None


def release_fd(fd: int, path: Path | str) -> None:
    """``close_fd`` for a descriptor nothing was written through (a directory, a file read):
    its close failing loses nothing, so it fails no operation and undoes no commit; a
    RuntimeWarning names ``path`` and the error."""
    try:
        close_fd(fd, path)
    except CheckpointIOError as exc:
        warnings.warn(
            f"{exc} (nothing is lost: nothing was written through it)", RuntimeWarning, stacklevel=3
        )


def io_threads() -> int:
    """Reads in flight: a disk (or a virtual one) wants a deeper queue than the core count."""
    from gpumem._env import env_int

    return max(1, env_int("GPUMEM_IO_THREADS", None) or max(4, min(16, os.cpu_count() or 1)))


class Dir:
    """An open directory: every name inside it is reached through its descriptor, never through
    a symbolic link. Closed by ``close()`` or when garbage-collected.

    Attributes:
        path: where it was opened (for messages; the descriptor, not this path, is used).
        fd: the directory descriptor.
    """

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | bytes | os.PathLike, *, create: bool = False) -> Dir:
        """Open the directory ``path`` itself (a symbolic link here is the caller's choice and is
        followed); with ``create`` make it first, parents included.

        Raises:
            CheckpointIOError: it cannot be created or opened, or is not a directory (ENOTDIR).
        """
        p = Path(os.fsdecode(path))
        try:
            if create:
                p.mkdir(parents=True, exist_ok=True)
            return cls(os.open(p, _DIR_FLAGS), p)
        except FileExistsError as exc:  # mkdir(exist_ok=True) on a file
            raise io_error(
                OSError(errno.ENOTDIR, "exists and is not a directory"), p, "opening"
            ) from exc
        except OSError as exc:
            raise io_error(exc, p, "creating" if create else "opening") from None

    def sub(self, name: str) -> Dir:
        """Open the directory ``name`` inside this one, never through a symbolic link.

        Raises:
            OSError: ELOOP for a symbolic link, ENOTDIR for something else, ENOENT if missing.
        """
        with naming(self.path / name):
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        return Dir(fd, self.path / name)

    def make_sub(self, name: str) -> Dir:
        """Create the directory ``name`` (it must not exist) and open it."""
        with naming(self.path / name, "mkdir"):
            retried(os.mkdir, name, 0o755, dir_fd=self.fd)
        return self.sub(name)

    def ensure_sub(self, name: str) -> Dir:
        """Open the directory ``name``, creating it if missing; a symbolic link or a file of that
        name is an error (ELOOP / ENOTDIR), never followed."""
        with contextlib.suppress(FileExistsError), naming(self.path / name, "mkdir"):
            retried(os.mkdir, name, 0o755, dir_fd=self.fd)
        return self.sub(name)

    def close(self) -> None:
        """Idempotent, and never raises: a failure is a warning (``release_fd``)."""
        fd, self.fd = self.fd, -1  # forgotten first: never closed twice (``close_fd``)
        if fd >= 0:
            release_fd(fd, self.path)

    def __del__(self) -> None:
        # also at interpreter exit, when module globals (os) may be gone already
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    # ------------------------------------------------------------------ looking

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a link is not followed), or None if there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entries(self) -> list[os.DirEntry]:
        """The entries of this directory (``is_dir(follow_symlinks=False)`` tells real ones)."""
        with os.scandir(self.fd) as it:
            return list(it)

    def identity(self) -> tuple[int, int]:
        """(device, inode): the same directory whatever path reached it."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    # ------------------------------------------------------------------ files

    def read_small(self, name: str, cap: int, what: str) -> bytes:
        """The whole of the small file ``name`` (a manifest, the pointer), read only if it is a
        regular file of at most ``cap`` bytes: its size is checked before a byte is read.

        Raises:
            CheckpointCorruptError: missing, a symbolic link, a FIFO or device, or over ``cap``.
            CheckpointIOError: any other operating-system error.
        """
        path = self.path / name
        # one descriptor for the checks and the read: a file replaced by rename in between (the
        # pointer, moved atomically) is either the old file or the new one, never a torn mix.
        # O_NONBLOCK: opening a FIFO does not wait for a writer; O_NOFOLLOW: no link is opened
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a symbolic link
                raise CheckpointCorruptError(
                    f"{path}: {what} is a symbolic link, not a regular file: refused",
                    path=str(path),
                ) from None
            raise read_error(exc, path, f"reading {what}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError(
                    f"{path}: {what} is {describe(st.st_mode)}, not a regular file: refused",
                    path=str(path),
                )
            if st.st_size > cap:
                raise CheckpointCorruptError(
                    f"{path}: {what} is {st.st_size} bytes, over the {cap} byte limit",
                    path=str(path),
                )
            chunks, left = [], st.st_size
            while left > 0:
                data = os.pread(fd, min(left, 1 << 24), st.st_size - left)
                if not data:
                    break
                chunks.append(data)
                left -= len(data)
        except OSError as exc:
            raise read_error(exc, path, f"reading {what}") from None
        finally:
            release_fd(fd, path)
        if left:  # truncated while open: a file replaced by rename never is
            raise CheckpointCorruptError(
                f"{path}: {what} ended {left} bytes short of its {st.st_size}", path=str(path)
            )
        return b"".join(chunks)

    def read_again(self) -> bool:
        """Never: a file read is not in transit, what it read is what the disk holds."""
        return False

    def check_size(self, name: str, size: int) -> None:
        """The data file ``name`` is a regular file of the ``size`` bytes its manifest records,
        checked before a byte is read (the reader checks again once it has the file open).

        Raises:
            CheckpointCorruptError: missing, not a regular file, or of another size.
            CheckpointIOError: the operating system failed the lstat.
        """
        file = self.path / name
        try:
            st = self.lstat(name)
        except OSError as exc:
            raise read_error(exc, file, "reading") from None
        if st is None:
            raise CheckpointCorruptError(f"{file}: data file unreadable: missing", path=str(file))
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(
                f"{file}: data file is {describe(st.st_mode)}, not a regular file: refused",
                path=str(file),
            )
        if st.st_size != size:
            raise CheckpointCorruptError(
                f"{file}: {st.st_size} bytes on disk, manifest says {size} (truncated or damaged)",
                path=str(file),
            )

    def read_file(
        self,
        name: str,
        pieces: list[tuple[int, Any]],
        *,
        chunk_bytes: int,
        crc_index: list[int],
        crc_out: Any,
        expect_size: int,
        threads: int | None = None,
        direct: bool = True,
    ) -> None:
        """``reader.read_file`` on the data file ``name`` (never through a link, never a FIFO):
        every ``(offset, buffer)`` piece filled on ``threads`` native threads (None:
        ``io_threads()``), its chunk CRC32Cs into ``crc_out`` from slot ``crc_index[i]``."""
        try:
            read_file(
                name,
                pieces,
                threads=threads or io_threads(),
                direct=direct,
                chunk_bytes=chunk_bytes,
                crc_index=crc_index,
                crc_out=crc_out,
                dir_fd=self.fd,
                expect_size=expect_size,
            )
        except OSError as exc:
            raise read_error(exc, self.path / name, f"reading {len(pieces)} ranges of") from None

    def read_spans(
        self,
        name: str,
        buffer: Any,
        spans: np.ndarray,
        *,
        chunk_bytes: int,
        crc_out: np.ndarray,
        expect_size: int,
    ) -> int:
        """``reader.read_spans`` on the data file ``name``: rows ``(file offset, buffer offset,
        length, slot)`` read into ``buffer``. Returns the lowest offset of a nonzero byte among
        the ``MUST_BE_ZERO`` spans, or -1."""
        try:
            return read_spans(
                name,
                buffer,
                spans,
                threads=io_threads(),
                direct=True,
                chunk_bytes=chunk_bytes,
                crc_out=crc_out,
                dir_fd=self.fd,
                expect_size=expect_size,
            )
        except OSError as exc:
            raise read_error(exc, self.path / name, f"reading {len(spans)} extents of") from None

    def write_new(self, name: str, data: bytes) -> None:
        """Create the file ``name`` (it must not exist: never through a link), write ``data``
        and fdatasync it."""
        buf = np.frombuffer(data, dtype=np.uint8)
        self._create(name, [(0, buf)] if len(buf) else [], len(buf))

    def write_pieces(
        self,
        name: str,
        pieces: list[tuple[int, Any]],
        size: int,
        direct: bool,
        threads: int | None = None,
    ) -> None:
        """Create the data file ``name`` (exclusively) from ``pieces``, fdatasync'ed, on
        ``threads`` native threads (None: all cores)."""
        self._create(name, pieces, size, direct=direct, threads=threads)

    def _create(self, name: str, pieces: list[tuple[int, Any]], size: int, **options: Any) -> None:
        """Create ``name`` exclusively (never through a link) from ``pieces``, fdatasync'ed; an
        error names the full path."""
        with naming(self.path / name):
            write_file(name, pieces, size=size, dir_fd=self.fd, exclusive=True, **options)

    def fsync(self) -> None:
        """Make creations, renames and removals inside this directory durable."""
        with naming(self.path, "fsync"):
            os.fsync(self.fd)

    # ------------------------------------------------------------------ moving and removing

    def rename(self, name: str, dest: Dir, new_name: str) -> None:
        """Rename ``name`` here to ``new_name`` in ``dest`` (a link is moved, never followed)."""
        with naming(self.path / name, "rename", dest.path / new_name):
            retried(os.rename, name, new_name, src_dir_fd=self.fd, dst_dir_fd=dest.fd)

    def replace(self, name: str, new_name: str) -> None:
        """Atomically replace ``new_name`` by ``name``, both in this directory."""
        with naming(self.path / name, "rename", self.path / new_name):
            retried(os.replace, name, new_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        with naming(self.path / name, "unlink"):
            retried(os.unlink, name, dir_fd=self.fd)

    def remove_tree(self, name: str, _depth: int = 0) -> None:
        """Remove ``name`` and, if it is a directory, everything under it. Links are removed,
        never followed, so nothing outside this directory is touched. A tree deeper than any
        checkpoint makes is left alone (it is not ours). Raises OSError."""
        st = self.lstat(name)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            self.unlink(name)
            return
        if _depth >= _MAX_DEPTH:
            raise OSError(errno.ELOOP, "nested deeper than any checkpoint", str(self.path / name))
        with self.sub(name) as d:
            for e in d.entries():
                d.remove_tree(e.name, _depth + 1)
        with naming(self.path / name, "rmdir"):
            retried(os.rmdir, name, dir_fd=self.fd)

    def discard_tree(self, name: str) -> bool:
        """``remove_tree`` that reports failure instead of raising (cleanup that a later start
        retries). Returns whether ``name`` is gone."""
        try:
            self.remove_tree(name)
            return True
        except OSError:
            return False
