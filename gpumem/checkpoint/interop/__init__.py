"""Interop: gpumem checkpoints with the formats and tools users already have.

Modules:
    dcp_storage  StorageWriter / StorageReader for torch.distributed.checkpoint (``gpumem.dcp``)
    dcp_items    DCP's items in a gpumem checkpoint: written, committed and read without pickle
    dcp_plain    plain DCP directories (.metadata + .distcp) verified and imported without pickle
    export       model weights consolidated into sharded safetensors with an index
"""
