"""DTensor state (FSDP2, tensor parallel, HSDP, 2-D meshes) as blocks of global tensors.

A DTensor's local shard is one *box* of its global tensor: an offset and a size per dimension
(torch's ``compute_local_shape_and_global_offset``, the function DCP uses, ``_StridedShard``
included). A checkpoint records each written box with the global shape, the mesh and the
placements; the box and the row-major order of the stored bytes say which global byte ranges a
data file holds, so any other layout can be read back from the boxes that overlap it.

Replicas are written once: a rank writes its box only if its coordinate is 0 on every mesh
dimension whose placement is ``Replicate`` (HSDP's replica groups, TP-replicated norms). A
``Partial`` DTensor holds no values of its own (they are a pending reduction) and is refused.
Sharded state needs the torch release in which ``fully_shard`` is public (2.6); older ones are
refused with that message.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointStateError
from .boxes import Box, Mesh

MIN_TORCH = (2, 6)


@dataclass(frozen=True)
class LocalBlock:
    """This rank's block of a DTensor: its box, mesh and placements, and whether this rank is
    the one that writes the box (the first replica)."""

    box: Box
    mesh: Mesh
    placements: tuple[str, ...]
    writer: bool

    def text(self) -> str:
        return f"{self.box.text()} placed ({', '.join(self.placements)}) on mesh {self.mesh.shape}"


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def sharding_supported() -> bool:
    return torch_version() >= MIN_TORCH


def require_sharding(what: str) -> None:
    if not sharding_supported():
        raise CheckpointStateError(
            f"{what}: DTensor (FSDP2 / tensor parallel) state needs torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (where fully_shard is public); this is torch "
            f"{torch.__version__}. Upgrade torch, or save plain tensors"
        )


def dtensor_type() -> type | None:
    """torch's DTensor class, or None where torch.distributed lacks it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes: a DTensor's local shard (no autograd, no copy) or
    ``t`` itself."""
    if is_dtensor(t):
        return t._local_tensor  # what to_local() returns outside autograd, without the dispatch
    return t


def placement_name(p: Any) -> str:
    """``S(d)`` shard on dim d, ``SS(d,k)`` strided shard with split factor k, ``R`` replicate,
    ``P(op)`` partial."""
    kind = type(p).__name__
    if kind == "_StridedShard":
        return f"SS({p.dim},{p.split_factor})"
    if kind == "Shard":
        return f"S({p.dim})"
    if kind == "Replicate":
        return "R"
    if kind in ("Partial", "_Partial", "_NormPartial", "MaskPartial"):
        return f"P({getattr(p, 'reduce_op', '?')})"
    return kind


def describe(t: torch.Tensor, path: str) -> LocalBlock:
    """The layout of the DTensor ``t`` (captured under ``path``) on this rank.

    Raises:
        CheckpointStateError: torch too old, a Partial placement, or this rank is not on the
            DTensor's mesh.
    """
    require_sharding(path)
    mesh = t.device_mesh
    placements = tuple(t.placements)
    global_shape = tuple(int(d) for d in t.shape)
    # a save or restore asks this for every tensor, and torch computes a mesh's rank table
    # anew on each access (~1 ms): the answer depends only on these, so it is computed once
    key = (mesh, placements, global_shape)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = _layout(mesh, placements, global_shape, path)
    local = t._local_tensor
    if tuple(local.shape) != layout.box.shape:
        raise CheckpointStateError(
            f"{path}: the local shard has shape {tuple(local.shape)}, its placements "
            f"({', '.join(layout.placements)}) give {layout.box.shape}; this DTensor layout "
            "is not supported"
        )
    return layout


_LAYOUTS: dict[tuple, LocalBlock] = {}


def _layout(mesh: Any, placements: tuple, global_shape: tuple[int, ...], path: str) -> LocalBlock:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = tuple(placement_name(p) for p in placements)
    if any(n.startswith("P(") for n in names):
        raise CheckpointStateError(
            f"{path}: a Partial DTensor ({', '.join(names)}) holds a pending reduction, not "
            "values; call .redistribute() to Replicate or Shard placements before saving"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise CheckpointStateError(f"{path}: this rank is not on the DTensor's device mesh")
    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    writer = all(c == 0 for c, n in zip(coord, names, strict=True) if n == "R")
    dim_names = mesh.mesh_dim_names
    table = mesh.mesh
    return LocalBlock(
        Box(global_shape, tuple(int(o) for o in offsets), tuple(int(s) for s in shape)),
        Mesh(
            tuple(int(s) for s in table.shape),
            tuple(str(n) for n in dim_names) if dim_names else None,
            tuple(int(r) for r in table.flatten().tolist()),
        ),
        names,
        writer,
    )


def target_box(t: torch.Tensor) -> tuple[Box, LocalBlock | None]:
    """The box a restore must fill for ``t``: its local shard for a DTensor, all of it for a
    plain tensor."""
    if is_dtensor(t):
        layout = describe(t, "restore target")
        return layout.box, layout
    return Box.full(tuple(int(d) for d in t.shape)), None


# ---------------------------------------------------------------------------------------------
# box geometry
