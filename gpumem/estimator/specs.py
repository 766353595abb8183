"""What a model is, for the estimator: its shape (``ModelSpec``), built-in presets, Hugging Face
``config.json`` parsing, and exact parameter counts.

A spec describes a decoder transformer (GPT-2 or Llama family, dense or MoE), a ViT, or a ResNet
(bottleneck). Parameter counts are exact sums over the tensors the reference implementations
create, so presets reproduce the published counts (Llama-2-70B: 68,976,648,192).

Example:
    >>> spec = resolve_model("llama-2-70b")
    >>> spec.n_params
    68976648192
    >>> spec = resolve_model("path/to/config.json")   # or a directory holding one
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Arch = Literal["gpt2", "llama", "vit", "resnet"]
MLP_ACTS = ("", "gelu", "swiglu", "geglu", "squared_relu")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model, enough to count its parameters and what autograd saves.

    Example:
        >>> ModelSpec(name="tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
        ...           ffn=128, vocab=256).n_params
    """

    name: str
    arch: Arch
    n_layers: int
    hidden: int = 0
    n_heads: int = 0
    n_kv_heads: int | None = None  # None: = n_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden // n_heads
    ffn: int = 0  # MLP intermediate size (per expert for MoE)
    vocab: int = 0
    max_seq: int = 2048  # learned position table size (gpt2, vit); default context otherwise
    tied_embeddings: bool = False
    qkv_bias: bool = False
    n_experts: int = 0  # 0: dense MLP
    top_k: int = 0
    # MoE structure (Qwen2-MoE, DeepSeek-V2/V3): dense first layers, shared experts
    first_k_dense: int = 0  # the first k layers keep a dense MLP of dense_ffn
    dense_ffn: int = 0  # 0: = ffn
    n_shared_experts: int = 0
    shared_ffn: int = 0  # intermediate size of all shared experts together
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(h, 1)) scales the shared expert
    # multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank > 0 turns it on
    q_lora_rank: int = 0  # 0: a plain q projection
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # implementation conventions: "" = gpumem.models (the reference modules), "hf" = Hugging Face
    # transformers (config.json); family = the config's model_type
    impl: str = ""
    family: str = ""
    norms_per_layer: int = 2  # Gemma2/3: pre- and post-norms around attention and MLP
    qk_norm: bool = False  # Qwen3 / Gemma3: RMSNorm of q and k per head
    # Gemma2: transformers runs eager attention (SDPA cannot soft-cap), the scores soft-capped
    # (tanh) and the logits too
    eager_attention: bool = False
    attn_softcap: bool = False
    logit_softcap: bool = False
    mlp_act: str = ""  # "" (the arch's: gelu / swiglu), "geglu" (Gemma: gelu_tanh(gate) * up),
    # or set explicitly: "gelu", "swiglu", "squared_relu" (Megatron's --swiglu / --squared-relu)
    bias: bool | None = None  # Linear biases (None: the arch's; Megatron --disable-bias-linear)
    # which layers are MoE, one 0/1 per layer (Megatron --moe-layer-freq, transformers'
    # mlp_only_layers / decoder_sparse_step); empty: all but the first_k_dense
    moe_layer_freq: tuple[int, ...] = ()
    mtp_layers: int = 0  # multi-token prediction layers after the last stage (DeepSeek-V3 MTP)
    pdrop: float = 0.0  # GPT-2's resid/embd/attn dropout from config.json
    # vision
    image_size: int = 224
    patch: int = 16
    channels: int = 3
    n_classes: int = 1000
    blocks: tuple[int, ...] = ()  # resnet bottleneck blocks per stage, e.g. (3, 4, 6, 3)
    width: int = 64  # resnet stem width
    buffer_bytes: int = 0  # non-parameter buffers of the whole model (RoPE caches), as weights
    # parameters of each MoE layer that stay fp32 whatever the model's dtype (transformers'
    # ``_keep_in_fp32_modules_strict``: DeepSeek-V2/V3's router weight)
    fp32_moe_params: int = 0
    source: str = ""  # where the numbers come from (preset citation or config path)
    published_params: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived shape -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or (self.hidden // self.n_heads if self.n_heads else 0)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_ffn(self) -> int:
        """Intermediate size of one routed expert."""
        return self.ffn

    @property
    def dense_layer_ffn(self) -> int:
        """Intermediate size of a dense layer's MLP (first-k dense layers of an MoE)."""
        return self.dense_ffn or self.ffn

    @property
    def n_dense_layers(self) -> int:
        """Layers with a dense MLP: all of them, an MoE's first k, or the 0s of its pattern."""
        if not self.is_moe:
            return self.n_layers
        if self.moe_layer_freq:
            return self.moe_layer_freq.count(0)
        return min(self.first_k_dense, self.n_layers)

    def is_dense_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) has a dense MLP."""
        if not self.is_moe:
            return True
        if self.moe_layer_freq:
            return not self.moe_layer_freq[i]
        return i < self.first_k_dense

    def dense_in(self, layers: range) -> int:
        """How many of ``layers`` have a dense MLP (lazy over huge ranges without a pattern)."""
        if not self.is_moe:
            return len(layers)
        if self.moe_layer_freq:
            return sum(1 for i in layers if not self.moe_layer_freq[i])
        return max(0, min(layers.stop, self.first_k_dense) - layers.start)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hf(self) -> bool:
        return self.impl == "hf"

    @property
    def gated(self) -> bool:
        """The MLP multiplies two up projections (SwiGLU, GeGLU)."""
        if self.mlp_act:
            return self.mlp_act in ("swiglu", "geglu")
        return self.arch == "llama"

    @property
    def has_bias(self) -> bool:
        """Linear layers carry biases (gpt2 and vit by default; llama's q/k/v by qkv_bias)."""
        return self.arch != "llama" if self.bias is None else self.bias

    @property
    def is_decoder(self) -> bool:
        return self.arch in ("gpt2", "llama")

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.arch == "llama" else "layernorm"

    @property
    def n_params(self) -> int:
        return param_groups(self).total

    @property
    def n_tokens_per_sample(self) -> int:
        """Sequence length of a vision transformer (patches + class token)."""
        return (self.image_size // self.patch) ** 2 + 1

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)


def _validate(s: ModelSpec) -> None:
    def positive(name: str, value: int) -> None:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"model {s.name!r}: {name} must be a positive integer, got {value!r}")

    if s.arch not in ("gpt2", "llama", "vit", "resnet"):
        raise ValueError(
            f"model {s.name!r}: arch {s.arch!r} is not one of gpt2, llama, vit, resnet"
        )
    if s.arch == "resnet":
        if not s.blocks or any(b <= 0 for b in s.blocks):
            raise ValueError(
                f"model {s.name!r}: a resnet needs blocks per stage, e.g. (3, 4, 6, 3)"
            )
        positive("width", s.width)
        return
    for name in ("n_layers", "hidden", "n_heads", "ffn"):
        positive(name, getattr(s, name))
    if s.arch != "vit":
        positive("vocab", s.vocab)
    positive("max_seq", s.max_seq)
    if s.head_dim is None and s.hidden % s.n_heads:
        raise ValueError(
            f"model {s.name!r}: hidden {s.hidden} is not divisible by n_heads {s.n_heads}; "
            "give head_dim explicitly"
        )
    if s.n_heads % s.kv_heads:
        raise ValueError(
            f"model {s.name!r}: n_heads {s.n_heads} is not a multiple of n_kv_heads {s.kv_heads}"
        )
    if s.n_experts and not 0 < s.top_k <= s.n_experts:
        raise ValueError(
            f"model {s.name!r}: top_k must be in 1..n_experts={s.n_experts}, got {s.top_k}"
        )
    if s.first_k_dense and not s.n_experts:
        raise ValueError(f"model {s.name!r}: first_k_dense needs experts (n_experts > 0)")
    if s.mlp_act not in MLP_ACTS:
        known = ", ".join(map(repr, MLP_ACTS))
        raise ValueError(f"model {s.name!r}: mlp_act {s.mlp_act!r} is not one of {known}")
    if s.moe_layer_freq:
        if not s.n_experts:
            raise ValueError(f"model {s.name!r}: moe_layer_freq needs experts (n_experts > 0)")
        if len(s.moe_layer_freq) != s.n_layers or set(s.moe_layer_freq) - {0, 1}:
            raise ValueError(
                f"model {s.name!r}: moe_layer_freq must hold one 0 (dense) or 1 (MoE) per layer "
                f"({s.n_layers}), got {list(s.moe_layer_freq)!r}"
            )
        if s.first_k_dense:
            raise ValueError(f"model {s.name!r}: give moe_layer_freq or first_k_dense, not both")
    if not isinstance(s.mtp_layers, int) or s.mtp_layers < 0:
        raise ValueError(f"model {s.name!r}: mtp_layers must be >= 0, got {s.mtp_layers!r}")
    if s.n_shared_experts and not s.shared_ffn:
        raise ValueError(
            f"model {s.name!r}: {s.n_shared_experts} shared experts need their size (shared_ffn)"
        )
    if s.is_mla and not (s.qk_nope_dim and s.qk_rope_dim and s.v_head_dim):
        raise ValueError(
            f"model {s.name!r}: multi-head latent attention (kv_lora_rank) needs qk_nope_dim, "
            "qk_rope_dim and v_head_dim"
        )


# --- parameter groups --------------------------------------------------------------------


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


def attention_params(s: ModelSpec) -> tuple[int, int]:
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


def mlp_params(s: ModelSpec, f: int) -> tuple[int, int]:
    """(tensor-parallel, replicated) parameters of one MLP of intermediate size ``f``."""
    if s.gated:
        return 3 * s.hidden * f + (2 * f if s.bias else 0), s.hidden if s.bias else 0
    if not s.has_bias:
        return 2 * s.hidden * f, 0
    return s.hidden * f + f + f * s.hidden, s.hidden


def param_groups(s: ModelSpec) -> ParamGroups:
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


def _step_scratch(s: ModelSpec, largest: int) -> int:
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


def resnet_stages(s: ModelSpec) -> list[tuple[int, int, int, int]]:
    """(in_channels, mid_channels, out_channels, stride) of every bottleneck block, in order."""
    out, cin = [], s.width
    for i, n in enumerate(s.blocks):
        mid = s.width * 2**i
        for j in range(n):
            out.append((cin, mid, mid * 4, 2 if (j == 0 and i > 0) else 1))
            cin = mid * 4
    return out


def _resnet_groups(s: ModelSpec) -> ParamGroups:
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


# --- presets -----------------------------------------------------------------------------

_L = "llama"


def _llama(name, L, h, a, g, f, v, ctx, published, src, **kw) -> ModelSpec:
    return ModelSpec(
        name=name,
        arch=_L,
        n_layers=L,
        hidden=h,
        n_heads=a,
        n_kv_heads=g,
        ffn=f,
        vocab=v,
        max_seq=ctx,
        published_params=published,
        source=src,
        **kw,
    )


def _gpt2(name, L, h, a, published) -> ModelSpec:
    return ModelSpec(
        name=name,
        arch="gpt2",
        n_layers=L,
        hidden=h,
        n_heads=a,
        ffn=4 * h,
        vocab=50257,
        max_seq=1024,
        tied_embeddings=True,
        published_params=published,
        source="openai-community/gpt2 config.json; HF model card parameter counts",
    )


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _gpt2("gpt2", 12, 768, 12, 124_439_808),
        _gpt2("gpt2-medium", 24, 1024, 16, 354_823_168),
        _gpt2("gpt2-large", 36, 1280, 20, 774_030_080),
        _gpt2("gpt2-xl", 48, 1600, 25, 1_557_611_200),
        _llama(
            "llama-2-7b",
            32,
            4096,
            32,
            32,
            11008,
            32000,
            4096,
            6_738_415_616,
            "meta-llama/Llama-2-7b-hf",
        ),
        _llama(
            "llama-2-13b",
            40,
            5120,
            40,
            40,
            13824,
            32000,
            4096,
            13_015_864_320,
            "meta-llama/Llama-2-13b-hf",
        ),
        _llama(
            "llama-2-70b",
            80,
            8192,
            64,
            8,
            28672,
            32000,
            4096,
            68_976_648_192,
            "meta-llama/Llama-2-70b-hf",
        ),
        _llama(
            "llama-3-8b",
            32,
            4096,
            32,
            8,
            14336,
            128256,
            8192,
            8_030_261_248,
            "meta-llama/Meta-Llama-3-8B",
        ),
        _llama(
            "llama-3-70b",
            80,
            8192,
            64,
            8,
            28672,
            128256,
            8192,
            70_553_706_496,
            "meta-llama/Meta-Llama-3-70B",
        ),
        _llama(
            "llama-3.1-405b",
            126,
            16384,
            128,
            8,
            53248,
            128256,
            8192,
            405_853_388_800,
            "meta-llama/Llama-3.1-405B",
        ),
        _llama(
            "mistral-7b",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            8192,
            7_241_732_096,
            "mistralai/Mistral-7B-v0.1",
        ),
        _llama(
            "mixtral-8x7b",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            8192,
            46_702_792_704,
            "mistralai/Mixtral-8x7B-v0.1",
            n_experts=8,
            top_k=2,
        ),
        _llama(
            "qwen2-7b",
            28,
            3584,
            28,
            4,
            18944,
            152064,
            8192,
            7_615_616_512,
            "Qwen/Qwen2-7B",
            qkv_bias=True,
        ),
        _llama(
            "qwen2-72b",
            80,
            8192,
            64,
            8,
            29568,
            152064,
            8192,
            72_706_203_648,
            "Qwen/Qwen2-72B",
            qkv_bias=True,
        ),
        ModelSpec(
            name="vit-b-16",
            arch="vit",
            n_layers=12,
            hidden=768,
            n_heads=12,
            ffn=3072,
            max_seq=197,
            published_params=86_567_656,
            source="torchvision vit_b_16",
        ),
        ModelSpec(
            name="vit-l-16",
            arch="vit",
            n_layers=24,
            hidden=1024,
            n_heads=16,
            ffn=4096,
            max_seq=197,
            published_params=304_326_632,
            source="torchvision vit_l_16",
        ),
        ModelSpec(
            name="resnet-50",
            arch="resnet",
            n_layers=0,
            blocks=(3, 4, 6, 3),
            published_params=25_557_032,
            source="torchvision resnet50",
        ),
        ModelSpec(
            name="resnet-101",
            arch="resnet",
            n_layers=0,
            blocks=(3, 4, 23, 3),
            published_params=44_549_160,
            source="torchvision resnet101",
        ),
    )
}

_ALIASES = {
    "gpt2-small": "gpt2",
    "gpt2-s": "gpt2",
    "gpt2-m": "gpt2-medium",
    "gpt2-l": "gpt2-large",
    "llama-3-405b": "llama-3.1-405b",
    "llama-3.1-8b": "llama-3-8b",
    "llama-3.1-70b": "llama-3-70b",
    "vit-base": "vit-b-16",
    "resnet50": "resnet-50",
    "resnet101": "resnet-101",
}


def _canon(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def preset(name: str) -> ModelSpec:
    """A built-in model by name, case-insensitive; unknown names get the nearest suggestions."""
    key = _canon(name)
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    names = sorted([*PRESETS, *_ALIASES])
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    raise LookupError(
        f"unknown model {name!r}: {hint}known presets are {', '.join(sorted(PRESETS))}; "
        "or pass the path of a Hugging Face config.json"
    )


# --- Hugging Face config.json ------------------------------------------------------------

# model_type -> our arch; field names differ between families
_HF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "llama",
    "qwen2_moe": "llama",
    "qwen3": "llama",
    "qwen3_moe": "llama",
    "phi3": "llama",
    "gemma": "llama",
    "gemma2": "llama",
    "gemma3_text": "llama",
    "deepseek_v2": "llama",
    "deepseek_v3": "llama",
    "gpt2": "gpt2",
}
# the fields that say how tokens are routed, per MoE family
_ROUTER_FIELDS = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok"),
    "deepseek_v2": ("n_routed_experts", "num_experts_per_tok"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok"),
}
# defaults of the transformers config classes for fields a config.json may leave out
_TIED_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True}
HF_FAMILIES = tuple(_HF_ARCH)  # the config.json model_types this module reads


def from_hf_config(config: dict[str, Any], name: str = "config.json") -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json``: Llama, Mistral, Qwen2/3, Phi-3,
    Gemma/Gemma2/Gemma3, GPT-2, and the MoE families Mixtral, Qwen2-MoE/Qwen3-MoE and
    DeepSeek-V2/V3 (dense first layers, shared experts, multi-head latent attention). The spec
    follows transformers' implementation (``impl="hf"``, see ``hf_ops.py``).

    Raises:
        ValueError: naming the missing or malformed field.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(config).__name__}")
    mtype = config.get("model_type")
    if mtype is None:
        raise ValueError(f"{name}: missing field 'model_type' (one of {', '.join(_HF_ARCH)})")
    if mtype not in _HF_ARCH:
        raise ValueError(
            f"{name}: model_type {mtype!r} is not supported; supported: {', '.join(_HF_ARCH)}"
        )

    def need(*keys: str) -> int:
        for k in keys:
            if k in config and config[k] is not None:
                v = config[k]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"{name}: field {k!r} must be a positive integer, got {v!r}")
                return v
        raise ValueError(f"{name}: missing field {keys[0]!r} (model_type {mtype!r})")

    def opt(key: str, default: int = 0) -> int:
        v = config.get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: field {key!r} must be a non-negative integer, got {v!r}")
        return v

    label = config.get("_name_or_path") or name
    if _HF_ARCH[mtype] == "gpt2":
        h = need("n_embd", "hidden_size")
        inner = config.get("n_inner")
        return ModelSpec(
            name=label,
            arch="gpt2",
            n_layers=need("n_layer", "num_hidden_layers"),
            hidden=h,
            n_heads=need("n_head", "num_attention_heads"),
            ffn=inner or 4 * h,
            vocab=need("vocab_size"),
            max_seq=need("n_positions", "max_position_embeddings"),
            tied_embeddings=bool(config.get("tie_word_embeddings", True)),
            source=name,
            impl="hf",
            family="gpt2",
        )
    moe = {}
    if mtype in _ROUTER_FIELDS:
        experts_key, topk_key = _ROUTER_FIELDS[mtype]
        missing = [k for k in (experts_key, topk_key) if not config.get(k)]
        if missing:
            raise ValueError(
                f"{name}: model_type {mtype!r} is a mixture of experts but the router field(s) "
                f"{', '.join(map(repr, missing))} are missing or 0: give the number of experts "
                f"({experts_key!r}) and the experts per token ({topk_key!r})"
            )
        moe["n_experts"] = need(experts_key)
        moe["top_k"] = need(topk_key)
        if mtype.startswith("deepseek"):
            moe["first_k_dense"] = opt("first_k_dense_replace")
            moe["dense_ffn"] = need("intermediate_size")
            n_shared = opt("n_shared_experts")
            moe["n_shared_experts"] = n_shared
            moe["shared_ffn"] = n_shared * need("moe_intermediate_size")
            # the router's weight stays fp32 (``_keep_in_fp32_modules_strict``)
            moe["fp32_moe_params"] = moe["n_experts"] * need("hidden_size")
        elif mtype == "qwen2_moe":
            shared = opt("shared_expert_intermediate_size")
            moe["n_shared_experts"] = 1 if shared else 0
            moe["shared_ffn"] = shared
            moe["shared_gate"] = bool(shared)
        step, only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        if step not in (None, 1) or only:
            moe["moe_layer_freq"] = sparse_pattern(need("num_hidden_layers"), step or 1, only, name)
    ffn = need("moe_intermediate_size") if mtype in ("qwen2_moe", "qwen3_moe") else None
    if mtype.startswith("deepseek"):
        ffn = need("moe_intermediate_size")
    mla = {}
    if mtype.startswith("deepseek") and config.get("kv_lora_rank"):
        mla = {
            "q_lora_rank": opt("q_lora_rank"),
            "kv_lora_rank": need("kv_lora_rank"),
            "qk_nope_dim": need("qk_nope_head_dim"),
            "qk_rope_dim": need("qk_rope_head_dim"),
            "v_head_dim": need("v_head_dim"),
        }
    gemma = mtype.startswith("gemma")
    return ModelSpec(
        name=label,
        arch="llama",
        n_layers=need("num_hidden_layers"),
        hidden=need("hidden_size"),
        n_heads=need("num_attention_heads"),
        n_kv_heads=config.get("num_key_value_heads") or None,
        head_dim=config.get("head_dim") or None,
        ffn=ffn or need("intermediate_size"),
        vocab=need("vocab_size"),
        max_seq=config.get("max_position_embeddings") or 4096,
        tied_embeddings=bool(config.get("tie_word_embeddings", _TIED_DEFAULT.get(mtype, False))),
        qkv_bias=mtype in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
        source=name,
        impl="hf",
        family=mtype,
        norms_per_layer=4 if mtype in ("gemma2", "gemma3_text") else 2,
        qk_norm=mtype in ("qwen3", "qwen3_moe", "gemma3_text"),
        eager_attention=mtype == "gemma2",
        attn_softcap=mtype == "gemma2" and config.get("attn_logit_softcapping", 50.0) is not None,
        logit_softcap=config.get("final_logit_softcapping", 30.0 if mtype == "gemma2" else None)
        is not None,
        mlp_act="geglu" if gemma else "",
        **moe,
        **mla,
    )


def sparse_pattern(n_layers: int, step: Any, only: Any, name: str) -> tuple[int, ...]:
    """transformers' Qwen2-MoE / Qwen3-MoE rule: layer i is MoE when it is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; as a 0/1 pattern."""
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ValueError(f"{name}: decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(only, list) or not all(
        isinstance(i, int) and 0 <= i < n_layers for i in only
    ):
        raise ValueError(f"{name}: mlp_only_layers must list layer indices below {n_layers}")
    return tuple(0 if i in only or (i + 1) % step else 1 for i in range(n_layers))


def load_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a config.json file or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {str(path)!r}")
    try:
        config = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return from_hf_config(config, str(p))


def resolve_model(model: Any) -> ModelSpec:
    """Anything a user may pass as a model -> ModelSpec.

    Accepts a ModelSpec, a preset name, a path to config.json (or its directory), a dict (HF
    config fields if it has ``model_type``, else ModelSpec fields), a ``gpumem.models``
    ModelConfig, or a dataclass of spec fields. (``gpumem.estimate`` measures an ``nn.Module``
    itself, see ``module_estimate.py``.)
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, Path)):
        return load_config(model) if _is_config_path(model) else preset(str(model))
    if isinstance(model, dict):
        if "model_type" in model:
            return from_hf_config(model, "dict")
        return _from_fields(dict(model), "dict")
    if type(model).__module__ == "gpumem.models.config":  # a built-in model's ModelConfig
        return from_model_config(model)
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        return _from_fields(dataclasses.asdict(model), type(model).__name__)
    if hasattr(model, "parameters") and hasattr(model, "named_modules"):
        raise TypeError(
            "an nn.Module needs a fake-tensor pass: call gpumem.estimate(module, "
            "example_input=...); searches over many layouts (gpumem plan) take a preset, a "
            "config.json or a ModelSpec"
        )
    raise TypeError(
        f"cannot use {type(model).__name__} as a model: pass a preset name, a config.json path, "
        "a dict, or a ModelSpec"
    )


def _is_config_path(model: str | Path) -> bool:
    text = str(model)
    return Path(text).exists() or text.endswith(".json") or "/" in text


def describes_hf(model: Any) -> bool:
    """``model`` (as ``resolve_model`` takes it) is a Hugging Face config, without reading it:
    its framework defaults to ``transformers``."""
    if isinstance(model, ModelSpec):
        return model.is_hf
    if isinstance(model, (str, Path)):
        return _is_config_path(model)
    return isinstance(model, dict) and "model_type" in model


def _from_fields(fields: dict[str, Any], what: str) -> ModelSpec:
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{what}: unknown model field(s) {unknown}; known: {sorted(known)}")
    fields.setdefault("name", what)
    for required in ("arch", "n_layers"):
        if required not in fields:
            raise ValueError(f"{what}: missing field {required!r}")
    for key in ("blocks", "moe_layer_freq"):
        if isinstance(fields.get(key), list):
            fields[key] = tuple(fields[key])
    return ModelSpec(**fields)


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


def from_model_config(cfg: Any) -> ModelSpec:
    """A ModelSpec from a ``gpumem.models.ModelConfig`` (the built-in models)."""
    arch = {"gpt2": "gpt2", "llama": "llama", "mixtral": "llama", "vit": "vit", "resnet": "resnet"}
    if cfg.arch == "resnet":
        return ModelSpec(
            name="resnet",
            arch="resnet",
            n_layers=0,
            blocks=tuple(cfg.resnet_blocks),
            width=cfg.resnet_width,
            image_size=cfg.image_size,
            channels=cfg.num_channels,
            n_classes=cfg.num_classes,
            source="gpumem.models",
        )
    # gpumem.models' Rotary keeps fp32 cos and sin tables (seq_len x head_dim/2) in every layer
    rope = (
        cfg.num_layers * 2 * cfg.seq_len * (cfg.head_dim // 2) * 4
        if cfg.arch in ("llama", "mixtral")
        else 0
    )
    return ModelSpec(
        name=f"gpumem.models.{cfg.arch}",
        arch=arch[cfg.arch],
        n_layers=cfg.num_layers,  # type: ignore[arg-type]
        hidden=cfg.hidden_size,
        n_heads=cfg.num_heads,
        n_kv_heads=cfg.num_kv_heads,
        ffn=cfg.ffn_hidden_size,
        vocab=cfg.vocab_size if cfg.arch != "vit" else 0,
        max_seq=cfg.seq_len,
        tied_embeddings=cfg.tie_word_embeddings,
        n_experts=cfg.num_experts,
        top_k=cfg.top_k if cfg.num_experts else 0,
        image_size=cfg.image_size,
        patch=cfg.patch_size,
        channels=cfg.num_channels,
        n_classes=cfg.num_classes,
        source="gpumem.models",
        buffer_bytes=rope,
        family=cfg.arch,
    )
