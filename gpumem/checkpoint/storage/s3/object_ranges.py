"""Ranged reads from the object store straight into the caller's buffers: one object's bytes
(``read_into``) or many pieces of it with each chunk's CRC32C as it lands (``read_pieces``,
``gpumem.reader.read_file``'s contract), every range pinned to one version of the object.

A ranged read whose body breaks off mid-stream (which botocore does not retry) is resumed here
from the byte it reached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpumem._native import load
from gpumem.checksum import crc32c

from ...errors import CheckpointCorruptError, CheckpointIOError
from .object_body import as_bytes_view
from .object_deadline import Deadline
from .object_listing import ObjectInfo, ObjectListing, sized
from .object_requests import NotFound, PreconditionFailed, S3Requests

_READ_BLOCK = 4 << 20
REREADS = 2  # a range whose bytes fail the CRC32C the caller gave is read again this often


class RangedReads:
    """Ranged reads under one root (see the module docstring).

    Args:
        requests: the root's request layer.
        listing: its HEADs (the version a read is pinned to).
    """

    def __init__(self, requests: S3Requests, listing: ObjectListing):
        self.requests, self.listing = requests, listing

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
        deadline: Deadline | None = None,
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
        name = self.requests.name(key)
        if offset < 0 or offset + n > object_size:
            raise CheckpointCorruptError(
                f"{name}: bytes [{offset}, {offset + n}) lie outside its {object_size} bytes",
                path=name,
            )
        if n == 0:
            return
        for _ in range(REREADS + 1):
            self._fill(key, offset, view, object_size, etag, range_bytes, deadline)
            if crc is None or crc32c(view) == crc:
                return
            # a fault in transit (a flipped byte) is read again before the bytes are damaged
        raise CheckpointCorruptError(
            f"{name}: bytes [{offset}, {offset + n}) fail their CRC32C (expected "
            f"{crc:#010x}), read {REREADS + 1} times; the object was damaged or replaced",
            path=name,
        )

    def _fill(
        self,
        key: str,
        offset: int,
        view: memoryview,
        object_size: int,
        etag: str | None,
        range_bytes: int,
        deadline: Deadline | None,
    ) -> None:
        """``read_into``'s ranged GETs, without the CRC check."""
        n = len(view)
        if n <= 2 * range_bytes or self.requests.max_concurrency == 1:
            self._read_resuming(key, offset, view, object_size, etag, deadline)
            return
        if etag is None:  # every range from the same object, not a mix of two versions
            found = self.listing.head(key, deadline=deadline)
            if found is None:
                name = self.requests.name(key)
                raise CheckpointCorruptError(f"{name} is missing", path=name)
            assert isinstance(found, ObjectInfo)
            etag = found.etag
        starts = range(0, n, range_bytes)
        threads = min(self.requests.max_concurrency, len(starts))
        _all(
            threads,
            [
                functools.partial(
                    self._read_resuming,
                    key,
                    offset + a,
                    view[a : a + range_bytes],
                    object_size,
                    etag,
                    deadline,
                )
                for a in starts
            ],
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
        deadline: Deadline | None = None,
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
        head = (
            ObjectInfo(key, expect_size, etag)
            if etag
            else self.listing.head(key, deadline=deadline)
        )
        found = sized(head, self.requests.name(key), expect_size)
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
                key,
                off,
                view,
                object_size=expect_size,
                etag=found.etag,
                range_bytes=1 << 62,
                deadline=deadline,
            )
            if out is not None and slot >= 0:
                count = -(-len(view) // chunk_bytes)
                data = np.frombuffer(view, dtype=np.uint8)  # a view: nothing copied
                load().chunk_crc32c(data, chunk_bytes, out[slot : slot + count])

        _all(self.requests.max_concurrency, [functools.partial(one, j) for j in range(len(work))])
        return sum(len(v) for _, v in views)

    def _read_resuming(
        self,
        key: str,
        offset: int,
        view: memoryview,
        size: int,
        etag: str | None,
        deadline: Deadline | None = None,
    ) -> None:
        """One ranged GET into ``view``, resumed from where its body broke off: one request
        to the deadlines (``S3Requests.watch``), its resumptions included."""
        done, name = 0, self.requests.name(key)
        with self.requests.watch("read", name, deadline) as guard:
            for attempt in range(1, self.requests.max_attempts + 1):
                try:
                    self._read_range(key, offset, view, done, size, etag, deadline)
                    return
                except _Transient as exc:
                    done = exc.done
                    if attempt == self.requests.max_attempts:
                        raise CheckpointIOError(
                            f"reading {name} failed after {attempt} attempts: {exc.__cause__}"
                        ) from exc
                    if not self.requests.pause(attempt, guard):
                        raise self.requests.too_slow("read", name, deadline, guard) from exc

    def _read_range(
        self,
        key: str,
        offset: int,
        view: memoryview,
        done: int,
        size: int,
        etag: str | None,
        deadline: Deadline | None,
    ) -> int:
        """Read ``view[done:]`` from ``offset + done``; returns the bytes read so far."""
        name = self.requests.name(key)
        first, last = offset + done, offset + len(view) - 1
        extra = {"IfMatch": etag} if etag else {}
        try:
            resp = self.requests.call(
                "read",
                self.requests.client.get_object,
                Bucket=self.requests.url.bucket,
                Key=key,
                Range=f"bytes={first}-{last}",
                deadline=deadline,
                **extra,
            )
        except NotFound:
            raise CheckpointCorruptError(f"{name} is missing", path=name) from None
        except PreconditionFailed:
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
            except self.requests.read_errors() as exc:
                raise _Transient(done) from exc
        finally:
            body.close()
        return done


class _Transient(Exception):
    """A ranged read's body broke off after ``done`` bytes: resumed by ``_read_resuming``."""

    def __init__(self, done: int):
        super().__init__(f"broke off after {done} bytes")
        self.done = done


def _all(threads: int, calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` on ``threads`` threads; the first failure is raised once those running
    end, and those not started never start (each would wait out its own deadline)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="gpumem-s3-get") as pool:
        futures = [pool.submit(c) for c in calls]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _range_total(content_range: str | None) -> int | None:
    """The object size of a ``Content-Range: bytes a-b/total`` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None
