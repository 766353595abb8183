"""A ``ModelSpec`` from a Hugging Face ``config.json`` (or its dict): the families transformers
implements that the estimator models, and the fields each names differently.

Example:
    >>> load_config("path/to/config.json")   # or a directory holding one
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import MLM_ENCODERS

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
    # encoders (BertForMaskedLM's shapes: LayerNorm, biases, learned positions, MHA, GELU)
    "bert": "gpt2",
    "roberta": "gpt2",
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
_ENCODER_DECODERS = ("t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "marian")
HF_FAMILIES = tuple(_HF_ARCH)  # the config.json model_types this module reads


def from_hf_config(config: dict[str, Any], name: str = "config.json") -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json``: Llama, Mistral, Qwen2/3, Phi-3,
    Gemma/Gemma2/Gemma3, GPT-2, the MoE families Mixtral, Qwen2-MoE/Qwen3-MoE and
    DeepSeek-V2/V3 (dense first layers, shared experts, multi-head latent attention), and the
    encoders BERT and RoBERTa (``_encoder_spec``: the masked LM or a classification head). The spec
    follows transformers' implementation (``impl="hf"``, see ``hf_ops.py``).

    Raises:
        ValueError: naming the missing or malformed field.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(config).__name__}")
    mtype = config.get("model_type")
    if mtype is None:
        raise ValueError(f"{name}: missing field 'model_type' (one of {', '.join(_HF_ARCH)})")
    if mtype in _ENCODER_DECODERS:
        raise ValueError(
            f"{name}: model_type {mtype!r} is an encoder-decoder (two stacks, cross-attention), "
            "not modelled from a config.json yet; estimate the module itself: gpumem.estimate("
            "AutoModelForSeq2SeqLM.from_config(cfg) built on the meta device, example_input="
            "{'input_ids': ids, 'labels': ids}) (read: "
            f"{', '.join(_HF_ARCH)})"
        )
    if mtype not in _HF_ARCH:
        raise ValueError(
            f"{name}: model_type {mtype!r} is not supported; supported: {', '.join(_HF_ARCH)}"
        )
    c = _Fields(config, name, mtype)
    if mtype in MLM_ENCODERS:
        return _encoder_spec(c)
    return _gpt2_spec(c) if _HF_ARCH[mtype] == "gpt2" else _llama_spec(c)


class _Fields:
    """A config's integer fields, checked as read: each error names the field."""

    def __init__(self, config: dict[str, Any], name: str, mtype: str) -> None:
        self.config, self.name, self.mtype = config, name, mtype
        self.label = config.get("_name_or_path") or name

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def need(self, *keys: str) -> int:
        """The first of ``keys`` present: a positive integer."""
        for k in keys:
            if k in self.config and self.config[k] is not None:
                v = self.config[k]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(
                        f"{self.name}: field {k!r} must be a positive integer, got {v!r}"
                    )
                return v
        raise ValueError(f"{self.name}: missing field {keys[0]!r} (model_type {self.mtype!r})")

    def opt(self, key: str, default: int = 0) -> int:
        """``key``, if present: a non-negative integer."""
        v = self.config.get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(
                f"{self.name}: field {key!r} must be a non-negative integer, got {v!r}"
            )
        return v


def _gpt2_spec(c: _Fields) -> ModelSpec:
    h = c.need("n_embd", "hidden_size")
    return ModelSpec(
        name=c.label,
        arch="gpt2",
        n_layers=c.need("n_layer", "num_hidden_layers"),
        hidden=h,
        n_heads=c.need("n_head", "num_attention_heads"),
        ffn=c.get("n_inner") or 4 * h,
        vocab=c.need("vocab_size"),
        max_seq=c.need("n_positions", "max_position_embeddings"),
        tied_embeddings=bool(c.get("tie_word_embeddings", True)),
        source=c.name,
        impl="hf",
        family="gpt2",
    )


def _encoder_spec(c: _Fields) -> ModelSpec:
    """BERT / RoBERTa: post-LN layers with separate q/k/v, exact GELU, token-type embeddings
    and an embedding LayerNorm, and the head ``architectures`` names: ``*ForMaskedLM`` (the
    checkpoints' and the default: dense + GELU + LayerNorm, the decoder tied to the word
    embeddings with its own bias), ``*ForSequenceClassification`` (pooler + classifier),
    ``*ForTokenClassification``, ``*ForQuestionAnswering`` (``num_labels`` outputs per token);
    ``hidden_dropout_prob`` and ``attention_probs_dropout_prob`` are the dropouts (0.1 in both
    checkpoints: masks saved in training), ``classifier_dropout`` the head's."""
    act = c.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(
            f"{c.name}: hidden_act {act!r} is not modelled for model_type {c.mtype!r}; "
            "the estimator follows BERT's exact 'gelu'"
        )
    head = _encoder_head(c)
    labels = 0
    if head:  # transformers' num_labels (from id2label when not given; QA's start and end: 2)
        id2label = c.get("id2label")
        labels = c.opt("num_labels", len(id2label) if isinstance(id2label, dict) else 2)
    pdrop = _probability(c, "hidden_dropout_prob")
    head_pdrop = pdrop
    if c.get("classifier_dropout") is not None:
        head_pdrop = _probability(c, "classifier_dropout")
    h, max_pos = c.need("hidden_size"), c.need("max_position_embeddings")
    return ModelSpec(
        name=c.label,
        arch="gpt2",
        n_layers=c.need("num_hidden_layers"),
        hidden=h,
        n_heads=c.need("num_attention_heads"),
        ffn=c.need("intermediate_size"),
        vocab=c.need("vocab_size"),
        max_seq=max_pos - (c.opt("pad_token_id", 1) + 1 if c.mtype == "roberta" else 0),
        position_rows=max_pos,
        type_vocab=c.opt("type_vocab_size", 2),
        # only the masked LM's decoder ties to the word embeddings
        tied_embeddings=not head and bool(c.get("tie_word_embeddings", True)),
        pdrop=pdrop,
        attn_pdrop=_probability(c, "attention_probs_dropout_prob"),
        encoder_head=head,
        n_labels=labels,
        head_pdrop=head_pdrop,
        # position_ids and token_type_ids: int64 buffers of max_position_embeddings
        buffer_bytes=2 * max_pos * 8,
        source=c.name,
        impl="hf",
        family=c.mtype,
    )


# the heads an encoder's ``architectures`` may name, by suffix
_ENCODER_HEAD_NAMES = {
    "ForMaskedLM": "",
    "ForSequenceClassification": "seq_cls",
    "ForTokenClassification": "token_cls",
    "ForQuestionAnswering": "qa",
}


def _encoder_head(c: _Fields) -> str:
    """The head ``architectures`` names (none: the masked LM, what the checkpoints name)."""
    names = [a for a in c.get("architectures") or [] if isinstance(a, str)]
    for a in names:
        for suffix, head in _ENCODER_HEAD_NAMES.items():
            if a.endswith(suffix):
                return head
    if names:
        known = ", ".join(f"*{k}" for k in _ENCODER_HEAD_NAMES)
        raise ValueError(
            f"{c.name}: architectures {names} name a head the estimator does not model for "
            f"model_type {c.mtype!r}; it prices {known} (give one in architectures, or "
            "estimate the module itself)"
        )
    return ""


def _probability(c: _Fields, key: str) -> float:
    v = c.get(key, 0.1)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ValueError(f"{c.name}: field {key!r} must be a probability in [0, 1), got {v!r}")
    return float(v)


def _moe_fields(c: _Fields) -> dict[str, Any]:
    """The routed and shared experts of an MoE family's config (empty for a dense one)."""
    mtype, name = c.mtype, c.name
    if mtype not in _ROUTER_FIELDS:
        return {}
    experts_key, topk_key = _ROUTER_FIELDS[mtype]
    missing = [k for k in (experts_key, topk_key) if not c.get(k)]
    if missing:
        raise ValueError(
            f"{name}: model_type {mtype!r} is a mixture of experts but the router field(s) "
            f"{', '.join(map(repr, missing))} are missing or 0: give the number of experts "
            f"({experts_key!r}) and the experts per token ({topk_key!r})"
        )
    moe: dict[str, Any] = {"n_experts": c.need(experts_key), "top_k": c.need(topk_key)}
    if mtype.startswith("deepseek"):
        moe["first_k_dense"] = c.opt("first_k_dense_replace")
        moe["dense_ffn"] = c.need("intermediate_size")
        n_shared = c.opt("n_shared_experts")
        moe["n_shared_experts"] = n_shared
        moe["shared_ffn"] = n_shared * c.need("moe_intermediate_size")
        # the router's weight stays fp32 (``_keep_in_fp32_modules_strict``)
        moe["fp32_moe_params"] = moe["n_experts"] * c.need("hidden_size")
    elif mtype == "qwen2_moe":
        shared = c.opt("shared_expert_intermediate_size")
        moe["n_shared_experts"] = 1 if shared else 0
        moe["shared_ffn"] = shared
        moe["shared_gate"] = bool(shared)
    step, only = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if step not in (None, 1) or only:
        moe["moe_layer_freq"] = sparse_pattern(c.need("num_hidden_layers"), step or 1, only, name)
    return moe


def _llama_spec(c: _Fields) -> ModelSpec:
    mtype = c.mtype
    moe = _moe_fields(c)
    ffn = c.need("moe_intermediate_size") if mtype in ("qwen2_moe", "qwen3_moe") else None
    if mtype.startswith("deepseek"):
        ffn = c.need("moe_intermediate_size")
    mla = {}
    if mtype.startswith("deepseek") and c.get("kv_lora_rank"):
        mla = {
            "q_lora_rank": c.opt("q_lora_rank"),
            "kv_lora_rank": c.need("kv_lora_rank"),
            "qk_nope_dim": c.need("qk_nope_head_dim"),
            "qk_rope_dim": c.need("qk_rope_head_dim"),
            "v_head_dim": c.need("v_head_dim"),
        }
    return ModelSpec(
        name=c.label,
        arch="llama",
        n_layers=c.need("num_hidden_layers"),
        hidden=c.need("hidden_size"),
        n_heads=c.need("num_attention_heads"),
        n_kv_heads=c.get("num_key_value_heads") or None,
        head_dim=c.get("head_dim") or None,
        ffn=ffn or c.need("intermediate_size"),
        vocab=c.need("vocab_size"),
        max_seq=c.get("max_position_embeddings") or 4096,
        tied_embeddings=bool(c.get("tie_word_embeddings", _TIED_DEFAULT.get(mtype, False))),
        qkv_bias=mtype in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias", False)),
        source=c.name,
        impl="hf",
        family=mtype,
        norms_per_layer=4 if mtype in ("gemma2", "gemma3_text") else 2,
        qk_norm=mtype in ("qwen3", "qwen3_moe", "gemma3_text"),
        eager_attention=mtype == "gemma2",
        attn_softcap=mtype == "gemma2" and c.get("attn_logit_softcapping", 50.0) is not None,
        logit_softcap=c.get("final_logit_softcapping", 30.0 if mtype == "gemma2" else None)
        is not None,
        mlp_act="geglu" if mtype.startswith("gemma") else "",
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
