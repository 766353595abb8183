"""What the ranks of one save must agree on, and what a sharded save records and checks.

Before anything is written every rank's step and the sections it saves (model, optimizer,
scheduler, scaler) are all-gathered: ranks that disagree fail the save on every rank, naming
them. A sharded save (DTensor state) writes each rank's blocks with their place in the global
tensor; rank 0 reads every shard manifest before it commits and checks that the blocks of each
global tensor agree on dtype and global shape and tile it exactly once, so a rank that passed
another model or optimizer (or none) fails the save on every rank instead of committing a
checkpoint that cannot be restored.
"""

from __future__ import annotations

from typing import Any

from .codec import TensorTable
from .errors import CheckpointCorruptError, CheckpointStateError
from .format import REPLICATED_KEYS, TensorEntry, shard_manifest_name
from .persist import read_manifest
from .reshard import Block, GlobalIndex
from .safe_fs import Dir
from .sharding import Box


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


def check_complete(tmp: Dir, crcs: list[int]) -> None:
    """Rank 0, before committing a sharded save: every shard manifest as written (its CRC as its
    rank reported) and every global tensor's blocks agreeing and tiling it.

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
