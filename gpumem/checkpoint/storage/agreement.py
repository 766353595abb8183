"""What the ranks of one save must agree on before anything is written, and the sharded save's
check of its blocks.

Before anything is written every rank's step and the sections it saves (model, optimizer,
scheduler, scaler) are all-gathered: ranks that disagree fail the save on every rank, naming
them. A sharded save (DTensor state) writes each rank's blocks with their place in the global
tensor. Where each block lies is known before any byte is written, so the same first collective
all-gathers every rank's block layout (``layout_blob``) and every rank checks (``check_layout``,
deterministic: all ranks reach the same verdict without another collective) that the blocks of
each global tensor tile it by the one rule restore applies (``capture.boxes.tile``). A rank that
passed another model or optimizer (or none) thus fails the save on every rank before anything is
written, instead of committing a checkpoint that cannot be restored, and the commit does not
wait for this check after the last write. Only a block that several ranks write (the same box:
its copies must hold the same bytes) needs the data's CRCs: then rank 0 also reads the shard
manifests before it commits (``check_complete``).
"""

from __future__ import annotations

import json
from typing import NoReturn

from ..capture.boxes import Box, Planned, TilingError, tile
from ..capture.codec import DTYPE_NAMES, TensorTable
from ..capture.replicated import REPLICATED_KEYS
from ..errors import CheckpointStateError
from .directory import read_manifest
from .format import shard_manifest_name
from .safe_fs import Dir


def check_agreement(rows: list[list[int]]) -> None:
    """``rows[r] = [step, sections]`` of rank r (``training_state.sections``): raise
    CheckpointStateError unless all agree."""
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


def layout_blob(table: TensorTable) -> bytes:
    """This rank's DTensor blocks as all-gathered before a save writes: per block its name, dtype,
    global shape, offsets and shape (JSON); empty when the save holds no DTensor."""
    rows = [
        [name, DTYPE_NAMES[t.dtype], block.box.global_shape, block.box.offsets, block.box.shape]
        for name, t, block in zip(table.names, table.tensors, table.blocks, strict=True)
        if block is not None
    ]
    if not rows:
        return b""
    return json.dumps(rows, separators=(",", ":")).encode()


def check_layout(blobs: list[bytes]) -> bool:
    """Every rank, before writing: the blocks of each global tensor (``blobs[r]``: rank r's
    ``layout_blob``) tile it (``tile``). Returns whether a box several ranks write exists: its
    copies must hold the same bytes, which only the CRCs in the shard manifests tell
    (``check_complete`` at commit).

    Raises:
        CheckpointStateError: naming the tensor and the ranks whose blocks disagree, overlap or
            leave part of it uncovered (the ranks saved different objects); nothing was written.
    """
    tensors: dict[str, list[Planned]] = {}
    for rank, blob in enumerate(blobs):
        for name, dtype, gshape, offsets, shape in json.loads(blob) if blob else []:
            box = Box(tuple(gshape), tuple(offsets), tuple(shape))
            tensors.setdefault(name, []).append(Planned(rank, box, dtype))
    shared = False
    for name, blocks in tensors.items():
        try:
            shared = tile(name, blocks)[1] or shared
        except TilingError as exc:
            _refuse(str(exc), "written")
    return shared


def check_complete(tmp: Dir, crcs: list[int]) -> None:
    """Rank 0, before committing a sharded save in which several ranks wrote one block
    (``check_layout`` returned True): every shard manifest as written (its CRC as its rank
    reported), and every global tensor's blocks tiling it, the copies of a shared block holding
    the same bytes (the same chunk CRCs).

    Only the blocks are taken from each manifest: these are the files this save's own ranks just
    wrote (each one's CRC as its rank reported it), which every restore validates field by field;
    the full validation here (``format.parse_shard``: every chunk CRC of every tensor) was most of
    this check's time, and this check sits between the last write and the commit.

    Raises:
        CheckpointStateError: naming the tensor and the ranks whose blocks disagree or are
            missing (the ranks saved different objects).
    """
    tensors: dict[str, list[Planned]] = {}
    for rank, crc in enumerate(crcs):
        path = tmp.path / shard_manifest_name(rank)
        body, got, _ = read_manifest(tmp, shard_manifest_name(rank))
        if got != crc:
            raise CheckpointStateError(f"{path} changed after rank {rank} wrote it")
        for t in body["tensors"]:
            g = t.get("global")
            if g is not None:
                box = Box(tuple(g["shape"]), tuple(g["offsets"]), tuple(t["shape"]))
                block = Planned(rank, box, t["dtype"], tuple(t["crc32c"]), body["chunk_bytes"])
                tensors.setdefault(g.get("tensor", t["name"]), []).append(block)
    for name, blocks in tensors.items():
        try:
            tile(name, blocks)
        except TilingError as exc:
            _refuse(str(exc), "committed")


def _refuse(detail: str, what: str) -> NoReturn:
    raise CheckpointStateError(
        f"the ranks' DTensor blocks do not fit together: {detail}. Every rank must save the "
        f"same model and optimizer (each its own shards); nothing was {what}"
    )
