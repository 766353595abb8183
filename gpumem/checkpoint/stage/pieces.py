"""The staging plan: where each tensor's bytes go in host memory and in the data files.

The layout is planned from tensor sizes alone: tensors are packed into *batches*,
each extent aligned, a batch being one data file and one slot of the host arena (arena offset =
file offset, so a batch is written with a single large pwrite). When the state fits the staging
budget there is one batch; otherwise the arena is split into two slots and contiguous tensors are
cut into chunk-aligned pieces that stream through them (copy batch b+1 while batch b is written),
so host memory never exceeds the budget whatever the state size. ``PlanCache`` reuses the previous
save's layout while the tensors keep their sizes and contiguity (the common case: the same model
and optimizer saved again), and gives each layout an id, so the caller can tell when the alignment
gaps it zeroed in the arena are still in place.

The CRC32C chunk of a save (``crc_chunk``) is decided here too: the plan cuts tensors at chunk
boundaries.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from gpumem.units import align_up

from ..capture.codec import TensorTable
from ..errors import CheckpointStateError

DEFAULT_CHUNK = 1 << 20  # CRC32C granularity unless chunk_bytes says otherwise
MIN_CHUNK = 4096  # the automatic chunk's floor
_PIPELINE_SEGMENT = 16 << 20  # smallest data file an overlap save splits its state into


@dataclass(slots=True)
class Piece:
    """A byte range [src_offset, src_offset + nbytes) of tensor ``index``, staged at ``offset`` of
    batch ``batch``."""

    index: int
    src_offset: int
    nbytes: int
    batch: int
    offset: int
    # per-chunk CRCs, set by the copy (CUDA: int32 bits in pinned memory, device_crcs) or by the
    # persist thread (CPU: int64 values); tensor_crcs reads both
    crc: torch.Tensor | None = None


@dataclass
class StagingPlan:
    """Where each tensor of a save lies in the host arena: batches, their bases, the pieces."""

    capacity: int  # target bytes per batch (hard limit when streaming)
    streaming: bool  # False: every batch resident at once; True: two slots reused in turn
    chunk: int = DEFAULT_CHUNK  # the CRC32C chunk the pieces are cut at
    batch_sizes: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)  # arena offset of each batch
    layout_id: int = 0  # equal ids: identical pieces (set by PlanCache; 0: not tracked)
    # the CUDA copy/CRC programs of this plan (device_copy.enqueue), shared by its copies
    programs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def slots(self) -> int:
        """Batches that can be staged before one must be written (back-pressure depth)."""
        return 2 if self.streaming else max(1, len(self.batch_sizes))

    @property
    def arena_bytes(self) -> int:
        if self.streaming:
            return 2 * self.capacity
        return max(1, self.bases[-1] + self.batch_sizes[-1]) if self.bases else 1

    def batch_pieces(self, b: int) -> list[Piece]:
        return [p for p in self.pieces if p.batch == b]

    def slot_base(self, b: int) -> int:
        return self.bases[b]

    def copy(self) -> StagingPlan:
        """The same layout with fresh pieces (no CRCs yet): each save fills in its own."""
        return StagingPlan(
            self.capacity,
            self.streaming,
            self.chunk,
            list(self.batch_sizes),
            [Piece(p.index, p.src_offset, p.nbytes, p.batch, p.offset) for p in self.pieces],
            list(self.bases),
            self.layout_id,
            self.programs,
        )


class PlanCache:
    """The last layout planned, reused while a save's tensors have the same sizes and contiguity
    and the settings are unchanged (``plan_staging`` depends on nothing else; names only appear
    in its errors). Each new layout gets a new ``layout_id``."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: StagingPlan | None = None

    def plan(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        budget: int,
        alignment: int,
        chunk: int,
        segment: int,
    ) -> StagingPlan:
        """``plan_staging(...)`` of these arguments, as a fresh copy."""
        key = (
            budget,
            alignment,
            chunk,
            segment,
            tuple([t.numel() * t.element_size() for t in tensors]),
            tuple([t.is_contiguous() for t in tensors]),
        )
        if self._plan is None or key != self._key:
            self._key, self._plan = None, None  # a failed plan_staging leaves nothing cached
            plan = plan_staging(tensors, names, budget, alignment, chunk, segment)
            plan.layout_id = next(self._ids)
            self._key, self._plan = key, plan
        return self._plan.copy()


def plan_staging(
    tensors: list[torch.Tensor],
    names: list[str],
    budget: int,
    alignment: int,
    chunk: int,
    segment: int = 256 << 20,
) -> StagingPlan:
    """Pack tensors into batches (data files): ``segment``-sized ones that all stay resident when
    the state fits ``budget`` (so writing batch b overlaps copying batch b+1), else two slots of
    ``budget / 2`` that the state streams through."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    segment = max(chunk, segment // chunk * chunk)
    packed = 0
    for n in sizes:
        packed = align_up(packed, alignment) + n
    if packed + alignment * (packed // segment + 1) <= budget:
        plan = _pack(
            StagingPlan(capacity=segment, streaming=False, chunk=chunk),
            tensors,
            names,
            sizes,
            alignment,
            chunk,
        )
        if plan.arena_bytes <= budget:
            return plan
    capacity = budget // 2 // chunk * chunk
    if capacity < chunk:
        raise CheckpointStateError(
            f"staging budget {budget} bytes is below two chunks of "
            f"{chunk} bytes; raise staging_bytes (or GPUMEM_STAGING_BYTES)"
        )
    return _pack(
        StagingPlan(capacity=capacity, streaming=True, chunk=chunk),
        tensors,
        names,
        sizes,
        alignment,
        chunk,
    )


def _pack(plan: StagingPlan, tensors, names, sizes, alignment: int, chunk: int) -> StagingPlan:
    batch, used = 0, 0
    for i, (t, size) in enumerate(zip(tensors, sizes, strict=True)):
        src = 0
        while src < size:
            off = align_up(used, alignment)
            room = plan.capacity - off
            if size - src <= room:
                n = size - src
            elif t.is_contiguous() and room >= chunk:
                n = room // chunk * chunk
            elif used == 0 and not plan.streaming:  # resident batches may grow for one such tensor
                n = size
            elif used == 0:
                raise CheckpointStateError(
                    f"tensor {names[i]!r} ({size} bytes) is not contiguous and larger than "
                    f"a staging slot ({plan.capacity} bytes); raise staging_bytes or make it "
                    "contiguous"
                )
            else:
                batch, used = batch + 1, 0
                continue
            plan.pieces.append(Piece(i, src, n, batch, off))
            src += n
            used = off + n
    last = max((p.batch for p in plan.pieces), default=0)
    plan.batch_sizes = [0] * (last + 1)
    for p in plan.pieces:
        plan.batch_sizes[p.batch] = max(plan.batch_sizes[p.batch], p.offset + p.nbytes)
    if plan.streaming:
        plan.bases = [(b % 2) * plan.capacity for b in range(last + 1)]
    else:
        base = 0
        for size in plan.batch_sizes:
            plan.bases.append(base)
            base = align_up(base + size, alignment)
    return plan


def crc_chunk(table: TensorTable, chunk_bytes: int | None, replicated: bool) -> int:
    """The CRC32C chunk of a save: ``chunk_bytes``, or by default 1 MiB, and for DTensor blocks a
    64th of their byte-weighted median size, a power of two between 4 KiB and 1 MiB: a resharding
    restore reads whole chunks, so at most one partial chunk at each end of each overlap is read
    beyond what it needs (replicated saves keep 1 MiB: every rank must use the same)."""
    if chunk_bytes is not None:
        return chunk_bytes
    if not table.sharded or replicated:
        return DEFAULT_CHUNK
    sizes = sorted(
        t.numel() * t.element_size()
        for t, block in zip(table.tensors, table.blocks, strict=True)
        if block is not None
    )
    half, acc, median = sum(sizes) / 2, 0, sizes[-1]
    for n in sizes:
        acc += n
        if acc >= half:
            median = n
            break
    chunk = MIN_CHUNK
    while chunk * 2 <= median // 64 and chunk < DEFAULT_CHUNK:
        chunk *= 2
    return chunk


def segment_for(table: TensorTable, segment_bytes: int, chunk: int, pipelined: bool) -> int:
    """The data file size of a save: ``segment_bytes``; a save that writes each file beside the
    copy of the next (``pipelined``: overlap mode over host tensors copied beside training) cuts
    its state into eight or more files (of at least 16 MiB), so the copy before the first write
    stays short."""
    if not pipelined:
        return segment_bytes
    total = sum(t.numel() * t.element_size() for t in table.tensors)
    return min(segment_bytes, max(_PIPELINE_SEGMENT, total // 8 // chunk * chunk))
