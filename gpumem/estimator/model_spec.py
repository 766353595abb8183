"""``ModelSpec``: the shape of a model, enough to count its parameters and what autograd saves,
checked when made.

A spec describes a decoder transformer (GPT-2 or Llama family, dense or MoE), an MLM encoder
(BERT, RoBERTa: GPT-2's shapes, ``is_encoder``), a ViT, or a ResNet (bottleneck). Its parameter
count (``n_params``) comes from ``param_count.py``; the built-in specs are
``model_presets.py``, those read from a config.json ``hf_config.py``, and ``resolver.py`` turns
whatever a user passes into one.

Example:
    >>> ModelSpec(name="tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, ffn=128,
    ...           vocab=256).n_params
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from gpumem.estimator.param_count import MLM_ENCODERS, param_groups

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
    pdrop: float = 0.0  # GPT-2's resid/embd/attn dropout; an encoder's hidden_dropout_prob
    # encoders (BERT, RoBERTa: family in MLM_ENCODERS): attention_probs_dropout_prob, the
    # token-type embedding's rows, the position table's rows (0: max_seq; RoBERTa offsets its
    # positions by padding_idx + 1)
    attn_pdrop: float = 0.0
    type_vocab: int = 0
    position_rows: int = 0
    # an encoder's head (``architectures``): "" the masked LM, ``seq_cls`` (pooler + classifier
    # of the [CLS] token), ``token_cls`` (a classifier per token), ``qa`` (start/end logits per
    # token); the classifier's labels and dropout (``classifier_dropout``, else the hidden one)
    encoder_head: str = ""
    n_labels: int = 0
    head_pdrop: float = 0.0
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
        """A token model with a language-model head (the decoders, and the MLM encoders that
        share GPT-2's shapes)."""
        return self.arch in ("gpt2", "llama")

    @property
    def is_encoder(self) -> bool:
        """BERT / RoBERTa: bidirectional, post-LN, an MLM head or ``encoder_head``'s."""
        return self.family in MLM_ENCODERS

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


ENCODER_HEADS = ("", "seq_cls", "token_cls", "qa")
"""An encoder's heads: the masked LM, sequence and token classification, question answering."""


def _validate(s: ModelSpec) -> None:
    def positive(name: str, value: int) -> None:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"model {s.name!r}: {name} must be a positive integer, got {value!r}")

    if s.encoder_head not in ENCODER_HEADS:
        raise ValueError(
            f"model {s.name!r}: encoder_head {s.encoder_head!r} is not one of "
            f"{', '.join(map(repr, ENCODER_HEADS))}"
        )
    if s.encoder_head and s.n_labels <= 0:
        raise ValueError(f"model {s.name!r}: a {s.encoder_head} head needs n_labels >= 1")
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
