"""``verify``: a checkpoint directory checked completely, without any object to load it into.

Every manifest (framing, CRC32C, every field), every data file (size, every chunk's CRC32C, the
zero padding between extents), the replicated shards against each other, the blocks of every
global tensor tiling it (``reshard.GlobalIndex``), and every state tree decoded against its
tensors. Memory stays bounded by the largest data file: each file's bytes are dropped once
checksummed.
"""

from __future__ import annotations

import os
from typing import Any

from gpumem._gc import paused as paused_gc

from ..capture.codec import decode
from ..storage.directory import load_info
from ..storage.format import CheckpointInfo
from ..storage.step_reads import StepFiles
from .files import load_shard, open_checkpoint
from .plain import check_same
from .reshard import GlobalIndex


def verify(path: str | os.PathLike) -> CheckpointInfo:
    """Check a checkpoint directory completely: manifests, every tensor's CRC, padding, file sizes.

    Returns:
        Its CheckpointInfo.

    Raises:
        CheckpointCorruptError: naming the file (and tensor) at fault.
        CheckpointIOError: the operating system failed a read (errno and path kept).

    Example:
        >>> gpumem.checkpoint.verify("ckpts/step-000001000")  # doctest: +SKIP
    """
    with open_checkpoint(path) as step, paused_gc():  # bulk decoding: see gpumem._gc
        return _verify(step)


def _verify(step: StepFiles) -> CheckpointInfo:
    p = step.path
    info = load_info(step)
    shards = [load_shard(step, info, rank, keep=False)[0] for rank in range(info.world_size)]
    if info.replicated:  # one owners map in every shard, and each shard holds what it maps there
        for shard in shards[1:]:
            check_same(shards[0], shard, p)
    held = [{t.name: t for t in shard.tensors} for shard in shards]
    blocks: dict[str, Any] = {}
    if info.sharded:  # every global tensor's blocks agree and tile it
        index = GlobalIndex(p, shards)
        index.check_all()
        blocks = index.blocks
    for shard in shards:
        tensors = dict(held[shard.rank])
        # the union: each replicated tensor from the one shard that holds it
        tensors.update((name, held[owner][name]) for name, owner in shard.owners.items())
        decode(shard.state, tensors, f"{p.name}.rank{shard.rank}", dtensors=blocks)
    return info
