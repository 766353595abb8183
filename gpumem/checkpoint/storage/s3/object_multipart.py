"""Writes to the object store: small objects (plain and conditional: the commit primitive) and
multipart uploads straight from the caller's memory.

Integrity: gpumem computes every CRC32C itself (``gpumem.checksum``, the native kernel) and sends
it, so the store checks the bytes it received: each part with ``x-amz-checksum-crc32c``, the
object with the CRC32C of its whole bytes (``ChecksumType=FULL_OBJECT``: the part CRCs combined
with ``crc32c_combine``, the data is not read twice). A store that assembled something else is
caught by the checksum it reports back (``MultipartWrites._check_stored``).
"""

from __future__ import annotations

import errno
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from gpumem.checksum import crc32c, crc32c_combine

from ...errors import CheckpointIOError, CheckpointStateError
from .object_body import Body, Budget, as_bytes_view, crc32c_header, crc_of, cut_parts, zeros
from .object_deadline import Deadline
from .object_listing import ObjectListing, Upload
from .object_requests import NotFound, PreconditionFailed, S3Requests

MIN_PART = 5 << 20  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000  # S3: parts of one upload
DEFAULT_PART = 64 << 20
DEFAULT_BUDGET = 512 << 20  # bytes of parts in flight at once
WRITER = "gpumem-writer"  # metadata naming who wrote an object (see put_new)


@dataclass(frozen=True)
class Uploaded:
    """What one ``upload`` stored: the object's size, CRC32C, ETag and the parts' CRC32Cs."""

    key: str
    size: int
    crc32c: int
    etag: str
    part_crcs: tuple[int, ...]


class MultipartWrites:
    """Every write under one root (see the module docstring).

    Args:
        requests: the root's request layer.
        listing: its small requests (a commit's winner read back, an upload aborted).
    """

    def __init__(self, requests: S3Requests, listing: ObjectListing):
        self.requests, self.listing = requests, listing
        self._writer = uuid.uuid4().hex

    def put(self, key: str, data: Any, *, deadline: Deadline | None = None) -> str:
        """Store ``data`` (bytes-like, array or CPU tensor) at ``key`` unconditionally; its
        CRC32C is checked by the store. Returns the ETag."""
        return self._put([as_bytes_view(data)], key, deadline)

    def _put(
        self, segments: Sequence[memoryview], key: str, deadline: Deadline | None = None
    ) -> str:
        resp = self.requests.call(
            "write", self.requests.client.put_object, **self._put_args(key, segments)
        )
        return str(resp["ETag"])

    def put_new(self, key: str, data: Any, *, _check_winner: bool = True) -> bool:
        """Store ``data`` at ``key`` only if no object is there (``If-None-Match: *``): the
        commit primitive. Returns whether this call created it; of two writers racing for one
        key exactly one gets True.

        A lost response (a reset after the store wrote the object) makes botocore retry and
        the retry fail the precondition: so on a failed precondition the object's writer tag is
        read back, and a retry of this call's own write counts as the win it was.
        """
        args = self._put_args(key, [as_bytes_view(data)], IfNoneMatch="*")
        try:
            self.requests.call(
                "commit", self.requests.client.put_object, retry_conflict=True, **args
            )
            return True
        except PreconditionFailed:
            if not _check_winner:
                return False
            info = self.listing.head(key, metadata=True)
            return info is not None and info[1].get(WRITER) == args["Metadata"][WRITER]

    def put_over(self, key: str, data: Any, etag: str) -> str | None:
        """Replace the object at ``key`` only if its ETag is still ``etag`` (``If-Match``):
        moving a pointer without losing a concurrent move. Returns the new ETag, or None where
        another writer moved it first (or it is gone)."""
        try:
            resp = self.requests.call(
                "write",
                self.requests.client.put_object,
                retry_conflict=True,
                **self._put_args(key, [as_bytes_view(data)], IfMatch=etag),
            )
        except (PreconditionFailed, NotFound):
            return None
        return str(resp["ETag"])

    def _put_args(self, key: str, segments: Sequence[memoryview], **extra: Any) -> dict[str, Any]:
        body = Body(segments)
        return {
            "Bucket": self.requests.url.bucket,
            "Key": key,
            "Body": body,
            "ContentLength": len(body),
            "ChecksumCRC32C": crc32c_header(crc_of(segments)),
            "Metadata": {WRITER: f"{self._writer}-{uuid.uuid4().hex}"},
            **extra,
        }

    def upload(
        self,
        key: str,
        buffers: Sequence[Any],
        *,
        part_bytes: int = DEFAULT_PART,
        budget_bytes: int = DEFAULT_BUDGET,
        deadline: Deadline | None = None,
    ) -> Uploaded:
        """Store the concatenation of ``buffers`` (bytes-like, arrays, CPU tensors: e.g. the
        staging arena's segments) as one object, sent from that memory as it is.

        Parts of ``part_bytes`` (at least 5 MiB; a part may span several buffers) are sent
        ``max_concurrency`` at a time with at most ``budget_bytes`` of them in flight, each with
        its CRC32C; the object is completed with the CRC32C of the whole. On any failure the
        upload is aborted (nothing is left that a list or a restore would see) and the error
        raised.

        Raises:
            CheckpointStateError: a part size below 5 MiB, or more than 10,000 parts.
            CheckpointIOError: a part could not be stored after the retries.
        """
        if not isinstance(part_bytes, int) or part_bytes < MIN_PART:
            raise CheckpointStateError(f"part_bytes={part_bytes!r} must be an int >= {MIN_PART}")
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise CheckpointStateError(f"budget_bytes={budget_bytes!r} must be a positive int")
        parts = cut_parts([as_bytes_view(b) for b in buffers], part_bytes)
        if len(parts) > MAX_PARTS:
            raise CheckpointStateError(
                f"{self.requests.name(key)}: {len(parts)} parts of {part_bytes} bytes exceed S3's "
                f"{MAX_PARTS}; raise part_bytes"
            )
        sizes = [sum(len(seg) for seg in p) for p in parts]
        total = sum(sizes)
        if len(parts) <= 1:  # one request: a plain put carries the object's CRC32C
            segments = parts[0] if parts else []
            crc = crc_of(segments)
            etag = self._put(segments, key, deadline)
            return Uploaded(key, total, crc, etag, (crc,))
        created = self.requests.call(
            "write",
            self.requests.client.create_multipart_upload,
            Bucket=self.requests.url.bucket,
            Key=key,
            ChecksumAlgorithm="CRC32C",
            ChecksumType="FULL_OBJECT",
            Metadata={WRITER: self._writer},
            deadline=deadline,
        )
        upload_id = created["UploadId"]
        try:
            crcs, etags = self._send_parts(key, upload_id, parts, budget_bytes, deadline)
            whole = crcs[0]
            for size, crc in zip(sizes[1:], crcs[1:], strict=True):
                whole = crc32c_combine(whole, crc, size)
            done = self.requests.call(
                "write",
                self.requests.client.complete_multipart_upload,
                Bucket=self.requests.url.bucket,
                Key=key,
                UploadId=upload_id,
                ChecksumCRC32C=crc32c_header(whole),
                ChecksumType="FULL_OBJECT",
                MultipartUpload={
                    "Parts": [
                        {"PartNumber": i + 1, "ETag": etag, "ChecksumCRC32C": crc32c_header(c)}
                        for i, (etag, c) in enumerate(zip(etags, crcs, strict=True))
                    ]
                },
                deadline=deadline,
            )
        except BaseException:
            self.listing.abort(Upload(key, upload_id, 0.0))
            raise
        self._check_stored(key, done.get("ChecksumCRC32C"), whole, crcs, deadline)
        return Uploaded(key, total, whole, str(done["ETag"]), tuple(crcs))

    def _check_stored(
        self,
        key: str,
        stored: str | None,
        whole: int,
        crcs: list[int],
        deadline: Deadline | None = None,
    ) -> None:
        """The checksum the store computed over what it assembled must be gpumem's: a store
        that does not check each part's header (some compatibles do not) still reports it, in
        the completion's answer or else to a HEAD. On a mismatch the object is deleted (it is
        not what was sent) and the save fails."""
        if not stored:
            resp = self.requests.call(
                "write",
                self.requests.client.head_object,
                Bucket=self.requests.url.bucket,
                Key=key,
                ChecksumMode="ENABLED",
                deadline=deadline,
            )
            stored = resp.get("ChecksumCRC32C")
        if not stored:
            return
        if "-" in stored:  # composite: the CRC32C of the parts' CRC32Cs, and their count
            raw = b"".join(c.to_bytes(4, "big") for c in crcs)
            expected = f"{crc32c_header(crc32c(raw))}-{len(crcs)}"
        else:
            expected = crc32c_header(whole)
        if stored != expected:
            self.listing.delete([key])
            raise CheckpointIOError(
                f"{self.requests.name(key)}: the store assembled bytes whose CRC32C ({stored}) "
                f"differs from the one gpumem computed ({expected}): damaged in transit; the "
                "object was deleted and the save failed",
                errno=errno.EIO,
                filename=self.requests.name(key),
            )

    def upload_pieces(
        self, key: str, pieces: Sequence[tuple[int, Any]], size: int, **kw: Any
    ) -> Uploaded:
        """Store a ``size``-byte data file given as ``safe_fs.Dir.write_pieces`` takes one:
        ``(offset, buffer)`` extents (e.g. views of the staging arena), zero bytes between and
        after them; sent as ``upload`` sends (``kw``: its options), the zeros from one shared
        buffer.

        Raises:
            ValueError: extents that overlap or end past ``size``.
        """
        views: list[memoryview] = []
        at = 0
        for off, buf in sorted(pieces, key=lambda p: p[0]):
            view = as_bytes_view(buf)
            if off < at:
                raise ValueError(f"{key}: the extent at {off} overlaps the one ending at {at}")
            views += zeros(off - at)
            views.append(view)
            at = off + len(view)
        if at > size:
            raise ValueError(f"{key}: the extents end at {at}, past the file's {size} bytes")
        views += zeros(size - at)
        return self.upload(key, views, **kw)

    def _send_parts(
        self,
        key: str,
        upload_id: str,
        parts: list[list[memoryview]],
        budget_bytes: int,
        deadline: Deadline | None,
    ) -> tuple[list[int], list[str]]:
        """Send every part (see ``upload``); their CRC32Cs and ETags."""
        budget = Budget(budget_bytes)
        crcs = [0] * len(parts)
        etags = [""] * len(parts)
        failed = threading.Event()

        def send(i: int, taken: int) -> None:
            try:
                if failed.is_set():
                    return
                crcs[i] = crc_of(parts[i])
                body = Body(parts[i])
                resp = self.requests.call(
                    "write",
                    self.requests.client.upload_part,
                    Bucket=self.requests.url.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=i + 1,
                    Body=body,
                    ContentLength=len(body),
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=crc32c_header(crcs[i]),
                    deadline=deadline,
                )
                etags[i] = str(resp["ETag"])
            except BaseException:
                failed.set()
                raise
            finally:
                budget.give(taken)

        futures: list[Future[None]] = []
        with ThreadPoolExecutor(
            self.requests.max_concurrency, thread_name_prefix="gpumem-s3"
        ) as pool:
            for i, part in enumerate(parts):
                taken = budget.take(sum(len(seg) for seg in part))
                if failed.is_set():
                    budget.give(taken)
                    break
                futures.append(pool.submit(send, i, taken))
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed_futures = [f for f in done if f.exception() is not None]
            if failed_futures:
                failed.set()
                wait(futures)
                raise failed_futures[0].exception()  # type: ignore[misc]
        return crcs, etags
