"""The built-in models (``PRESETS``): one row each, every number named by its field, with the
source of its shape and its published parameter count.

Example:
    >>> preset("llama-2-70b").n_params
    68976648192
"""

from __future__ import annotations

import difflib
from typing import Any

from gpumem.estimator.model_spec import ModelSpec


def _llama(**fields: Any) -> ModelSpec:
    """A Llama-family row: the fields of ``ModelSpec`` by name."""
    return ModelSpec(arch="llama", **fields)


def _gpt2(**fields: Any) -> ModelSpec:
    """A GPT-2 row: OpenAI's vocabulary, context, 4x MLP and tied embeddings."""
    return ModelSpec(
        arch="gpt2",
        ffn=4 * fields["hidden"],
        vocab=50257,
        max_seq=1024,
        tied_embeddings=True,
        source="openai-community/gpt2 config.json; HF model card parameter counts",
        **fields,
    )


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _gpt2(name="gpt2", n_layers=12, hidden=768, n_heads=12, published_params=124_439_808),
        _gpt2(
            name="gpt2-medium", n_layers=24, hidden=1024, n_heads=16, published_params=354_823_168
        ),
        _gpt2(
            name="gpt2-large", n_layers=36, hidden=1280, n_heads=20, published_params=774_030_080
        ),
        _gpt2(name="gpt2-xl", n_layers=48, hidden=1600, n_heads=25, published_params=1_557_611_200),
        _llama(
            name="llama-2-7b",
            n_layers=32,
            hidden=4096,
            n_heads=32,
            n_kv_heads=32,
            ffn=11008,
            vocab=32000,
            max_seq=4096,
            published_params=6_738_415_616,
            source="meta-llama/Llama-2-7b-hf",
        ),
        _llama(
            name="llama-2-13b",
            n_layers=40,
            hidden=5120,
            n_heads=40,
            n_kv_heads=40,
            ffn=13824,
            vocab=32000,
            max_seq=4096,
            published_params=13_015_864_320,
            source="meta-llama/Llama-2-13b-hf",
        ),
        _llama(
            name="llama-2-70b",
            n_layers=80,
            hidden=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn=28672,
            vocab=32000,
            max_seq=4096,
            published_params=68_976_648_192,
            source="meta-llama/Llama-2-70b-hf",
        ),
        _llama(
            name="llama-3-8b",
            n_layers=32,
            hidden=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn=14336,
            vocab=128256,
            max_seq=8192,
            published_params=8_030_261_248,
            source="meta-llama/Meta-Llama-3-8B",
        ),
        _llama(
            name="llama-3-70b",
            n_layers=80,
            hidden=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn=28672,
            vocab=128256,
            max_seq=8192,
            published_params=70_553_706_496,
            source="meta-llama/Meta-Llama-3-70B",
        ),
        _llama(
            name="llama-3.1-405b",
            n_layers=126,
            hidden=16384,
            n_heads=128,
            n_kv_heads=8,
            ffn=53248,
            vocab=128256,
            max_seq=8192,
            published_params=405_853_388_800,
            source="meta-llama/Llama-3.1-405B",
        ),
        _llama(
            name="mistral-7b",
            n_layers=32,
            hidden=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn=14336,
            vocab=32000,
            max_seq=8192,
            published_params=7_241_732_096,
            source="mistralai/Mistral-7B-v0.1",
        ),
        _llama(
            name="mixtral-8x7b",
            n_layers=32,
            hidden=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn=14336,
            vocab=32000,
            max_seq=8192,
            published_params=46_702_792_704,
            source="mistralai/Mixtral-8x7B-v0.1",
            n_experts=8,
            top_k=2,
        ),
        _llama(
            name="qwen2-7b",
            n_layers=28,
            hidden=3584,
            n_heads=28,
            n_kv_heads=4,
            ffn=18944,
            vocab=152064,
            max_seq=8192,
            published_params=7_615_616_512,
            source="Qwen/Qwen2-7B",
            qkv_bias=True,
        ),
        _llama(
            name="qwen2-72b",
            n_layers=80,
            hidden=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn=29568,
            vocab=152064,
            max_seq=8192,
            published_params=72_706_203_648,
            source="Qwen/Qwen2-72B",
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
