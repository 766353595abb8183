"""Staging: where each tensor's bytes go in host memory and in the data files, and the copies.

The layout is planned from tensor sizes alone: tensors are packed into *batches*,
each extent aligned, a batch being one data file and one slot of the host arena (arena offset =
file offset, so a batch is written with a single large pwrite). When the state fits the staging
budget there is one batch; otherwise the arena is split into two slots and contiguous tensors are
cut into chunk-aligned pieces that stream through them (copy batch b+1 while batch b is written),
so host memory never exceeds the budget whatever the state size. ``LayoutCache`` reuses the previous
save's layout while the tensors keep their sizes and contiguity (the common case: the same model
and optimizer saved again), and gives each layout an id, so the caller can tell when the alignment
gaps it zeroed in the arena are still in place.

Copies: CPU tensors go through the arena's multithreaded memcpy; their CRCs are computed later by
the persist thread from the staged bytes. CUDA tensors are copied by one native call and
checksummed on the device by one Triton launch (``device_copy.py``), on a side stream that first
waits on an event recorded on the compute stream at save() time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._core import chunk_crc32c
from .errors import CheckpointStateError
from .format import align_up

if TYPE_CHECKING:
    from .device_copy import Snapshot
    from .spill import SpillControl


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
class ArenaLayout:
    """Where each tensor of a save lies in the host arena: batches, their bases, the pieces."""

    capacity: int  # target bytes per batch (hard limit when streaming)
    streaming: bool  # False: every batch resident at once; True: two slots reused in turn
    batch_sizes: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)  # arena offset of each batch
    layout_id: int = 0  # equal ids: identical pieces (set by LayoutCache; 0: not tracked)
    # the CUDA copy/CRC programs of this layout (device_copy.enqueue), shared by its copies
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

    def copy(self) -> ArenaLayout:
        """The same layout with fresh pieces (no CRCs yet): each save fills in its own."""
        return ArenaLayout(
            self.capacity,
            self.streaming,
            list(self.batch_sizes),
            [Piece(p.index, p.src_offset, p.nbytes, p.batch, p.offset) for p in self.pieces],
            list(self.bases),
            self.layout_id,
            self.programs,
        )


class LayoutCache:
    """The last layout planned, reused while a save's tensors have the same sizes and contiguity
    and the settings are unchanged (``plan_layout`` depends on nothing else; names only appear
    in its errors). Each new layout gets a new ``layout_id``."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: ArenaLayout | None = None

    def plan(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        budget: int,
        alignment: int,
        chunk: int,
        segment: int,
    ) -> ArenaLayout:
        """``plan_layout(...)`` of these arguments, as a fresh copy."""
        key = (
            budget,
            alignment,
            chunk,
            segment,
            tuple([t.numel() * t.element_size() for t in tensors]),
            tuple([t.is_contiguous() for t in tensors]),
        )
        if self._plan is None or key != self._key:
            self._key, self._plan = None, None  # a failed plan_layout leaves nothing cached
            plan = plan_layout(tensors, names, budget, alignment, chunk, segment)
            plan.layout_id = next(self._ids)
            self._key, self._plan = key, plan
        return self._plan.copy()


def plan_layout(
    tensors: list[torch.Tensor],
    names: list[str],
    budget: int,
    alignment: int,
    chunk: int,
    segment: int = 256 << 20,
) -> ArenaLayout:
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
            ArenaLayout(capacity=segment, streaming=False), tensors, names, sizes, alignment, chunk
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
        ArenaLayout(capacity=capacity, streaming=True), tensors, names, sizes, alignment, chunk
    )


def _pack(plan: ArenaLayout, tensors, names, sizes, alignment: int, chunk: int) -> ArenaLayout:
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


def zero_padding(arena, plan: ArenaLayout, b: int) -> None:
    """Zero the alignment gaps of batch ``b`` in its slot (the format verifies they are zero)."""
    base, end = plan.slot_base(b), 0
    for p in sorted(plan.batch_pieces(b), key=lambda p: p.offset):
        if p.offset > end:
            arena.view(base + end, p.offset - end).zero_()
        end = p.offset + p.nbytes


def copy_pieces(
    arena,
    plan: ArenaLayout,
    pieces: list[Piece],
    tensors: list[torch.Tensor],
    chunk: int,
    stream=None,
    wait_event=None,
    views: HostViews | None = None,
    spill: SpillControl | None = None,
) -> Snapshot | None:
    """Copy ``pieces`` of ``tensors`` (as TensorTable holds them: detached, strided, no lazy
    conjugate/negative bit) into the arena. CPU pieces are copied before returning, contiguous
    ones in one native call (``views`` supplies their byte views); CUDA pieces are enqueued in
    one native call and checksummed on the device beside the copies (``device_copy.enqueue``);
    the returned Snapshot's events mark their completion. ``spill``: the copier's side of the
    device spill (overlap mode; see spill.py)."""
    views = views if views is not None else HostViews()
    cpu_src, cpu_off, cuda, staged = [], [], [], []
    bases = plan.bases
    last, flat = -1, None  # byte view of the last tensor: a split tensor's pieces are consecutive
    for p in pieces:
        t = tensors[p.index]
        dst = bases[p.batch] + p.offset
        if t.is_cuda:
            cuda.append((p, t, dst))
            continue
        if not t.is_cpu:  # other accelerators: through a host copy (rare, correct)
            t = t.cpu()
            staged.append(t)  # alive until the native copy below has read it
            last = -1
        if t.is_contiguous():
            if p.index != last:
                last, flat = p.index, views.get(t)
            cpu_src.append(
                flat
                if p.src_offset == 0 and p.nbytes == flat.shape[0]
                else flat[p.src_offset : p.src_offset + p.nbytes]
            )
            cpu_off.append(dst)
        else:  # planned whole (never split): let torch gather the strides into the slot
            arena.view(dst, p.nbytes).view(t.dtype).view(t.shape).copy_(t)
    if cpu_src:
        arena.copy_in(cpu_src, cpu_off)
    del staged
    if not cuda:
        return None
    from .device_copy import enqueue

    return enqueue(
        arena, plan.programs, cuda, chunk, stream=stream, wait_event=wait_event, spill=spill
    )


class HostViews:
    """Flat uint8 NumPy views of CPU tensors' bytes, found by (address, size) and kept from one
    save to the next: making a view costs ~1.5 us, finding one ~0.4 us, and a model with its
    optimizer has hundreds of tensors whose memory stays where it is between saves.

    A view holds no reference to the memory it shows (a cached one must not keep a freed model
    alive). That is safe because a view is only ever found through a live tensor that owns
    exactly those bytes: the key is that tensor's own ``data_ptr()`` and byte size, so a stale
    entry whose memory was freed can only match a tensor that now owns the same range. The caller
    keeps the tensor alive until the copy that reads the view has finished (copy_pieces: the
    native copy is synchronous and the job holds its tensors).
    """

    def __init__(self, previous: HostViews | None = None) -> None:
        self._old = previous._views if previous is not None else {}  # not ``previous``: no chain
        self._views: dict[tuple[int, int], np.ndarray] = {}

    def get(self, t: torch.Tensor) -> np.ndarray:
        """Read-only bytes of the contiguous CPU tensor ``t``; valid while ``t`` is alive."""
        key = (t.data_ptr(), t.numel() * t.element_size())
        view = self._views.get(key)
        if view is None:
            view = self._old.get(key)
            if view is None:
                view = _raw_bytes(*key)
            self._views[key] = view
        return view


class _ArrayInterface:
    __slots__ = ("__array_interface__",)


def _raw_bytes(address: int, nbytes: int) -> np.ndarray:
    box = _ArrayInterface()
    box.__array_interface__ = {
        "data": (address, True),
        "shape": (nbytes,),
        "typestr": "|u1",
        "version": 3,
    }
    return np.asarray(box)


def checksum_cpu_pieces(arena, plan: ArenaLayout, pieces: list[Piece], chunk: int) -> None:
    """CRCs of pieces staged from host tensors, from the staged copy (off the training thread)."""
    for p in pieces:
        if p.crc is None:
            p.crc = chunk_crc32c(arena.view(plan.slot_base(p.batch) + p.offset, p.nbytes), chunk)


def tensor_crcs(plan: ArenaLayout, count: int) -> list[list[int]]:
    """Per-tensor chunk CRC lists, concatenated over each tensor's pieces (pieces are chunk
    aligned)."""
    out: list[list[int]] = [[] for _ in range(count)]
    for p in plan.pieces:  # host int64 values (native) or int32 bits (device_crcs)
        out[p.index].extend(int(x) & 0xFFFFFFFF for x in p.crc.cpu().tolist())
    return out
