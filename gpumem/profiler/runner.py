"""Profile N training steps of a built-in model or a local Hugging Face ``config.json``.

Used by ``gpumem profile``; handy in notebooks too:

    >>> from gpumem.profiler.runner import profile_model
    >>> rep = profile_model("llama", size="7b", batch_size=1, seq_len=4096, fake=True)
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpumem.profiler.report import Report

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
PRECISIONS = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer | None:
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-4)


def _hf_model(path: Path, dtype: torch.dtype | None):
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"{path} is a Hugging Face config: install transformers (pip install transformers)"
        ) from None
    raw = json.loads(path.read_text())
    cfg = transformers.AutoConfig.for_model(**raw) if "model_type" in raw else None
    if cfg is None:
        raise ValueError(f"{path} has no 'model_type'; it does not look like a transformers config")
    from gpumem.models import default_dtype

    with default_dtype(dtype):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model, getattr(cfg, "vocab_size", 32000)


def profile_model(
    model: str,
    *,
    size: str = "tiny",
    batch_size: int = 2,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    precision: str = "fp32",
    checkpointing: bool = False,
    fake: bool = False,
    device: str = "cpu",
    steps: int = 2,
    mode: str = "exact",
) -> Report:
    """Build ``model``, run ``steps`` training steps inside ``gpumem.profile``, return the report.

    Args:
        model: ``gpt2``, ``llama``, ``mixtral``, ``vit``, ``resnet``, or a path to a local
            transformers ``config.json`` (causal LMs; nothing is downloaded).
        size: preset size of a built-in model (see ``gpumem.models.PRESETS``).
        precision: parameter dtype (``fp32``, ``bf16``, ``fp16``) or fp32 weights under autocast
            (``amp-bf16``, ``amp-fp16``).
        fake: build everything under ``gpumem.fake()``: any size, no memory.
        mode: ``"exact"`` or ``"light"`` (see :func:`gpumem.profile`).
    """
    from gpumem.models import build_model, example_batch
    from gpumem.profiler import fake as fake_ctx
    from gpumem.profiler import profile

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if batch_size < 1 or steps < 1:
        raise ValueError(f"batch size and steps must be >= 1, got {batch_size} and {steps}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    amp = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(precision)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # fake CUDA tensors cannot record autograd without a usable CUDA device either (fake.py)
        what = "--device cuda"
        if fake:
            what = "--fake --device cuda trains on fake CUDA tensors, which"
        raise ValueError(
            f"{what} needs a torch build with a usable CUDA device; on this machine use --fake "
            "without --device (fake CPU tensors of any size: the same storages without the "
            "512-byte CUDA rounding)"
        )
    outer = (
        fake_ctx(device=device if dev.type != "cpu" else None) if fake else contextlib.nullcontext()
    )
    with outer:
        path = Path(model)
        if path.suffix == ".json" or path.is_file():
            if not path.is_file():
                raise ValueError(f"config file {path} does not exist")
            net, vocab = _hf_model(path, dtype)
            net = net if fake else net.to(dev)
            seq = seq_len or 128
            x = torch.randint(0, vocab, (batch_size, seq), device=dev)
            y = x
            if checkpointing:
                net.gradient_checkpointing_enable()
        else:
            net = build_model(model, size, dtype=dtype)
            net = net if fake else net.to(dev)
            net.gradient_checkpointing = checkpointing
            x, y = example_batch(net.config, batch_size, seq_len, device=dev)
            if x.is_floating_point() and dtype is not None:
                x = x.to(dtype)
        net.train()
        opt = _optimizer(optimizer, net.parameters())
        with profile(net, opt, mode=mode) as prof:
            for _ in range(steps):
                with torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext():
                    out = net(x)
                    logits = out.logits if hasattr(out, "logits") else out
                    loss = F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)
                    )
                loss.backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del out, logits, loss
    return prof.report()
