"""torch.distributed.checkpoint storage in gpumem's format: ``gpumem.dcp.StorageWriter`` and
``StorageReader`` (defined in ``gpumem.checkpoint.interop.dcp_storage``; this is the public path).

    import torch.distributed.checkpoint as dcp
    import gpumem.dcp

    dcp.save(state, storage_writer=gpumem.dcp.StorageWriter("ckpts"))          # also async_save
    dcp.load(state, storage_reader=gpumem.dcp.StorageReader("ckpts"))          # newest valid
"""

from gpumem.checkpoint.interop.dcp_storage import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
