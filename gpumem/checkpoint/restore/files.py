"""Reading a shard's tensors back from its data files, every byte verified as it lands.

Each tensor is read into a fresh buffer of its own (restored tensors own their memory, and the
optimizer may keep them), one native call per data file: the file's extents are read on the I/O
thread pool with several requests in flight, and each chunk's CRC32C is computed by the reading
thread right after its bytes land, while they are still in cache. The alignment padding between
extents is read too and must be zero, and the file sizes must match the manifest. Any mismatch
raises CheckpointCorruptError naming the file and the tensor. Files are opened relative to the
checkpoint directory's descriptor and only if they are regular files of the recorded size (no
symbolic link is followed, no FIFO or device opened: ``safe_fs``); an operating-system error
(EACCES, EIO, ENOMEM) is a CheckpointIOError with errno and path, not damage.

Why O_DIRECT into page-aligned memory from torch's allocator: a tensor of ``DIRECT_MIN_BYTES``
or more gets a buffer aligned to the page (the allocation is a page larger), so the aligned middle
of its extent is read with ``O_DIRECT`` and only the unaligned tail through the page cache;
smaller tensors and the padding are read buffered. The native reader maps the fresh pages in
(``MADV_POPULATE_WRITE``) on a thread of its own that runs ahead of the readers, so the kernel's
zeroing of fresh memory overlaps the disk instead of adding to it (865 MiB in a fresh process on
a 2-vCPU VM: reads 963 ms -> 850 ms, ``benchmarks/results/checkpoint_restore_profile.md``). On
the 2-vCPU VM of ``benchmarks/results/checkpoint.md``, restoring 3.66 GiB in a fresh process took
6.3 s this way against 14.2 s with buffered reads into the same allocator (medians of 3
interleaved runs with the page cache dropped; 865 MiB: 1.6 s against 2.7 s): the buffered path
copies every byte through a page cache that a restore never reads twice. Buffers still come from
torch's allocator, so restored tensors own their memory (the optimizer keeps them) and a process
that freed memory gets it back already faulted in. A file system that refuses ``O_DIRECT``
(tmpfs) is read buffered.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gpumem.reader import MUST_BE_ZERO

from ..errors import CheckpointCorruptError, CheckpointIOError
from ..storage.directory import load_shard_manifest
from ..storage.format import CheckpointInfo, ShardManifest, TensorEntry, shard_manifest_name
from ..storage.safe_fs import Dir
from ..storage.step_reads import StepFiles
from ..storage.tensor_table import Columns

DIRECT_MIN_BYTES = 1 << 20  # tensors read with O_DIRECT; page alignment costs them <= 0.4 %
_PAGE = 4096


def _check_sizes(step: StepFiles, shard: ShardManifest) -> None:
    """Every data file of its recorded size, before a byte is read (a directory: a regular file,
    by lstat; an object store: by a HEAD, ``storage.s3.object_files``)."""
    for name, size in shard.files.items():
        step.check_size(name, size)


def _read_file(
    step: StepFiles,
    name: str,
    size: int,
    extents: list[tuple[int, torch.Tensor, int]],
    chunk: int,
    crcs: np.ndarray,
) -> None:
    """Read the ``size``-byte data file ``name``'s extents ``(offset, buffer, first CRC slot)``
    into their buffers and their chunk CRCs into ``crcs`` (the padding between extents is
    checked by ``_stream_file``)."""
    ordered = sorted(extents, key=lambda x: x[0])
    step.read_file(
        name,
        [(off, buf) for off, buf, _ in ordered],
        chunk_bytes=chunk,
        crc_index=[slot for *_, slot in ordered],
        crc_out=crcs,
        expect_size=size,
    )


def _buffer(entry: TensorEntry, file: Any, into: Callable | None) -> torch.Tensor:
    """Where ``entry``'s bytes land: the caller's buffer (``read_tensors``' ``into``), else
    fresh host memory."""
    given = into(entry) if into is not None else None
    return _host_bytes(entry.nbytes, file) if given is None else given


def _host_bytes(n: int, file: Any) -> torch.Tensor:
    """Fresh host memory for ``n`` bytes of ``file``, page-aligned from ``DIRECT_MIN_BYTES`` on
    (see the module docs). ``n`` is bounded by the file sizes checked on disk, so a failure here
    is the machine's (ENOMEM), not the checkpoint's."""
    try:
        if n < DIRECT_MIN_BYTES:
            return torch.empty(n, dtype=torch.uint8)
        raw = torch.empty(n + _PAGE - 1, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        return raw[skip : skip + n]
    except (RuntimeError, MemoryError) as exc:
        raise CheckpointIOError(
            f"allocating {n} bytes of host memory to read {file} failed ({exc}); free memory "
            "and restore again",
            errno=errno.ENOMEM,
            filename=str(file),
        ) from None


def _check_crcs(
    path: Any,
    entries: list[TensorEntry],
    chunk: int,
    crcs: np.ndarray,
    base: Sequence[int] | np.ndarray,
    expected: np.ndarray | None = None,
) -> None:
    """Every computed chunk CRC equals the manifest's (``expected``: those CRCs as one array,
    where the decoder made it); the first that does not is named with its file and bytes."""
    if expected is None:
        expected = np.fromiter(
            itertools.chain.from_iterable(e.crc32c for e in entries), np.int64, count=len(crcs)
        )
    bad = np.flatnonzero(crcs != expected)
    if not len(bad):
        return
    i = int(bad[0])
    t = int(np.searchsorted(np.asarray(base), i, side="right")) - 1
    entry, k = entries[t], i - int(base[t])
    lo = k * chunk
    raise CheckpointCorruptError(
        f"{_file_of(path, entry, lo)}: tensor {entry.name!r} bytes "
        f"{lo}-{min(lo + chunk, entry.nbytes)} fail their CRC32C "
        f"({int(crcs[i]) & 0xFFFFFFFF:08x} != {int(expected[i]):08x})",
        path=str(_file_of(path, entry, lo)),
        tensor=entry.name,
    )


def _file_of(path: Any, entry: TensorEntry, byte: int) -> Any:
    pos = 0
    for f, _, length in entry.extents:
        if byte < pos + length:
            return path / f
        pos += length
    return path / entry.extents[-1][0]


def load_shard(
    step: StepFiles, info: CheckpointInfo, rank: int, *, keep: bool = True
) -> tuple[ShardManifest, dict[str, torch.Tensor]]:
    """Verify and (if ``keep``) return every tensor of ``rank``'s shard; raises
    CheckpointCorruptError.

    Each tensor is read into its own fresh buffer (restored tensors own their memory). Without
    ``keep`` the bytes are only checked, through ``STREAM_BYTES`` of memory.
    """
    shard = load_shard_manifest(step, info, rank)
    return shard, read_tensors(step, shard, keep=keep)


STREAM_BYTES = 64 << 20
"""Host memory through which the bytes nobody keeps are checked (verify, and the tensors of
sections a restore was not asked for): at most ``max(STREAM_BYTES, chunk_bytes)`` at a time,
however large the files (a sparse one costs its apparent size in reads, not in memory)."""


def _read_again(
    read: Callable[..., dict[str, torch.Tensor]],
) -> Callable[..., dict[str, torch.Tensor]]:
    """``read``, where an object store's bytes that fail a check are read again first: a fault
    in transit is gone on the next read (``ObjectFiles.read_again`` says how often)."""

    @functools.wraps(read)
    def again(step: StepFiles, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        while True:
            try:
                return read(step, *args, **kwargs)
            except CheckpointCorruptError:
                if not step.read_again():
                    raise

    return again


@_read_again
def read_tensors(
    step: StepFiles,
    shard: ShardManifest,
    names: list[str] | None = None,
    *,
    keep: bool = True,
    keep_only: set[str] | None = None,
    into: Callable[[TensorEntry], torch.Tensor | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read and verify tensors of a shard whose manifest is loaded: all of them (``names``
    None: every byte of its data files, the zero padding too) or only those named (only their
    extents are read). Every chunk's CRC32C is checked; sizes of the shard's files too.

    Args:
        keep: return the tensors (False: only check them, through ``STREAM_BYTES`` of memory).
        keep_only: of the tensors read, return only these; the others are checked through the
            bounded stream, never held whole (a restore not asked for ``extra``, say).
        into: a kept tensor's destination (a page-aligned uint8 buffer of its size) or None.

    Returns: name -> tensor (empty without ``keep``).
    Raises:
        CheckpointCorruptError: naming the file and the tensor.
        CheckpointIOError: the operating system failed a read (errno and path kept).
    """
    path = step.path
    _check_sizes(step, shard)
    if names is None:
        entries = list(shard.tensors)
    else:
        held = {e.name: e for e in shard.tensors}
        missing = [n for n in names if n not in held]
        if missing:
            raise CheckpointCorruptError(
                f"{path / shard_manifest_name(shard.rank)}: lacks tensor {missing[0]!r}",
                path=str(path),
                tensor=missing[0],
            )
        entries = [held[n] for n in names]
    only = keep_only
    kept = {t for t, e in enumerate(entries) if only is None or e.name in only} if keep else set()
    chunk = shard.chunk_bytes
    if names is None and not kept and shard.table is not None:
        _check_columns(step, shard, shard.table)  # no object per entry (verify)
        return {}
    base = [0, *itertools.accumulate(len(e.crc32c) for e in entries)]  # first chunk-CRC slots
    crcs = np.zeros(base.pop(), dtype=np.int64)
    by_file: dict[str, list[tuple[int, int, int, int]]] = {}
    for t, entry in enumerate(entries):
        pos = 0
        for f, off, length in entry.extents:
            by_file.setdefault(f, []).append((t, pos, off, length))
            pos += length
    buffers: dict[int, torch.Tensor] = {}
    # the whole shard: every file, empty ones included (their padding is checked, trivially)
    files = sorted(shard.files) if names is None else sorted(by_file)
    for f in files:
        extents, streamed = [], []
        spans = by_file.pop(f, [])
        for t, pos, off, length in spans:
            if t in kept:
                if t not in buffers:
                    buffers[t] = _buffer(entries[t], path / f, into)
                extents.append((off, buffers[t][pos : pos + length], base[t] + pos // chunk))
            else:
                streamed.append((off, length, base[t] + pos // chunk))
        if extents:
            _read_file(step, f, shard.files[f], extents, chunk, crcs)
        del extents
        occupied = [(off, length) for _, _, off, length in spans]
        _stream_file(
            step, f, shard.files[f], streamed, occupied, chunk, crcs, padding=names is None
        )
    _check_crcs(path, entries, chunk, crcs, base)
    return {
        e.name: buffers[t].view(e.torch_dtype).view(e.shape)
        if e.nbytes
        else torch.empty(e.shape, dtype=e.torch_dtype)
        for t, e in enumerate(entries)
        if t in kept
    }


def _check_columns(step: StepFiles, shard: ShardManifest, table: Columns) -> None:
    """``read_tensors`` of every byte of a shard, nothing kept, from the decoded table's arrays:
    the same pieces, files in the same order, the same checks, no Python object per extent."""
    chunk = shard.chunk_bytes
    ext = table.extents
    counts = table.counts
    base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    slots = base[ext[:, 0]] + ext[:, 1] // chunk
    crcs = np.zeros(int(base[-1]), dtype=np.int64)
    index = {f: i for i, f in enumerate(shard.files)}
    for f in sorted(shard.files):
        mine = ext[:, 2] == index[f]
        rows = ext[mine]
        spans = np.stack([rows[:, 3], rows[:, 4], slots[mine]], 1)
        _stream_file(step, f, shard.files[f], spans, rows[:, 3:5], chunk, crcs, padding=True)
    _check_crcs(step.path, list(shard.tensors), chunk, crcs, base, expected=table.crcs)


def _stream_file(
    step: StepFiles,
    name: str,
    size: int,
    spans: list[tuple[int, int, int]] | np.ndarray,
    occupied: list[tuple[int, int]] | np.ndarray,
    chunk: int,
    crcs: np.ndarray,
    padding: bool,
) -> None:
    """Check the ``(offset, length, first CRC slot)`` spans of the data file ``name`` (and with
    ``padding`` that every byte no extent of ``occupied`` covers is zero) through one reused
    buffer of at most a window (a multiple of ``chunk``, so each piece starts on a chunk boundary
    of its tensor). The pieces are arrays, never a Python object each, and pieces that follow
    each other in the file are read by one ``pread`` (``reader.read_spans``): a hundred thousand
    one-byte extents cost a few dozen calls."""
    if not len(spans) and not padding:
        return
    window = max(STREAM_BYTES // chunk, 1) * chunk
    parts = [_split(np.array(spans, dtype=np.int64).reshape(-1, 3), window, chunk)]
    if padding:
        parts.append(_split(_gaps(occupied, size), window, chunk))
    todo = np.concatenate(parts)
    todo = todo[np.argsort(todo[:, 0], kind="stable")]
    if not len(todo):
        return
    ends = np.concatenate([[0], np.cumsum(todo[:, 1])])  # each piece's place in the stream
    buf = _host_bytes(int(min(window, ends[-1])), step.path / name)
    first = 0
    while first < len(todo):  # greedy batches of at most a window
        last = int(np.searchsorted(ends, ends[first] + window, side="right")) - 1
        batch = todo[first:last]
        spans_ = np.stack(
            [batch[:, 0], ends[first:last] - ends[first], batch[:, 1], batch[:, 2]], 1
        )
        _read_spans(step, name, size, buf, spans_, chunk, crcs)
        first = last


def _split(parts: np.ndarray, window: int, chunk: int) -> np.ndarray:
    """``(offset, length, slot)`` rows cut into pieces of at most ``window`` bytes (a multiple of
    ``chunk``: each piece's first CRC slot is ``slot + position // chunk``; a negative slot,
    none or padding, stays as it is)."""
    if not len(parts):
        return parts.reshape(0, 3)
    counts = -(-parts[:, 1] // window)
    row = np.repeat(np.arange(len(parts)), counts)
    k = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
    pos = k * window
    slot = parts[row, 2]
    return np.stack(
        [
            parts[row, 0] + pos,
            np.minimum(window, parts[row, 1] - pos),
            np.where(slot >= 0, slot + pos // chunk, slot),
        ],
        1,
    )


def _gaps(occupied: list[tuple[int, int]] | np.ndarray, size: int) -> np.ndarray:
    """The bytes of a ``size``-byte file that no ``(offset, length)`` extent covers, as
    ``(offset, length, MUST_BE_ZERO)`` rows."""
    occ = np.asarray(occupied, dtype=np.int64).reshape(-1, 2)
    occ = occ[np.lexsort((occ[:, 1], occ[:, 0]))]  # by offset, then length (as sorted() does)
    stops = np.concatenate([occ[:, 0], [size]])
    starts = np.concatenate([[0], np.maximum.accumulate(occ[:, 0] + occ[:, 1])])
    keep = stops > starts
    n = int(keep.sum())
    return np.stack([starts[keep], (stops - starts)[keep], np.full(n, MUST_BE_ZERO)], 1)


def _read_spans(
    step: StepFiles,
    name: str,
    size: int,
    buf: torch.Tensor,
    spans: np.ndarray,
    chunk: int,
    crcs: np.ndarray,
) -> None:
    file = step.path / name
    nonzero = step.read_spans(name, buf, spans, chunk_bytes=chunk, crc_out=crcs, expect_size=size)
    if nonzero >= 0:
        raise CheckpointCorruptError(
            f"{file}: alignment padding at byte {nonzero} is not zero", path=str(file)
        )


def open_checkpoint(path: str | bytes | os.PathLike) -> Dir:
    """The checkpoint directory the caller named (a symbolic link there is the caller's choice)."""
    try:
        return Dir.open(path)
    except CheckpointIOError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        p = os.fsdecode(path)
        raise CheckpointCorruptError(f"{p}: not a checkpoint directory", path=p) from None
