"""What torch.distributed sharding looks like to the profiler: FSDP2 units, their buffers, and
the collective ops.

FSDP2 (``fully_shard``) keeps a unit's parameters sharded (DTensors) between uses. Before the
unit's forward and backward an ``FSDPParamGroup`` all-gathers them into flat buffers and copies
them into the unsharded parameters, whose storages it keeps for the whole run and resizes to 0
when it reshards; after the unit's backward it copies the unsharded gradients into a
reduce-scatter buffer whose output becomes the sharded gradient. Tensor parallelism (DTensor)
redistributes through functional collectives (``_c10d_functional``), whose outputs are new
tensors.

Nothing here imports FSDP or DTensor: a model can only be sharded after torch has loaded them,
so their classes are looked up in ``sys.modules`` (``import gpumem`` stays cheap, and an unsharded
model never pays for the check). The names read from FSDP's objects are the ones
``torch.distributed._tools.fsdp2_mem_tracker`` reads too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

_FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"
_DTENSOR_MODULE = "torch.distributed.tensor._api"
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})

GROUP_CALLS = ("unshard", "wait_for_unshard", "reshard", "post_backward")
"""The ``FSDPParamGroup`` methods during which FSDP gathers, frees or reduces: what they create is
communication. FSDP calls each through the instance (also for prefetching and from its final
backward callback), so an instance attribute wraps every call."""

GATHERS = ("unshard", "wait_for_unshard")


class Unit(NamedTuple):
    """One ``fully_shard`` unit: what gathers, reshards and reduces its parameters together."""

    fqn: str
    """The unit's module (its first, when sharded from several at once)."""
    module: torch.nn.Module
    group: Any
    """Its ``FSDPParamGroup``."""


def fsdp_units(model: torch.nn.Module, fqn_of: dict[int, str]) -> list[Unit]:
    """Every ``fully_shard`` unit with parameters in ``model``; ``fqn_of`` names modules by id."""
    mod = sys.modules.get(_FSDP_MODULE)
    if mod is None:
        return []
    out: list[Unit] = []
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, mod.FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                out.append(Unit(fqn_of.get(id(m), ""), m, group))
    return out


def final_callback_pending(units: list[Unit]) -> bool:
    """Whether FSDP's end-of-backward callback (the last reshards and reduce-scatters) is queued
    with autograd's engine and has not run yet."""
    return any(
        u.module._get_fsdp_state()._state_ctx.post_backward_final_callback_queued for u in units
    )


def unsharded_storages(group: Any) -> Iterator[torch.Tensor]:
    """The storages of the unit's unsharded parameters: FSDP's all-gather outputs, created at
    the unit's first gather and kept for the whole run (resized between 0 and full size)."""
    for p in group.fsdp_params:
        yield from p.all_gather_outputs
        yield from getattr(p, "_unsharded_inner_tensors", ())


def post_forward_shards(group: Any) -> Iterator[torch.Tensor]:
    """The shards FSDP keeps between forward and backward with an integer
    ``reshard_after_forward`` (none otherwise)."""
    for p in group.fsdp_params:
        shard = getattr(p, "_sharded_post_forward_param_data", None)
        if shard is not None:
            yield shard


def unsharded_params(group: Any) -> Iterator[torch.Tensor]:
    """The unit's unsharded parameters (created at its first gather, then kept)."""
    for p in group.fsdp_params:
        param = getattr(p, "_unsharded_param", None)
        if param is not None and param.requires_grad:
            yield param


def unsharded_grads(group: Any) -> Iterator[torch.Tensor]:
    """Gradients of the unit's unsharded parameters, waiting for their reduce-scatter."""
    for p in group.fsdp_params:
        param = getattr(p, "_unsharded_param", None)
        if param is not None and param.grad is not None:
            yield param.grad
        acc = getattr(p, "unsharded_accumulated_grad", None)
        if acc is not None:
            yield acc


def comm_allocators(group: Any) -> list[Any]:
    """The objects whose ``allocate`` creates the unit's all-gather output and its
    reduce-scatter input and output buffers."""
    return [c for c in (group._all_gather_comm, group._reduce_scatter_comm) if c is not None]


PROPAGATES = "_propagate_tensor_meta_non_cached"
"""The ``ShardingPropagator`` method that runs an op on fake tensors to learn a DTensor op's
output shapes. In a real run they belong to a fake mode of their own and no tracker counts them;
under ``gpumem.fake()`` DTensor borrows the active fake mode, so they must be left out."""


def dtensor_propagator() -> Any | None:
    """DTensor's sharding propagator (one per process), when DTensor is loaded."""
    api = sys.modules.get(_DTENSOR_MODULE)
    return None if api is None else api.DTensor._op_dispatcher.sharding_propagator


_COLLECTIVE: dict[Any, bool] = {}


def is_collective(func: Any) -> bool:
    """Whether an op is a torch.distributed collective (c10d or functional collectives)."""
    c = _COLLECTIVE.get(func)
    if c is None:
        c = _COLLECTIVE[func] = getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES
    return c


_DTENSOR_TYPE: dict[type, bool] = {}


def has_dtensor(types: Any) -> bool:
    """Whether a dispatch involves DTensors. A dispatch mode that lets DTensor run first (by
    returning ``NotImplemented``) sees the local ops it runs, temporaries and collectives
    included, instead of only the DTensor that comes out."""
    for t in types:
        d = _DTENSOR_TYPE.get(t)
        if d is None:
            api = sys.modules.get(_DTENSOR_MODULE)
            d = _DTENSOR_TYPE[t] = api is not None and issubclass(t, api.DTensor)
        if d:
            return True
    return False
