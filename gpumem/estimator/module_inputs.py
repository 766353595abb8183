"""The fake copy of a user's ``nn.Module`` and the fake inputs of one micro-batch.

``gpumem.estimate(nn.Module)`` never runs the module itself: it runs a copy whose parameters and
buffers are fake tensors (shape and dtype, no data), on inputs made from ``example_input``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from gpumem.estimator.states import Training
from gpumem.models import example_batch


def weight_dtype(training: Training):
    """The dtype of the copy's floating parameters: the precision's weight storage."""
    import torch

    if training.weight_bytes == 4:
        return torch.float32
    return torch.float16 if training.precision.startswith("fp16") else torch.bfloat16


def fake_copy(module: Any, device: str, dtype: Any) -> Any:
    """A copy of ``module`` whose parameters and buffers are fake tensors on ``device``; floating
    ones in ``dtype`` (as ``module.to(dtype)`` would; None: each keeps its own, as PEFT's fp32
    adapters on a 16-bit base). Call inside ``gpumem.fake()``."""
    import torch

    memo: dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            dt = (dtype or p.dtype) if p.is_floating_point() else p.dtype
            memo[id(p)] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=dt, device=device), requires_grad=p.requires_grad
            )
    for b in module.buffers():
        if id(b) not in memo:
            dt = (dtype or b.dtype) if b.is_floating_point() else b.dtype
            memo[id(b)] = torch.empty(b.shape, dtype=dt, device=device)
    try:
        out = copy.deepcopy(module, memo)
    except Exception as exc:
        raise TypeError(
            f"cannot copy {type(module).__name__} for a fake-tensor pass ({type(exc).__name__}: "
            f"{exc}); the estimate runs a copy so that your module stays untouched: make it "
            "deep-copyable (no open files, locks or real tensors outside parameters/buffers)"
        ) from None
    return out.train()


def _resize(t: Any, batch: int | None, seq: int | None, device: str) -> Any:
    """A fake tensor shaped like ``t``: dim 0 set to ``batch``, dim 1 of integer (token) tensors to
    ``seq``."""
    import torch

    shape = list(t.shape)
    if batch is not None and shape:
        shape[0] = batch
    if seq is not None and len(shape) >= 2 and not t.is_floating_point() and not t.is_complex():
        shape[1] = seq
    return torch.zeros(shape, dtype=t.dtype, device=device)


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[Any]:
    out: list[Any] = []
    _map_tensors(obj, lambda t: out.append(t) or t)
    return out


def default_input(module: Any) -> Callable[[int, int | None], Any] | None:
    """For a built-in ``gpumem.models`` module: its example batch as an input factory."""
    cfg = getattr(module, "config", None)
    if cfg is None or type(cfg).__module__ != "gpumem.models.config":
        return None
    return lambda batch, seq: example_batch(cfg, batch, seq)[0]


def resolve_batch(module: Any, example_input: Any, batch_size: int | None) -> int:
    """The micro-batch: ``batch_size``, else dim 0 of the example's first tensor, else 1."""
    if batch_size is not None:
        return batch_size
    if example_input is not None and not callable(example_input):
        ts = _tensors(example_input)
        if ts and ts[0].dim() > 0:
            return int(ts[0].shape[0])
    return 1


def make_inputs(module: Any, example_input: Any, batch: int, seq: int | None, device: str):
    """(args, kwargs) of fake tensors for one micro-batch. Call inside ``gpumem.fake()``."""
    import torch

    factory = (
        example_input
        if callable(example_input) and not isinstance(example_input, torch.Tensor)
        else None
    )
    if example_input is None:
        factory = default_input(module)
        if factory is None:
            needed = _required_args(module)
            if needed:
                raise ValueError(
                    f"{type(module).__name__}.forward needs {', '.join(needed)}: "
                    "pass example_input= "
                    "(a tensor, a tuple of positional inputs, a dict of keyword inputs, or a "
                    "function (batch_size, seq_len) -> those) shaped like one micro-batch"
                )
            return (), {}
    if factory is not None:
        with torch.device(device):
            made = factory(batch, seq)
        example, resize = made, False
    else:
        example, resize = example_input, True

    def fake(t: Any) -> Any:
        return _resize(t, batch if resize else None, seq if resize else None, device)

    if isinstance(example, dict):
        return (), _map_tensors(example, fake)
    if isinstance(example, tuple):
        return _map_tensors(example, fake), {}
    return (_map_tensors(example, fake),), {}


def _required_args(module: Any) -> list[str]:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return []
    return [
        n
        for n, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
