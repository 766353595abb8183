"""The stage: a save's tensors copied into host memory, fast and without disturbing training.

Modules:
    staging      Staging: the arena(s), prepare(), spill buffer, side stream and caches a save uses
    pieces       StagingPlan: where each tensor's pieces go (batches, slots, offsets); the CRC chunk
    snapshot     Snapshot: one save's copy (caller thread, overlap copier, fence) and its hand-off
    host_copy    CPU pieces copied in one native call; alignment gaps zeroed; cached byte views
    device_copy  CUDA pieces: one native enqueue of every copy, one Triton launch of every CRC
    spill        device-side spill of the parameters not yet copied at the optimizer fence
    coalesce     coalesce=True: a newer snapshot supersedes the one waiting to be written
"""
