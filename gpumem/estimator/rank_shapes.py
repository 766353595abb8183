"""A described model's pipeline rank as the tensors its step allocates (``step_trace``'s
shapes), from the rank's peak terms and the layer's saved ``Item``s; and the rank's simulated
fragmentation, the term ``peak.FRAG_BYTES``.

``preset.PresetTerms.terms`` calls :func:`fill_fragmentation` per rank when an alloc conf is
set. Sizes come from the same places as the analytical bill: per-parameter tensors from
``param_tensors`` times the bytes per parameter of each state, divided by the ZeRO/FSDP shard
degree; saved tensors from the activation rules of the layer's kind (the stage's majority
kind in an MoE); the backward and step temporaries as the one tensor each the bill counts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator import peak
from gpumem.estimator.frameworks.conventions import engine
from gpumem.estimator.layout import Layout
from gpumem.estimator.param_tensors import layer_tensors, outer_tensors
from gpumem.estimator.step_trace import StatesShape, StepShape, frag_bytes
from gpumem.estimator.terms import recompute_every


def fill_fragmentation(
    pt: Any,  # a preset.PresetTerms (not imported: preset imports this module)
    conf: AllocConf,
    x: list[float],
    layout: Layout,
    batch: int,
    recompute: str,
    *,
    first: bool,
    last: bool,
    moe: bool,
) -> None:
    """Set ``x[peak.FRAG_BYTES]`` and ``x[peak.RESERVED_FRAG]`` to the rank's simulated
    fragmentation (``step_trace.frag_bytes``), and drop the flat share ``x[peak.FRAG]`` they
    replace."""
    n = int(x[peak.N_LAYERS])
    states = states_shape(pt, x, layout, first=first, last=last, moe=moe)
    step = step_shape(pt, x, layout, batch, recompute, first=first, last=last, moe=moe)
    unreleasable, reserved = frag_bytes(conf, states, step, n)
    x[peak.FRAG_BYTES], x[peak.RESERVED_FRAG] = float(unreleasable), float(reserved)
    if not pt.cuda:  # a CPU run has no caching allocator: reserved is reported, not billed
        x[peak.FRAG_BYTES] = 0.0
    x[peak.FRAG] = 0.0


def _degrees(x: list[float]) -> tuple[float, float, float]:
    """Shard degrees of (weights, gradients, optimizer state) under the rank's ZeRO stage."""
    stage, n = x[peak.STAGE], x[peak.N_SHARD]
    return (n if stage >= 3 else 1.0), (n if stage >= 2 else 1.0), (n if stage >= 1 else 1.0)


def _tensors(pt: Any, layout: Layout, moe: bool) -> tuple[int, ...]:
    cache = pt.__dict__.setdefault("_tensor_cache", {})
    key = (layout.tp, layout.ep, layout.expert_tp, moe)
    if key not in cache:
        cache[key] = layer_tensors(pt.spec, layout.tp, layout.ep, layout.expert_tp, moe)
    return cache[key]


def states_shape(
    pt: Any, x: list[float], layout: Layout, *, first: bool, last: bool, moe: bool
) -> StatesShape:
    """Weights per tensor, persistent gradients and optimizer states per tensor or flat."""
    tr = pt.training
    nw, ng, no = _degrees(x)
    tensors = _tensors(pt, layout, moe)
    embed, head = outer_tensors(pt.spec, layout.tp)
    outer_params = (embed if first else ()) + (head if last else ())
    lora = bool(tr.lora_rank)
    wb = x[peak.W_FROZEN_BYTES] if lora else x[peak.W_BYTES]
    gb, ob = x[peak.G_BYTES], 0.0 if x[peak.OFFLOAD] else x[peak.O_BYTES]
    persist = x[peak.G_PERSIST] > 0
    k = max(1, round(ob / 4))  # fp32 states: master weights, exp_avg, exp_avg_sq, ...
    # Megatron's distributed optimizer and DeepSpeed keep flat per-rank buffers
    flat = engine(pt.framework, layout) in ("megatron", "deepspeed") and x[peak.STAGE] >= 1
    flat = flat or pt.framework == "megatron" or lora

    def per_tensor(sizes: tuple[int, ...]) -> list[int]:
        out = [int(n * wb / nw) for n in sizes]
        if not flat:
            out += [int(n * gb / ng) for n in sizes] if persist else []
            out += [int(n * ob / k / no) for n in sizes for _ in range(k)] if ob else []
        return out

    layer = tuple(s for s in per_tensor(tensors) if s)
    outer = [s for s in per_tensor(outer_params) if s]
    if flat:  # one buffer per state of everything the rank trains
        trained = x[peak.P_TRAIN] + x[peak.P_EXP_TRAIN]
        outer += [int(trained * gb / ng)] if persist else []
        outer += [int(trained * ob / k / no)] * k if ob else []
    outer += [int(v) for v in (x[peak.COMM], x[peak.W_BUFFERS]) if v]
    return StatesShape(layer, tuple(outer))


def step_shape(
    pt: Any,
    x: list[float],
    layout: Layout,
    batch: int,
    recompute: str,
    *,
    first: bool,
    last: bool,
    moe: bool,
) -> StepShape:
    """The saved tensors of a layer under the recompute policy, and the rank's transients."""
    saved, recomputed = _saved(pt, layout, batch, recompute, moe, x[peak.A_LAYER])
    grads: tuple[int, ...] = ()
    if x[peak.G_PERSIST] == 0 and not pt.training.lora_rank:
        ng = _degrees(x)[1]
        grads = tuple(int(n * x[peak.G_BYTES] / ng) for n in _tensors(pt, layout, moe))
    return StepShape(
        saved=saved,
        recomputed=recomputed,
        grads=tuple(g for g in grads if g),
        gather=int(x[peak.GATHER]),
        t_layer=int(x[peak.T_LAYER]),
        t_start=int(x[peak.T_BWD0]),
        t_step=int(x[peak.T_STEP]),
        first=int(x[peak.A_FIRST]) if first else 0,
        last=int(x[peak.A_LAST] + x[peak.CASTS]) if last else 0,
        held=max(0.0, x[peak.INFLIGHT] - 1.0),
    )


def _saved(
    pt: Any, layout: Layout, batch: int, recompute: str, moe: bool, a_layer: float
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(saved, recomputed) tensors of one layer, cached per workload."""
    lay = layout
    key = (lay.tp, lay.sp, lay.cp, lay.ep, lay.expert_tp, batch, recompute, moe)
    cache = pt.__dict__.setdefault("_saved_cache", {})
    if key in cache:
        return cache[key]
    spec = pt.spec
    items = []
    if pt.activation_model == "ops" and (spec.is_decoder or spec.arch == "vit"):
        w = pt.workload(layout, batch, dense=not moe)
        if recompute != "none" and spec.is_hf:  # transformers' checkpointing: no KV cache
            w = replace(w, kv_cache=False)
        items = pt._items(w)
    every = recompute_every(recompute)
    if not items:  # no itemised rule (Korthikanti's model, ResNet): the layer as one tensor
        out: tuple[tuple[int, ...], tuple[int, ...]] = ((int(a_layer),) if a_layer else (), ())
    elif every:  # the block input is saved; the layer's tensors come back in its backward
        full = tuple(i.nbytes for i in items if i.nbytes)
        out = ((int(a_layer),) if a_layer else (), full)
    elif recompute == "selective":
        out = (tuple(i.nbytes for i in items if i.nbytes and not i.core), ())
    else:
        out = (tuple(i.nbytes for i in items if i.nbytes), ())
    cache[key] = out
    return out


__all__ = ["fill_fragmentation", "states_shape", "step_shape"]
