"""The capture stage: what a training state is, and how it becomes a JSON tree plus tensors.

Modules:
    training_state  TrainingState (the objects of a save or restore, declared once), capture()
    codec           state tree <-> JSON with tensor references; the tensor table; stored dtypes
    replicated      DDP state written once: the owners of each tensor, the ranks' signatures
    dtensor         a DTensor as this rank's block of its global tensor (box, mesh, placements)
    boxes           boxes of global tensors, their geometry, and the one tiling rule
"""
