"""A described model's parameters as the tensors its modules register (element counts per
tensor, split by tensor parallelism): what the caching allocator rounds, one tensor at a time.

    layer_tensors(spec, tp=8)     # one transformer layer's tensors on a tp rank, in order
    outer_tensors(spec, tp=8)     # (embedding's, head's) tensors

The reference layouts (``param_count.param_groups`` counts the same parameters in parallelism
buckets): llama-style decoders register ``input_layernorm``, q/k/v/o, ``post_attention_layernorm``,
gate/up/down; gpt2-style ones ln_1, the fused ``c_attn`` (+ bias), ``c_proj``, ln_2, ``c_fc``,
``c_proj``; an MoE layer its router and each local expert's matrices (Hugging Face's grouped
experts: one gate_up and one down tensor). Other shapes (MLA, ResNet) fall back to the
layer's tensor-parallel parameters as four equal matrices plus one replicated vector.
"""

from __future__ import annotations

from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import param_groups


def layer_tensors(
    s: ModelSpec, tp: int = 1, ep: int = 1, etp: int = 1, moe: bool = False
) -> tuple[int, ...]:
    """Element counts of one layer's parameter tensors on one tensor-parallel rank."""
    h, a, g, d = s.hidden, s.n_heads, s.kv_heads, s.dhead
    q, kv = a * d // tp, g * d // min(tp, max(g, 1))
    if s.arch not in ("llama", "gpt2", "vit") or s.is_mla or not a:
        pg = param_groups(s)
        per = (pg.layer_tp + pg.layer_expert / max(ep * etp, 1)) / tp / 4
        return (*(int(per),) * 4, pg.layer_rep) if per else ()
    if s.arch == "llama":
        out = [h] * (s.norms_per_layer // 2)
        out += [h * q, h * kv, h * kv]
        if s.qkv_bias:
            out += [q, kv, kv]
        if s.qk_norm:
            out += [d, d]
        out += [q * h] + [h] * (s.norms_per_layer - s.norms_per_layer // 2)
    else:  # gpt2 / vit: ln_1, c_attn (+ bias), c_proj (+ bias), ln_2
        out = [h, h, h * (q + 2 * kv)] + ([q + 2 * kv] if s.has_bias else [])
        out += [q * h] + ([h] if s.has_bias else []) + [h, h]
    if moe and s.is_moe:
        out.append(h * s.n_experts)  # the router
        local, f = max(1, s.n_experts // ep), s.moe_ffn // etp
        if s.is_hf:  # transformers' grouped experts: one 3-D gate_up, one down
            out += [local * 2 * h * f, local * f * h]
        else:
            out += [h * f, h * f, f * h] * local if s.gated else [h * f, f * h] * local
        if s.n_shared_experts:
            out += [h * s.shared_ffn // tp] * (3 if s.gated else 2)
        return tuple(out)
    f = s.dense_layer_ffn // tp
    if s.gated:
        out += [h * f, h * f, f * h]
    else:
        out += [h * f] + ([f] if s.has_bias else []) + [f * h] + ([h] if s.has_bias else [])
    return tuple(out)


def outer_tensors(s: ModelSpec, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the embedding's tensors, the head's: final norm and an untied LM head) on one rank."""
    pg = param_groups(s)
    embed = tuple(n for n in (pg.embed_tp // tp, pg.embed_rep) if n)
    head = tuple(n for n in (pg.head_rep, pg.head_tp // tp) if n)
    return embed, head


__all__ = ["layer_tensors", "outer_tensors"]
