"""Trainer integrations: gpumem checkpointing inside trainers that own the training loop.

- ``gpumem.integrations.hf.CheckpointCallback``: transformers ``Trainer`` (a TrainerCallback).
- ``gpumem.integrations.lightning.CheckpointCallback``: Lightning ``Trainer`` (a Callback).
- torchtitan: its checkpoint manager takes DCP storage, so ``gpumem.dcp.StorageWriter`` and
  ``StorageReader`` plug in there (recipe in docs/checkpoint.md, "Sharded training").

Each imports its trainer library only when used.
"""
