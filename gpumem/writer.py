"""Parallel file writes through the native core (pwrite on a thread pool); reads are in
:mod:`gpumem.reader`.

Checkpoint shards are written as many ``(file offset, buffer)`` pieces into one file: the native
core splits big pieces into 8 MiB sub-ranges, writes them with ``pwrite`` from several threads with
the GIL released, continues short writes, then ``fdatasync``s. Every failure surfaces as an
``OSError`` carrying ``errno`` and ``filename`` (ENOSPC, EFBIG, EIO, EACCES, ...); a failed write
leaves a partial file behind, so write to a temporary name, then rename and :func:`fsync_dir`.

Example:
    >>> import torch
    >>> from gpumem.writer import write_file, fsync_dir
    >>> a, b = torch.arange(4, dtype=torch.float32), torch.ones(2, dtype=torch.float64)
    >>> write_file("/tmp/shard.tmp", [(0, a), (16, b)], size=32)
    32
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from gpumem._native import dir_fd_arg, fs_path, load, nonneg, resolve_threads, split_pieces

__all__ = ["fsync_dir", "write_file"]

PathLike = str | bytes | os.PathLike


def write_file(
    path: PathLike,
    pieces: Iterable[tuple[int, Any]],
    *,
    size: int | None = None,
    threads: int | None = None,
    fsync: bool = True,
    direct: bool = False,
    dir_fd: int | None = None,
    exclusive: bool = False,
) -> int:
    """Create or truncate ``path`` and write every piece at its offset, in parallel.

    Args:
        path: the file to write (str, bytes or path-like; any name the OS accepts).
        pieces: ``(file_offset, buffer)`` pairs; a buffer is bytes-like, a numpy array or a
            contiguous CPU torch tensor (its bytes in memory order). Gaps between pieces read
            back as zeros.
        size: if given, the file is truncated/extended to exactly this many bytes afterwards.
        threads: writer threads (default: GPUMEM_THREADS or the number of cores).
        fsync: ``fdatasync`` the file before returning (its directory entry needs
            :func:`fsync_dir`).
        direct: write through ``O_DIRECT`` (bypassing the page cache) the part of each piece whose
            buffer address, file offset and length are multiples of 4096 (e.g. buffers from
            :class:`gpumem.arena.HostArena` at 4096-aligned offsets); unaligned heads and tails
            go through the page cache. A file system that refuses ``O_DIRECT`` (tmpfs: EINVAL)
            gets buffered writes instead of an error.
        dir_fd: an open directory descriptor ``path`` is relative to (``openat``).
        exclusive: create a new file (``O_EXCL | O_NOFOLLOW``): an existing file, or a symbolic
            link in its place, is an error (EEXIST) and is never written through.

    Returns:
        Bytes written (the sum of the piece lengths).

    Raises:
        OSError: with ``errno`` and ``filename`` set, for any failed open/pwrite/ftruncate/
            fdatasync/close.
        ValueError: negative offsets or size, non-contiguous or non-CPU buffers, a piece that
            ends past the largest file offset.
    """
    offsets, buffers = split_pieces(pieces, writable=False)
    total_size = -1 if size is None else nonneg(size, "size")
    written, _direct_bytes = load().write_file(
        fs_path(path),
        offsets,
        buffers,
        total_size,
        resolve_threads(threads),
        bool(fsync),
        bool(direct),
        dir_fd_arg(dir_fd),
        bool(exclusive),
    )
    return written


def fsync_dir(path: PathLike) -> None:
    """``fsync`` a directory so that a file created or renamed in it survives a crash.

    Raises:
        OSError: with ``errno`` and ``filename`` (e.g. ENOENT, ENOTDIR).
    """
    load().fsync_dir(fs_path(path))
