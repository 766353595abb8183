"""Parallel file reads through the native core (pread on a thread pool), each chunk's CRC32C
computed as it lands; writes are in :mod:`gpumem.writer`.

Every failure surfaces as an ``OSError`` carrying ``errno`` and ``filename``. Asked for a file of
a known size (``expect_size``), the reader opens it only if it is a regular file of exactly that
size, never through a symbolic link, and never opens a FIFO or a device: such a file raises
:class:`UnexpectedFileError` without a byte read, so a hostile directory can neither make a read
block nor point it outside.

Example:
    >>> import torch
    >>> from gpumem.writer import write_file
    >>> from gpumem.reader import read_into
    >>> write_file("/tmp/shard.tmp", [(0, torch.arange(4, dtype=torch.float32))])
    16
    >>> out = torch.empty(16, dtype=torch.uint8)
    >>> read_into("/tmp/shard.tmp", 0, out)
    16
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from typing import Any

from gpumem._native import (
    byte_view,
    dir_fd_arg,
    fs_path,
    load,
    nonneg,
    resolve_threads,
    split_pieces,
)

__all__ = [
    "drop_page_cache",
    "read_file",
    "read_into",
    "read_spans",
]  # and UnexpectedFileError (lazy)

PathLike = str | bytes | os.PathLike


def __getattr__(name: str) -> Any:
    # the exception class lives in the native module, loaded on first use like everything else
    if name == "UnexpectedFileError":
        return load().UnexpectedFileError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_file(
    path: PathLike,
    pieces: Iterable[tuple[int, Any]],
    *,
    threads: int | None = None,
    direct: bool = False,
    chunk_bytes: int = 0,
    crc_index: Iterable[int] | None = None,
    crc_out: Any = None,
    dir_fd: int | None = None,
    expect_size: int | None = None,
) -> int:
    """Fill every ``(file_offset, buffer)`` piece from ``path``, in parallel; optionally checksum.

    The mirror of :func:`gpumem.writer.write_file`: pieces are split into 8 MiB reads on the
    thread pool; with ``direct`` the part of a piece whose buffer address and file offset are
    equally aligned to 4096 is read through ``O_DIRECT`` (many large requests in flight, no
    page-cache copy) and the rest through the page cache; a file system that refuses
    ``O_DIRECT`` gets buffered reads.

    Args:
        path: the file to read (str, bytes or path-like; any name the OS accepts).
        pieces: ``(file_offset, buffer)`` pairs; a buffer is a writable bytes-like object, numpy
            array or contiguous CPU tensor, filled with the bytes at its offset.
        threads: reader threads (default: GPUMEM_THREADS or the number of cores; reads from a
            disk want several requests in flight, so more threads than cores can pay).
        direct: use ``O_DIRECT`` where aligned.
        chunk_bytes: if > 0, compute the CRC32C of every ``chunk_bytes`` chunk of each piece
            (relative to the piece start) right after it is read, into ``crc_out``.
        crc_index: for each piece, its first slot in ``crc_out`` (negative: no checksum).
        crc_out: int64 numpy array or CPU tensor receiving the chunk CRCs.
        dir_fd: an open directory descriptor ``path`` is relative to (``openat``).
        expect_size: the file must be a regular file of exactly this many bytes, not a symbolic
            link (checked before and after opening it; a FIFO or device is never opened).

    Returns:
        Bytes read (the sum of the piece lengths).

    Raises:
        UnexpectedFileError: (an ``OSError``) with ``expect_size``: the file is a symbolic link,
            not a regular file, or of another size; nothing was read.
        OSError: with ``errno`` and ``filename``; EIO when the file ends before a piece.
        ValueError: negative offsets, read-only or non-contiguous buffers, CRC slots out of range.
    """

    offsets, buffers = split_pieces(pieces, writable=True)
    chunk = nonneg(chunk_bytes, "chunk_bytes")
    index = [-1] * len(buffers) if crc_index is None else [operator.index(i) for i in crc_index]
    if any(i < -1 for i in index):
        raise ValueError("crc_index entries must be >= 0 or -1 (none)")
    out = _crc_out(chunk, crc_out)
    read, _direct_bytes, _, _cached = load().read_file(
        fs_path(path),
        offsets,
        buffers,
        index,
        chunk,
        out,
        resolve_threads(threads),
        bool(direct),
        dir_fd_arg(dir_fd),
        -1 if expect_size is None else nonneg(expect_size, "expect_size"),
    )
    return read


MUST_BE_ZERO = -2
"""A span's CRC index for bytes that must all be zero (alignment padding)."""


def read_spans(
    path: PathLike,
    buffer: Any,
    spans: Any,
    *,
    threads: int | None = None,
    direct: bool = False,
    chunk_bytes: int = 0,
    crc_out: Any = None,
    dir_fd: int | None = None,
    expect_size: int | None = None,
) -> int:
    """:func:`read_file` for many spans of one buffer, given as one array: no Python object per
    span, and spans that follow each other in the file and in the buffer (sorted by offset) are
    read by one ``pread`` (up to 8 MiB), each still checked on its own.

    Args:
        buffer: the writable buffer every span lands in.
        spans: an ``(n, 4)`` int64 array of (file offset, buffer offset, length, CRC index); the
            CRC index is the span's first slot in ``crc_out``, -1 for none, or ``MUST_BE_ZERO``.
        The others: as for :func:`read_file`.

    Returns:
        The lowest file offset of a nonzero byte among the ``MUST_BE_ZERO`` spans, or -1.

    Raises:
        As :func:`read_file`; ValueError also for a span outside the buffer.
    """
    import numpy as np

    arr = np.ascontiguousarray(spans, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"spans must be an (n, 4) int64 array, got shape {arr.shape}")
    cols = [np.ascontiguousarray(arr[:, k]) for k in range(4)]
    _read, _direct_bytes, nonzero, _cached = load().read_spans(
        fs_path(path),
        byte_view(buffer, writable=True, what="buffer"),
        *cols,
        nonneg(chunk_bytes, "chunk_bytes"),
        _crc_out(nonneg(chunk_bytes, "chunk_bytes"), crc_out),
        resolve_threads(threads),
        bool(direct),
        dir_fd_arg(dir_fd),
        -1 if expect_size is None else nonneg(expect_size, "expect_size"),
    )
    return int(nonzero)


def _crc_out(chunk: int, crc_out: Any) -> Any:
    import numpy as np

    if chunk and crc_out is None:
        raise ValueError("chunk_bytes > 0 needs crc_out (an int64 array) and crc_index")
    out = np.empty(0, dtype=np.int64) if crc_out is None else crc_out
    if hasattr(out, "numpy"):  # a torch tensor
        out = out.numpy()
    if not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.ndim != 1:
        raise ValueError("crc_out must be a 1-D int64 numpy array or CPU tensor")
    return out


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
    return load().read_into(fs_path(path), nonneg(offset, "offset"), view, resolve_threads(threads))


def drop_page_cache(paths: Iterable[PathLike]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (files; directories are walked), so
    the next read comes from the device: how a restore after a reboot or on another node reads.
    Dirty pages are written out first. A hint: network file systems may keep client caches, and
    where ``posix_fadvise`` is missing nothing happens."""
    from pathlib import Path

    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        p = Path(os.fsdecode(path))
        for f in (q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
