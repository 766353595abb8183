"""Trainer integrations: gpumem checkpointing inside trainers that own the training loop.

- ``gpumem.integrations.hf.CheckpointCallback``: transformers ``Trainer`` (a TrainerCallback).
- ``gpumem.integrations.lightning.CheckpointCallback``: Lightning ``Trainer`` (a Callback).
- torchtitan: its checkpoint manager takes DCP storage, so ``gpumem.dcp.StorageWriter`` and
  ``StorageReader`` plug in there (recipe in docs/checkpoint.md, "Sharded training").

Each imports its trainer library only when used.
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
