"""Which training framework's buffer conventions a bill follows, and what its buffers cost.

The same layout costs different memory under different frameworks, because each keeps its own
communication buffers (the bill's ``communication`` category, the profiler's name for the same
memory):

============  =====================================================================================
framework     conventions (sources in docs/estimator.md)
============  =====================================================================================
``megatron``  Megatron-core: a contiguous fp32 main-grad buffer (``grads="fp32"`` by default, bf16
              training accumulates and reduces in fp32); ``zero=1`` is the distributed optimizer
              (fp32 master weights and Adam state sharded over ``dp · cp``, grads not sharded);
              gradient reduce-scatter and parameter all-gather run in place in the grad and
              parameter buffers, so there are no extra buckets; the master step reads fp32 grads
              (no ``.float()`` copies). Context parallelism: ring (p2p) KV exchange.
``deepspeed`` DeepSpeed ZeRO 0–3: ZeRO-1/2 keep ``reduce_bucket_size`` and
              ``allgather_bucket_size`` (default 5e8 elements each) of gradient and parameter
              buckets; ZeRO-3 gathers a layer, prefetches the next and reduce-scatters a layer's
              gradients.
``fsdp2``     PyTorch FSDP2 (``fully_shard``, ``reshard_after_forward=True``): one parameter group
              (a layer) unsharded, the next one prefetched, one group's gradients unsharded before
              their reduce-scatter. Context parallelism: all-gather of K and V (torchtitan's
              default rotate method).
``torchtitan`` torchtitan's Llama recipe on FSDP2: its modules, SAC policies, loss and FSDP units
              (``torchtitan.py``); the peak terms are its own.
``torch``     plain DDP: ``gradient_as_bucket_view=False`` (the default) keeps a flat bucket
              buffer beside ``.grad`` for every gradient (one gradient-size copy) when more than
              one data-parallel rank reduces. Context parallelism as fsdp2.
============  =====================================================================================

The default follows the layout: ``fsdp`` set → ``fsdp2``; ``zero >= 1`` → ``deepspeed``; otherwise
``torch``.
"""

from __future__ import annotations

from gpumem.estimator.layout import Layout

FRAMEWORKS = ("megatron", "deepspeed", "fsdp2", "torchtitan", "torch")
DEEPSPEED_BUCKET = 500_000_000  # reduce_bucket_size / allgather_bucket_size default (elements)
# what each framework accepts, in the words of the error message
_ALLOWED = {
    "megatron": "zero 0 or 1 (1 = the distributed optimizer), no fsdp",
    "deepspeed": "zero 0-3, no fsdp",
    "fsdp2": "fsdp='full' or 'hybrid' (zero 0)",
    "torchtitan": "fsdp='full' or 'hybrid' (zero 0), no pp",
    "torch": "zero 0, no fsdp (plain DDP)",
}


def default_framework(layout: Layout) -> str:
    """The framework a layout implies: fsdp → fsdp2, ZeRO ≥ 1 → deepspeed, else torch."""
    if layout.fsdp:
        return "fsdp2"
    return "deepspeed" if layout.zero >= 1 else "torch"


def resolve_framework(framework: str | None, layout: Layout) -> str:
    """``framework`` checked against ``layout`` (None: the layout's default).

    Raises:
        ValueError: an unknown framework, or a layout it cannot run, naming what it accepts.
    """
    if framework is None:
        return default_framework(layout)
    if not isinstance(framework, str) or framework.strip().lower() not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)} "
            "(default: fsdp2 when fsdp is set, deepspeed when zero >= 1, else torch)"
        )
    fw = framework.strip().lower()
    ok = {
        "megatron": layout.zero in (0, 1) and not layout.fsdp,
        "deepspeed": not layout.fsdp,
        "fsdp2": bool(layout.fsdp),
        "torchtitan": bool(layout.fsdp) and layout.pp == 1,
        "torch": layout.zero == 0 and not layout.fsdp,
    }[fw]
    if not ok:
        got = f"fsdp={layout.fsdp!r}" if layout.fsdp else f"zero={layout.zero}"
        if fw == "torchtitan" and layout.fsdp:
            got = f"pp={layout.pp}"
        raise ValueError(
            f"framework={fw!r} does not run {got}: {fw} takes {_ALLOWED[fw]}; "
            f"for {got} use framework={default_framework(layout)!r}"
        )
    return fw


def default_fused_ops(framework: str) -> tuple[str, ...]:
    """The fused kernels a framework runs by default: Megatron-core with Transformer Engine
    fuses the norms, SwiGLU (``bias_swiglu_fusion``) and RoPE (``apply_rope_fusion``); its
    cross-entropy fusion is off by default. The others run PyTorch's unfused ops."""
    return ("norm", "swiglu", "rope") if framework == "megatron" else ()


def default_grads(framework: str, master_weights: bool) -> str:
    """The gradient storage a framework keeps under mixed precision (see ``states.GRADS``):
    Megatron's fp32 main-grad buffer; DeepSpeed's and torch's 16-bit ``.grad``."""
    return "fp32" if framework == "megatron" and master_weights else "compute"


def communication_bytes(
    framework: str,
    layout: Layout,
    *,
    trainable: float,
    layer_params: float,
    weight_bytes: float,
    grad_bytes: float,
) -> tuple[float, float]:
    """(steady, gathered) communication buffers of one rank, in bytes.

    ``steady`` lives through the whole step (buckets); ``gathered`` is a layer's unsharded
    parameters with the next one's prefetch and one layer's unsharded gradients (ZeRO-3 and
    FSDP), present through forward and backward but not in the optimizer step.

    Args:
        trainable: trainable parameters on this rank before sharding.
        layer_params: parameters of one layer on this rank before sharding.
    """
    stage = layout.stage
    replicas = layout.dp * layout.cp
    if framework in ("deepspeed", "fsdp2") and stage >= 3:
        return 0.0, layer_params * (2 * weight_bytes + grad_bytes)
    if framework == "deepspeed" and stage in (1, 2):
        return min(DEEPSPEED_BUCKET, trainable) * (grad_bytes + weight_bytes), 0.0
    if framework == "torch" and replicas > 1:
        return trainable * grad_bytes, 0.0
    return 0.0, 0.0


def cp_exchange_bytes(framework: str, cp: int, tokens: int, kv_width: int, nbytes: int) -> float:
    """KV exchange buffers of context-parallel attention for one layer (forward or backward).

    Ring / p2p (Megatron, Transformer Engine): the K and V chunk being computed on and the one
    arriving, double-buffered: 2 · 2 · local tokens · kv width. All-gather (torchtitan): the
    whole sequence's K and V gathered: 2 · cp · local tokens · kv width.

    Args:
        tokens: tokens of one micro-batch on this rank (already divided by cp).
        kv_width: K (= V) width per token on this rank (kv heads · head dim).
    """
    if cp <= 1:
        return 0.0
    if framework == "megatron":
        return float(2 * 2 * tokens * kv_width * nbytes)
    return float(2 * cp * tokens * kv_width * nbytes)
