"""An S3-protocol object store as a checkpoint needs it: multipart upload from memory, conditional
put, ranged read into a caller's buffer, list, delete and the incomplete uploads.

The client is boto3 (the optional extra ``gpumem[s3]``, imported only when an ``s3://`` root is
opened). obstore (Rust ``object_store``) moves bytes faster per core, but it takes and returns
its own buffers (a copy on each side), computes no CRC32C for the S3 checksum headers (its only
S3 checksum is SHA-256) and hides the multipart protocol behind ``put``, so neither a part's
checksum, nor the byte budget of the parts in flight, nor aborting and listing incomplete uploads
can be had from it. boto3 exposes each of those, is AWS's own client, reads credentials, region,
endpoint and profiles from the environment exactly as the AWS CLI does, and is released weekly.

Integrity: gpumem computes every CRC32C itself and sends it (``object_multipart``), so the store
checks the bytes it received; boto3's own checksumming is turned off (``when_required``): it
would read every byte again in Python.

Deadlines (``object_deadline``): every request ends within ``request_deadline_s`` (default
120 s, ``GPUMEM_S3_REQUEST_DEADLINE_S``), retries and back-off included, and the requests of one
save's or one restore's objects within ``deadline_s`` (default 3600 s, ``GPUMEM_S3_DEADLINE_S``)
all together; past either, the request is cut off and fails as ``CheckpointIOError`` (ETIMEDOUT)
naming what it did and the object.

Retries (``object_requests``): a transient fault (a 5xx or throttling answer, a reset or broken
connection, a timeout) is tried again, ``max_attempts`` (default 8, ``GPUMEM_S3_ATTEMPTS``) in
all, with exponential back-off and jitter that never runs past the deadline; a ranged read
whose body breaks off is resumed from the byte it reached; a range whose bytes fail the CRC32C
the caller gave is read again (``object_ranges.REREADS``) before it is called damaged.

Errors: a missing bucket, denied or missing credentials, an unreachable endpoint are
``CheckpointIOError`` (errno ENOENT, EACCES, ECONNREFUSED) naming the URL and what to do
(``object_requests``); an object whose size or checksum is not what the caller expected is
``CheckpointCorruptError``.

``S3Store`` composes the parts, each owning one concern: ``object_requests.S3Requests`` (the
client and the request funnel), ``object_listing.ObjectListing`` (HEAD, small reads, listing,
deletion, incomplete uploads), ``object_multipart.MultipartWrites`` (puts, conditional puts,
multipart uploads) and ``object_ranges.RangedReads`` (ranged reads into caller memory).
"""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ...errors import CheckpointIOError
from ..location import ObjectURL
from .object_deadline import Deadline
from .object_listing import SMALL_OBJECT, ObjectInfo, ObjectListing, Upload
from .object_multipart import MultipartWrites, Uploaded
from .object_ranges import RangedReads
from .object_requests import S3Requests


class S3Store:
    """The objects under one ``s3://bucket/prefix`` root (see the module docstring).

    Args:
        url: the root (``ObjectURL`` or its text).
        endpoint_url: the S3 endpoint (a local server, MinIO, R2, ...); None: ``AWS_ENDPOINT_URL``
            (``AWS_ENDPOINT_URL_S3``) or AWS itself, as boto3 resolves it.
        region: None: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's, else us-east-1.
        profile: a named profile of ``~/.aws/config``; None: ``AWS_PROFILE`` or the default.
        max_attempts: attempts per request, and per ranged read whose body breaks off; None:
            ``GPUMEM_S3_ATTEMPTS``, else 8.
        max_concurrency: requests in flight at once in ``upload`` and ``read_ranges``.
        connect_timeout_s, read_timeout_s: botocore's, for each connect and each wait for
            the socket.
        request_deadline_s: the most one request may take, retries included; None:
            ``GPUMEM_S3_REQUEST_DEADLINE_S``, else 120.
        deadline_s: the most the requests of one save's or one restore's objects may take
            together (``deadline``); None: ``GPUMEM_S3_DEADLINE_S``, else 3600.
        check: probe the root at once (``check``), so a bad URL, bucket or credentials fail here.
        writable: the probe also checks that the bucket honours conditional writes.

    Raises:
        CheckpointStateError: boto3 is not installed (``pip install 'gpumem[s3]'``), or the URL
            is malformed.
        CheckpointIOError: from the probe (see ``check``).

    Example:
        >>> store = S3Store("s3://bucket/run", endpoint_url="http://127.0.0.1:9000")
        >>> up = store.upload("run/shard", [tensor])  # doctest: +SKIP
        >>> store.read_into("run/shard", 0, out, object_size=up.size)  # doctest: +SKIP
    """

    def __init__(
        self,
        url: ObjectURL | str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        max_attempts: int | None = None,
        max_concurrency: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        request_deadline_s: float | None = None,
        deadline_s: float | None = None,
        check: bool = True,
        writable: bool = True,
    ):
        self.url = url if isinstance(url, ObjectURL) else ObjectURL.parse(url)
        self.requests = S3Requests(
            self.url,
            endpoint_url=endpoint_url,
            region=region,
            profile=profile,
            max_attempts=max_attempts,
            max_concurrency=max_concurrency,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            request_deadline_s=request_deadline_s,
            deadline_s=deadline_s,
        )
        self.listing = ObjectListing(self.requests)
        self.writes = MultipartWrites(self.requests, self.listing)
        self.reads = RangedReads(self.requests, self.listing)
        if check:
            self.check(writable=writable)

    @property
    def endpoint(self) -> str:
        """The endpoint the client talks to."""
        return str(self.requests.endpoint)

    def deadline(self, what: str) -> Deadline:
        """A deadline for an operation (``what``: "save of s3://...") of many requests,
        ``deadline_s`` from now: pass it as their ``deadline``."""
        return self.requests.deadline(what)

    @property
    def max_attempts(self) -> int:
        return self.requests.max_attempts

    @property
    def max_concurrency(self) -> int:
        return self.requests.max_concurrency

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        self.requests.max_concurrency = value

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
        self.requests.call("open", self.requests.client.head_bucket, Bucket=self.url.bucket)
        if not writable:
            return
        probe = self.url.key(f".gpumem-probe-{uuid.uuid4().hex}")
        try:
            if not self.writes.put_new(probe, b"probe"):
                raise CheckpointIOError(f"{self.url}: a fresh probe object already existed")
            if self.writes.put_new(probe, b"again", _check_winner=False):
                raise CheckpointIOError(
                    f"{self.url} ({self.endpoint}) ignores conditional writes (If-None-Match: "
                    "* overwrote an existing object), so two jobs could both commit one step; "
                    "use a store that supports them (AWS S3, MinIO, R2, Ceph RGW >= 18)",
                    errno=errno.EOPNOTSUPP,
                    filename=str(self.url),
                )
        finally:
            self.listing.delete([probe])

    # ------------------------------------------------------------------ the parts' calls
    # (each documented where it lives)

    def head(
        self, key: str, metadata: bool = False, *, deadline: Deadline | None = None
    ) -> ObjectInfo | tuple[ObjectInfo, dict[str, str]] | None:
        """``ObjectListing.head``."""
        return self.listing.head(key, metadata, deadline=deadline)

    def get(
        self, key: str, max_bytes: int = SMALL_OBJECT, *, deadline: Deadline | None = None
    ) -> tuple[bytes, str] | None:
        """``ObjectListing.get``."""
        return self.listing.get(key, max_bytes, deadline=deadline)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """``ObjectListing.list``."""
        return self.listing.list(prefix)

    def delete(self, keys: Sequence[str]) -> None:
        """``ObjectListing.delete``."""
        self.listing.delete(keys)

    def uploads(self) -> list[Upload]:
        """``ObjectListing.uploads``."""
        return self.listing.uploads()

    def abort(self, upload: Upload) -> None:
        """``ObjectListing.abort``."""
        self.listing.abort(upload)

    def put(self, key: str, data: Any, *, deadline: Deadline | None = None) -> str:
        """``MultipartWrites.put``."""
        return self.writes.put(key, data, deadline=deadline)

    def put_new(self, key: str, data: Any) -> bool:
        """``MultipartWrites.put_new``: the commit primitive."""
        return self.writes.put_new(key, data)

    def put_over(self, key: str, data: Any, etag: str) -> str | None:
        """``MultipartWrites.put_over``."""
        return self.writes.put_over(key, data, etag)

    def upload(self, key: str, buffers: Sequence[Any], **kw: Any) -> Uploaded:
        """``MultipartWrites.upload`` (``kw``: ``part_bytes``, ``budget_bytes``, ``deadline``)."""
        return self.writes.upload(key, buffers, **kw)

    def upload_pieces(
        self, key: str, pieces: Sequence[tuple[int, Any]], size: int, **kw: Any
    ) -> Uploaded:
        """``MultipartWrites.upload_pieces``."""
        return self.writes.upload_pieces(key, pieces, size, **kw)

    def read_into(self, key: str, offset: int, out: Any, **kw: Any) -> None:
        """``RangedReads.read_into``."""
        self.reads.read_into(key, offset, out, **kw)

    def read_pieces(self, key: str, pieces: Sequence[tuple[int, Any]], **kw: Any) -> int:
        """``RangedReads.read_pieces``."""
        return self.reads.read_pieces(key, pieces, **kw)
