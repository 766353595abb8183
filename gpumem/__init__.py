"""gpumem: measure, estimate and protect the memory of PyTorch training jobs.

The public face. Everything is imported lazily so that ``import gpumem`` stays cheap: it imports
neither torch, triton nor numba and creates no CUDA context until a feature is used
(``tests/test_lean_import.py`` holds us to it).

    with gpumem.profile(model, optimizer=opt) as prof: ...   # measure (gpumem.profiler)
    gpumem.estimate("llama-2-70b", ...)                        # estimate (gpumem.estimator)
    ckpt = gpumem.Checkpointer("ckpts")                        # protect (gpumem.checkpoint)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute); resolved on first access
_LAZY_ATTRS: dict[str, tuple[str, str]] = {
    "profile": ("gpumem.profiler", "profile"),
    "fake": ("gpumem.profiler", "fake"),
    "Checkpointer": ("gpumem.checkpoint", "Checkpointer"),
    "PreemptionGuard": ("gpumem.checkpoint", "PreemptionGuard"),
    "CheckpointInfo": ("gpumem.checkpoint", "CheckpointInfo"),
    "CheckpointError": ("gpumem.checkpoint", "CheckpointError"),
    "CheckpointCorruptError": ("gpumem.checkpoint", "CheckpointCorruptError"),
    "CheckpointIOError": ("gpumem.checkpoint", "CheckpointIOError"),
    "CheckpointStateError": ("gpumem.checkpoint", "CheckpointStateError"),
    "CheckpointFallbackWarning": ("gpumem.checkpoint", "CheckpointFallbackWarning"),
    "CheckpointBranchWarning": ("gpumem.checkpoint", "CheckpointBranchWarning"),
    "estimate": ("gpumem.estimator", "estimate"), "Layout": ("gpumem.estimator", "Layout"),
    "ModelSpec": ("gpumem.estimator", "ModelSpec"), "GPU": ("gpumem.estimator", "GPU"),
    "plan": ("gpumem.planner", "plan"),
    "Calibration": ("gpumem.calibrate", "Calibration"), "CalibrationError": ("gpumem.calibrate", "CalibrationError"),
}

# submodules reachable as attributes (gpumem.checksum.crc32c(...)) without an explicit import
_LAZY_MODULES = ("checksum", "device", "writer", "arena", "checkpoint", "calibrate")

__all__ = ["__version__", *_LAZY_MODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        module, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'gpumem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_ATTRS) | set(_LAZY_MODULES))
