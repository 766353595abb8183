"""The peak terms every model shares, whatever describes it (preset, config or ``nn.Module``).

The preset path (``preset.py``) and the module path (``module_pass.py``) each measure or model a
model's own terms (activations, the widest backward moment); this module fills in the rest the
same way for both: layers per pipeline stage, in-flight micro-batches, whether gradients
persist, state bytes and sharding, the optimizer step's temporaries, ZeRO/FSDP buffers and the
CUDA reserve. ``peak.assemble`` turns the terms into the bill's categories.
"""

from __future__ import annotations

import functools

from gpumem.estimator import peak
from gpumem.estimator.frameworks import deepspeed
from gpumem.estimator.frameworks.conventions import communication_bytes, engine
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.states import ParamMix, Training

RECOMPUTE = ("none", "selective", "full")


def split_layers(n_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; the remainder of an uneven split goes to the first stages."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


@functools.lru_cache(maxsize=256)
def stage_chunks(n_layers: int, pp: int, vpp: int = 1) -> list[list[range]]:
    """The layers each pipeline rank holds, as ranges of layer indices (lazy: a billion layers
    cost nothing): one contiguous block per rank (``split_layers``), or under interleaving
    ``vpp`` chunks per rank assigned round robin (rank r holds chunks r, r + pp, ...), as
    Megatron does."""
    if vpp == 1:
        out, start = [], 0
        for n in split_layers(n_layers, pp):
            out.append([range(start, start + n)])
            start += n
        return out
    chunk = n_layers // (pp * vpp)
    return [[range(c * chunk, (c + 1) * chunk) for c in range(r, pp * vpp, pp)] for r in range(pp)]


def grads_persist(layout: Layout, grad_accum: int, persistent_grads: bool | None) -> bool:
    """Whether gradient buffers live across steps: given, or when distributed or accumulating
    (a plain single-GPU ``zero_grad(set_to_none=True)`` frees them)."""
    if persistent_grads is None:
        return grad_accum > 1 or layout.n_gpus > 1
    return persistent_grads


def inflight(layout: Layout, grad_accum: int, stage: int) -> float:
    """Micro-batches' worth of a stage's activations that pipeline rank ``stage`` holds when its
    first backward starts, in units of the whole stage (all its virtual chunks).

    Megatron-core's schedules (``schedules.py``): 1F1B runs ``pp - stage - 1`` warm-up forwards,
    so ``pp - stage`` micro-batches are in flight; the interleaved schedule runs
    ``(pp - stage - 1) · 2 + (vpp - 1) · pp`` warm-up forwards of model chunks (each
    ``1/vpp`` of the stage), so ``that + 1`` chunks are in flight. Both are capped by the
    micro-batches (chunks) of the step. Rank 0 of the interleaved schedule gives Korthikanti's
    ``1 + (pp-1)/(pp·vpp)`` factor; the last rank holds ``((vpp-1)·pp + 1)/vpp`` stages' worth,
    not 1F1B's single micro-batch.
    """
    pp, v = layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    if v == 1:
        return float(min(grad_accum, pp - stage))
    chunks = (pp - stage - 1) * 2 + (v - 1) * pp + 1
    return min(chunks, grad_accum * v) / v


def job_terms(
    x: list[float],
    tr: Training,
    layout: Layout,
    gpu: GPU,
    cuda: bool,
    *,
    trainable: float,
    layer_params: float,
    scratch: float,
    persist: bool,
    framework: str,
    layer_comm: float = 0.0,
    mix: ParamMix | None = None,
) -> None:
    """Fill the peak terms every model shares: state bytes and sharding, the optimizer step's
    temporaries, the framework's communication buffers, and the CUDA reserve.

    Args:
        trainable: trainable parameters on this rank before ZeRO sharding.
        layer_params: parameters of one layer (what ZeRO-3/FSDP gathers at once).
        scratch: elements a per-tensor optimizer step holds at once.
        framework: whose buffer conventions (``frameworks/conventions.py``).
        layer_comm: per-layer communication buffers of forward and backward besides sharding
            (context parallelism's KV exchange, MoE token dispatch).
        mix: how the trainable parameters split into matrices (Muon, Adafactor).
    """
    x[peak.W_BYTES], x[peak.W_FROZEN_BYTES] = tr.weight_bytes, tr.frozen_weight_bytes
    x[peak.G_BYTES], x[peak.O_BYTES] = tr.grad_bytes, tr.optimizer_bytes_for(mix or ParamMix())
    x[peak.N_SHARD] = layout.shard_degree(gpu.gpus_per_node)
    x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node, expert=True)
    x[peak.STAGE] = layout.stage
    opt_shard = x[peak.N_SHARD] if layout.stage >= 1 else 1
    x[peak.T_STEP] = tr.step_temp_bytes(int(trainable / opt_shard), int(scratch), cuda, mix)
    sharded = opt_shard > 1 or bool(layout.fsdp)
    x[peak.T_STEP] += muon_gather_bytes(tr, mix) if sharded else 0
    steady, gathered = communication_bytes(
        framework,
        layout,
        trainable=trainable,
        layer_params=layer_params,
        weight_bytes=tr.weight_bytes,
        grad_bytes=tr.grad_bytes,
        zero=tr.deepspeed,
    )
    x[peak.COMM], x[peak.GATHER] = steady, gathered + layer_comm
    x[peak.G_PERSIST] = 1.0 if persist else 0.0
    if cuda:
        x[peak.CONTEXT] = gpu.context_bytes
        x[peak.NCCL] = gpu.nccl_bytes if layout.n_gpus > 1 else 0
        x[peak.FRAG] = gpu.fragmentation
    x[peak.OFFLOAD] = 1.0 if tr.offload_optimizer else 0.0
    if engine(framework, layout) == "deepspeed" and layout.stage >= 1:
        deepspeed_states(x, tr, trainable / opt_shard, mix)


def muon_gather_bytes(tr: Training, mix: ParamMix | None) -> float:
    """A sharded Muon's gather: each matrix's full fp32 gradient for Newton–Schulz, one matrix
    at a time (Moonlight's distributed Muon gathers the owner's matrix over the DP group;
    DeepSpeed all-reduces Muon's gradients instead of reduce-scattering them)."""
    if tr.optimizer != "muon" or mix is None:
        return 0.0
    return float(mix.largest[0] * mix.largest[1] * 4)


def deepspeed_states(x: list[float], tr: Training, shard: float, mix: ParamMix | None) -> None:
    """DeepSpeed ZeRO's own state placement (``frameworks/deepspeed.py``): the step's fp32 gradient
    partition and its flattened 16-bit source replace torch.optim's temporaries (DeepSpeed steps
    a fused Adam on the flat partition); offloading the optimizer moves master weights, state,
    and every gradient partition to the host (the GPU keeps the IPG bucket) and the step to the
    CPU; ``offload_param`` (ZeRO-3) moves the 16-bit partitions too.

    ZeRO-1's step frees the other ranks' gradients (``free_grad_in_param_list``) before it makes
    the fp32 partition; the step moment counts every gradient, so the partition's bytes are
    billed only beyond that freed room: exact for dp = 2, an upper bound by
    ``2Ψ - 8Ψ/N`` beyond (2.66 GiB for t5-3b on 8 GPUs)."""
    zero = tr.deepspeed or deepspeed.ZeroConfig()
    stage = int(x[peak.STAGE])
    x[peak.T_STEP] = deepspeed.step_bytes(zero, stage, shard, tr.master_bytes > 0)
    if tr.optimizer == "muon" and mix is not None and mix.largest[0]:
        x[peak.T_STEP] += tr.muon_step_bytes(*mix.largest) + muon_gather_bytes(tr, mix)
    if stage == 1:
        freed = (shard * x[peak.N_SHARD] - shard) * x[peak.G_BYTES]
        x[peak.T_STEP] = max(0.0, x[peak.T_STEP] - freed)
    if tr.offload_optimizer or zero.offload_optimizer == "cpu":
        x[peak.OFFLOAD] = 1.0
        x[peak.T_STEP] = 0.0
        if stage >= 2:  # ZeRO-1 keeps every 16-bit .grad until the boundary, offload or not
            x[peak.G_BYTES] = 0.0
    if (tr.offload_param or zero.offload_param == "cpu") and stage >= 3:
        x[peak.W_BYTES] = x[peak.W_FROZEN_BYTES] = 0.0


def offload_host_bytes(x: list[float], tr: Training, gpus_per_node: int) -> int:
    """Pinned host memory per node that offloading needs (0 without), from a rank's terms: one
    rule for every spelling (``offload_optimizer=True``, ``--offload-optimizer``, DeepSpeed's
    ``offload_optimizer: cpu`` / ``{"device": "cpu"}``, ``offload_param``) and both paths (a
    described model, an ``nn.Module``): ``deepspeed.host_bytes`` for the rank's optimizer
    partition (``P_TRAIN`` over the shard degree when ZeRO/FSDP shards the state, its experts
    over theirs), times the node's GPUs. Without DeepSpeed the host holds the same: the fp32
    master and optimizer state, the fp32 gradients the CPU step reads and the 16-bit weights
    it writes back."""
    if not (tr.offload_optimizer or tr.offload_param):
        return 0
    cfg = deepspeed.ZeroConfig(
        offload_optimizer="cpu" if tr.offload_optimizer else "none",
        offload_param="cpu" if tr.offload_param else "none",
    )
    stage = int(x[peak.STAGE])
    host = 0
    for params, shard in ((x[peak.P_TRAIN], peak.N_SHARD), (x[peak.P_EXP_TRAIN], peak.N_SHARD_EXP)):
        host += deepspeed.host_bytes(
            cfg,
            stage,
            trainable=params,
            n_shard=int(x[shard]) if stage >= 1 else 1,
            gpus_per_node=gpus_per_node,
            state_bytes=x[peak.O_BYTES],
            weight_bytes=tr.weight_bytes,
        )
    return host


def own_dtype_states(x: list[float], tr: Training, nbytes: int, scratch: float, cuda: bool) -> None:
    """Trainable parameters kept in a dtype of their own (``nbytes`` per element: PEFT's fp32
    adapters on a 16-bit base): their weights, gradients, optimizer state (as fp32 training's)
    and the step's temporaries, in place of the precision's (after ``job_terms``)."""
    if nbytes == tr.weight_bytes:
        return
    own = Training("fp32" if nbytes == 4 else tr.precision, tr.optimizer, foreach=tr.foreach,
                   fused=tr.fused)  # fmt: skip
    x[peak.W_BYTES] = x[peak.G_BYTES] = float(nbytes)
    x[peak.O_BYTES] = own.optimizer_bytes
    x[peak.T_STEP] = own.step_temp_bytes(int(x[peak.P_TRAIN]), int(scratch), cuda)


def cluster_states(tr: Training, trainable: float, frozen: float) -> int:
    """Unique weights + gradients + optimizer state of a job (no sharding, no replicas)."""
    return int(
        trainable * (tr.weight_bytes + tr.grad_bytes + tr.optimizer_bytes)
        + frozen * tr.frozen_weight_bytes
    )


def recompute_every(recompute: str) -> int:
    """K of a recompute policy: 1 for ``full``, K for ``every-K``, 0 for ``none``/``selective``."""
    if recompute in RECOMPUTE:
        return 1 if recompute == "full" else 0
    if recompute.startswith("every-"):
        try:
            k = int(recompute[6:])
        except ValueError:
            k = 0
        if k > 0:
            return k
    raise ValueError(
        f"unknown recompute {recompute!r}; use none, selective, full or every-K (K >= 1)"
    )


def steady_states(x) -> dict[str, int]:
    """Weights / gradients / optimizer per GPU with every gradient present (the ZeRO paper's
    accounting), independent of which phase peaks."""
    y = list(x)
    y[peak.G_PERSIST] = 1.0
    for k in (
        peak.A_LAYER,
        peak.A_FIRST,
        peak.A_LAST,
        peak.T_BWD0,
        peak.A_GONE,
        peak.G_START,
        peak.T_LAYER,
        peak.T_STEP,
        peak.A_END,
        peak.G_WALK,
        peak.P_PEND,
        peak.P_PEND_EXP,
        peak.HELD,
        peak.IDS,
        peak.GATHER,
        peak.CASTS,
        peak.COMM,
        peak.CONTEXT,
        peak.NCCL,
        peak.FRAG,
        peak.FRAG_BYTES,
        peak.RESERVED_FRAG,
    ):
        y[k] = 0.0
    w, g, o = peak.assemble(y)[:3]
    return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}


def model_states(
    n_params: int, training: Training, layout: Layout, gpus_per_node: int = 8
) -> dict[str, int]:
    """Per-GPU weights / gradients / optimizer of ``n_params`` dense parameters under ``layout``
    (data parallel and ZeRO only; the ZeRO paper's Figure 1 accounting). Same formula as
    ``gpumem.estimate``, without a model shape."""
    x = [0.0] * peak.N_TERMS
    x[peak.P_TRAIN] = n_params / (layout.tp * layout.pp)
    x[peak.W_BYTES], x[peak.G_BYTES], x[peak.O_BYTES] = (
        training.weight_bytes,
        training.grad_bytes,
        training.optimizer_bytes,
    )
    x[peak.N_SHARD] = x[peak.N_SHARD_EXP] = layout.shard_degree(gpus_per_node)
    x[peak.STAGE] = layout.stage
    x[peak.OFFLOAD] = 1.0 if training.offload_optimizer else 0.0
    return steady_states(x)
