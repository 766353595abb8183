"""An S3-protocol object store as a checkpoint needs it: multipart upload from memory, conditional
put, ranged read into a caller's buffer, list, delete and the incomplete uploads.

The client is boto3 (the optional extra ``gpumem[s3]``, imported only when an ``s3://`` root is
opened). obstore (Rust ``object_store``) moves bytes faster per core, but it takes and returns
its own buffers (a copy on each side), computes no CRC32C for the S3 checksum headers (its only
S3 checksum is SHA-256) and hides the multipart protocol behind ``put``, so neither a part's
checksum, nor the byte budget of the parts in flight, nor aborting and listing incomplete uploads
can be had from it. boto3 exposes each of those, is AWS's own client, reads credentials, region,
endpoint and profiles from the environment exactly as the AWS CLI does, and is released weekly.

Integrity: gpumem computes every CRC32C itself (``gpumem.checksum``, the native kernel) and sends
it, so the store checks the bytes it received: each part with ``x-amz-checksum-crc32c``, the
object with the CRC32C of its whole bytes (``ChecksumType=FULL_OBJECT``: the part CRCs combined
with ``crc32c_combine``, the data is not read twice). boto3's own checksumming is turned off
(``when_required``): it would read every byte again in Python.

Retries: botocore's ``standard`` mode retries a request on 503 SlowDown, 500/502/504, throttling
and connection errors, with exponential back-off and jitter; a ranged read whose body breaks off
mid-stream (which botocore does not retry) is resumed here from the byte it reached.

Errors: a missing bucket, denied or missing credentials, an unreachable endpoint are
``CheckpointIOError`` (errno ENOENT, EACCES, ECONNREFUSED) naming the URL and what to do; an
object whose size or checksum is not what the caller expected is ``CheckpointCorruptError``.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpumem._native import load
from gpumem.checksum import crc32c, crc32c_combine

from ...errors import CheckpointCorruptError, CheckpointIOError, CheckpointStateError
from ..location import ObjectURL
from .object_body import (
    Body,
    Budget,
    as_bytes_view,
    crc32c_header,
    crc_of,
    cut_parts,
    parse_crc32c_header,
    zeros,
)

MIN_PART = 5 << 20  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000  # S3: parts of one upload
DEFAULT_PART = 64 << 20
DEFAULT_BUDGET = 512 << 20  # bytes of parts in flight at once
SMALL_OBJECT = 64 << 20  # the most ``get`` reads into memory (manifests, pointers)
_READ_BLOCK = 4 << 20
_WRITER = "gpumem-writer"  # metadata naming who wrote an object (see put_new)

_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
_MISSING = {"NoSuchBucket"}
_NO_KEY = {"NoSuchKey", "NoSuchUpload", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
_BAD_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidChecksum"}


@dataclass(frozen=True)
class ObjectInfo:
    """One object as the store lists or describes it.

    Attributes:
        key: its key.
        size: its length in bytes.
        etag: its ETag (changes whenever the object does).
        crc32c: the CRC32C of its whole bytes when the store keeps one (None: unknown).
    """

    key: str
    size: int
    etag: str
    crc32c: int | None = None


@dataclass(frozen=True)
class Upload:
    """An incomplete multipart upload (a crashed or killed writer leaves these)."""

    key: str
    upload_id: str
    initiated: float  # seconds since the epoch


@dataclass(frozen=True)
class Uploaded:
    """What one ``upload`` stored: the object's size, CRC32C, ETag and the parts' CRC32Cs."""

    key: str
    size: int
    crc32c: int
    etag: str
    part_crcs: tuple[int, ...]


class _S3Requests:
    """The requests under a root: small reads, listing, deletion, incomplete uploads, and the
    one funnel every call goes through (``_call``: retries, and one clear error per cause).
    Split from ``S3Store`` by what it does; only ``S3Store`` is built."""

    url: ObjectURL
    client: Any
    endpoint: str
    max_attempts: int
    max_concurrency: int
    _botocore: Any
    _writer: str

    def head(
        self, key: str, metadata: bool = False
    ) -> ObjectInfo | tuple[ObjectInfo, dict[str, str]] | None:
        """The object at ``key`` (with its user metadata when asked), or None if there is none."""
        try:
            resp = self._call(
                "read",
                self.client.head_object,
                Bucket=self.url.bucket,
                Key=key,
                ChecksumMode="ENABLED",
            )
        except _NotFound:
            return None
        crc_text = resp.get("ChecksumCRC32C")
        info = ObjectInfo(
            key,
            int(resp["ContentLength"]),
            str(resp["ETag"]),
            parse_crc32c_header(crc_text) if crc_text else None,
        )
        return (info, dict(resp.get("Metadata", {}))) if metadata else info

    def get(self, key: str, max_bytes: int = SMALL_OBJECT) -> tuple[bytes, str] | None:
        """The bytes and ETag of a small object (a manifest, a pointer); None if there is none.

        Raises:
            CheckpointCorruptError: it is larger than ``max_bytes`` (checked before reading),
                or shorter than it said.
        """
        try:
            resp = self._call("read", self.client.get_object, Bucket=self.url.bucket, Key=key)
        except _NotFound:
            return None
        body = resp["Body"]
        try:
            size = int(resp["ContentLength"])
            if size > max_bytes:
                raise CheckpointCorruptError(
                    f"{self._name(key)} is {size} bytes, more than the {max_bytes} such an "
                    "object may have: not read",
                    path=self._name(key),
                )
            data = self._read_body(body, key)
            if len(data) != size:
                raise CheckpointCorruptError(
                    f"{self._name(key)} ended after {len(data)} of its {size} bytes",
                    path=self._name(key),
                )
        finally:
            body.close()
        return data, str(resp["ETag"])

    def _read_body(self, body: Any, key: str) -> bytes:
        try:
            return bytes(body.read())
        except self._transient_read_errors() as exc:
            raise CheckpointIOError(f"reading {self._name(key)} failed: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with the root's prefix + ``prefix``, in key order."""
        full = (
            self.url.key(prefix) if prefix else (f"{self.url.prefix}/" if self.url.prefix else "")
        )
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.url.bucket, Prefix=full
        )
        for page in self._pages("list", pages):
            for item in page.get("Contents", []):
                yield ObjectInfo(item["Key"], int(item["Size"]), str(item["ETag"]))

    def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects at ``keys`` (missing ones are no error).

        Raises:
            CheckpointIOError: the store refused to delete some (naming the first).
        """
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # S3: at most 1000 keys a request
            resp = self._call(
                "delete",
                self.client.delete_objects,
                Bucket=self.url.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )
            errors = resp.get("Errors", [])
            if errors:
                e = errors[0]
                raise CheckpointIOError(
                    f"deleting {len(errors)} objects under {self.url} failed; first: "
                    f"{e.get('Key')}: {e.get('Code')} {e.get('Message')}",
                    errno=errno.EACCES if e.get("Code") in _DENIED else errno.EIO,
                    filename=str(self.url),
                )

    def uploads(self) -> list[Upload]:
        """The incomplete multipart uploads under the root (a killed writer's, say)."""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.url.bucket, Prefix=self.url.key("") if self.url.prefix else ""
        )
        found = []
        for page in self._pages("list uploads", pages):
            for u in page.get("Uploads", []):
                found.append(Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp()))
        return found

    def abort(self, upload: Upload) -> None:
        """Abort an incomplete upload: the store drops its parts (a gone upload is no error)."""
        with contextlib.suppress(_NotFound):
            self._call(
                "abort",
                self.client.abort_multipart_upload,
                Bucket=self.url.bucket,
                Key=upload.key,
                UploadId=upload.upload_id,
            )

    def _name(self, key: str) -> str:
        return f"s3://{self.url.bucket}/{key}"

    def _pages(self, doing: str, pages: Any) -> Iterator[Any]:
        it = iter(pages)
        while True:
            try:
                page = self._call(doing, next, it)
            except StopIteration:
                return
            yield page

    def _call(self, doing: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with botocore's errors as gpumem's (see the module
        docstring); ``retry_conflict``: a 409 ConditionalRequestConflict (a concurrent
        conditional write in progress) is retried with back-off."""
        retry_conflict = kwargs.pop("retry_conflict", False)
        exc_mod = self._botocore.exceptions
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except exc_mod.ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _PRECONDITION or status == 412:
                    raise _PreconditionFailed() from exc
                conflict = code in _CONFLICT or status == 409
                if conflict and retry_conflict and attempt < self.max_attempts:
                    _back_off(attempt)
                    continue
                if doing != "open" and (
                    code in _NO_KEY or (status == 404 and code not in _MISSING)
                ):
                    raise _NotFound() from exc
                raise self._client_error(doing, code, status, err.get("Message", "")) from exc
            except exc_mod.NoCredentialsError:
                raise CheckpointIOError(
                    f"{self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run on a machine with an "
                    "instance role",
                    errno=errno.EACCES,
                    filename=str(self.url),
                ) from None
            except (exc_mod.EndpointConnectionError, exc_mod.ConnectTimeoutError) as exc:
                raise CheckpointIOError(
                    f"{self.url}: cannot reach the store at {self.endpoint} ({exc}); check "
                    "endpoint_url / AWS_ENDPOINT_URL and the network",
                    errno=errno.ECONNREFUSED,
                    filename=str(self.url),
                ) from None
            except (exc_mod.ConnectionError, exc_mod.HTTPClientError) as exc:
                raise CheckpointIOError(
                    f"{doing} {self.url} failed after {self.max_attempts} attempts: {exc}",
                    errno=errno.EIO,
                    filename=str(self.url),
                ) from exc
        raise AssertionError("unreachable")

    def _client_error(self, doing: str, code: str, status: Any, message: str) -> Exception:
        where = f"{self.url} ({self.endpoint})"
        if code in _MISSING or (doing == "open" and status == 404):
            return CheckpointIOError(
                f"{where}: the bucket {self.url.bucket!r} does not exist; create it or fix the URL",
                errno=errno.ENOENT,
                filename=str(self.url),
            )
        if code in _DENIED or status == 403:
            return CheckpointIOError(
                f"{where}: access denied ({code or status}: {message}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and that they may "
                f"read and write {self.url}",
                errno=errno.EACCES,
                filename=str(self.url),
            )
        if code in _BAD_DIGEST:
            return CheckpointIOError(
                f"{doing} {where}: the store received bytes whose CRC32C differs from the one "
                f"gpumem computed ({code}): damaged in transit; the save failed",
                errno=errno.EIO,
                filename=str(self.url),
            )
        return CheckpointIOError(
            f"{doing} {where} failed: {code or status}: {message}",
            errno=errno.EIO,
            filename=str(self.url),
        )

    def _transient_read_errors(self) -> tuple[type[BaseException], ...]:
        exc = self._botocore.exceptions
        from urllib3.exceptions import HTTPError as Urllib3Error

        return (
            exc.IncompleteReadError,
            exc.ResponseStreamingError,
            exc.ReadTimeoutError,
            exc.ConnectionError,
            Urllib3Error,
            ConnectionError,
        )


class _S3Writes(_S3Requests):
    """Writes: small objects (plain and conditional) and multipart uploads from memory."""

    def put(self, key: str, data: Any) -> str:
        """Store ``data`` (bytes-like, array or CPU tensor) at ``key`` unconditionally; its
        CRC32C is checked by the store. Returns the ETag."""
        return self._put([as_bytes_view(data)], key)

    def _put(self, segments: Sequence[memoryview], key: str) -> str:
        resp = self._call("write", self.client.put_object, **self._put_args(key, segments))
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
            self._call("commit", self.client.put_object, retry_conflict=True, **args)
            return True
        except _PreconditionFailed:
            if not _check_winner:
                return False
            info = self.head(key, metadata=True)
            return info is not None and info[1].get(_WRITER) == args["Metadata"][_WRITER]

    def put_over(self, key: str, data: Any, etag: str) -> str | None:
        """Replace the object at ``key`` only if its ETag is still ``etag`` (``If-Match``):
        moving a pointer without losing a concurrent move. Returns the new ETag, or None where
        another writer moved it first (or it is gone)."""
        try:
            resp = self._call(
                "write",
                self.client.put_object,
                retry_conflict=True,
                **self._put_args(key, [as_bytes_view(data)], IfMatch=etag),
            )
        except (_PreconditionFailed, _NotFound):
            return None
        return str(resp["ETag"])

    def _put_args(self, key: str, segments: Sequence[memoryview], **extra: Any) -> dict[str, Any]:
        body = Body(segments)
        return {
            "Bucket": self.url.bucket,
            "Key": key,
            "Body": body,
            "ContentLength": len(body),
            "ChecksumCRC32C": crc32c_header(crc_of(segments)),
            "Metadata": {_WRITER: f"{self._writer}-{uuid.uuid4().hex}"},
            **extra,
        }

    def upload(
        self,
        key: str,
        buffers: Sequence[Any],
        *,
        part_bytes: int = DEFAULT_PART,
        budget_bytes: int = DEFAULT_BUDGET,
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
                f"{self._name(key)}: {len(parts)} parts of {part_bytes} bytes exceed S3's "
                f"{MAX_PARTS}; raise part_bytes"
            )
        sizes = [sum(len(seg) for seg in p) for p in parts]
        total = sum(sizes)
        if len(parts) <= 1:  # one request: a plain put carries the object's CRC32C
            segments = parts[0] if parts else []
            crc = crc_of(segments)
            etag = self._put(segments, key)
            return Uploaded(key, total, crc, etag, (crc,))
        created = self._call(
            "write",
            self.client.create_multipart_upload,
            Bucket=self.url.bucket,
            Key=key,
            ChecksumAlgorithm="CRC32C",
            ChecksumType="FULL_OBJECT",
            Metadata={_WRITER: self._writer},
        )
        upload_id = created["UploadId"]
        try:
            crcs, etags = self._send_parts(key, upload_id, parts, budget_bytes)
            whole = crcs[0]
            for size, crc in zip(sizes[1:], crcs[1:], strict=True):
                whole = crc32c_combine(whole, crc, size)
            done = self._call(
                "write",
                self.client.complete_multipart_upload,
                Bucket=self.url.bucket,
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
            )
        except BaseException:
            self.abort(Upload(key, upload_id, 0.0))
            raise
        self._check_stored(key, done.get("ChecksumCRC32C"), whole, crcs)
        return Uploaded(key, total, whole, str(done["ETag"]), tuple(crcs))

    def _check_stored(self, key: str, stored: str | None, whole: int, crcs: list[int]) -> None:
        """The checksum the store computed over what it assembled must be gpumem's: a store
        that does not check each part's header (some compatibles do not) still reports it, in
        the completion's answer or else to a HEAD. On a mismatch the object is deleted (it is
        not what was sent) and the save fails."""
        if not stored:
            resp = self._call(
                "write",
                self.client.head_object,
                Bucket=self.url.bucket,
                Key=key,
                ChecksumMode="ENABLED",
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
            self.delete([key])
            raise CheckpointIOError(
                f"{self._name(key)}: the store assembled bytes whose CRC32C ({stored}) differs "
                f"from the one gpumem computed ({expected}): damaged in transit; the object was "
                "deleted and the save failed",
                errno=errno.EIO,
                filename=self._name(key),
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
        self, key: str, upload_id: str, parts: list[list[memoryview]], budget_bytes: int
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
                resp = self._call(
                    "write",
                    self.client.upload_part,
                    Bucket=self.url.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=i + 1,
                    Body=body,
                    ContentLength=len(body),
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=crc32c_header(crcs[i]),
                )
                etags[i] = str(resp["ETag"])
            except BaseException:
                failed.set()
                raise
            finally:
                budget.give(taken)

        futures: list[Future[None]] = []
        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="gpumem-s3") as pool:
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


class S3Store(_S3Writes):
    """The objects under one ``s3://bucket/prefix`` root (see the module docstring).

    Args:
        url: the root (``ObjectURL`` or its text).
        endpoint_url: the S3 endpoint (a local server, MinIO, R2, ...); None: ``AWS_ENDPOINT_URL``
            (``AWS_ENDPOINT_URL_S3``) or AWS itself, as boto3 resolves it.
        region: None: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's, else us-east-1.
        profile: a named profile of ``~/.aws/config``; None: ``AWS_PROFILE`` or the default.
        max_attempts: attempts per request (botocore's standard retry mode), and per ranged
            read whose body breaks off.
        max_concurrency: requests in flight at once in ``upload`` and ``read_ranges``.
        connect_timeout_s, read_timeout_s: per request.
        check: probe the root at once (``check``), so a bad URL, bucket or credentials fail here.
        writable: the probe also checks that the bucket honours conditional writes.

    Raises:
        CheckpointStateError: boto3 is not installed (``pip install 'gpumem[s3]'``), or the URL
            is malformed.
        CheckpointIOError: from the probe (see ``check``).
    """

    def __init__(
        self,
        url: ObjectURL | str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        max_attempts: int = 8,
        max_concurrency: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        check: bool = True,
        writable: bool = True,
    ):
        self.url = url if isinstance(url, ObjectURL) else ObjectURL.parse(url)
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise CheckpointStateError(f"max_attempts={max_attempts!r} must be an int >= 1")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise CheckpointStateError(f"max_concurrency={max_concurrency!r} must be an int >= 1")
        boto3, self._botocore = _import_boto3()
        from botocore.config import Config

        try:
            session = boto3.session.Session(profile_name=profile, region_name=region)
        except self._botocore.exceptions.ProfileNotFound as exc:
            raise CheckpointStateError(
                f"{self.url}: {exc}; name a profile of ~/.aws/config or unset AWS_PROFILE"
            ) from None
        config = Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max_concurrency + 4,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # a custom endpoint (MinIO, a local server) rarely resolves bucket.host names
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )
        self.endpoint = endpoint_url or self.client.meta.endpoint_url
        self.max_attempts, self.max_concurrency = max_attempts, max_concurrency
        self._writer = uuid.uuid4().hex
        if check:
            self.check(writable=writable)

    # ------------------------------------------------------------------ the probe

    def check(self, writable: bool = True) -> None:
        """Fail now, with one clear error, where the root cannot hold checkpoints: the bucket
        does not exist, the credentials are missing or denied, the endpoint cannot be reached,
        or (``writable``) the store ignores ``If-None-Match`` (two jobs could both commit a
        step). The conditional-write probe writes one object twice under the prefix and
        deletes it.

        Raises:
            CheckpointIOError: naming the URL, the cause and what to do.
        """
        self._call("open", self.client.head_bucket, Bucket=self.url.bucket)
        if not writable:
            return
        probe = self.url.key(f".gpumem-probe-{uuid.uuid4().hex}")
        try:
            if not self.put_new(probe, b"probe"):
                raise CheckpointIOError(f"{self.url}: a fresh probe object already existed")
            if self.put_new(probe, b"again", _check_winner=False):
                raise CheckpointIOError(
                    f"{self.url} ({self.endpoint}) ignores conditional writes (If-None-Match: "
                    "* overwrote an existing object), so two jobs could both commit one step; "
                    "use a store that supports them (AWS S3, MinIO, R2, Ceph RGW >= 18)",
                    errno=errno.EOPNOTSUPP,
                    filename=str(self.url),
                )
        finally:
            self.delete([probe])

    # ------------------------------------------------------------------ reads

    def read_into(
        self,
        key: str,
        offset: int,
        out: Any,
        *,
        object_size: int,
        etag: str | None = None,
        crc: int | None = None,
        range_bytes: int = 16 << 20,
    ) -> None:
        """Fill ``out`` (a writable bytes-like, array or CPU tensor) with the object's bytes
        ``[offset, offset + len(out))`` by ranged GETs: one, or for more than two
        ``range_bytes`` that many at a time (``max_concurrency``), all pinned to one version of
        the object (``If-Match`` on the ETag a HEAD gave, or ``etag``).

        ``object_size`` is what the manifest says the object holds: the range is checked
        against it before any request, and the store's answer (``Content-Range``) against it
        before any byte is read, so a truncated or grown object is refused, not read. With
        ``etag`` the read fails if the object changed since (``If-Match``); with ``crc`` the
        bytes read must have that CRC32C. A body that breaks off is resumed where it stopped.

        Raises:
            CheckpointCorruptError: the object is missing, has another size, changed, or its
                bytes do not match ``crc``.
            CheckpointIOError: the store could not be read after the retries.
        """
        view = as_bytes_view(out, writable=True)
        n = len(view)
        name = self._name(key)
        if offset < 0 or offset + n > object_size:
            raise CheckpointCorruptError(
                f"{name}: bytes [{offset}, {offset + n}) lie outside its {object_size} bytes",
                path=name,
            )
        if n == 0:
            return
        if n <= 2 * range_bytes or self.max_concurrency == 1:
            self._read_resuming(key, offset, view, object_size, etag)
        else:
            if etag is None:  # every range from the same object, not a mix of two versions
                found = self.head(key)
                if found is None:
                    raise CheckpointCorruptError(f"{name} is missing", path=name)
                assert isinstance(found, ObjectInfo)
                etag = found.etag
            starts = range(0, n, range_bytes)
            with ThreadPoolExecutor(
                min(self.max_concurrency, len(starts)), thread_name_prefix="gpumem-s3-get"
            ) as pool:
                for f in [
                    pool.submit(
                        self._read_resuming,
                        key,
                        offset + a,
                        view[a : a + range_bytes],
                        object_size,
                        etag,
                    )
                    for a in starts
                ]:
                    f.result()
        if crc is not None and crc32c(view) != crc:
            raise CheckpointCorruptError(
                f"{name}: bytes [{offset}, {offset + n}) fail their CRC32C (expected "
                f"{crc:#010x}); the object was damaged or replaced",
                path=name,
            )

    def read_pieces(
        self,
        key: str,
        pieces: Sequence[tuple[int, Any]],
        *,
        expect_size: int,
        chunk_bytes: int = 0,
        crc_index: Sequence[int] | None = None,
        crc_out: Any = None,
        etag: str | None = None,
        range_bytes: int = 16 << 20,
    ) -> int:
        """``gpumem.reader.read_file``'s contract on an object: fill every ``(offset, buffer)``
        piece (``max_concurrency`` ranged GETs at once, all pinned to one version), and with
        ``chunk_bytes`` put the CRC32C of every chunk of each piece (from its start) into
        ``crc_out[crc_index[i] + k]`` (a negative index: none). The object must hold exactly
        ``expect_size`` bytes, checked before a byte is read (with ``etag``: by the caller's
        HEAD, whose version every read is pinned to). A piece larger than ``range_bytes`` is
        read as several ranges at once. Returns the bytes read.

        Raises:
            CheckpointCorruptError: the object is missing, of another size, or changed.
            CheckpointIOError: the store failed after the retries.
            ValueError: CRC slots out of range, or chunk_bytes without crc_out.
        """
        name = self._name(key)
        found = self.head(key) if etag is None else ObjectInfo(key, expect_size, etag)
        if found is None:
            raise CheckpointCorruptError(f"{name} is missing", path=name)
        assert isinstance(found, ObjectInfo)
        if found.size != expect_size:
            raise CheckpointCorruptError(
                f"{name} holds {found.size} bytes, not the {expect_size} its manifest records: "
                "not read",
                path=name,
            )
        views = [(off, as_bytes_view(buf, writable=True)) for off, buf in pieces]
        index = [-1] * len(views) if crc_index is None else list(crc_index)
        out = None
        if chunk_bytes:
            if crc_out is None or len(index) != len(views):
                raise ValueError("chunk_bytes > 0 needs crc_out and one crc_index per piece")
            out = crc_out.numpy() if hasattr(crc_out, "numpy") else crc_out
            for (_, view), slot in zip(views, index, strict=True):
                if slot >= 0 and slot + -(-len(view) // chunk_bytes) > len(out):
                    raise ValueError(f"crc_index {slot} leaves too few slots in crc_out")

        # a large piece goes as several ranges in flight, each a whole number of chunks (so
        # each range's CRC slots follow from its place in the piece)
        step = max(range_bytes // chunk_bytes, 1) * chunk_bytes if chunk_bytes else range_bytes
        work = [
            (
                off + a,
                view[a : a + step],
                slot + a // chunk_bytes if slot >= 0 and out is not None else -1,
            )
            for (off, view), slot in zip(views, index, strict=True)
            for a in range(0, len(view), step)
        ]

        def one(j: int) -> None:
            off, view, slot = work[j]
            self.read_into(
                key, off, view, object_size=expect_size, etag=found.etag, range_bytes=1 << 62
            )
            if out is not None and slot >= 0:
                count = -(-len(view) // chunk_bytes)
                data = np.frombuffer(view, dtype=np.uint8)  # a view: nothing copied
                load().chunk_crc32c(data, chunk_bytes, out[slot : slot + count])

        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="gpumem-s3-get") as pool:
            for f in [pool.submit(one, j) for j in range(len(work))]:
                f.result()
        return sum(len(v) for _, v in views)

    def _read_resuming(
        self, key: str, offset: int, view: memoryview, size: int, etag: str | None
    ) -> None:
        """One ranged GET into ``view``, resumed from where its body broke off."""
        done = 0
        for attempt in range(1, self.max_attempts + 1):
            try:
                self._read_range(key, offset, view, done, size, etag)
                return
            except _Transient as exc:
                done = exc.done
                if attempt == self.max_attempts:
                    raise CheckpointIOError(
                        f"reading {self._name(key)} failed after {attempt} attempts: "
                        f"{exc.__cause__}"
                    ) from exc
                _back_off(attempt)

    def _read_range(
        self, key: str, offset: int, view: memoryview, done: int, size: int, etag: str | None
    ) -> int:
        """Read ``view[done:]`` from ``offset + done``; returns the bytes read so far."""
        name = self._name(key)
        first, last = offset + done, offset + len(view) - 1
        extra = {"IfMatch": etag} if etag else {}
        try:
            resp = self._call(
                "read",
                self.client.get_object,
                Bucket=self.url.bucket,
                Key=key,
                Range=f"bytes={first}-{last}",
                **extra,
            )
        except _NotFound:
            raise CheckpointCorruptError(f"{name} is missing", path=name) from None
        except _PreconditionFailed:
            raise CheckpointCorruptError(
                f"{name} changed after it was written (its ETag is no longer {etag})", path=name
            ) from None
        body = resp["Body"]
        try:
            total = _range_total(resp.get("ContentRange"))
            length = int(resp["ContentLength"])
            if total != size or length != last - first + 1:
                raise CheckpointCorruptError(
                    f"{name} holds {total} bytes (range {resp.get('ContentRange')}), not the "
                    f"{size} its manifest records: not read",
                    path=name,
                )
            try:
                while done < len(view):
                    block = body.read(min(_READ_BLOCK, len(view) - done))
                    if not block:
                        raise _Transient(done) from ConnectionError(
                            f"the body ended after {done} of {len(view)} bytes"
                        )
                    view[done : done + len(block)] = block
                    done += len(block)
            except self._transient_read_errors() as exc:
                raise _Transient(done) from exc
        finally:
            body.close()
        return done


class _PreconditionFailed(Exception):
    """412: a conditional write or read whose condition did not hold."""


class _NotFound(Exception):
    """404 for a key (not for the bucket, which is an error of its own)."""


class _Transient(Exception):
    """A ranged read's body broke off after ``done`` bytes: resumed by ``_read_resuming``."""

    def __init__(self, done: int):
        super().__init__(f"broke off after {done} bytes")
        self.done = done


def _range_total(content_range: str | None) -> int | None:
    """The object size of a ``Content-Range: bytes a-b/total`` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def _back_off(attempt: int) -> None:
    """Exponential back-off with full jitter, as botocore's standard mode: up to 2^attempt
    x 50 ms, at most 5 s."""
    import random

    time.sleep(random.uniform(0, min(5.0, 0.05 * 2**attempt)))


def _import_boto3() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore
        import botocore.exceptions
    except ImportError:
        raise CheckpointStateError("an s3:// root needs boto3: pip install 'gpumem[s3]'") from None
    return boto3, botocore
