"""What an Inductor-compiled torchtune decoder layer saves for backward (``compile=True``).

torchtune's ``compile=True`` (``training.compile_model``) compiles each
``TransformerSelfAttentionLayer`` on its own; AOTAutograd's min-cut partitioner (the one
Inductor runs, with Inductor's decompositions) then chooses what the forward keeps. Measured at
bf16 and fp32 on six small configurations (MHA, GQA 3:1, 4:1 and 5:1, MQA) and at Llama 3.2 3B's
and 3.1 8B's widths, from the partitioned backward graph's inputs
(``tests/estimator/test_tune_compiled.py``), per token of a layer
with hidden ``h``, ``a`` heads of ``d``, ``g`` KV heads, intermediate ``f``, ``A`` bytes per
element of the compute dtype:

- the layer's input itself (``A·h``): the norm's fp32 upcast, ``x²`` and the mean are
  recomputed from it, and each norm keeps its fp32 ``rstd`` (4 B) and its scaled 16-bit output
  (``A·h``, read by q, k and v; by w1 and w3);
- q after RoPE (``A·a·d``); k after RoPE and v, expanded to every head (``A·a·d`` each) where
  the expansion is a copy (``1 < g < a``), else as ``k_proj``/``v_proj`` made them (``A·g·d``:
  MHA, and MQA, where ``flatten`` of the expanded size-1 dim is a view); SDPA's output
  (``A·a·d``) and log-sum-exp (``4·a``);
- ``output_proj``'s output (``A·h``: the second residual's addend; the sum is recomputed);
- w1's and w3's outputs and their gated product (``3·A·f``).

So ``A·(4h + 2ad + 2·kv + 3f) + 4a + 8`` bytes a token, where eager keeps the norms' fp32 inputs,
RoPE's fp32 intermediates, the unexpanded and expanded k and v, the contiguous attention
output and SiLU's output besides (Llama 3.2 3B: 98,408 B a token against eager's 145,512,
what ``hf_ops`` and torchtune's copies price).

With LoRA (torchtune's ``LoRALinear``: ``linear(x, W) + lora_b(lora_a(x)) * scaling`` on a frozen
``W``) a frozen Linear's input is not kept: each norm's output only where an adapter reads it
(q, k, v; w1, w3), the gated product only for w2's adapter, w1's and w3's outputs wherever a
gradient crosses the MLP, the attention set wherever one reaches it, the layer input and the
first norm's rstd only where the input carries a gradient, and each adapter's ``lora_a``
output (``A·r``); measured the same way with the adapters on q, v; q, v, o; and every Linear,
with and without a gradient into the layer.

Full activation checkpointing (torchtune wraps the compiled layer in ``checkpoint``) keeps the
layer input only, as eager does; the compiled set is what one layer's recomputation brings
back. Not modelled: Inductor's fused backward kernels (the layer's backward moment is eager's,
an upper bound), DoRA and QLoRA under compile (refused, see ``finetune.FineTune``: the NF4
weight's dequantization is inside the compiled region, whose partition may keep it), compile's
own workspace (autotuning, CUDA graphs: torchtune uses none).
"""

from __future__ import annotations

from gpumem.estimator.activations import Item, Workload
from gpumem.estimator.model_spec import ModelSpec

_RSTD = 4  # the norms' fp32 reciprocal RMS, one per token
_LSE = 4  # SDPA's fp32 log-sum-exp, one per token and head


def kv_width(spec: ModelSpec, t: int = 1) -> int:
    """Elements per token of the saved k (and of v): expanded to every head where torchtune's
    ``expand(...).flatten(1, 2)`` copies (``1 < g < a``), else the projections' own output."""
    a, g, d = spec.n_heads // t, max(1, spec.kv_heads // t), spec.dhead
    return a * d if 1 < g < a else g * d


ALL = frozenset(("q", "k", "v", "o", "gate", "up", "down"))
"""Every Linear of a layer trains (a full fine-tune saves what an adapter on each would read)."""


def compiled_layer_items(
    spec: ModelSpec,
    w: Workload,
    adapted: frozenset[str] = ALL,
    grad_in: bool = True,
    rank: int = 0,
) -> list[Item]:
    """The saved tensors of one compiled torchtune layer (module docstring), in forward order.

    ``adapted``: the Linears whose weights (full fine-tune: all) or LoRA adapters (``rank`` > 0)
    train; ``grad_in``: the layer's input carries a gradient. A frozen Linear's input is not
    kept, so a LoRA layer keeps the norms' outputs only where an adapter reads them, the gated
    product only for ``w2``'s adapter, and each adapter's ``lora_a`` output (``n·r``)."""
    n, A, t = w.tokens, w.compute, w.tp
    h, a, d, f = spec.hidden, spec.n_heads // t, spec.dhead, spec.dense_layer_ffn // t
    kv = kv_width(spec, t)
    g_attn = grad_in or bool(adapted & {"q", "k", "v"})
    g_mlp = g_attn or "o" in adapted
    g_act = g_mlp or bool(adapted & {"gate", "up"})
    items: list[Item] = []
    if grad_in:
        items += [Item("attn_norm.input", n * h * A), Item("attn_norm.rstd", n * _RSTD)]
    if adapted & {"q", "k", "v"}:
        items.append(Item("attn_norm.normalized", n * h * A))
    lora = [k for k in ("q", "k", "v", "o", "gate", "up", "down") if k in adapted and rank]
    items += [Item(f"{k}.lora_b.input", n * rank * A) for k in lora]
    if g_attn:
        items += [
            Item("attn.q_rope", n * a * d * A),
            Item("attn.k_rope", n * kv * A),
            Item("attn.v", n * kv * A),
            Item("attn.out", n * a * d * A, core=True),
            Item("attn.lse", n * a * _LSE, core=True),
        ]
    if g_mlp:  # the residual sum (or output_proj's output beside the kept input)
        items += [Item("mlp_norm.input", n * h * A), Item("mlp_norm.rstd", n * _RSTD)]
    if adapted & {"gate", "up"}:
        items.append(Item("mlp_norm.normalized", n * h * A))
    if g_act:
        items += [Item("mlp.gate_out", n * f * A), Item("mlp.up_out", n * f * A)]
    if "down" in adapted:
        items.append(Item("down.input", n * f * A))
    return items


def compiled_layer_bytes_per_token(spec: ModelSpec, compute: int) -> int:
    """The module docstring's formula: ``A·(4h + 2ad + 2·kv + 3f) + 4a + 8``."""
    h, a, d, f = spec.hidden, spec.n_heads, spec.dhead, spec.dense_layer_ffn
    return compute * (4 * h + 2 * a * d + 2 * kv_width(spec) + 3 * f) + _LSE * a + 2 * _RSTD


__all__ = ["ALL", "compiled_layer_bytes_per_token", "compiled_layer_items", "kv_width"]
