"""Will the profiled step run out of memory? A warning before it does.

``gpumem.profile`` receives a model that is already built, so it cannot refuse (the CLI's
``gpumem profile`` estimates a whole run and refuses instead); it can say when the step is bound
to fail. The check is a lower bound of what the step still has to allocate: a gradient for every
trainable parameter that has none, and the state the optimizer creates on its first step (Adam
and AdamW: two moments per parameter; SGD with momentum: one buffer) for parameters it has no
state for yet. Activations come on top; they depend on the inputs, which are not known here.
"""

from __future__ import annotations

import warnings
from typing import Any

from gpumem.device import available_bytes
from gpumem.units import format_bytes

_STATE_COPIES = {"Adam": 2, "AdamW": 2}


class ProfileMemoryWarning(RuntimeWarning):
    """The profiled step needs more memory than the device has available."""


def step_needs_bytes(model: Any, optimizer: Any) -> int:
    """The lower bound described in the module doc, in bytes."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    need = sum(p.numel() * p.element_size() for p in params.values() if p.grad is None)
    if optimizer is not None:
        copies = _STATE_COPIES.get(type(optimizer).__name__, 0)
        if type(optimizer).__name__ == "SGD":
            copies = int(any(g.get("momentum", 0) for g in optimizer.param_groups))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in params and p not in optimizer.state:
                    need += copies * p.numel() * p.element_size()
    return need


def warn_if_short(model: Any, optimizer: Any) -> None:
    """Warn (``ProfileMemoryWarning``) when the step's lower bound exceeds what the parameters'
    device has available. Fake and meta models are never short."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return
    device = next(iter(devices))
    if device.type not in ("cpu", "cuda"):
        return
    need = step_needs_bytes(model, optimizer)
    try:
        avail, where = available_bytes(str(device))
    except (ValueError, RuntimeError, OSError):
        return
    if need > avail:
        warnings.warn(
            f"this training step needs at least {format_bytes(need)} more (gradients and "
            f"optimizer state) but {format_bytes(avail)} is {where}: it will likely run out of "
            "memory. Profile it under gpumem.fake() (no memory used) or with a smaller model",
            ProfileMemoryWarning,
            stacklevel=3,
        )
