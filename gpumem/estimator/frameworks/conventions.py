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
              ``zero=3`` is Megatron-FSDP (``--use-megatron-fsdp``,
              ``optim_grads_params``): everything sharded over ``dp · cp``, a layer gathered
              (and the next prefetched) with its unsharded fp32 gradient. Library workspaces,
              the loss inside forward, fp8 and the pipeline splits: ``megatron.py``.
``deepspeed`` DeepSpeed ZeRO 0–3 as its code allocates (``deepspeed.py``): the IPG bucket of
              ``reduce_bucket_size`` (5e8) 16-bit elements (two with ``overlap_comm`` at
              ZeRO-1/2), the in-place all-gather (no ``allgather_bucket_size`` buffer), ZeRO-2's
              16-bit gradient partition only, the fp32 gradient partition in the step only;
              ZeRO-3 gathers a module, prefetches ``stage3_prefetch_bucket_size`` and keeps what
              is reused within ``stage3_max_reuse_distance``; offload to CPU.
``fsdp2``     PyTorch FSDP2 (``fully_shard``, ``reshard_after_forward=True``): one parameter group
              (a layer) unsharded, the next one prefetched, one group's gradients unsharded before
              their reduce-scatter. Context parallelism: all-gather of K and V (torchtitan's
              default rotate method).
``transformers`` ``Trainer``'s loop (below); buffers of the engine the layout implies.
``torchtitan`` torchtitan's Llama recipe on FSDP2 (over every data-parallel rank by default, as
              its ``dp_shard=-1`` does: ``torchtitan.titan_layout``): its modules, SAC
              policies, loss, FSDP units and float8 (torchao's Float8Linear, FSDP float8
              all-gather) (``torchtitan.py``); the peak terms are its own.
``torch``     plain DDP: ``gradient_as_bucket_view=False`` (the default) keeps a flat bucket
              buffer beside ``.grad`` for every gradient (one gradient-size copy) when more than
              one data-parallel rank reduces. Context parallelism as fsdp2.
============  =====================================================================================

A framework is also a *recipe*: how its training loop computes the loss and what it holds while
backward runs. ``transformers`` (the default for a ``config.json`` model) is the loop ``Trainer``
runs, ``loss = model(**batch, labels=labels).loss``: the model computes the loss inside forward
(``ForCausalLMLoss`` in ``transformers/loss/loss_utils.py`` upcasts the logits with
``logits.float()`` before ``cross_entropy``, so the log-probabilities are fp32 whatever the
model's dtype) and ``Trainer.compute_loss`` returns only the loss, so no logits live through
backward. Its buffers are those of the engine ``Trainer`` hands the layout to (accelerate: DDP,
FSDP2 or DeepSpeed): ``engine()``. The other frameworks' default loop holds the logits
(``logits = model(x)`` lives through backward); ``keep_logits=`` overrides either.

The default follows the model and the layout: a ``config.json`` model → ``transformers``; else
``fsdp`` set → ``fsdp2``; ``zero >= 1`` → ``deepspeed``; otherwise ``torch``.
"""

from __future__ import annotations

from gpumem.estimator.frameworks import deepspeed
from gpumem.estimator.layout import Layout

FRAMEWORKS = ("transformers", "megatron", "deepspeed", "fsdp2", "torchtitan", "torch")
# what each framework accepts, in the words of the error message
_ALLOWED = {
    "megatron": "zero 0, 1 (the distributed optimizer) or 3 (Megatron-FSDP), no fsdp",
    "deepspeed": "zero 0-3, no fsdp",
    "fsdp2": "fsdp='full' or 'hybrid' (zero 0)",
    "torchtitan": "FSDP2 over every data-parallel rank (its default dp_shard=-1: leave zero and "
    "fsdp unset, or fsdp='full'; fsdp='hybrid' for dp_replicate > 1), no ZeRO-1/2",
    "torch": "zero 0, no fsdp (plain DDP)",
    "transformers": "any layout (DDP, FSDP or DeepSpeed ZeRO under accelerate)",
}


def default_framework(layout: Layout) -> str:
    """The framework a layout implies: fsdp → fsdp2, ZeRO ≥ 1 → deepspeed, else torch."""
    if layout.fsdp:
        return "fsdp2"
    return "deepspeed" if layout.zero >= 1 else "torch"


def engine(framework: str, layout: Layout) -> str:
    """Whose communication buffers a framework's job keeps: ``transformers`` hands the layout to
    DDP, FSDP2 or DeepSpeed (``default_framework``); the others are their own engine."""
    return default_framework(layout) if framework == "transformers" else framework


def default_keep_logits(framework: str) -> bool:
    """Whether the framework's loop holds the logits through backward: not ``transformers``
    (``Trainer`` keeps only the loss) nor ``megatron`` (its model computes the loss inside
    forward and returns it) nor ``torchtitan`` (``del pred`` before backward); the generic loop
    ``logits = model(x)`` does."""
    return framework not in ("transformers", "megatron", "torchtitan")


def upcasts_logits(framework: str) -> bool:
    """The loss runs on an fp32 copy of 16-bit logits (transformers' ``logits.float()``)."""
    return framework == "transformers"


def loss_convention(framework: str, keep_logits: bool, upcast: bool = True) -> str:
    """One line for the bill's header: where the loss runs and what lives through backward
    (``upcast`` False: a transformers model whose loss keeps the logits' dtype, BERT's MLM)."""
    if framework == "transformers" and not upcast:
        where = "inside the model (model(**batch, labels=).loss), log-softmax in the logits' dtype"
        return f"{where}, logits {'held' if keep_logits else 'not held'} through backward"
    where = {
        "transformers": "inside the model (model(**batch, labels=).loss), fp32 log-softmax",
        "megatron": "inside the model (GPTModel returns the loss), fp32 softmax",
        "torchtitan": "outside the model on logits.float() (its loss_fn), pred deleted",
    }.get(framework, "outside the model (loss_fn(model(x)))")
    return f"{where}, logits {'held' if keep_logits else 'not held'} through backward"


def resolve_framework(framework: str | None, layout: Layout, hf: bool = False) -> str:
    """``framework`` checked against ``layout`` (None: ``transformers`` for a config.json model
    (``hf``), else the layout's default).

    Raises:
        ValueError: an unknown framework, or a layout it cannot run, naming what it accepts.
    """
    if framework is None:
        return "transformers" if hf else default_framework(layout)
    if not isinstance(framework, str) or framework.strip().lower() not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)} "
            "(default: transformers for a config.json model; else fsdp2 when fsdp is set, "
            "deepspeed when zero >= 1, else torch)"
        )
    fw = framework.strip().lower()
    ok = {
        "megatron": layout.zero in (0, 1, 3) and not layout.fsdp,
        "deepspeed": not layout.fsdp,
        "fsdp2": bool(layout.fsdp),
        "torchtitan": layout.zero in (0, 3),
        "torch": layout.zero == 0 and not layout.fsdp,
        "transformers": True,
    }[fw]
    if not ok:
        got = f"fsdp={layout.fsdp!r}" if layout.fsdp else f"zero={layout.zero}"
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
    zero: deepspeed.ZeroConfig | None = None,
) -> tuple[float, float]:
    """(steady, gathered) communication buffers of one rank, in bytes.

    ``steady`` lives through the whole step (buckets); ``gathered`` is a layer's unsharded
    parameters with the next one's prefetch and one layer's unsharded gradients (ZeRO-3 and
    FSDP), present through forward and backward but not in the optimizer step.

    Args:
        trainable: trainable parameters on this rank before sharding.
        layer_params: parameters of one layer on this rank before sharding.
        zero: DeepSpeed's knobs (default: its defaults).
    """
    stage = layout.stage
    replicas = layout.dp * layout.cp
    framework = engine(framework, layout)
    if framework == "deepspeed":
        return deepspeed.gpu_buffers(
            zero or deepspeed.ZeroConfig(),
            stage,
            trainable=trainable,
            layer_params=layer_params,
            weight_bytes=weight_bytes,
            grad_bytes=grad_bytes,
        )
    if framework in ("fsdp2", "megatron") and stage >= 3:
        return 0.0, layer_params * (2 * weight_bytes + grad_bytes)
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
