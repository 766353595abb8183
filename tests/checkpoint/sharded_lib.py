"""A small model in every layout the sharded checkpoint tests use, on CPU with gloo.

``Sequential(Linear(64, 96), ReLU, Linear(96, 7), LayerNorm(7))`` with AdamW. Sizes are chosen so
that blocks cross chunk boundaries at odd places (chunk_bytes=4096 in the tests: the first weight
is 24 KiB, 256 bytes a row) and shards are uneven (7 rows over 2, 3 or 4 ranks; FSDP gives the
last ranks fewer rows, some none). Layouts: ``plain``; ``fsdp`` (each Linear its own
``fully_shard`` unit, resharding after forward, the root not); ``offload`` (the same with
``CPUOffloadPolicy``); ``tp`` (column- then row-parallel on a 1-D mesh: the second weight is split
along dimension 1); ``2d`` (that TP inside FSDP on a (dp, tp) mesh).
"""

from __future__ import annotations

import torch
from torch import nn


def build(layout: str, seed: int = 0, dp: int | None = None, device: str = "cpu"):
    """The model and its AdamW in ``layout`` on ``device`` ("cpu" or "cuda"; needs an
    initialized process group unless plain). Meshes are explicit: on a machine with a GPU,
    fully_shard would otherwise put a CPU test's model on it."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 7), nn.LayerNorm(7))
    model.to(device)
    if layout in ("fsdp", "offload"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(device, (dist.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=False) if layout == "offload" else OffloadPolicy()
        fully_shard(model[0], mesh=mesh, offload_policy=policy)
        fully_shard(model[2], mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
    elif layout in ("tp", "2d"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        world = dist.get_world_size()
        if layout == "tp":
            tp_mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
        else:
            mesh = init_device_mesh(device, (dp, world // dp), mesh_dim_names=("dp", "tp"))
            tp_mesh = mesh["tp"]
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if layout == "2d":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh["dp"])
    elif layout != "plain":
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def train(model, opt, steps: int, start: int = 0, device: str = "cpu") -> None:
    """The same batches on every rank (batch i from seed i)."""
    for i in range(start, start + steps):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(i)).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor as a full plain tensor (a collective for DTensors)."""

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

    out = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{pid}.{k}"] = full(v)
    return out


def differences(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bit-identical (dtype, shape and every byte)."""
    keys = sorted(set(ref) | set(got))
    return [
        k
        for k in keys
        if k not in ref
        or k not in got
        or ref[k].dtype != got[k].dtype
        or ref[k].shape != got[k].shape
        or not torch.equal(ref[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8))
    ]


def start_ranks(
    script: str, args: list[str], tmp_path, tag: str, world: int, per_node: int, env=None
) -> list:
    """``script`` (next to this file) started on ``world`` ranks, ``per_node`` a node
    (``GPUMEM_NODE``), rendezvous through a fresh file under ``tmp_path``: the processes."""
    import os
    import subprocess
    import sys

    rdv = tmp_path / f"rdv-{tag}-{world}-{len(os.listdir(tmp_path))}"
    return [
        subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), script), *args],
            env={
                **os.environ,
                **(env or {}),
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "INIT": f"file://{rdv}",
                "GPUMEM_NODE": str(r // per_node),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def init_rank() -> tuple[int, int]:
    """A worker started by ``start_ranks``: one torch thread, gloo joined; (rank, world)."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=os.environ["INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    return dist.get_rank(), dist.get_world_size()
