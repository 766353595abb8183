"""One save's files in an object store (``step-<N>/<save>/``), as the directory code uses a step
directory (``safe_fs.Dir``): the seam between the directory backend and the object store.

The save side has ``write_pieces`` and ``write_new``, so ``storage.writes`` and
``directory.write_manifest`` write objects as they write files: each data file goes up as one
multipart upload straight from the staging arena's extents (``S3Store.upload_pieces``: no host
copy, parts in flight bounded by a byte budget, every part and the object with its CRC32C).

The read side has ``read_small`` (manifests, read by the directory's own checks), ``check_size``
(a data object's size against its manifest, before a byte is read) and ``read_file`` /
``read_spans``, the contracts of ``gpumem.reader`` on objects: ranged GETs straight into the
restore's buffers, pinned to one version of the object, each chunk's CRC32C taken as its bytes
land; the restore compares them with the manifest's as it does for files.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpumem._native import load
from gpumem.reader import MUST_BE_ZERO

from ...errors import CheckpointCorruptError
from .object_listing import ObjectInfo, sized
from .object_ranges import REREADS
from .object_store import S3Store


class ObjectPath:
    """``Path``'s ``/``, ``name`` and ``str`` for an object key prefix, for messages."""

    def __init__(self, text: str):
        self._text = text.rstrip("/")

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self._text}/{name}")

    @property
    def name(self) -> str:
        return self._text.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return repr(self._text)

    def __fspath__(self) -> str:  # never opened: for os.fsdecode in messages only
        return self._text


class ObjectFiles:
    """The files of one save under ``key`` (see the module docstring).

    Args:
        store: the opened store.
        key: the full key prefix of the save (``<prefix>/step-<N>/<save>``).
        part_bytes, budget_bytes: of the multipart uploads (``S3Store.upload``).
        doing: "save" or "restore": every request for these files, from now on, is part of
            that operation and its deadline (``S3Store.deadline``).
    """

    def __init__(
        self,
        store: S3Store,
        key: str,
        part_bytes: int = 64 << 20,
        budget_bytes: int = 512 << 20,
        doing: str = "save",
    ):
        self.store, self.key = store, key.rstrip("/")
        self.part_bytes, self.budget_bytes = part_bytes, budget_bytes
        self.path = ObjectPath(f"s3://{store.url.bucket}/{self.key}")
        self.deadline = store.deadline(f"{doing} of {self.path}")
        self._heads: dict[str, ObjectInfo] = {}
        self._reads = 0

    def __enter__(self) -> ObjectFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None

    # ------------------------------------------------------------------ writing

    def write_pieces(
        self,
        name: str,
        pieces: list[tuple[int, Any]],
        size: int,
        direct: bool = False,
        threads: int | None = None,
    ) -> None:
        """Upload the data file ``name`` from ``(offset, buffer)`` extents (zeros between)."""
        del direct, threads  # the upload's parallelism is the store's max_concurrency
        self.store.upload_pieces(
            f"{self.key}/{name}",
            pieces,
            size,
            part_bytes=self.part_bytes,
            budget_bytes=self.budget_bytes,
            deadline=self.deadline,
        )

    def write_new(self, name: str, data: bytes) -> None:
        self.store.put(f"{self.key}/{name}", data, deadline=self.deadline)

    def discard(self) -> None:
        """Delete every object of this save (a failed or losing one; never a committed one)."""
        self.store.delete([o.key for o in self.store.list(self.key[len(self._base()) :] + "/")])

    def _base(self) -> str:
        return self.store.url.key("") if self.store.url.prefix else ""

    # ------------------------------------------------------------------ reading

    def read_small(self, name: str, cap: int, what: str) -> bytes:
        got = self.store.get(f"{self.key}/{name}", max_bytes=cap, deadline=self.deadline)
        if got is None:
            path = str(self.path / name)
            raise CheckpointCorruptError(f"{path}: {what} unreadable: missing", path=path)
        return got[0]

    def check_size(self, name: str, size: int) -> ObjectInfo:
        """The data object ``name`` exists and holds the ``size`` bytes its manifest records
        (checked before any byte is read); its HEAD, whose ETag pins the reads that follow."""
        found = sized(
            self._heads.get(name) or self.store.head(f"{self.key}/{name}", deadline=self.deadline),
            str(self.path / name),
            size,
        )
        self._heads[name] = found
        return found

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
        """``reader.read_file`` on the object ``name``: every ``(offset, buffer)`` piece filled
        by ranged GETs, its chunk CRC32Cs into ``crc_out`` from slot ``crc_index[i]``
        (``threads`` and ``direct`` are a local file's: the store's reads have their own)."""
        self.check_size(name, expect_size)
        self.store.read_pieces(
            f"{self.key}/{name}",
            pieces,
            expect_size=expect_size,
            chunk_bytes=chunk_bytes,
            crc_index=crc_index,
            crc_out=crc_out,
            etag=self._heads[name].etag,
            range_bytes=self.part_bytes,
            deadline=self.deadline,
        )

    def read_again(self) -> bool:
        """Whether bytes that failed their check (a CRC32C, a changed ETag) are worth reading
        again before the step is called damaged: a fault in transit (a flipped byte, a
        mangled header) is gone on the next read, a damaged object is not. True ``REREADS``
        times per step opened, each time forgetting the HEADs, so the next read asks again."""
        if self._reads >= REREADS:
            return False
        self._reads += 1
        self._heads.clear()
        return True

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
        """``reader.read_spans`` on the object ``name``: rows ``(file offset, buffer offset,
        length, slot)`` read into ``buffer``; a slot >= 0 takes the span's chunk CRC32Cs, a
        ``MUST_BE_ZERO`` span must be zero. Returns the lowest offset of a nonzero byte among
        those, or -1."""
        self.check_size(name, expect_size)
        data = buffer.numpy() if hasattr(buffer, "numpy") else np.asarray(buffer)
        # spans that follow each other both in the object and in the buffer (padding, then a
        # tensor, then padding) go as one range: one GET, not one per span
        pieces: list[tuple[int, Any]] = []
        run_f = run_b = run_n = -1
        for f, b, n, _ in spans:
            f, b, n = int(f), int(b), int(n)
            if n <= 0:
                continue
            if run_n >= 0 and f == run_f + run_n and b == run_b + run_n:
                run_n += n
                continue
            if run_n > 0:
                pieces.append((run_f, data[run_b : run_b + run_n]))
            run_f, run_b, run_n = f, b, n
        if run_n > 0:
            pieces.append((run_f, data[run_b : run_b + run_n]))
        self.store.read_pieces(
            f"{self.key}/{name}",
            pieces,
            expect_size=expect_size,
            etag=self._heads[name].etag,
            range_bytes=self.part_bytes,
            deadline=self.deadline,
        )
        native, nonzero = load(), -1
        for f, b, n, slot in spans:
            view = data[int(b) : int(b) + int(n)]
            if slot >= 0 and n > 0:
                count = -(-int(n) // chunk_bytes)
                native.chunk_crc32c(view, chunk_bytes, crc_out[int(slot) : int(slot) + count])
            elif slot == MUST_BE_ZERO and n > 0:
                hit = np.flatnonzero(view)
                if len(hit) and (nonzero < 0 or int(f) + int(hit[0]) < nonzero):
                    nonzero = int(f) + int(hit[0])
        return nonzero
