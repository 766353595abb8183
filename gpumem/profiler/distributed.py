"""Per-rank profiles under torch.distributed: every rank profiles itself, one rank gathers.

The summaries travel as UTF-8 JSON in uint8 tensors (``all_gather`` of sizes, then of padded
bytes), so nothing is pickled on the way, unlike ``gather_object``.

Example:
    >>> with gpumem.profile(model, opt) as prof:
    ...     train_step()
    >>> summaries = gather_summaries(prof.report())   # list on rank 0, None elsewhere
    >>> max(s["peak_bytes"] for s in summaries)
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from gpumem.profiler.report import Report


def gather_summaries(
    report: Report, dst: int = 0, group: Any = None
) -> list[dict[str, Any]] | None:
    """Collect every rank's ``report.summary()`` on rank ``dst`` (ordered by rank).

    Collective: every rank of ``group`` must call it. Returns ``None`` on the other ranks.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "gather_summaries needs an initialized process group; call "
            "torch.distributed.init_process_group first, or use report.summary() on one process"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    summary = report.summary()
    summary["rank"] = rank
    payload = json.dumps(summary).encode()
    device = _device_for(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    if rank != dst:
        return None
    return [
        json.loads(bytes(b[: int(n.item())].cpu().tolist()))
        for b, n in zip(bufs, sizes, strict=True)
    ]


def _device_for(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
