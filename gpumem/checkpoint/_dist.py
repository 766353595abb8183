"""The few collectives checkpointing needs, on a private gloo group (never the training group).

Background saves and preemption checks run collectives from other threads than the training
loop's; sharing its process group would interleave them with training collectives and deadlock
(the KempnerForge#104 failure). Each user of collectives therefore gets its own gloo group,
created collectively when the object is built. Without torch.distributed every call is local.
"""

from __future__ import annotations

import torch


class Group:
    """rank / world size and int collectives; trivial when not running distributed."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.pg = 0, 1, None
        dist = _dist()
        if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.pg = dist.new_group(backend="gloo")

    def all_reduce(self, value: int, op: str) -> int:
        """``op`` in {"min", "max"} over every rank."""
        if self.pg is None:
            return value
        dist = _dist()
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(
            t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.pg
        )
        return int(t.item())

    def all_gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on all ranks), indexed by rank."""
        if self.pg is None:
            return [list(values)]
        dist = _dist()
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.pg)
        return [t.tolist() for t in out]


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() else None
