"""The plain restore's staging: the model's and the optimizer's tensors read into the warm
staging arena, then copied into the live tensors at the commit.

Without it every restored tensor lands in fresh host memory that the read faults in page by
page, the optimizer takes those tensors as its new state and its old state is freed: a restore
paid a pass of page faults and one of frees over the state, and held two copies of the optimizer
state at once (``benchmarks/results/calibration.md``). With it the reads land in the arena the
saves copy into (allocated and faulted in by ``prepare()``), the model's tensors and the
optimizer's state tensors that can take the bytes keep their storage and get them in one copy at
the commit, and whatever cannot is cloned out of the arena before any object sees it: nothing an
object keeps points into the arena, which the next save overwrites.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..capture.training_state import TrainingState, capture
from ..errors import CheckpointError
from ..storage.format import TensorEntry

_PAGE = 4096
SECTIONS = ("model.", "optimizer.")  # the names capture gives these sections' tensors


def live_targets(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """The live model and optimizer tensors that can take restored bytes in place (on the CPU,
    strided, contiguous, plain values), by the name a save gives them (``capture``): a fresh
    optimizer has no state yet, so a resume's optimizer state reads into fresh memory, as the
    tensors the optimizer will keep."""
    optimizer = optimizer if torch_loads(optimizer) else None
    if model is None and optimizer is None:
        return {}
    try:
        table = capture(0, TrainingState(model=model, optimizer=optimizer, rng=False)).table
    except CheckpointError:  # the objects' own state cannot be captured: no staging
        return {}
    return {
        name: t
        for name, t in zip(table.names, table.tensors, strict=True)
        if name.startswith(SECTIONS)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
        and t.numel() > 0
    }


def arena_views(
    entries: Iterable[TensorEntry],
    keep: set[str],
    live: dict[str, torch.Tensor],
    stage: Callable[[int], torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A page-aligned uint8 view of one staging buffer (``stage(n)``: the arena when it is large
    enough) for each kept tensor that a live one of its name, dtype and shape will take; the
    buffer (None: nothing to stage)."""
    wanted = [
        e
        for e in entries
        if e.name in keep
        and e.nbytes
        and (t := live.get(e.name)) is not None
        and t.dtype == e.torch_dtype
        and tuple(t.shape) == tuple(e.shape)
    ]
    offsets, total = [], 0
    for e in wanted:
        offsets.append(total)
        total += -(-e.nbytes // _PAGE) * _PAGE
    if not total:
        return {}, None
    buf = stage(total + _PAGE)
    base = -buf.data_ptr() % _PAGE
    views = {
        e.name: buf[base + off : base + off + e.nbytes]
        for e, off in zip(wanted, offsets, strict=True)
    }
    return views, buf


def optimizer_in_place(
    tree: dict[str, Any], optimizer: Any
) -> tuple[dict[str, Any], list[tuple[int, Any, torch.Tensor]]]:
    """``tree`` with each saved optimizer state tensor whose live counterpart (the same
    parameter index and key, on the CPU, of the same shape, a storage of its own) can take its
    values replaced by that live tensor, and the (index, key, staged) copies the commit makes:
    ``load_state_dict`` then keeps the live tensors (its ``.to()`` of a tensor already in place
    returns it), and the commit copies the staged values into whatever tensor it holds."""
    saved = tree.get("optimizer") if torch_loads(optimizer) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return tree, []
    live_state = optimizer.state_dict().get("state", {})
    owners: dict[int, int] = {}
    for st in live_state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                owners[ptr] = owners.get(ptr, 0) + 1
    copies: list[tuple[int, Any, torch.Tensor]] = []
    state: dict[Any, Any] = {}
    for idx, st in saved["state"].items():
        mine = live_state.get(idx)
        if not isinstance(st, dict) or not isinstance(mine, dict):
            state[idx] = st
            continue
        row = dict(st)
        for key, v in st.items():
            t = mine.get(key)
            if takes(t, v) and owners[t.untyped_storage().data_ptr()] == 1:
                row[key] = t
                copies.append((idx, key, v))
        state[idx] = row
    return {**tree, "optimizer": {**saved, "state": state}}, copies


def torch_loads(optimizer: Any) -> bool:
    """Whether ``optimizer`` saves and loads its state as ``torch.optim.Optimizer`` does (state
    by parameter index in ``param_groups``' order, ``load_state_dict`` keeping a tensor already
    in place), which the commit's copies rely on; another one loads its state as before."""
    cls, base = type(optimizer), torch.optim.Optimizer
    return (
        isinstance(optimizer, base)
        and cls.state_dict is base.state_dict
        and cls.load_state_dict is base.load_state_dict
    )


def takes(live: Any, saved: Any) -> bool:
    """Whether the live tensor can take the saved one's bytes as they are: plain, on the CPU,
    strided and contiguous, the same dtype and shape, not empty."""
    return (
        isinstance(saved, torch.Tensor)
        and isinstance(live, torch.Tensor)
        and type(live) is torch.Tensor
        and live.device.type == "cpu"
        and live.layout == torch.strided
        and live.is_contiguous()
        and not (live.is_conj() or live.is_neg())
        and live.dtype == saved.dtype
        and live.shape == saved.shape
        and live.numel() > 0
        and saved.is_contiguous()
    )


def copy_optimizer_state(optimizer: Any, copies: list[tuple[int, Any, torch.Tensor]]) -> None:
    """The commit's copies into the state tensors ``optimizer`` holds now (by parameter index, in
    ``state_dict``'s order): the live ones, or whatever its ``load_state_dict`` made of them."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for idx, key, staged in copies:
            held = optimizer.state[params[idx]][key]
            held.copy_(staged)


def clone_out(node: Any, arena: torch.Tensor | None, keep: set[int]) -> Any:
    """``node`` with every tensor that lies in ``arena`` copied out of it, except those whose
    ``id`` is in ``keep`` (the staged sides of the commit's copies, read before the next save)."""
    if arena is None:
        return node
    ptr = arena.untyped_storage().data_ptr()
    end = ptr + arena.untyped_storage().nbytes()

    def out(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            inside = x.device.type == "cpu" and x.untyped_storage().data_ptr() == ptr
            return x.clone() if inside and id(x) not in keep else x
        if hasattr(x, "__array_interface__"):  # a NumPy array decoded over staged bytes
            at = x.__array_interface__["data"][0]
            return x.copy() if ptr <= at < end else x
        if isinstance(x, dict):
            return {k: out(v) for k, v in x.items()}
        if isinstance(x, list):
            return [out(v) for v in x]
        if isinstance(x, tuple):
            return tuple(out(v) for v in x)
        return x

    return out(node)
