"""Resharding reads: fill any block of a global tensor from the blocks a checkpoint holds, reading
only the chunks that overlap it and verifying the CRC32C of every chunk read.

``GlobalIndex`` gathers every saved block of every global (DTensor) tensor from all shard
manifests and checks that they tile the global tensor exactly once, by the rule the save checked
before writing (``capture.boxes.tile``).
``Reader`` takes requests "fill this host buffer with box B of tensor X from these saved blocks",
turns them into chunk-aligned reads per data file (one native call per file: several requests in
flight, each chunk's CRC32C computed by the thread that read it) and copies the needed elements
into place once every chunk has verified.

Where the needed part of a saved block and its place in the buffer are both one contiguous run
(blocks along dimension 0, FSDP's layout), the whole chunks inside it are read straight into the
buffer and only the two partial chunks at its ends go through small temporaries; otherwise the
chunks spanning the needed part are read into a temporary and the elements copied out of it. So a
rank reads at most one chunk more than it needs at each end of each overlap, and never holds more
than its own buffers plus those temporaries.

Files are opened as ``restore`` opens them (``safe_fs``): relative to the checkpoint directory's
descriptor, only if they are regular files of the size the manifests record (no symbolic link
followed, no FIFO or device opened), and every range read must lie inside its file by the
manifests before anything is read. Damage is CheckpointCorruptError; an operating-system error
(EACCES, EIO) is CheckpointIOError with errno and path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..capture.boxes import Box, TilingError, intersect, is_contiguous_block, linear, tile
from ..errors import CheckpointCorruptError, CheckpointStateError
from ..storage.format import ShardManifest, TensorEntry
from ..storage.step_reads import StepFiles, StepPath


class SavedBlock(NamedTuple):
    """A saved block: tensor entry ``entry`` of rank ``rank``'s shard, lying at ``box``. A tuple:
    a hundred thousand of them are built in one pass (``GlobalIndex``)."""

    rank: int
    entry: TensorEntry
    box: Box
    chunk: int

    @property
    def dtype(self) -> str:
        return self.entry.dtype

    @property
    def crcs(self) -> tuple[int, ...]:
        return self.entry.crc32c


class GlobalIndex:
    """Every saved block of every global tensor of one checkpoint, by name."""

    def __init__(self, path: StepPath, shards: list[ShardManifest]):
        self.path = path
        self.blocks: dict[str, list[SavedBlock]] = {}
        self._checked: dict[str, list[SavedBlock]] = {}
        new = tuple.__new__  # a hundred thousand blocks: no Python-level __new__ per block
        for shard in shards:
            rank, chunk = shard.rank, shard.chunk_bytes
            for e in shard.tensors:
                if e.box is not None:
                    block = new(SavedBlock, (rank, e, e.box, chunk))
                    self.blocks.setdefault(e.tensor, []).append(block)

    def __contains__(self, name: object) -> bool:
        return name in self.blocks

    def check(self, name: str) -> list[SavedBlock]:
        """The blocks of ``name``, checked to tile the global tensor exactly once (``tile``). A
        block several ranks wrote (a module sharded on a sub-mesh but not parallelized over the
        other dimension: its DTensor does not say it is replicated there) is taken once, from
        the lowest rank, after checking that its copies hold the same bytes (same chunk
        CRC32Cs).

        Raises:
            CheckpointCorruptError: naming the tensor and the ranks that disagree.
        """
        cached = self._checked.get(name)
        if cached is not None:
            return cached
        try:
            blocks, _ = tile(name, self.blocks[name])
        except TilingError as exc:
            raise CheckpointCorruptError(
                f"{self.path}: {exc}", path=str(self.path), tensor=name
            ) from None
        self._checked[name] = blocks
        return blocks

    def check_all(self) -> None:
        for name in self.blocks:
            self.check(name)


def data_files(path: StepPath, shards: list[ShardManifest]) -> dict[str, int]:
    """Every data file the shard manifests list, with its recorded size.

    Raises:
        CheckpointCorruptError: two shards list one file with different sizes.
    """
    files: dict[str, int] = {}
    for shard in shards:
        for name, size in shard.files.items():
            if files.setdefault(name, size) != size:
                raise CheckpointCorruptError(
                    f"{path / name}: the shard manifests record it as {files[name]} and {size} "
                    "bytes",
                    path=str(path / name),
                )
    return files


@dataclass
class _Copy:
    """After verification: copy ``src`` (a view of a temporary) into ``dst`` (a view of the
    target buffer)."""

    dst: torch.Tensor
    src: torch.Tensor


@dataclass
class _FileReads:
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class Reader:
    """Collects box requests, then reads and verifies them in one pass per data file.

    Example:
        >>> reader = Reader(step)  # a safe_fs.Dir of the checkpoint          # doctest: +SKIP
        >>> reader.add("model.w", buf, box, index.check("model.w"))          # doctest: +SKIP
        >>> reader.run(files, threads=4)                                     # doctest: +SKIP
    """

    def __init__(self, step: StepFiles):
        self.step, self.path = step, step.path
        self._files: dict[tuple[str, int], _FileReads] = {}  # (file, chunk) -> reads
        self._expected: list[int] = []
        self._where: list[tuple[str, int, int]] = []  # per CRC slot: tensor, first byte, file
        self._copies: list[_Copy] = []
        self.bytes_read = 0
        self.bytes_needed = 0

    def add(self, name: str, dst: torch.Tensor, box: Box, blocks: list[SavedBlock]) -> None:
        """Fill ``dst`` (a contiguous host tensor of ``box.shape``) with ``box`` of tensor
        ``name`` from ``blocks``, which must cover it.

        Raises:
            CheckpointStateError: the blocks do not cover ``box`` or differ in dtype.
        """
        covered = 0
        for b in blocks:
            if b.entry.torch_dtype != dst.dtype:
                raise CheckpointStateError(
                    f"{self.path}: tensor {name!r} was saved as {b.entry.dtype}, the target is "
                    f"{dst.dtype}; convert the model or optimizer to the saved dtype first"
                )
            inter = intersect(box, b.box)
            if inter is None:
                continue
            off, shape = inter
            n = 1
            for s in shape:
                n *= s
            if n:
                covered += n
                self._add_overlap(name, dst, box, b, off, shape)
        if covered != box.numel:
            raise CheckpointStateError(
                f"{self.path}: tensor {name!r}: the checkpoint's blocks cover {covered} of the "
                f"{box.numel} elements this rank needs ({box.text()}); it was saved with "
                f"another global shape or a rank's part is missing"
            )
        self.bytes_needed += box.numel * dst.element_size()

    def _add_overlap(
        self,
        name: str,
        dst: torch.Tensor,
        box: Box,
        b: SavedBlock,
        off: tuple[int, ...],
        shape: tuple[int, ...],
    ) -> None:
        item = dst.element_size()
        src_start = tuple(o - s for o, s in zip(off, b.box.offsets, strict=True))
        dst_start = tuple(o - s for o, s in zip(off, box.offsets, strict=True))
        last = tuple(s + n - 1 for s, n in zip(src_start, shape, strict=True))
        lo = linear(b.box.shape, src_start) * item
        hi = (linear(b.box.shape, last) + 1) * item
        chunk, nbytes = b.chunk, b.entry.nbytes
        c0, c1 = lo // chunk, -(-hi // chunk)
        dst_bytes = dst.view(-1).view(torch.uint8) if dst.numel() else dst.view(torch.uint8)
        if is_contiguous_block(b.box.shape, shape) and is_contiguous_block(box.shape, shape):
            base = linear(box.shape, dst_start) * item - lo  # dst byte of source byte 0
            k = c0
            while k < c1:
                a, z = k * chunk, min((k + 1) * chunk, nbytes)
                if a >= lo and z <= hi:  # whole chunks inside the run: straight into place
                    j = k
                    while j + 1 < c1 and min((j + 2) * chunk, nbytes) <= hi:
                        j += 1
                    z = min((j + 1) * chunk, nbytes)
                    self._read(b, a, dst_bytes[base + a : base + z])
                    k = j + 1
                    continue
                tmp = torch.empty(z - a, dtype=torch.uint8)  # a partial chunk at either end
                self._read(b, a, tmp)
                s, e = max(a, lo), min(z, hi)
                self._copies.append(_Copy(dst_bytes[base + s : base + e], tmp[s - a : e - a]))
                k += 1
            return
        a, z = c0 * chunk, min(c1 * chunk, nbytes)
        tmp = torch.empty(z - a, dtype=torch.uint8)
        self._read(b, a, tmp)
        strides, acc = [], 1
        for d in reversed(b.box.shape):
            strides.append(acc)
            acc *= d
        src = torch.as_strided(
            tmp.view(dst.dtype),
            shape,
            tuple(reversed(strides)),
            linear(b.box.shape, src_start) - a // item,
        )
        region = dst[tuple(slice(s, s + n) for s, n in zip(dst_start, shape, strict=True))]
        self._copies.append(_Copy(region, src))

    def _read(self, b: SavedBlock, start: int, buf: torch.Tensor) -> None:
        """Read bytes [start, start + len(buf)) of block ``b`` (``start`` chunk-aligned) into
        ``buf``, split at its extents, each chunk's CRC expected as recorded."""
        e, chunk = b.entry, b.chunk
        end, pos = start + buf.numel(), 0
        for f, off, length in e.extents:
            s, z = max(start, pos), min(end, pos + length)
            if s < z:
                reads = self._files.setdefault((f, chunk), _FileReads())
                reads.pieces.append((off + s - pos, buf[s - start : z - start]))
                reads.slots.append(len(self._expected))
                first = s // chunk
                for k in range(first, -(-z // chunk)):
                    self._expected.append(e.crc32c[k])
                    self._where.append((e.name, k * chunk, f))
                self.bytes_read += z - s
            pos += length

    def run(self, files: dict[str, int], threads: int) -> None:
        """Read everything requested, verify every chunk, then copy into place.

        Args:
            files: size of every data file of the checkpoint (from the shard manifests).
            threads: reads in flight per file.

        Raises:
            CheckpointCorruptError: a file that is missing, not a regular file (a symbolic link,
                a FIFO, a device) or of the wrong size, a range outside its file, or a chunk
                that fails its CRC32C (naming the file, the tensor and the bytes).
            CheckpointIOError: the operating system failed a read (errno and path kept).
        """
        crcs = np.zeros(len(self._expected), dtype=np.int64)
        for (f, _), reads in self._files.items():  # every range inside its file, before a read
            size = files.get(f)
            end = max((off + buf.numel() for off, buf in reads.pieces), default=0)
            if size is None or end > size:
                raise CheckpointCorruptError(
                    f"{self.path / f}: the manifests place bytes up to {end} in a data file of "
                    f"{size if size is not None else 'no recorded'} size",
                    path=str(self.path / f),
                )
        for (f, chunk), reads in sorted(self._files.items(), key=lambda x: x[0]):
            # a regular file (or object) of the recorded size, never through a link or a FIFO
            self.step.read_file(
                f,
                reads.pieces,
                threads=threads,
                direct=False,
                chunk_bytes=chunk,
                crc_index=reads.slots,
                crc_out=crcs,
                expect_size=files[f],
            )
        expected = np.asarray(self._expected, dtype=np.int64)
        bad = np.flatnonzero(crcs != expected)
        if len(bad):
            i = int(bad[0])
            name, lo, f = self._where[i]
            raise CheckpointCorruptError(
                f"{self.path / f}: tensor {name!r} bytes from {lo} fail their CRC32C "
                f"({int(crcs[i]) & 0xFFFFFFFF:08x} != {int(expected[i]):08x})",
                path=str(self.path / f),
                tensor=name,
            )
        for c in self._copies:
            c.dst.copy_(c.src)
        self._copies.clear()
        self._files.clear()
