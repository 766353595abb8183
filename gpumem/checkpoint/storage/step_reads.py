"""What a restore reads of one committed step: the read half of the storage seam
(``backend``), on its own so that the manifest readers (``directory``) take it without importing
the save's side.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class StepPath(Protocol):
    """Where a step's files are, for messages: a directory's ``Path``, an object's key."""

    @property
    def name(self) -> str: ...

    def __truediv__(self, name: str) -> StepPath: ...

    def __fspath__(self) -> str: ...


class StepFiles(Protocol):
    """The files of one committed step, read (step 3 of a restore): ``safe_fs.Dir`` on a
    directory, ``s3.object_files.ObjectFiles`` on an object store.

    Attributes:
        path: the step's place, for messages (``path / name`` names a file).
    """

    @property
    def path(self) -> StepPath: ...

    def read_small(self, name: str, cap: int, what: str) -> bytes:
        """The whole of a small file (a manifest), refused beyond ``cap`` bytes."""
        ...

    def check_size(self, name: str, size: int) -> object:
        """The data file ``name`` exists and holds ``size`` bytes, before a byte is read."""
        ...

    def read_file(
        self,
        name: str,
        pieces: list[tuple[int, Any]],
        *,
        chunk_bytes: int,
        crc_index: list[int],
        crc_out: Any,
        expect_size: int,
        threads: int | None = None,
        direct: bool = True,
    ) -> None:
        """Fill every ``(offset, buffer)`` piece of the data file ``name``, its chunk CRC32Cs
        into ``crc_out`` from slot ``crc_index[i]`` (``threads``/``direct``: a local file's)."""
        ...

    def read_spans(
        self,
        name: str,
        buffer: Any,
        spans: np.ndarray,
        *,
        chunk_bytes: int,
        crc_out: np.ndarray,
        expect_size: int,
    ) -> int:
        """``gpumem.reader.read_spans``'s rows read from the data file ``name``; the lowest
        offset of a nonzero byte among the must-be-zero spans, or -1."""
        ...

    def read_again(self) -> bool:
        """Whether bytes that failed a check are worth reading again before the step is
        called damaged (a fault in transit); a True answer also forgets what was cached."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> StepFiles: ...

    def __exit__(self, *exc: object) -> object: ...
