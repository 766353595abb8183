"""torch.distributed.checkpoint storage in gpumem's format: ``gpumem.dcp.StorageWriter`` and
``StorageReader`` (defined in ``gpumem.checkpoint.interop.dcp``; this path is the public one).

    import torch.distributed.checkpoint as dcp
    import gpumem.dcp

    dcp.save(state, storage_writer=gpumem.dcp.StorageWriter("ckpts"))          # also async_save
    dcp.load(state, storage_reader=gpumem.dcp.StorageReader("ckpts"))          # newest valid
"""

from gpumem.checkpoint.interop.dcp import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
