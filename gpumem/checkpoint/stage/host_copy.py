"""Host copies: a save's pieces copied into the staging arena, and the alignment gaps zeroed.

CPU tensors go through the arena's multithreaded memcpy in one native call (``HostViews`` caches
their byte views between saves). Their CRCs are computed either by that copy (``checksum``: block
by block from the bytes just copied, still in cache: the copy and the checksum then cost ~1.2x
the copy instead of ~1.6x, one pass over memory instead of two; the overlap copy does this,
as it runs beside training and every CPU millisecond it saves is the loop's), or later, from the
staged bytes, by the persist thread (``storage.writes``; blocking mode, whose caller waits for
the copy alone). CUDA tensors are copied by one native call and checksummed
on the device by one Triton launch (``device_copy``), on a side stream that first waits on an
event recorded on the compute stream at save() time.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device_copy import DeviceCopy, enqueue
from .pieces import Piece, StagingPlan

if TYPE_CHECKING:
    from .spill import SpillControl


def zero_padding(arena, plan: StagingPlan, b: int) -> None:
    """Zero the alignment gaps of batch ``b`` in its slot (the format verifies they are zero)."""
    base, end = plan.slot_base(b), 0
    for p in sorted(plan.batch_pieces(b), key=lambda p: p.offset):
        if p.offset > end:
            arena.view(base + end, p.offset - end).zero_()
        end = p.offset + p.nbytes


def cold_bytes(arena, plan: StagingPlan, pieces: list[Piece]) -> int:
    """Bytes of ``pieces`` whose place in the arena is not faulted in yet (``HostArena.prefault``
    still runs): copying them faults those pages on the copying thread."""
    ready_from = arena.ready_from
    if ready_from == 0:
        return 0
    bases = plan.bases
    return sum(
        max(0, min(bases[p.batch] + p.offset + p.nbytes, ready_from) - bases[p.batch] - p.offset)
        for p in pieces
    )


def copy_pieces(
    arena,
    plan: StagingPlan,
    pieces: list[Piece],
    tensors: list[torch.Tensor],
    chunk: int,
    stream=None,
    wait_event=None,
    views: HostViews | None = None,
    spill: SpillControl | None = None,
    threads: int | None = None,
    checksum: bool = False,
) -> DeviceCopy | None:
    """Copy ``pieces`` of ``tensors`` (as TensorTable holds them: detached, strided, no lazy
    conjugate/negative bit) into the arena. CPU pieces are copied before returning, contiguous
    ones in one native call (``views`` supplies their byte views); CUDA pieces are enqueued in
    one native call and checksummed on the device beside the copies (``device_copy.enqueue``);
    the returned DeviceCopy's events mark their completion. ``spill``: the copier's side of the
    device spill (overlap mode; see spill.py). ``threads``: native copy threads (None: all).
    ``checksum``: the contiguous CPU pieces' chunk CRCs are computed by the copy (``p.crc``)."""
    views = views if views is not None else HostViews()
    cpu_src, cpu_off, cpu_pieces, cuda, staged = [], [], [], [], []
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
            cpu_pieces.append(p)
        else:  # planned whole (never split): let torch gather the strides into the slot
            arena.view(dst, p.nbytes).view(t.dtype).view(t.shape).copy_(t)
    if cpu_src and checksum:
        counts = [-(-p.nbytes // chunk) for p in cpu_pieces]
        slots = list(itertools.accumulate(counts, initial=0))
        crcs = torch.empty(slots[-1], dtype=torch.int64)
        arena.copy_in(
            cpu_src,
            cpu_off,
            threads=threads,
            chunk_bytes=chunk,
            crc_index=slots[:-1],
            crc_out=crcs.numpy(),
        )
        for p, lo, hi in zip(cpu_pieces, slots, slots[1:], strict=False):
            p.crc = crcs[lo:hi]
    elif cpu_src:
        arena.copy_in(cpu_src, cpu_off, threads=threads)
    del staged
    if not cuda:
        return None
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
