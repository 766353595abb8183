"""The peak terms every model shares, whatever describes it (preset, config or ``nn.Module``).

The preset path (``preset.py``) and the module path (``module_pass.py``) each measure or model a
model's own terms (activations, the widest backward moment); this module fills in the rest the
same way for both: layers per pipeline stage, in-flight micro-batches, whether gradients
persist, state bytes and sharding, the optimizer step's temporaries, ZeRO/FSDP buffers and the
CUDA reserve. ``peak.assemble`` turns the terms into the bill's categories.
"""

from __future__ import annotations

from gpumem.estimator import peak
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.states import Training

RECOMPUTE = ("none", "selective", "full")
DEEPSPEED_BUCKET = 500_000_000  # reduce_bucket_size / allgather_bucket_size default (elements)


def split_layers(n_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; the remainder of an uneven split goes to the first stages."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def grads_persist(layout: Layout, grad_accum: int, persistent_grads: bool | None) -> bool:
    """Whether gradient buffers live across steps: given, or when distributed or accumulating
    (a plain single-GPU ``zero_grad(set_to_none=True)`` frees them)."""
    if persistent_grads is None:
        return grad_accum > 1 or layout.n_gpus > 1
    return persistent_grads


def inflight(layout: Layout, grad_accum: int, stage: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at the start of backward (1F1B:
    ``pp - stage``, at most the micro-batches per step; interleaving adds ``(pp-1)/(pp·vpp)``)."""
    pp = layout.pp
    interleave = 1 + (pp - 1) / (pp * layout.vpp) if layout.vpp > 1 else 1.0
    return (min(grad_accum, pp - stage) if pp > 1 else 1) * interleave


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
) -> None:
    """Fill the peak terms every model shares: state bytes and sharding, the optimizer step's
    temporaries, ZeRO/FSDP communication buffers, and the CUDA reserve.

    Args:
        trainable: trainable parameters on this rank before ZeRO sharding.
        layer_params: parameters of one layer (what ZeRO-3/FSDP gathers at once).
        scratch: elements a per-tensor optimizer step holds at once.
    """
    x[peak.W_BYTES], x[peak.W_FROZEN_BYTES] = tr.weight_bytes, tr.frozen_weight_bytes
    x[peak.G_BYTES], x[peak.O_BYTES] = tr.grad_bytes, tr.optimizer_bytes
    x[peak.N_SHARD] = layout.shard_degree(gpu.gpus_per_node)
    x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node, expert=True)
    x[peak.STAGE] = layout.stage
    opt_shard = x[peak.N_SHARD] if layout.stage >= 1 else 1
    x[peak.T_STEP] = tr.step_temp_bytes(int(trainable / opt_shard), int(scratch), cuda)
    if layout.stage >= 3:  # all-gather of a layer + prefetch of the next, reduce-scatter
        x[peak.GATHER] = layer_params * (2 * tr.weight_bytes + tr.grad_bytes)
    elif layout.stage in (1, 2):  # DeepSpeed's reduce and all-gather buckets
        x[peak.COMM] = min(DEEPSPEED_BUCKET, trainable) * (tr.grad_bytes + tr.weight_bytes)
    x[peak.G_PERSIST] = 1.0 if persist else 0.0
    if cuda:
        x[peak.CONTEXT] = gpu.context_bytes
        x[peak.NCCL] = gpu.nccl_bytes if layout.n_gpus > 1 else 0
        x[peak.FRAG] = gpu.fragmentation
    x[peak.OFFLOAD] = 1.0 if tr.offload_optimizer else 0.0


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
