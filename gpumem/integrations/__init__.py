"""Trainer integrations: gpumem checkpointing inside trainers that own the training loop.

Modules:

    hf          ``CheckpointCallback`` for the transformers ``Trainer`` (a TrainerCallback)
    lightning   ``CheckpointCallback`` for the Lightning ``Trainer`` (a Callback)
    _guarded    what both callbacks share once built: the exit code and the release

Each imports its trainer library only when used (``gpumem.integrations.hf`` on first access).
torchtitan needs no callback: its checkpoint manager takes DCP storage, so
``gpumem.dcp.StorageWriter`` and ``StorageReader`` plug in there (recipe in docs/checkpoint.md,
"Sharded training").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumem.integrations import hf, lightning

# the trainers' modules, imported on first access: `import gpumem.integrations` loads neither
# torch, transformers nor lightning
_LAZY_MODULES = ("hf", "lightning")

__all__ = ["hf", "lightning"]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULES))
