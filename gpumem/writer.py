"""Parallel file writes and reads through the native core (pwrite/pread on a thread pool).

Checkpoint shards are written as many ``(file offset, buffer)`` pieces into one file: the native
core splits big pieces into 8 MiB sub-ranges, writes them with ``pwrite`` from several threads with
the GIL released, continues short writes, then ``fdatasync``s. Every failure surfaces as an
``OSError`` carrying ``errno`` and ``filename`` (ENOSPC, EFBIG, EIO, EACCES, ...); a failed write
leaves a partial file behind, so write to a temporary name, then rename and :func:`fsync_dir`.

Example:
    >>> import torch
    >>> from gpumem.writer import write_file, read_into, fsync_dir
    >>> a, b = torch.arange(4, dtype=torch.float32), torch.ones(2, dtype=torch.float64)
    >>> write_file("/tmp/shard.tmp", [(0, a), (16, b)], size=32)
    32
    >>> out = torch.empty(32, dtype=torch.uint8)
    >>> read_into("/tmp/shard.tmp", 0, out)
    32
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from typing import Any

from gpumem._native import byte_view, load, resolve_threads

__all__ = ["fsync_dir", "read_file", "read_into", "write_file"]

PathLike = str | os.PathLike


def write_file(
    path: PathLike,
    pieces: Iterable[tuple[int, Any]],
    *,
    size: int | None = None,
    threads: int | None = None,
    fsync: bool = True,
    direct: bool = False,
) -> int:
    """Create or truncate ``path`` and write every piece at its offset, in parallel.

    Args:
        path: the file to write.
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

    Returns:
        Bytes written (the sum of the piece lengths).

    Raises:
        OSError: with ``errno`` and ``filename`` set, for any failed open/pwrite/ftruncate/
            fdatasync/close.
        ValueError: negative offsets or size, non-contiguous or non-CPU buffers.
    """
    offsets, buffers = _split_pieces(pieces, writable=False)
    total_size = -1 if size is None else _nonneg(size, "size")
    written, _direct_bytes = load().write_file(
        _path(path),
        offsets,
        buffers,
        total_size,
        resolve_threads(threads),
        bool(fsync),
        bool(direct),
    )
    return written


def fsync_dir(path: PathLike) -> None:
    """``fsync`` a directory so that a file created or renamed in it survives a crash.

    Raises:
        OSError: with ``errno`` and ``filename`` (e.g. ENOENT, ENOTDIR).
    """
    load().fsync_dir(_path(path))


def drop_page_cache(paths: Iterable[PathLike]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (files; directories are walked), so
    the next read comes from the device: how a restore after a reboot or on another node reads.
    Dirty pages are written out first. A hint: network file systems may keep client caches, and
    where ``posix_fadvise`` is missing nothing happens."""
    from pathlib import Path

    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        p = Path(path)
        for f in (q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def read_file(
    path: PathLike,
    pieces: Iterable[tuple[int, Any]],
    *,
    threads: int | None = None,
    direct: bool = False,
    chunk_bytes: int = 0,
    crc_index: Iterable[int] | None = None,
    crc_out: Any = None,
) -> int:
    """Fill every ``(file_offset, buffer)`` piece from ``path``, in parallel; optionally checksum.

    The mirror of :func:`write_file`: pieces are split into 8 MiB reads on the thread pool; with
    ``direct`` the part of a piece whose buffer address and file offset are equally aligned to
    4096 is read through ``O_DIRECT`` (many large requests in flight, no page-cache copy) and the
    rest through the page cache; a file system that refuses ``O_DIRECT`` gets buffered reads.

    Args:
        path: the file to read.
        pieces: ``(file_offset, buffer)`` pairs; a buffer is a writable bytes-like object, numpy
            array or contiguous CPU tensor, filled with the bytes at its offset.
        threads: reader threads (default: GPUMEM_THREADS or the number of cores; reads from a
            disk want several requests in flight, so more threads than cores can pay).
        direct: use ``O_DIRECT`` where aligned.
        chunk_bytes: if > 0, compute the CRC32C of every ``chunk_bytes`` chunk of each piece
            (relative to the piece start) right after it is read, into ``crc_out``.
        crc_index: for each piece, its first slot in ``crc_out`` (negative: no checksum).
        crc_out: int64 numpy array or CPU tensor receiving the chunk CRCs.

    Returns:
        Bytes read (the sum of the piece lengths).

    Raises:
        OSError: with ``errno`` and ``filename``; EIO when the file ends before a piece.
        ValueError: negative offsets, read-only or non-contiguous buffers, CRC slots out of range.
    """
    import numpy as np

    offsets, buffers = _split_pieces(pieces, writable=True)
    chunk = _nonneg(chunk_bytes, "chunk_bytes")
    index = [-1] * len(buffers) if crc_index is None else [operator.index(i) for i in crc_index]
    if chunk and crc_out is None:
        raise ValueError("chunk_bytes > 0 needs crc_out (an int64 array) and crc_index")
    out = np.empty(0, dtype=np.int64) if crc_out is None else crc_out
    if hasattr(out, "numpy"):  # a torch tensor
        out = out.numpy()
    if not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.ndim != 1:
        raise ValueError("crc_out must be a 1-D int64 numpy array or CPU tensor")
    read, _direct_bytes = load().read_file(
        _path(path), offsets, buffers, index, chunk, out, resolve_threads(threads), bool(direct)
    )
    return read


def read_into(path: PathLike, offset: int, out: Any, *, threads: int | None = None) -> int:
    """Read exactly ``len(out)`` bytes of ``path`` starting at ``offset`` into ``out``.

    Large reads are split into 8 MiB ``pread`` calls on the thread pool.

    Args:
        path: the file to read.
        offset: byte offset in the file.
        out: a writable buffer: bytearray, numpy array or contiguous CPU tensor (filled bytewise).
        threads: reader threads (default: GPUMEM_THREADS or the number of cores).

    Returns:
        Bytes read (always the size of ``out``).

    Raises:
        OSError: with ``errno`` and ``filename``; EIO when the file ends before ``out`` is full.
    """
    view = byte_view(out, writable=True, what="out")
    return load().read_into(_path(path), _nonneg(offset, "offset"), view, resolve_threads(threads))


def _split_pieces(
    pieces: Iterable[tuple[int, Any]], *, writable: bool
) -> tuple[list[int], list[Any]]:
    """File offsets and byte views of ``(file_offset, buffer)`` pairs, each checked."""
    offsets: list[int] = []
    buffers: list[Any] = []
    for i, piece in enumerate(pieces):
        try:
            offset, buffer = piece
        except (TypeError, ValueError):
            raise TypeError(
                f"pieces[{i}] must be a (file_offset, buffer) pair, got {piece!r:.80}"
            ) from None
        offsets.append(_nonneg(offset, f"pieces[{i}] file offset"))
        buffers.append(byte_view(buffer, writable=writable, what=f"pieces[{i}] buffer"))
    return offsets, buffers


def _path(path: PathLike) -> str:
    return os.fsdecode(os.fspath(path))


def _nonneg(value: Any, name: str) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v
