"""Built-in models at named sizes, for the profiler, the estimator and the CLI.

Modules:

    config        one config dataclass for every built-in model, and the named sizes
    transformer   decoders (gpt2, llama, mixtral) and the ViT encoder, from one set of blocks
    resnet        ResNet with BatchNorm: basic blocks (18/34) or bottlenecks (50+)

Example:
    >>> from gpumem.models import build_model, example_batch
    >>> model = build_model("gpt2", "tiny")
    >>> inputs, targets = example_batch(model.config, batch_size=2, seq_len=16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from gpumem.models.config import ARCHS, PRESETS, ModelConfig, get_config

__all__ = [
    "ARCHS",
    "PRESETS",
    "ModelConfig",
    "build_model",
    "default_dtype",
    "example_batch",
    "get_config",
]


def build_model(arch: str | ModelConfig, size: str = "tiny", *, dtype=None, **overrides: Any):
    """Build a model from a preset (``build_model("llama", "7b")``) or a ``ModelConfig``.

    ``dtype`` (e.g. ``torch.bfloat16``) creates the parameters in that dtype directly, which is
    cheaper than ``.to(dtype)`` and works under fake tensors. Under ``gpumem.fake()`` no memory is
    allocated, so the full-size presets are fine there.
    """
    cfg = arch if isinstance(arch, ModelConfig) else get_config(arch, size, **overrides)
    with default_dtype(dtype):
        if cfg.arch == "resnet":
            from gpumem.models.resnet import ResNet

            return ResNet(cfg)
        from gpumem.models.transformer import CausalLM, ViT

        return ViT(cfg) if cfg.arch == "vit" else CausalLM(cfg)


@contextlib.contextmanager
def default_dtype(dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` torch's default floating dtype (``None``: leave it alone)."""
    import torch

    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def example_batch(cfg: ModelConfig, batch_size: int, seq_len: int | None = None, device=None):
    """Random ``(inputs, targets)`` of the right shapes and dtypes for ``cfg``.

    Language models get token ids (batch, seq) and next-token targets of the same shape; vision
    models get images (batch, C, H, W) and class labels (batch,).
    """
    import torch

    if cfg.arch in ("vit", "resnet"):
        images = torch.randn(
            batch_size, cfg.num_channels, cfg.image_size, cfg.image_size, device=device
        )
        return images, torch.randint(0, cfg.num_classes, (batch_size,), device=device)
    seq_len = seq_len or cfg.seq_len
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's seq_len {cfg.seq_len}")
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
    return ids, torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
