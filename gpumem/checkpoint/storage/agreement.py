"""What the ranks of one save must agree on, and what a sharded save records and checks.

Before anything is written every rank's step and the sections it saves (model, optimizer,
scheduler, scaler) are all-gathered: ranks that disagree fail the save on every rank, naming
them. A sharded save (DTensor state) writes each rank's blocks with their place in the global
tensor. Where each block lies is known before any byte is written, so the same first collective
all-gathers every rank's block layout (``layout_blob``) and every rank checks (``check_layout``,
deterministic: all ranks reach the same verdict without another collective) that the blocks of
each global tensor agree on dtype and global shape and tile it exactly once. A rank that passed
another model or optimizer (or none) thus fails the save on every rank before anything is
written, instead of committing a checkpoint that cannot be restored, and the commit does not
wait for this check after the last write. Only a block that several ranks write (the same box:
its copies must hold the same bytes) needs the data's CRCs: then rank 0 also reads the shard
manifests before it commits (``check_complete``).
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from .codec import TensorTable
from .errors import CheckpointCorruptError, CheckpointStateError
from .format import DTYPE_NAMES, REPLICATED_KEYS, TensorEntry, shard_manifest_name
from .persist import read_manifest
from .reshard import Block, GlobalIndex
from .safe_fs import Dir
from .sharding import Box, overlaps


def sections(tree: dict[str, Any]) -> int:
    """Bit i set: the save holds section ``REPLICATED_KEYS[i]``."""
    return sum(1 << i for i, key in enumerate(REPLICATED_KEYS) if key in tree)


def check_agreement(rows: list[list[int]]) -> None:
    """``rows[r] = [step, sections]`` of rank r: raise CheckpointStateError unless all agree."""
    steps = {row[0] for row in rows}
    if len(steps) > 1:
        by_step: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            by_step.setdefault(row[0], []).append(r)
        detail = "; ".join(f"step {s} on rank(s) {ranks}" for s, ranks in sorted(by_step.items()))
        raise CheckpointStateError(
            f"the ranks saved different steps ({detail}): save() is a collective, call it on "
            "every rank with the same step; nothing was written"
        )
    ref = rows[0][1]
    for r, row in enumerate(rows):
        if row[1] != ref:
            names = [k for i, k in enumerate(REPLICATED_KEYS) if row[1] >> i & 1]
            mine = [k for i, k in enumerate(REPLICATED_KEYS) if ref >> i & 1]
            raise CheckpointStateError(
                f"rank {r} saves {names or 'none'} of model/optimizer/scheduler/scaler, rank 0 "
                f"saves {mine or 'none'}: pass the same objects on every rank; nothing was "
                "written"
            )


def global_fields(table: TensorTable, tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the ``global`` field to the entries (``tensors``, in table order) of DTensor blocks;
    return the shard manifest's ``meshes``."""
    meshes: dict[Any, int] = {}
    for entry, layout in zip(tensors, table.layouts, strict=True):
        if layout is None:
            continue
        index = meshes.setdefault(layout.mesh, len(meshes))
        entry["global"] = {
            "shape": list(layout.box.global_shape),
            "offsets": list(layout.box.offsets),
            "mesh": index,
            "placements": list(layout.placements),
        }
    return [m.as_json() for m in meshes]


def layout_blob(table: TensorTable) -> bytes:
    """This rank's DTensor blocks as all-gathered before a save writes: per block its name, dtype,
    global shape, offsets and shape (JSON); empty when the save holds no DTensor."""
    rows = [
        [name, DTYPE_NAMES[t.dtype], layout.box.global_shape, layout.box.offsets, layout.box.shape]
        for name, t, layout in zip(table.names, table.tensors, table.layouts, strict=True)
        if layout is not None
    ]
    if not rows:
        return b""
    return json.dumps(rows, separators=(",", ":")).encode()


def check_layout(blobs: list[bytes]) -> bool:
    """Every rank, before writing: the blocks of each global tensor (``blobs[r]``: rank r's
    ``layout_blob``) agree on dtype and global shape and tile it exactly once, by the rules a
    restore applies (``reshard.GlobalIndex.check``: a box several ranks write is taken once, from
    the lowest rank). Returns whether such a shared box exists: its copies must hold the same
    bytes, which only the CRCs in the shard manifests tell (``check_complete`` at commit).

    Raises:
        CheckpointStateError: naming the tensor and the ranks whose blocks disagree, overlap or
            leave part of it uncovered (the ranks saved different objects); nothing was written.
    """
    # name -> (offsets, shape) -> (rank, dtype, global shape): the lowest rank's copy of a box
    tensors: dict[str, dict[tuple, tuple[int, str, tuple[int, ...]]]] = {}
    shared = False
    for rank, blob in enumerate(blobs):
        if not blob:
            continue
        for name, dtype, gshape, offsets, shape in json.loads(blob):
            boxes = tensors.setdefault(name, {})
            key = (tuple(offsets), tuple(shape))
            if key in boxes:
                shared = True
            else:
                boxes[key] = (rank, dtype, tuple(gshape))
    for name, boxes in tensors.items():
        items = list(boxes.items())
        (_, first), rank0 = items[0], items[0][1][0]
        for _, (rank, dtype, gshape) in items[1:]:
            if dtype != first[1] or gshape != first[2]:
                _refuse(
                    f"global tensor {name!r} is {first[1]} {first[2]} on rank {rank0} but "
                    f"{dtype} {gshape} on rank {rank}"
                )
        if _rows_tile(first[2], list(boxes)):
            continue
        blocks = [Box(g, off, shp) for (off, shp), (_, _, g) in items]
        pair = overlaps(blocks)
        if pair is not None:
            i, j = pair
            _refuse(
                f"global tensor {name!r}: rank {items[i][1][0]}'s block {blocks[i].text()} "
                f"overlaps rank {items[j][1][0]}'s {blocks[j].text()}"
            )
        total = sum(b.numel for b in blocks)
        want = Box.full(first[2]).numel
        if total != want:
            ranks = sorted({r for r, _, _ in boxes.values()})
            _refuse(
                f"the blocks of global tensor {name!r} that rank(s) {ranks} save cover {total} of "
                f"its {want} elements (shape {first[2]}): a rank's part is missing"
            )
    return shared


def _rows_tile(gshape: tuple[int, ...], boxes: list[tuple]) -> bool:
    """The fast case (FSDP's layout): every box ``(offsets, shape)`` spans whole rows of dimension
    0 and, by start, each begins where the previous ended, the last at the end: they tile
    ``gshape``. False says only "not shown here" (the general check decides)."""
    if not gshape:
        return False
    rest = gshape[1:]
    spans = []
    for offsets, shape in boxes:
        if shape[1:] != rest or any(offsets[1:]) or len(offsets) != len(gshape):
            return False
        if shape[0]:
            spans.append((offsets[0], shape[0]))
    end = 0
    for start, n in sorted(spans):
        if start != end:
            return False
        end += n
    return end == gshape[0] or 0 in rest


def _refuse(detail: str) -> NoReturn:
    raise CheckpointStateError(
        f"the ranks' DTensor blocks do not fit together: {detail}. Every rank must save the "
        "same model and optimizer (each its own shards); nothing was written"
    )


def check_complete(tmp: Dir, crcs: list[int]) -> None:
    """Rank 0, before committing a sharded save in which several ranks wrote one block
    (``check_layout`` returned True): every shard manifest as written (its CRC as its rank
    reported), every global tensor's blocks agreeing and tiling it, and the copies of a shared
    block holding the same bytes (the same chunk CRCs).

    Only the blocks are taken from each manifest: these are the files this save's own ranks just
    wrote (each one's CRC as its rank reported it), which every restore validates field by field;
    the full validation here (``format.parse_shard``: every chunk CRC of every tensor) was most of
    this check's time, and this check sits between the last write and the commit.

    Raises:
        CheckpointStateError: naming the tensor and the ranks whose blocks disagree or are
            missing (the ranks saved different objects).
    """
    index = GlobalIndex(tmp.path, [])
    for rank, crc in enumerate(crcs):
        path = tmp.path / shard_manifest_name(rank)
        body, got = read_manifest(tmp, shard_manifest_name(rank))
        if got != crc:
            raise CheckpointStateError(f"{path} changed after rank {rank} wrote it")
        chunk = body["chunk_bytes"]
        for t in body["tensors"]:
            g = t.get("global")
            if g is None:
                continue
            box = Box(tuple(g["shape"]), tuple(g["offsets"]), tuple(t["shape"]))
            name = g.get("tensor", t["name"])
            crcs32 = tuple(t["crc32c"])
            entry = TensorEntry(
                t["name"], t["dtype"], box.shape, t["nbytes"], crcs32, (), box, tensor=name
            )
            index.blocks.setdefault(name, []).append(Block(rank, entry, box, chunk))
    try:
        index.check_all()
    except CheckpointCorruptError as exc:
        raise CheckpointStateError(
            f"the ranks' DTensor blocks do not fit together: {exc}. Every rank must save the "
            "same model and optimizer (each its own shards); nothing was committed"
        ) from None
