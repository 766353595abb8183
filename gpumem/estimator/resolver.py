"""``resolve_model``: whatever a user passes as a model (a preset name, a config.json path or
its directory, a dict, a ``ModelSpec``, a ``gpumem.models`` config) as a ``ModelSpec``.

Example:
    >>> spec = resolve_model("llama-2-70b")
    >>> spec.n_params
    68976648192
    >>> spec = resolve_model("path/to/config.json")   # or a directory holding one
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpumem.estimator.hf_config import from_hf_config, load_config
from gpumem.estimator.model_presets import preset
from gpumem.estimator.model_spec import ModelSpec


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
