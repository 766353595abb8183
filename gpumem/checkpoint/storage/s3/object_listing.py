"""What is under an object-store root and the small requests on it: HEAD, a small object read
whole (a manifest, a pointer), listing, deletion, and the incomplete multipart uploads."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...errors import CheckpointCorruptError, CheckpointIOError
from .object_body import parse_crc32c_header
from .object_deadline import Deadline
from .object_requests import NotFound, S3Requests

SMALL_OBJECT = 64 << 20  # the most ``get`` reads into memory (manifests, pointers)


@dataclass(frozen=True)
class ObjectInfo:
    """One object as the store lists or describes it.

    Attributes:
        key: its key.
        size: its length in bytes.
        etag: its ETag (changes whenever the object does).
        crc32c: the CRC32C of its whole bytes when the store keeps one (None: unknown).
        modified: when it was last written, seconds since the epoch (listing only; None:
            not known).
    """

    key: str
    size: int
    etag: str
    crc32c: int | None = None
    modified: float | None = None


@dataclass(frozen=True)
class Upload:
    """An incomplete multipart upload (a crashed or killed writer leaves these)."""

    key: str
    upload_id: str
    initiated: float  # seconds since the epoch


def sized(found: object, name: str, size: int) -> ObjectInfo:
    """``found`` (a HEAD's answer for the data object ``name``) where it holds the ``size``
    bytes its manifest records: checked before a byte is read.

    Raises:
        CheckpointCorruptError: it is missing, or holds another size.
    """
    if found is None:
        raise CheckpointCorruptError(f"{name}: data object missing", path=name)
    assert isinstance(found, ObjectInfo)
    if found.size != size:
        raise CheckpointCorruptError(
            f"{name} holds {found.size} bytes, not the {size} its manifest records "
            "(truncated or replaced): not read",
            path=name,
        )
    return found


class ObjectListing:
    """HEAD, small reads, listing, deletion and incomplete uploads under one root.

    Args:
        requests: the root's request layer.
    """

    def __init__(self, requests: S3Requests):
        self.requests = requests
        self.url = requests.url

    def head(
        self, key: str, metadata: bool = False, *, deadline: Deadline | None = None
    ) -> ObjectInfo | tuple[ObjectInfo, dict[str, str]] | None:
        """The object at ``key`` (with its user metadata when asked), or None if there is none;
        ``deadline``: of the operation it is part of (``S3Requests.watch``)."""
        try:
            resp = self.requests.call(
                "read",
                self.requests.client.head_object,
                Bucket=self.url.bucket,
                Key=key,
                ChecksumMode="ENABLED",
                deadline=deadline,
            )
        except NotFound:
            return None
        crc_text = resp.get("ChecksumCRC32C")
        info = ObjectInfo(
            key,
            int(resp["ContentLength"]),
            str(resp["ETag"]),
            parse_crc32c_header(crc_text) if crc_text else None,
        )
        return (info, dict(resp.get("Metadata", {}))) if metadata else info

    def get(
        self, key: str, max_bytes: int = SMALL_OBJECT, *, deadline: Deadline | None = None
    ) -> tuple[bytes, str] | None:
        """The bytes and ETag of a small object (a manifest, a pointer); None if there is none.
        The request and its body's read are one request to the deadlines.

        Raises:
            CheckpointCorruptError: it is larger than ``max_bytes`` (checked before reading),
                or shorter than it said.
            CheckpointIOError: the store failed, or answered too slowly.
        """
        with self.requests.watch("read", self.requests.name(key), deadline):
            return self._get(key, max_bytes, deadline)

    def _get(self, key: str, max_bytes: int, deadline: Deadline | None) -> tuple[bytes, str] | None:
        name = self.requests.name(key)
        try:
            resp = self.requests.call(
                "read",
                self.requests.client.get_object,
                Bucket=self.url.bucket,
                Key=key,
                deadline=deadline,
            )
        except NotFound:
            return None
        body = resp["Body"]
        try:
            size = int(resp["ContentLength"])
            if size > max_bytes:
                raise CheckpointCorruptError(
                    f"{name} is {size} bytes, more than the {max_bytes} such an object may "
                    "have: not read",
                    path=name,
                )
            try:
                data = bytes(body.read())
            except self.requests.read_errors() as exc:
                raise CheckpointIOError(f"reading {name} failed: {exc}") from exc
            if len(data) != size:
                raise CheckpointCorruptError(
                    f"{name} ended after {len(data)} of its {size} bytes", path=name
                )
        finally:
            body.close()
        return data, str(resp["ETag"])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with the root's prefix + ``prefix``, in key order."""
        full = (
            self.url.key(prefix) if prefix else (f"{self.url.prefix}/" if self.url.prefix else "")
        )
        pages = self.requests.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.url.bucket, Prefix=full
        )
        for page in self.requests.pages("list", pages):
            for item in page.get("Contents", []):
                modified = item.get("LastModified")
                yield ObjectInfo(
                    item["Key"],
                    int(item["Size"]),
                    str(item["ETag"]),
                    modified=modified.timestamp() if modified is not None else None,
                )

    def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects at ``keys`` (missing ones are no error).

        Raises:
            CheckpointIOError: the store refused to delete some (naming the first).
        """
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # S3: at most 1000 keys a request
            resp = self.requests.call(
                "delete",
                self.requests.client.delete_objects,
                Bucket=self.url.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )
            errors = resp.get("Errors", [])
            if errors:
                e = errors[0]
                raise CheckpointIOError(
                    f"deleting {len(errors)} objects under {self.url} failed; first: "
                    f"{e.get('Key')}: {e.get('Code')} {e.get('Message')}",
                    errno=errno.EACCES if self.requests.denied(e.get("Code")) else errno.EIO,
                    filename=str(self.url),
                )

    def uploads(self) -> list[Upload]:
        """The incomplete multipart uploads under the root (a killed writer's, say)."""
        pages = self.requests.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.url.bucket, Prefix=self.url.key("") if self.url.prefix else ""
        )
        found = []
        for page in self.requests.pages("list uploads", pages):
            for u in page.get("Uploads", []):
                found.append(Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp()))
        return found

    def abort(self, upload: Upload) -> None:
        """Abort an incomplete upload: the store drops its parts (a gone upload is no error)."""
        with contextlib.suppress(NotFound):
            self.requests.call(
                "abort",
                self.requests.client.abort_multipart_upload,
                Bucket=self.url.bucket,
                Key=upload.key,
                UploadId=upload.upload_id,
            )
