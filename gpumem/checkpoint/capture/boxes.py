"""Boxes of global tensors: where a block lies, the geometry of overlaps, and the one tiling rule.

A block of a global tensor (a DTensor's local shard, a DCP chunk) is a *box*: an offset and a size
per dimension. ``tile`` is the rule every check of a sharded checkpoint applies, at save time
(before any rank writes: the blocks the ranks are about to write, see ``storage.agreement``) and
at restore and verify time (the blocks the shard manifests record, see ``restore.reshard``): the
blocks of one global tensor agree on dtype and global shape, and tile it exactly once. A box that
several ranks hold is taken once, from the lowest rank, and where both copies' chunk CRC32Cs are
known they must be equal. Pure geometry: nothing here imports torch (numpy adds up the corners
of many blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Protocol, TypeVar

import numpy as np


@dataclass(frozen=True)
class Box:
    """Where a block of a global tensor lies: ``offsets`` and ``shape`` per dimension."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_full(self) -> bool:
        return self.shape == self.global_shape

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls(tuple(shape), (0,) * len(shape), tuple(shape))

    def text(self) -> str:
        spans = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape, strict=True))
        return f"[{spans}] of {tuple(self.global_shape)}"


@dataclass(frozen=True)
class Mesh:
    """A device mesh as a manifest records it: its shape, dimension names and global ranks."""

    shape: tuple[int, ...]
    names: tuple[str, ...] | None
    ranks: tuple[int, ...]  # row-major, len == prod(shape)

    def as_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "names": self.names and list(self.names),
            "ranks": list(self.ranks),
        }


class Placed(Protocol):
    """A block as the tiling rule sees it: which rank holds it, where it lies, its dtype (the
    format's name), and its chunk CRC32Cs where they are known (None before they are written)."""

    @property
    def rank(self) -> int: ...
    @property
    def box(self) -> Box: ...
    @property
    def dtype(self) -> str: ...
    @property
    def crcs(self) -> tuple[int, ...] | None: ...
    @property
    def chunk(self) -> int: ...


@dataclass(frozen=True)
class Planned:
    """A block a rank is about to write: its CRCs are not known yet."""

    rank: int
    box: Box
    dtype: str
    crcs: tuple[int, ...] | None = None
    chunk: int = 0


class TilingError(ValueError):
    """The blocks of a global tensor do not tile it exactly once; the message names the tensor
    and the ranks."""


B = TypeVar("B", bound=Placed)


def tile(name: str, blocks: Sequence[B], *, copies: bool = True) -> tuple[list[B], bool]:
    """The blocks of the global tensor ``name`` with every box once (a box several ranks hold is
    taken from the lowest rank), and whether such a shared box exists. ``copies=False``: a box
    may appear only once (a second copy overlaps the first).

    Raises:
        TilingError: no blocks, two copies of one box with different chunk CRC32Cs (diverged
            replicas), blocks that disagree on dtype or global shape, overlap, or leave part of
            the tensor uncovered.
    """
    if not blocks:
        raise TilingError(f"global tensor {name!r} has no blocks")
    order = sorted(blocks, key=_rank)  # stable: the lowest rank's copy first
    if _tiles_as_is(name, order):
        return order, False
    keys = [(b.box.offsets, b.box.shape) for b in order]
    if len(set(keys)) == len(keys):  # every box once (the usual case): nothing to take once
        out, shared = order, False
    else:
        out, shared = _take_once(name, order, keys, copies)
    first = out[0]
    gshape = first.box.global_shape
    if len({b.dtype for b in out}) > 1 or len({b.box.global_shape for b in out}) > 1:
        for b in out[1:]:  # name the first block that differs from the first
            if b.dtype != first.dtype or b.box.global_shape != gshape:
                raise TilingError(
                    f"global tensor {name!r} is {first.dtype} {gshape} on rank {first.rank} "
                    f"but {b.dtype} {b.box.global_shape} on rank {b.rank}"
                )
    boxes = [b.box for b in out]
    arrays = box_arrays(gshape, boxes)
    if arrays is None or not _in_bounds(gshape, *arrays):
        _check_bounds(name, out, gshape)  # names the first block at fault (or passes, exactly)
    if _rows_tile(gshape, boxes) or covers_once(name, gshape, boxes, arrays):
        return out, shared
    total = sum(b.numel for b in boxes)
    want = math.prod(gshape)
    pair, complete = overlaps(boxes, budget=DIAGNOSIS_BUDGET)
    if pair is not None:
        a, b = out[pair[0]], out[pair[1]]
        raise TilingError(
            f"global tensor {name!r}: rank {a.rank}'s block {a.box.text()} overlaps rank "
            f"{b.rank}'s {b.box.text()}"
        )
    if total >= want:  # in bounds, not a tiling, not short: some blocks overlap
        raise TilingError(
            f"the blocks of global tensor {name!r} overlap: they hold {total} elements of its "
            f"{want} (shape {gshape})"
        )
    ranks = sorted({b.rank for b in out})
    raise TilingError(
        f"the blocks of global tensor {name!r} (held by rank(s) {ranks}) cover "
        f"{'at most ' if not complete else ''}{total} of its {want} elements (shape {gshape}): "
        "a rank's part is missing"
    )


_rank = attrgetter("rank")


def _tiles_as_is(name: str, order: Sequence[Placed]) -> bool:
    """The usual case on arrays, with no Python object per block made: one dtype and global
    shape, every box holding elements and inside the tensor, tiling it. Then no box repeats (two
    copies of a box with elements overlap), so ``tile``'s answer is the blocks as they are.
    False says only "not shown here": ``tile``'s full path decides, and names the fault."""
    first = order[0]
    gshape = first.box.global_shape
    if len(set(map(_dtype, order))) > 1 or len(set(map(_gshape, order))) > 1:
        return False
    boxes = list(map(_box, order))
    arrays = box_arrays(gshape, boxes)
    if arrays is None or not (arrays[1] != 0).all() or not _in_bounds(gshape, *arrays):
        return False
    try:
        return covers_once(name, gshape, boxes, arrays)
    except TilingError:  # past the corner cap: the full path may still show rows that tile
        return False


_dtype, _box, _gshape = attrgetter("dtype"), attrgetter("box"), attrgetter("box.global_shape")
_offsets, _shape = attrgetter("offsets"), attrgetter("shape")


def _take_once(
    name: str, order: list[B], keys: list[tuple[Any, Any]], copies: bool
) -> tuple[list[B], bool]:
    """``order`` (sorted by rank) with each box once, from the lowest rank, and whether a box
    appeared twice; ``keys``: each block's (offsets, shape).

    Raises:
        TilingError: a second copy where ``copies`` is False, or copies with different CRCs.
    """
    kept: dict[tuple[Any, Any], B] = {}
    shared = False
    for key, b in zip(keys, order, strict=True):
        other = kept.get(key)
        if other is None:
            kept[key] = b
            continue
        if not copies and b.box.numel:
            raise TilingError(
                f"global tensor {name!r}: rank {other.rank}'s block {other.box.text()} overlaps "
                f"rank {b.rank}'s {b.box.text()}"
            )
        shared = True
        if (
            other.crcs is not None
            and b.crcs is not None
            and other.chunk == b.chunk
            and other.crcs != b.crcs
        ):
            raise TilingError(
                f"global tensor {name!r}: ranks {other.rank} and {b.rank} wrote the same block "
                f"{b.box.text()} with different bytes (diverged replicas)"
            )
    return list(kept.values()), shared


def _check_bounds(name: str, out: Sequence[Placed], gshape: tuple[int, ...]) -> None:
    """Every block has the tensor's dimensions and lies inside it."""
    for b in out:
        box = b.box
        if len(box.offsets) != len(gshape) or len(box.shape) != len(gshape):
            raise TilingError(
                f"global tensor {name!r}: rank {b.rank}'s block {box.text()} has "
                f"{len(box.shape)} dimensions, the tensor {len(gshape)}"
            )
        if box.numel and any(
            o < 0 or n < 0 or o + n > g
            for o, n, g in zip(box.offsets, box.shape, gshape, strict=True)
        ):
            raise TilingError(
                f"global tensor {name!r}: rank {b.rank}'s block {box.text()} lies outside it"
            )


def box_arrays(
    gshape: tuple[int, ...], boxes: Sequence[Box]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes' offsets and shapes as two (blocks, dimensions) int64 arrays, built once for the
    checks below; None where a box has other dimensions than ``gshape`` or a number past int64
    (the per-box checks decide those)."""
    n, d = len(boxes), len(gshape)
    if not n or not d or max(gshape) >= 1 << 62:
        return None
    offsets = list(map(_offsets, boxes))
    shapes = list(map(_shape, boxes))
    if set(map(len, offsets)) != {d} or set(map(len, shapes)) != {d}:
        return None
    try:  # one C loop over the flattened tuples
        offs = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=n * d)
        shp = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=n * d)
    except (OverflowError, TypeError, ValueError):
        return None
    return offs.reshape(n, d), shp.reshape(n, d)


def _in_bounds(gshape: tuple[int, ...], offs: np.ndarray, shp: np.ndarray) -> bool:
    """``_check_bounds`` on arrays: every block that holds elements lies inside the tensor."""
    top = np.array(gshape, dtype=np.int64)
    live = (shp != 0).all(axis=1)
    # shp <= top first, so top - shp cannot wrap where it decides
    out = (offs < 0) | (shp < 0) | (shp > top) | (offs > top - shp)
    return not (out.any(axis=1) & live).any()


MAX_CORNERS = 1 << 22
"""Work cap of ``covers_once``: blocks x corners per block (2 ** dimensions the blocks split).
Real layouts split one or two dimensions (FSDP rows, TP columns, DCP's chunk grids): 100,000
blocks of a tensor cost 200,000 corners. A layout past the cap is refused, not checked slowly."""
DIAGNOSIS_BUDGET = 250_000
"""Box pairs ``overlaps`` compares, at most, to name the two blocks of a failed tiling."""


def covers_once(
    name: str,
    gshape: tuple[int, ...],
    boxes: Sequence[Box],
    arrays: tuple[np.ndarray, np.ndarray] | None = None,
) -> bool:
    """Whether ``boxes`` (each within ``gshape``) cover the tensor exactly once, in time linear
    in the blocks (one sort of their corners).

    The coverage count c(x) = number of boxes holding element x is the d-dimensional prefix
    sum of the boxes' signed corners (a box [a, b) puts (-1)^|S| at the corner taking b on the
    dimensions S and a on the others). So c is 1 on the tensor and 0 elsewhere exactly when the
    boxes' corners, summed, equal the tensor's own corners: every other corner cancels. Only
    dimensions some box splits matter (elsewhere every box spans the tensor).

    The corners are summed as arrays (each corner one int64 key, mixed-radix over the split
    dimensions); coordinates too large for that take ``corner_sum_exact``, the same sum on
    Python integers (a slow path no real layout takes).

    ``arrays``: ``box_arrays(gshape, boxes)`` where the caller has it.

    Raises:
        TilingError: more corners than ``MAX_CORNERS`` to add up.
    """
    radix = [g + 1 for g in gshape]
    if arrays is None:
        arrays = box_arrays(gshape, boxes)
    if arrays is None or math.prod(gshape) == 0 or math.prod(radix) >= 1 << 62:
        return corner_sum_exact(name, gshape, boxes)  # nothing to cover, or keys past int64
    offs, shp = arrays
    top = np.array(gshape, dtype=np.int64)
    live = (shp != 0).all(axis=1)  # numel != 0
    offs, shp = offs[live], shp[live]
    dims = np.flatnonzero(((offs != 0) | (shp != top)).any(axis=0))
    k = len(dims)
    _corner_cap(name, len(offs), k)
    if not k:  # every live box spans the tensor
        return len(offs) == 1
    stride = np.cumprod([1] + [radix[d] for d in dims[:-1]]).astype(np.int64)
    lo = offs[:, dims] @ stride  # each box's lower corner as one key
    step = (shp[:, dims] * stride).T  # (k, n): what taking the upper end adds per dimension
    bits = (np.arange(1 << k)[:, None] >> np.arange(k)) & 1  # (2^k, k): dims at the upper end
    sign = 1 - 2 * (bits.sum(axis=1) % 2)
    keys = np.concatenate([(lo + bits @ step).ravel(), bits @ (top[dims] * stride)])
    weights = np.concatenate([np.repeat(sign, len(lo)), -sign])  # minus the tensor's corners
    order = np.argsort(keys, kind="stable")
    keys, weights = keys[order], weights[order]
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return not np.add.reduceat(weights, starts).any()


def _corner_cap(name: str, live: int, k: int) -> None:
    """Refuse ``live`` blocks splitting ``k`` dimensions past ``MAX_CORNERS`` corners."""
    if live << k > MAX_CORNERS:
        raise TilingError(
            f"global tensor {name!r}: {live} blocks splitting {k} dimensions are "
            f"more than gpumem checks ({MAX_CORNERS} block corners); a checkpoint of FSDP, TP or "
            "DCP chunks splits one or two"
        )


def corner_sum_exact(name: str, gshape: tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """``covers_once`` on Python integers, one corner at a time: for coordinates past int64,
    and the reference the array version is tested against."""
    live = [b for b in boxes if b.numel]
    dims = [
        d for d in range(len(gshape)) if any(b.offsets[d] or b.shape[d] != gshape[d] for b in live)
    ]
    _corner_cap(name, len(live), len(dims))
    if math.prod(gshape) == 0:
        return not live
    signs = [-1 if bin(m).count("1") % 2 else 1 for m in range(1 << len(dims))]
    acc: dict[tuple[int, ...], int] = {}

    def add(lo: tuple[int, ...], hi: tuple[int, ...], weight: int) -> None:
        for m, sign in enumerate(signs):  # bit i of m: dimension dims[i] takes its upper end
            corner = tuple(hi[i] if m >> i & 1 else lo[i] for i in range(len(dims)))
            acc[corner] = acc.get(corner, 0) + weight * sign

    add((0,) * len(dims), tuple(gshape[d] for d in dims), -1)  # minus the tensor's own corners
    for b in live:
        add(tuple(b.offsets[d] for d in dims), tuple(b.offsets[d] + b.shape[d] for d in dims), 1)
    return not any(acc.values())


def _rows_tile(gshape: tuple[int, ...], boxes: list[Box]) -> bool:
    """The fast case (FSDP's layout): every box spans whole rows of dimension 0 and, by start,
    each begins where the previous ended, the last at the end: they tile ``gshape``. False says
    only "not shown here" (the general check decides)."""
    if not gshape:
        return False
    rest = gshape[1:]
    spans = []
    for b in boxes:
        if b.shape[1:] != rest or any(b.offsets[1:]) or len(b.offsets) != len(gshape):
            return False
        if b.shape[0]:
            spans.append((b.offsets[0], b.shape[0]))
    end = 0
    for start, n in sorted(spans):
        if start != end:
            return False
        end += n
    return end == gshape[0] or 0 in rest


def intersect(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, shape) of the overlap of two boxes of one global tensor, or None."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(
        min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True)
    )
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def is_contiguous_block(shape: tuple[int, ...], sub_shape: tuple[int, ...]) -> bool:
    """Whether a sub-box of ``sub_shape`` is one contiguous run of a row-major ``shape``: leading
    dimensions of size 1, then one partial dimension, then full ones."""
    k = 0
    while k < len(shape) and sub_shape[k] == 1:
        k += 1
    return all(sub_shape[j] == shape[j] for j in range(k + 1, len(shape)))


def linear(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    """Row-major element index of ``index`` in ``shape``."""
    out = 0
    for d, i in zip(shape, index, strict=True):
        out = out * d + i
    return out


def overlaps(boxes: list[Box], budget: int | None = None) -> tuple[tuple[int, int] | None, bool]:
    """The first pair of boxes (indices) that overlap, or None; and whether the search was
    complete (False: ``budget`` pairs compared without finding one). A sorted sweep on the
    dimension with the most distinct offsets (where the blocks are split), dropping boxes that
    end before the next begins."""
    live = [i for i in range(len(boxes)) if boxes[i].numel]
    if not live:
        return None, True
    ndim = len(boxes[live[0]].offsets)
    if not ndim:  # 0-d boxes all cover the one element
        return ((live[0], live[1]) if len(live) > 1 else None), True
    d = max(range(ndim), key=lambda k: len({boxes[i].offsets[k] for i in live}))
    order = sorted(live, key=lambda i: (boxes[i].offsets[d], boxes[i].offsets))
    active: list[int] = []
    compared = 0
    for i in order:
        b = boxes[i]
        start = b.offsets[d]
        active = [j for j in active if boxes[j].offsets[d] + boxes[j].shape[d] > start]
        for j in active:
            compared += 1
            if intersect(boxes[j], b) is not None:
                return (j, i), True
            if budget is not None and compared >= budget:
                return None, False
        active.append(i)
    return None, True
