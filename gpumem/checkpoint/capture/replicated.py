"""Replicated (DDP) state written once: which rank writes which tensor, and the checks that the
ranks agree on what they declared replicated.

Under data parallelism every rank holds the same model, optimizer, scheduler and scaler state
(``REPLICATED_KEYS``). With ``Checkpointer(..., replicated=True)`` each of those tensors is
written by one *owner* rank only. Every rank computes the same owners from its own capture
(nothing is exchanged): largest tensor first, ties in save order, each to the rank with the
fewest bytes so far, ties to the lower rank. Each shard manifest then records the whole map, so
a restore never recomputes it. The non-tensor parts of those sections (param_groups, scheduler
state) stay in every shard's JSON tree: they are small, and they let every shard be checked
against the others.

Because the ranks do not exchange data, the save checks that they captured the same thing: each
rank's persist thread all-gathers a CRC32C per replicated section of its JSON tree and of its
tensors' names, dtypes and shapes (``signature``) before anything is written; a mismatch fails
the save on every rank. Tensor *values* are not compared (that would need every rank to read
every replicated byte, which is what this mode avoids): ``replicated=True`` is a declaration.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from typing import Any

from gpumem.checksum import crc32c

from ..errors import CheckpointStateError
from .codec import DTYPE_NAMES, TensorTable

# the parts of a state tree every data-parallel replica holds alike; the rest is the rank's own
REPLICATED_KEYS = ("model", "optimizer", "scheduler", "scaler")


@dataclass(frozen=True)
class Replication:
    """What one rank of a replicated save writes and records.

    Attributes:
        owners: every replicated tensor's name -> the rank that writes it (the manifest's map).
        meta: (name, dtype name, shape) of every replicated tensor, for ``signature``.
    """

    owners: dict[str, int]
    meta: tuple[tuple[str, str, tuple[int, ...]], ...]


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each tensor: largest first (ties: lower index), each to the rank with the
    fewest bytes assigned so far (ties: lower rank). Deterministic in ``sizes`` and ``world``.

    Example:
        >>> assign_owners([8, 4, 4, 2], 2)
        [0, 1, 1, 0]
    """
    if world < 1:
        raise ValueError(f"world size {world} must be at least 1")
    loads = [
        (0, r) for r in range(world)
    ]  # a heap of (bytes so far, rank): the least loaded on top
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + sizes[i], rank))
    return owners


def split(table: TensorTable, rank: int, world: int) -> tuple[TensorTable, Replication]:
    """The tensors ``rank`` writes (the replicated ones it owns, then all of its own state) and
    the Replication to record."""
    count = table.replicated_count
    # DTensor blocks are this rank's own already (their replicas are written once by sharding)
    plain = [i for i in range(count) if table.blocks[i] is None]
    owners = assign_owners(
        [table.tensors[i].numel() * table.tensors[i].element_size() for i in plain], world
    )
    keep = [i for i, owner in zip(plain, owners, strict=True) if owner == rank]
    keep += [i for i in range(count) if table.blocks[i] is not None]
    keep += list(range(count, len(table.tensors)))
    meta = tuple(
        (table.names[i], DTYPE_NAMES[table.tensors[i].dtype], tuple(table.tensors[i].shape))
        for i in plain
    )
    names = [table.names[i] for i in plain]
    return table.subset(keep), Replication(dict(zip(names, owners, strict=True)), meta)


def signature(tree: dict[str, Any], replication: Replication | None, chunk: int) -> list[int]:
    """What every rank of a replicated save must agree on, as integers to all-gather: the
    replicated flag, ``chunk_bytes`` (CRCs of one tensor come from one shard, so one chunk size)
    and per ``REPLICATED_KEYS`` section a CRC32C of its JSON tree and its tensors' names, dtypes
    and shapes. All zeros for a save that is not replicated."""
    if replication is None:
        return [0] * (2 + len(REPLICATED_KEYS))
    out = [1, chunk]
    for key in REPLICATED_KEYS:
        tensors = [[n, d, list(s)] for n, d, s in replication.meta if n.split(".", 1)[0] == key]
        blob = json.dumps(
            [tree.get(key), tensors], sort_keys=True, separators=(",", ":"), allow_nan=False
        )
        out.append(crc32c(blob.encode()))
    return out


def check_signatures(gathered: list[list[int]]) -> None:
    """Raise CheckpointStateError naming the first rank whose ``signature`` differs from rank
    0's."""
    ref = gathered[0]
    for rank, sig in enumerate(gathered[1:], start=1):
        if sig == ref:
            continue
        if sig[0] != ref[0]:
            raise CheckpointStateError(
                f"rank {rank} saves with replicated={bool(sig[0])}, "
                f"rank 0 with replicated={bool(ref[0])}: create every "
                "rank's Checkpointer with the same replicated= argument"
            )
        if sig[1] != ref[1]:
            raise CheckpointStateError(
                f"rank {rank} uses chunk_bytes={sig[1]}, rank 0 chunk_bytes={ref[1]}: "
                "a replicated checkpoint needs the same chunk_bytes on every rank"
            )
        key = next(k for k, a, b in zip(REPLICATED_KEYS, sig[2:], ref[2:], strict=True) if a != b)
        raise CheckpointStateError(
            f"replicated=True, but rank {rank}'s {key} state differs from rank 0's "
            "(its structure, non-tensor values or tensor names, dtypes and shapes), so "
            "it is not replicated: save sharded state (FSDP, ZeRO, tensor or pipeline "
            "parallel) with replicated=False, or find where the replicas diverged"
        )
