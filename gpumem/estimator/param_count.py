"""Exact parameter counts of a described model, split the way parallelism splits them.

Counts are exact sums over the tensors the reference implementations create, so presets
reproduce the published counts (Llama-2-70B: 68,976,648,192); and of an ``nn.Module``, tied
tensors once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Spec = Any
"""A ``model_spec.ModelSpec`` (that module counts through this one, so no import back)."""

MLM_ENCODERS = ("bert", "roberta")
"""config.json families built as ``*ForMaskedLM`` encoders on GPT-2's shapes."""


@dataclass(frozen=True)
class ParamGroups:
    """Parameter counts split the way parallelism splits them (Megatron's buckets).

    Per transformer layer: ``layer_tp`` is sharded by tensor parallelism (attention and MLP
    matrices), ``layer_rep`` replicated (norms, row-parallel biases), ``layer_expert`` the routed
    experts (sharded by expert parallelism, then by TP). Outside the layers: ``embed`` (input
    embedding + learned positions, vocab-parallel under TP: ``embed_tp``), ``head`` (final norm and
    an untied LM head; the head matrix ``head_tp`` is vocab-parallel). ``largest_tensor`` is the
    largest single parameter; ``step_scratch`` the elements a per-tensor optimizer step holds
    at once (see :func:`_step_scratch`).
    """

    n_layers: int
    layer_tp: int
    layer_rep: int
    layer_expert: int
    embed_tp: int
    embed_rep: int
    head_tp: int
    head_rep: int
    largest_tensor: int
    step_scratch: int = 0
    n_dense: int = 0  # an MoE's first dense layers (layer_* describe the MoE layers)
    dense_tp: int = 0
    dense_rep: int = 0
    mtp: int = 0  # the MTP layers (Megatron's multi-token prediction, on the last stage)

    @property
    def per_layer(self) -> int:
        return self.layer_tp + self.layer_rep + self.layer_expert

    @property
    def total(self) -> int:
        return (
            (self.n_layers - self.n_dense) * self.per_layer
            + self.n_dense * (self.dense_tp + self.dense_rep)
            + self.embed_tp
            + self.embed_rep
            + self.head_tp
            + self.head_rep
            + self.mtp
        )


def attention_params(s: Spec) -> tuple[int, int]:
    """(tensor-parallel, replicated) parameters of one layer's attention and its norms."""
    h, a, g, d = s.hidden, s.n_heads, s.kv_heads, s.dhead
    q, kv = a * d, g * d
    rep = s.norms_per_layer * h if s.arch == "llama" else 4 * h
    if s.is_mla:  # down projections (and their norms) replicate, as in Megatron's MLA
        qk = s.qk_nope_dim + s.qk_rope_dim
        if s.q_lora_rank:
            rep += h * s.q_lora_rank + s.q_lora_rank
            tp = s.q_lora_rank * a * qk
        else:
            tp = h * a * qk
        rep += h * (s.kv_lora_rank + s.qk_rope_dim) + s.kv_lora_rank
        tp += s.kv_lora_rank * a * (s.qk_nope_dim + s.v_head_dim) + a * s.v_head_dim * h
        return tp, rep
    if s.arch == "llama":  # bias-free projections (Qwen2: biased q/k/v)
        tp = h * (q + 2 * kv) + (q + 2 * kv if s.qkv_bias else 0) + q * h
        if s.qk_norm:
            rep += 2 * d
        return tp, rep
    # gpt2 / vit: biased qkv and out; the row-parallel out bias replicates
    if not s.has_bias:
        return h * (q + 2 * kv) + q * h, rep
    return h * (q + 2 * kv) + (q + 2 * kv) + q * h, rep + h


def mlp_params(s: Spec, f: int) -> tuple[int, int]:
    """(tensor-parallel, replicated) parameters of one MLP of intermediate size ``f``."""
    if s.gated:
        return 3 * s.hidden * f + (2 * f if s.bias else 0), s.hidden if s.bias else 0
    if not s.has_bias:
        return 2 * s.hidden * f, 0
    return s.hidden * f + f + f * s.hidden, s.hidden


def param_groups(s: Spec) -> ParamGroups:
    """Exact parameter counts of the reference implementation of ``s``, in parallelism buckets."""
    if s.arch == "resnet":
        return _resnet_groups(s)
    h, a, g, d = s.hidden, s.n_heads, s.kv_heads, s.dhead
    q, kv = a * d, g * d
    attn_tp, attn_rep = attention_params(s)
    dense_tp, dense_rep = mlp_params(s, s.dense_layer_ffn)
    largest = max(h * (q + 2 * kv), h * s.dense_layer_ffn, s.vocab * h)
    if s.is_moe:  # routed experts (EP-sharded), a replicated router, TP-split shared experts
        e_tp, e_rep = mlp_params(s, s.moe_ffn)
        expert = s.n_experts * (e_tp + e_rep)
        shared_tp = mlp_params(s, s.shared_ffn)[0] if s.n_shared_experts else 0
        tp_layer = attn_tp + shared_tp
        rep = attn_rep + h * s.n_experts + (h if s.shared_gate else 0)
        # Hugging Face stores all experts of a layer in one 3-D gate_up tensor
        largest = max(largest, (s.n_experts if s.is_hf else 1) * 2 * h * s.moe_ffn)
    else:
        tp_layer, expert, rep = attn_tp + dense_tp, 0, attn_rep + dense_rep
    n_dense = s.n_dense_layers if s.is_moe else 0
    if s.arch == "llama":
        embed_tp, embed_rep = s.vocab * h, 0
        head_rep = h  # final RMSNorm
        head_tp = 0 if s.tied_embeddings else s.vocab * h
    elif s.family in MLM_ENCODERS:  # + token types and the embedding LayerNorm (no ln_f);
        # the MLM head: dense, LayerNorm and the decoder's bias (its weight tied)
        embed_tp = s.vocab * h
        embed_rep = ((s.position_rows or s.max_seq) + s.type_vocab) * h + 2 * h
        head_rep = h * h + h + 2 * h + s.vocab
        head_tp = 0 if s.tied_embeddings else s.vocab * h
        if s.encoder_head:  # a classifier (after the pooler's dense), no MLM head
            head_rep = (h * h + h if s.encoder_head == "seq_cls" else 0) + (h + 1) * s.n_labels
            head_tp = 0
    elif s.arch == "gpt2":
        embed_tp, embed_rep = s.vocab * h, s.max_seq * h
        head_rep = 2 * h
        head_tp = 0 if s.tied_embeddings else s.vocab * h
    else:  # vit: conv patch embedding + class token + positions; LN + classifier head
        embed_tp = 0
        embed_rep = s.channels * s.patch * s.patch * h + h + h + s.n_tokens_per_sample * h
        head_rep = 2 * h + h * s.n_classes + s.n_classes
        head_tp = 0
        largest = max(h * (q + 2 * kv), h * s.ffn, h * s.n_classes)
    mtp = 0
    if s.mtp_layers:  # per layer: eh_proj (2h x h), three norms and a layer of the last kind
        last_dense = s.is_dense_layer(s.n_layers - 1)
        layer = attn_tp + dense_tp + attn_rep + dense_rep if last_dense else tp_layer + rep + expert
        norm = h if s.norm == "rmsnorm" else 2 * h
        mtp = s.mtp_layers * (2 * h * h + 3 * norm + layer)
    return ParamGroups(
        n_layers=s.n_layers,
        layer_tp=tp_layer,
        layer_rep=rep,
        layer_expert=expert,
        embed_tp=embed_tp,
        embed_rep=embed_rep,
        head_tp=head_tp,
        head_rep=head_rep,
        largest_tensor=largest,
        step_scratch=_step_scratch(s, largest),
        n_dense=n_dense,
        dense_tp=attn_tp + dense_tp,
        dense_rep=attn_rep + dense_rep,
        mtp=mtp,
    )


def _step_scratch(s: Spec, largest: int) -> int:
    """Elements torch's per-tensor Adam holds at once: ``sqrt(v)`` and its quotient for one
    parameter while the Python name ``denom`` still holds the previous parameter's quotient
    (measured on CPU), so the maximum over consecutive parameters of prev + 2 x current, in the
    registration order of the reference implementations (separate q/k/v, biases after weights).
    """
    h, f, v = s.hidden, s.ffn, s.vocab
    q, kv = s.n_heads * s.dhead, s.kv_heads * s.dhead
    if s.arch == "llama":  # q after the norm, k after q, v after k, o after v; gate, up, down
        c = [
            h + 2 * h * q,
            h * q + 2 * h * kv,
            h * kv + 2 * h * kv,
            h * kv + 2 * q * h,
            3 * h * f,
            2 * v * h,
        ]
        c.append(0 if s.tied_embeddings else h + 2 * v * h)
    elif s.arch == "gpt2":  # each weight follows a bias (or a norm's bias)
        c = [
            h + 2 * h * q,
            q + 2 * h * kv,
            kv + 2 * h * kv,
            kv + 2 * q * h,
            h + 2 * h * f,
            f + 2 * f * h,
            2 * v * h,
            v * h + 2 * s.max_seq * h,
        ]
        c.append(0 if s.tied_embeddings else 2 * h + 2 * v * h)
    else:  # vision: a bound, the largest tensor after one as large
        return 3 * largest
    return max(c)


def resnet_stages(s: Spec) -> list[tuple[int, int, int, int]]:
    """(in_channels, mid_channels, out_channels, stride) of every bottleneck block, in order."""
    out, cin = [], s.width
    for i, n in enumerate(s.blocks):
        mid = s.width * 2**i
        for j in range(n):
            out.append((cin, mid, mid * 4, 2 if (j == 0 and i > 0) else 1))
            cin = mid * 4
    return out


def _resnet_groups(s: Spec) -> ParamGroups:
    """torchvision's ResNet (v1.5): bias-free convs, BatchNorm weight+bias, fc with bias."""
    total = s.channels * 49 * s.width + 2 * s.width  # 7x7 stem conv + bn
    largest = 0
    for cin, mid, cout, stride in resnet_stages(s):
        convs = cin * mid + 9 * mid * mid + mid * cout
        bns = 2 * (mid + mid + cout)
        if stride != 1 or cin != cout:
            convs += cin * cout
            bns += 2 * cout
        total += convs + bns
        largest = max(largest, 9 * mid * mid)
    cfinal = s.width * 2 ** (len(s.blocks) - 1) * 4
    fc = cfinal * s.n_classes + s.n_classes
    big = max(largest, cfinal * s.n_classes)
    return ParamGroups(0, 0, 0, 0, 0, total, 0, fc, big, 3 * big)


def module_param_count(module: Any) -> tuple[int, int]:
    """(total, trainable) parameters of an ``nn.Module``, shared (tied) tensors counted once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in module.parameters():
        key = id(p)
        if key in seen:
            continue
        seen.add(key)
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
