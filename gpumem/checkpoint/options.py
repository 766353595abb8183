"""What a save runs under: the copy mode (``Mode``) and the settings every save of a
Checkpointer shares (``SaveOptions``), handed to a SaveJob as one frozen object."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Mode(str, enum.Enum):
    """How a save copies its tensors into host memory (a ``str``: ``Mode.OVERLAP == "overlap"``).

    Attributes:
        OVERLAP: buffers, RNG states and extras before save() returns, parameters and optimizer
            state after, beside the next forward/backward, fenced by the optimizer's pre-step
            hook.
        BLOCKING: everything before save() returns.
        STREAMING: the state is larger than the staging budget and streams through two slots,
            batch b written while batch b+1 is copied; save() returns once all is copied.
    """

    OVERLAP = "overlap"
    BLOCKING = "blocking"
    STREAMING = "streaming"


@dataclass(frozen=True)
class SaveOptions:
    """The Checkpointer's settings for one save.

    Attributes:
        root_path: the checkpoint directory (for messages; rank 0 passes its open ``Dir``).
        chunk: CRC32C chunk bytes.
        alignment: extent alignment in the data files.
        direct: write data files with O_DIRECT where the file system allows.
        group: the process group (rank, world size, collectives).
        keep: checkpoints to keep (None: all).
        versions: what the manifest records as the versions that wrote it.
        workers: the (persist, copier) worker threads.
        side_stream: the CUDA stream of the background copy (None: no CUDA state).
    """

    root_path: Path
    chunk: int
    alignment: int
    direct: bool
    group: Any
    keep: int | None
    versions: dict[str, str]
    workers: tuple[Any, Any]
    side_stream: Any = None
