"""What the DCP interop harness (test_dcp_interop.py) runs on each gloo rank: the behaviours DCP's
own tests check for its file-system storage (round trips with every writer argument, overwrite,
async save with a cached stager, DTensor resharding across meshes and placements), through
``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with gpumem's storage. Each scenario returns
a list of the mismatches it found (empty: as DCP behaves)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import gpumem.dcp


def full(name: str, scale: float = 1.0) -> torch.Tensor:
    """The global tensors every scenario saves (8 x 12 divides over 1, 2 and 4 ranks)."""
    if name == "w":
        return torch.arange(96, dtype=torch.float32).reshape(8, 12) * scale
    g = torch.Generator().manual_seed(7)
    return (torch.randn(8, 12, generator=g, dtype=torch.float64) * scale).to(torch.bfloat16)


def layouts(world: int) -> dict[str, tuple[Any, list[Any]]]:
    """Named (mesh, placements): 1-D over every rank, and 2 x 2 on four."""
    one = init_device_mesh("cpu", (world,))
    out = {
        "1d-shard0": (one, [Shard(0)]),
        "1d-shard1": (one, [Shard(1)]),
        "1d-replicate": (one, [Replicate()]),
    }
    if world == 4:
        two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        out["2d-shard0-shard1"] = (two, [Shard(0), Shard(1)])
        out["2d-replicate-shard0"] = (two, [Replicate(), Shard(0)])
        out["2d-shard1-replicate"] = (two, [Shard(1), Replicate()])
    return out


def dtensor_state(layout: tuple[Any, list[Any]], scale: float = 1.0) -> dict[str, Any]:
    mesh, placements = layout
    return {
        "model": {n: distribute_tensor(full(n, scale), mesh, placements) for n in ("w", "b")},
        "plain": torch.full((3,), scale),  # the same on every rank: DCP writes it once
        "step": int(scale * 10),  # a byte item (DCP's planner torch.saves it)
        "cfg": {"lr": 0.5 * scale, "name": "x"},
    }


def empty_like(state: dict[str, Any], layout: tuple[Any, list[Any]]) -> dict[str, Any]:
    mesh, placements = layout
    return {
        "model": {
            n: distribute_tensor(torch.zeros_like(full(n)), mesh, placements) for n in ("w", "b")
        },
        "plain": torch.zeros(3),
        "step": -1,
        "cfg": {"lr": 0.0, "name": ""},
    }


def compare(tag: str, got: dict[str, Any], scale: float) -> list[str]:
    bad = []
    for n in ("w", "b"):
        t = got["model"][n]
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if not torch.equal(t, full(n, scale)):
            bad.append(f"{tag}: model.{n} differs")
    if not torch.equal(got["plain"], torch.full((3,), scale)):
        bad.append(f"{tag}: plain differs")
    if got["step"] != int(scale * 10) or got["cfg"] != {"lr": 0.5 * scale, "name": "x"}:
        bad.append(f"{tag}: non-tensor items differ: {got['step']!r} {got['cfg']!r}")
    return bad


def reshard(root: Path, world: int) -> list[str]:
    """Save in every layout, load each into every layout (DCP's resharding tests)."""
    bad: list[str] = []
    named = layouts(world)
    for i, (src, layout) in enumerate(named.items()):
        dcp.save(
            dtensor_state(layout, 1.0 + i),
            storage_writer=gpumem.dcp.StorageWriter(
                root / f"reshard-{world}" / f"step-{i}", keep=None
            ),
        )
        for dst, target in named.items():
            state = empty_like(dtensor_state(target), target)
            dcp.load(
                state,
                storage_reader=gpumem.dcp.StorageReader(root / f"reshard-{world}" / f"step-{i}"),
            )
            bad += compare(f"{src} -> {dst}", state, 1.0 + i)
    return bad


def writer_arguments(root: Path, world: int) -> list[str]:
    """Every FileSystemWriter argument, by keyword and by position, round trips."""
    layout = layouts(world)["1d-shard0"]
    kwargs: dict[str, Any] = {
        "single_file_per_rank": False,
        "sync_files": False,
        "thread_count": 2,
        "per_thread_copy_ahead": 0,
        "cache_staged_state_dict": False,
        "overwrite": True,
        "_extensions": None,
    }
    try:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        kwargs["serialization_format"] = SerializationFormat.SAFETENSORS
    except ImportError:  # torch releases before the argument
        pass
    writers = {
        "keywords": gpumem.dcp.StorageWriter(root / "args" / "step-1", **kwargs),
        "positional": gpumem.dcp.StorageWriter(root / "args" / "step-2", False, False, 2, 0),
    }
    bad = []
    for i, (tag, writer) in enumerate(writers.items(), start=1):
        dcp.save(dtensor_state(layout, float(i)), storage_writer=writer)
        state = empty_like(dtensor_state(layout), layout)
        reader = gpumem.dcp.StorageReader(root / "args" / f"step-{i}", _extension_registry=None)
        dcp.load(state, storage_reader=reader)
        bad += compare(tag, state, float(i))
    return bad


def _refused(save: Any) -> str:
    try:
        save()
    except CheckpointException as exc:
        return "refused" if "already exists" in str(exc) else f"other error: {exc}"
    return "written"


def overwrite(root: Path, world: int) -> list[str]:
    """overwrite=False refuses an existing checkpoint on every rank, as FileSystemWriter does,
    whether the writer names a step or only the directory; overwrite=True replaces it."""
    layout = layouts(world)["1d-shard0"]
    paths = {"gpumem step": root / "ow" / "step-3", "gpumem dir": root / "ow-dir"}
    outcomes = {}
    for kind in (*paths, "dcp"):

        def save(scale: float, ow: bool, kind: str = kind) -> None:
            if kind in paths:
                writer: Any = gpumem.dcp.StorageWriter(paths[kind], overwrite=ow)
            else:
                writer = dcp.FileSystemWriter(root / "plain-ow", overwrite=ow)
            dcp.save(dtensor_state(layout, scale), storage_writer=writer)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when overwrite=True replaces
            outcomes[kind] = [
                _refused(lambda: save(1.0, False)),
                _refused(lambda: save(2.0, False)),
                _refused(lambda: save(3.0, True)),
            ]
    bad = []
    if any(o != ["written", "refused", "written"] for o in outcomes.values()):
        bad.append(f"overwrite outcomes differ: {outcomes}")
    for kind, where in (("overwritten", root / "ow"), ("newest", root / "ow-dir")):
        state = empty_like(dtensor_state(layout), layout)
        dcp.load(state, storage_reader=gpumem.dcp.StorageReader(where))
        bad += compare(kind, state, 3.0)
    return bad


def _result(future: Any) -> None:
    staged = getattr(future, "staging_completion", None)  # torch versions that stage apart
    if staged is not None:
        staged.result()
        future = future.upload_completion
    future.result()


def async_save(root: Path, world: int) -> list[str]:
    """dcp.async_save twice through one writer (caching its staged state dict on a GPU box)."""
    layout = layouts(world)["1d-shard0"]
    side = dist.new_group(backend="gloo")  # the save's collectives run on a background thread
    # caching pins the CPU copy, which needs an accelerator (FileSystemWriter's too)
    cache = torch.cuda.is_available()
    writer = gpumem.dcp.StorageWriter(root / "async", cache_staged_state_dict=cache, keep=None)
    for scale in (1.0, 2.0):
        _result(
            dcp.async_save(dtensor_state(layout, scale), storage_writer=writer, process_group=side)
        )
    bad = []
    for step, scale in ((0, 1.0), (1, 2.0)):
        state = empty_like(dtensor_state(layout), layout)
        dcp.load(state, storage_reader=gpumem.dcp.StorageReader(root / "async" / f"step-{step}"))
        bad += compare(f"async step {step}", state, scale)
    return bad


SCENARIOS = {
    "reshard": reshard,
    "writer_arguments": writer_arguments,
    "overwrite": overwrite,
    "async_save": async_save,
}
