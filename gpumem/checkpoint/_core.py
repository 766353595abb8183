"""The pieces of the native core the snapshot code shares: CRC32C and the host arena (one place
that tests can patch), and a tensor's bytes. The persist and restore paths call the parallel
writer and reader (``gpumem.writer``, ``gpumem.reader``) directly."""

from __future__ import annotations

import torch

from gpumem.arena import HostArena
from gpumem.checksum import chunk_crc32c, crc32c

__all__ = [
    "HostArena",
    "as_bytes",
    "chunk_crc32c",
    "crc32c",
]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 alias of a contiguous tensor (any dtype, any rank including 0-d)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
