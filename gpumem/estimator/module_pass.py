"""The fake-tensor pass behind ``gpumem.estimate(nn.Module)``, and the peak terms it yields.

Two passes run on a fake copy of the module (``module_inputs.fake_copy``), both at the real
micro-batch
(fake tensors cost no memory, so there is nothing to extrapolate):

1. a *structure* forward (no profile): which modules run before, inside and after the blocks,
   a block's input and output sizes, the output the loop holds, and (for tensor parallelism)
   which saved tensors have the residual stream's size;
2. a *profiled* forward, loss and backward under ``gpumem.profile``: saved activations per
   module and the widest moment of the pass with its categories.

See ``module_estimate.py`` for what each measured number becomes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from gpumem.estimator import peak
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.module_inputs import fake_copy, make_inputs, weight_dtype
from gpumem.estimator.module_structure import (
    BLOCK,
    POST,
    PRE,
    ModuleSpec,
    count_params,
    find_blocks,
    step_scratch,
)
from gpumem.estimator.states import Training, param_mix
from gpumem.estimator.terms import (
    grads_persist,
    inflight,
    job_terms,
    own_dtype_states,
    split_layers,
)
from gpumem.profiler.categories import TEMPORARY
from gpumem.profiler.fake import cuda_kernels_on_cpu

_CUDA_BLOCK = 512  # the caching allocator's granularity, as the profiler counts CUDA storages


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy over the last dimension (language models and classifiers alike), a scalar
    output as the loss itself, a ``.loss`` attribute (Hugging Face) when present, else the mean
    squared error against zeros."""
    held = held_output(output)
    if held is None:
        raise ValueError(
            f"the module returned {type(output).__name__} with no tensor in it: pass loss_fn= "
            "(output -> scalar tensor)"
        )
    if getattr(output, "loss", None) is not None:
        return output.loss
    if held.dim() == 0:
        return held
    if held.is_floating_point() and held.dim() >= 2:
        return F.cross_entropy(held.reshape(-1, held.shape[-1]), target.reshape(-1))
    return F.mse_loss(held.float(), target)


def held_output(output: Any) -> torch.Tensor | None:
    """The tensor a training loop keeps from the forward (the logits)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, torch.Tensor):
                return o
    if isinstance(output, dict):
        for o in output.values():
            if isinstance(o, torch.Tensor):
                return o
    return None


def _target_for(held: torch.Tensor | None) -> torch.Tensor | None:
    if held is None or held.dim() == 0:
        return None
    if held.is_floating_point() and held.dim() >= 2:
        return torch.zeros(held.shape[:-1], dtype=torch.long, device=held.device)
    return torch.zeros(held.shape, dtype=torch.float32, device=held.device)


def _storage_ids(tensors: Any) -> set[int]:
    out = set()
    for t in tensors:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            out.add(id(t.untyped_storage()))
    return out


def _nbytes(t: torch.Tensor, device: str) -> int:
    n = t.untyped_storage().nbytes()
    return -(-n // _CUDA_BLOCK) * _CUDA_BLOCK if device == "cuda" else n


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under ``torch.utils.checkpoint`` (full recompute)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _structure(net, blocks, args, kwargs, run: str, autocast, loss_fn, keep_logits):
    """The structure forward: call order, block sizes, held output, saved-tensor split."""
    order: dict[str, int] = {}
    io: dict[str, int] = {}
    where = [PRE]
    block_set = set(blocks)
    skip = _storage_ids([*net.parameters(), *net.buffers(), *_leaves(args), *_leaves(kwargs)])
    seen: set[int] = set()
    keep: list[Any] = []
    saved = {r: [0, 0] for r in (PRE, BLOCK, POST)}  # region -> [all bytes, residual-sized bytes]

    def pre_hook(name):
        def hook(mod, a, k=None):
            order.setdefault(name, len(order))
            if name in block_set:
                where[0] = BLOCK
                t = _first_tensor(a) if a else _first_tensor(tuple((k or {}).values()))
                if t is not None and "resid" not in io:
                    io["resid"] = t.numel()

        return hook

    def post_hook(name):
        def hook(mod, a, out):
            if name in block_set:
                where[0] = POST
                t = _first_tensor(out)
                if t is not None and "out" not in io:
                    io["out"] = _nbytes(t, run)

        return hook

    def pack(t):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if id(st) not in skip and id(st) not in seen:
            seen.add(id(st))
            keep.append(st)
            acc = saved[where[0]]
            acc[0] += _nbytes(t, run)
            if t.numel() == io.get("resid", -1):
                acc[1] += _nbytes(t, run)
        return t

    handles = []
    for name, mod in net.named_modules():
        handles.append(mod.register_forward_pre_hook(pre_hook(name)))
        if name in block_set:
            handles.append(mod.register_forward_hook(post_hook(name)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            out = net(*args, **kwargs)
            held = held_output(out)
            target = _target_for(held)
            (loss_fn(out) if loss_fn else default_loss(out, target))
    finally:
        for h in handles:
            h.remove()
    held_bytes = _nbytes(held, run) if (held is not None and held.dim() and keep_logits) else 0
    return order, io, saved, held_bytes, target


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _leaves(o)]
    return []


def measure(
    module: torch.nn.Module,
    training: Training,
    *,
    example_input: Any,
    batch: int,
    seq: int | None,
    device: str,
    recompute: str,
    keep_logits: bool,
    loss_fn: Any,
) -> ModuleSpec:
    """Count ``module``'s parameters and measure one fake training pass of a copy of it.

    The pass runs on fake CUDA tensors where a GPU is present and on fake CPU tensors otherwise
    (PyTorch builds without CUDA cannot run autograd on fake CUDA tensors); only the 512-byte
    rounding of CUDA storages differs, so the terms are the same up to that rounding.
    """
    from gpumem import profiler

    if not any(True for _ in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameters: there is nothing to train; pass the "
            "module that owns the parameters (or a preset / config for a model by name)"
        )
    blocks = find_blocks(module)
    run = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = weight_dtype(training)
    amp = torch.float16 if training.precision.startswith("fp16") else torch.bfloat16

    def autocast():
        return torch.autocast(run, dtype=amp) if training.autocast else contextlib.nullcontext()

    own = own_trainable_bytes(module)
    # a CUDA job priced on the CPU: CUDA autocast's fp32 ops and dropout's bool mask
    on_cpu = contextlib.nullcontext()
    if device == "cuda" and run == "cpu":
        on_cpu = cuda_kernels_on_cpu()
    with profiler.fake(device=run if run == "cuda" else None), on_cpu:
        net = fake_copy(module, run, None if own else dtype)
        args, kwargs = make_inputs(module, example_input, batch, seq, run)
        order, io, saved, held, target = _structure(
            net, blocks, args, kwargs, run, autocast, loss_fn, keep_logits
        )
        if recompute in ("full", "every-1"):
            for name in blocks:
                parent, _, child = name.rpartition(".")
                owner = net.get_submodule(parent) if parent else net
                setattr(owner, child, _Checkpointed(owner.get_submodule(child)))
        with profiler.profile(net) as prof:
            with autocast():
                out = net(*args, **kwargs)
                loss = loss_fn(out) if loss_fn else default_loss(out, target)
                # autocast's cached 16-bit weight copies that nothing saved (checkpointed
                # blocks): alive until the autocast region ends, with the forward's end
                casts = prof.tracker.by_category[TEMPORARY] if training.autocast else 0
            if not keep_logits:
                del out
            loss.backward()
        rep = prof.report()
        log = prof.tracker.alloc_log or []
    spec = _spec(module, training, blocks, order, io, saved, held, rep, own)
    spec.casts = casts
    from gpumem.profiler.reserved import log_events

    spec.alloc_events = tuple((ev[1], ev[2] if ev[0] == "alloc" else -1) for ev in log_events(log))
    seen: set[int] = set()
    numels = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            numels.append(p.numel())
    spec.trainable_numels = tuple(numels)
    return spec


def _muon_split(module, in_block) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is a hidden matrix) of every trainable parameter, tied ones once: the matrices
    of the repeated blocks are hidden (Muon's standard split); without blocks, every 2-D
    parameter but an embedding's."""
    seen: set[int] = set()
    out = []
    for mod_name, mod in module.named_modules():
        for p in mod.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if in_block is not None:
                hidden = in_block(mod_name)
            else:
                hidden = not isinstance(mod, torch.nn.Embedding)
            out.append((tuple(p.shape), hidden))
    return out


def own_trainable_bytes(module: Any) -> int:
    """Bytes per element of the trainable parameters when they are in another floating dtype
    than the frozen ones (PEFT's fp32 adapters on a 16-bit base: the copy keeps every dtype
    as built), else 0 (the copy takes the precision's dtype, as ``module.to(dtype)``)."""
    train = {p.dtype for p in module.parameters() if p.requires_grad and p.is_floating_point()}
    frozen = {p.dtype for p in module.parameters() if not p.requires_grad and p.is_floating_point()}
    if len(train) != 1 or not frozen or train == frozen:
        return 0
    return next(iter(train)).itemsize


def _spec(module, training, blocks, order, io, saved, held, rep, own=0) -> ModuleSpec:
    """Turn the two passes into a ModuleSpec (see ``module_estimate.py`` for the mapping)."""
    block_pos = [order[b] for b in blocks if b in order]
    first = min(block_pos) if block_pos else -1
    last = max(
        (order[n] for n in order if any(n == b or n.startswith(b + ".") for b in blocks)),
        default=-1,
    )
    if not blocks:  # no repeated blocks: everything is the first stage's
        first = last = max(order.values(), default=0) + 1
    regions, n_params, n_train, tied, largest = count_params(module, blocks, order, first, last)
    layers = rep.layers

    def act(name: str) -> int:
        return layers[name].activations if name in layers else 0

    def in_block(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in blocks)

    acts = {PRE: 0.0, BLOCK: 0.0, POST: 0.0}
    for name, mod in module.named_modules():
        if in_block(name):
            continue
        direct = act(name) - sum(act(f"{name}.{c}" if name else c) for c, _ in mod.named_children())
        if name == "" or (order.get(name, -1) > last and blocks):
            acts[POST] += direct
        else:
            acts[PRE] += direct
    acts[BLOCK] = sum(act(b) for b in blocks) / max(len(blocks), 1)
    at = rep.at_peak
    w, g, a, t, i = (
        at.get(k) or 0 for k in ("weights", "gradients", "activations", "temporary", "inputs")
    )
    a_all = act("")
    spec = ModuleSpec(
        name=type(module).__name__,
        n_params=n_params,
        n_trainable=n_train,
        blocks=blocks,
        regions=regions,
        acts=acts,
        inputs=i,
        held=held,
        block_out=io.get("out", 0),
        peak_bytes=rep.peak_bytes,
        residual_elems=io.get("resid", 0),
        tied_pre_post=tied,
        scratch=step_scratch(module),
        block_params=largest,
        tp_split={r: (1.0 - s[1] / s[0]) if s[0] else 1.0 for r, s in saved.items()},
    )
    spec.mix = param_mix(_muon_split(module, in_block if blocks else None))
    spec.trainable_bytes = own
    total = [sum(s[k] for s in saved.values()) for k in (0, 1)]
    spec.tp_split["all"] = 1.0 - total[1] / total[0] if total[0] else 1.0
    if g == 0:  # no parameter gradient yet: the start of backward (or the forward)
        spec.moment = "start"
        spec.t_start = max(0.0, rep.peak_bytes - w - a_all - i - held)
    else:
        spec.moment = "end"
        spec.pend_params = max(0.0, n_train - g / (own or training.weight_bytes))
        spec.a_end = a - acts[PRE]
        spec.t_end = t - held
    return spec


def module_terms(
    ms: ModuleSpec,
    tr: Training,
    layout: Layout,
    gpu: GPU,
    cuda: bool,
    grad_accum: int,
    persistent_grads: bool | None,
    framework: str = "torch",
) -> list[list[float]]:
    """Peak terms of every pipeline rank (as ``PresetTerms.terms`` for presets)."""
    t, sp, pp = layout.tp, layout.sp, layout.pp
    persist = grads_persist(layout, grad_accum, persistent_grads)
    R = ms.regions
    layers = split_layers(ms.n_blocks, pp)
    f_all = ms.act_scale("all", t, sp)
    resid = 1.0 / t if sp else 1.0  # the residual stream: split only by sequence parallelism
    # share of the trainable parameters one TP rank holds (scales the pending gradients)
    on_rank = ms.n_blocks * R[BLOCK].trainable(t) + R[PRE].trainable(t) + R[POST].trainable(t)
    tp_ratio = on_rank / ms.n_trainable if ms.n_trainable else 1.0
    out = []
    for i in range(pp):
        is_first, is_last = i == 0, i == pp - 1
        n_l = layers[i]
        ends = [r for r, on in ((PRE, is_first), (POST, is_last)) if on]
        p_train = n_l * R[BLOCK].trainable(t) + sum(R[r].trainable(t) for r in ends)
        p_frozen = n_l * R[BLOCK].frozen(t) + sum(R[r].frozen(t) for r in ends)
        if is_last and pp > 1:
            p_train += ms.tied_pre_post / t  # Megatron keeps a copy of tied embeddings at the end
        x = [0.0] * peak.N_TERMS
        x[peak.P_TRAIN], x[peak.P_FROZEN] = p_train, p_frozen
        x[peak.W_BUFFERS] = n_l * R[BLOCK].buffers + sum(R[r].buffers for r in ends)
        x[peak.A_LAYER], x[peak.N_LAYERS] = ms.acts[BLOCK] * ms.act_scale(BLOCK, t, sp), n_l
        x[peak.INFLIGHT] = inflight(layout, grad_accum, i)
        held = ms.held / t  # logits are vocab-parallel under TP
        if is_first:
            x[peak.A_FIRST] = ms.acts[PRE] * ms.act_scale(PRE, t, sp) + ms.inputs
            x[peak.IDS] = ms.inputs
        if is_last:
            x[peak.A_LAST] = ms.acts[POST] * ms.act_scale(POST, t, sp) + held
            x[peak.HELD] = held
        grad_in = ms.block_out * resid  # what a non-last stage receives from the next one
        # the forward's end: autocast's unsaved weight copies, of this stage's blocks
        x[peak.CASTS] = ms.casts * f_all * (n_l / ms.n_blocks if ms.n_blocks else 1.0)
        if ms.moment == "start":
            x[peak.T_BWD0] = ms.t_start * f_all if is_last else grad_in
        else:
            x[peak.T_BWD0] = 0.0 if is_last else grad_in
            x[peak.T_LAYER] = ms.t_end * f_all
            x[peak.A_END] = ms.a_end * f_all
            if not persist:
                x[peak.P_PEND] = min(ms.pend_params * tp_ratio, p_train)
        job_terms(
            x,
            tr,
            layout,
            gpu,
            cuda,
            trainable=p_train,
            layer_params=ms.block_params / t,
            scratch=ms.scratch / t,
            persist=persist,
            framework=framework,
            mix=ms.mix,
        )
        if ms.trainable_bytes:  # PEFT's fp32 adapters: their states in their own dtype
            own_dtype_states(x, tr, ms.trainable_bytes, ms.scratch / t, cuda)
        out.append(x)
    return out
