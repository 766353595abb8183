"""One config dataclass for every built-in model, and the named sizes (presets).

The field names are the ones people already know from Hugging Face configs, so the estimator and
the profiler can share them. Sizes are chosen so that ``tiny`` runs a training step in well under a
second on a laptop CPU and the large ones match the published architectures (use them under
``gpumem.fake()``).

Example:
    >>> from gpumem.models import get_config
    >>> cfg = get_config("llama", "70b")
    >>> cfg.hidden_size, cfg.num_kv_heads, cfg.ffn_hidden_size
    (8192, 8, 28672)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("gpt2", "llama", "mixtral", "vit", "resnet")


@dataclass
class ModelConfig:
    """Architecture of a built-in model. Transformer fields are ignored by ``resnet``."""

    arch: str
    """One of ``ARCHS``."""
    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``num_heads`` (plain MHA)."""
    ffn_hidden_size: int | None = None
    """Inner MLP width; ``None`` means 4 × hidden (gpt2, vit) or the Llama 8/3 rule rounded to
    256."""
    seq_len: int = 1024
    """Maximum sequence length (position table / RoPE cache size)."""
    num_experts: int = 0
    """Experts per MoE layer (``mixtral``); 0 means a dense MLP."""
    top_k: int = 2
    """Experts each token is routed to."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    dropout: float = 0.0
    # vision
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    num_classes: int = 1000
    resnet_blocks: tuple[int, ...] = (2, 2, 2, 2)
    """Blocks per stage (resnet)."""
    resnet_width: int = 64
    resnet_bottleneck: bool = False
    """Bottleneck blocks (ResNet-50 and up) instead of basic blocks."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            if self.arch in ("llama", "mixtral"):
                self.ffn_hidden_size = 256 * ((8 * self.hidden_size // 3 + 255) // 256)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.arch != "resnet":
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; pick sizes with hidden_size % num_heads == 0"
                )
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                    f"{self.num_kv_heads}; grouped-query attention needs whole groups"
                )
        if self.arch == "mixtral" and not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"mixtral needs 0 < top_k <= num_experts, got top_k={self.top_k}, "
                f"num_experts={self.num_experts}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (unknown names raise ``TypeError``)."""
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "tiny": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "seq_len": 128,
        },
        "small": {
            "hidden_size": 768,
            "num_layers": 12,
            "num_heads": 12,
            "tie_word_embeddings": True,
        },
        "medium": {
            "hidden_size": 1024,
            "num_layers": 24,
            "num_heads": 16,
            "tie_word_embeddings": True,
        },
        "large": {
            "hidden_size": 1280,
            "num_layers": 36,
            "num_heads": 20,
            "tie_word_embeddings": True,
        },
        "xl": {"hidden_size": 1600, "num_layers": 48, "num_heads": 25, "tie_word_embeddings": True},
    },
    "llama": {
        "tiny": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "ffn_hidden_size": 176,
            "seq_len": 128,
        },
        "7b": {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "ffn_hidden_size": 11008,
            "seq_len": 4096,
        },
        "13b": {
            "vocab_size": 32000,
            "hidden_size": 5120,
            "num_layers": 40,
            "num_heads": 40,
            "ffn_hidden_size": 13824,
            "seq_len": 4096,
        },
        "70b": {
            "vocab_size": 32000,
            "hidden_size": 8192,
            "num_layers": 80,
            "num_heads": 64,
            "num_kv_heads": 8,
            "ffn_hidden_size": 28672,
            "seq_len": 4096,
        },
    },
    "mixtral": {
        "tiny": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "ffn_hidden_size": 128,
            "seq_len": 128,
            "num_experts": 4,
            "top_k": 2,
        },
        "8x7b": {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "num_kv_heads": 8,
            "ffn_hidden_size": 14336,
            "seq_len": 4096,
            "num_experts": 8,
            "top_k": 2,
            "rope_theta": 1e6,
        },
    },
    "vit": {
        "tiny": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "image_size": 32,
            "patch_size": 8,
            "num_classes": 10,
        },
        "base": {"hidden_size": 768, "num_layers": 12, "num_heads": 12},
        "large": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16},
    },
    "resnet": {
        "tiny": {"resnet_blocks": (1, 1), "resnet_width": 8, "image_size": 32, "num_classes": 10},
        "18": {"resnet_blocks": (2, 2, 2, 2)},
        "34": {"resnet_blocks": (3, 4, 6, 3)},
        "50": {"resnet_blocks": (3, 4, 6, 3), "resnet_bottleneck": True},
    },
}


def get_config(arch: str, size: str = "tiny", **overrides: Any) -> ModelConfig:
    """The preset ``size`` of ``arch`` with ``overrides`` applied.

    Raises:
        ValueError: unknown arch or size, naming the choices.
    """
    if arch not in PRESETS:
        raise ValueError(
            f"unknown model {arch!r}; choose one of {', '.join(PRESETS)} (or, where a "
            "transformers config is accepted, the path of a config.json)"
        )
    if size not in PRESETS[arch]:
        raise ValueError(
            f"unknown size {size!r} for {arch}; choose one of {', '.join(PRESETS[arch])}"
        )
    return ModelConfig(arch=arch, **{**PRESETS[arch][size], **overrides})
