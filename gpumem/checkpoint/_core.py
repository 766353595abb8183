"""The native core (issue #2) as the checkpoint code uses it: CRC32C, the parallel writer and
reader, and the host arena. One import point, so the rest of the package never reaches into
``gpumem._C``."""

from __future__ import annotations

import torch

from gpumem.arena import HostArena
from gpumem.checksum import chunk_crc32c, crc32c
from gpumem.reader import read_file
from gpumem.writer import write_file

__all__ = [
    "HostArena",
    "as_bytes",
    "chunk_crc32c",
    "crc32c",
    "read_file",
    "write_file",
]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 alias of a contiguous tensor (any dtype, any rank including 0-d)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
