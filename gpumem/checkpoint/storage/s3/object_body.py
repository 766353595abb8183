"""The bytes of an object-store request, as views of the caller's memory: a body that sends
them without a copy, their cut into multipart parts, their CRC32C as the S3 checksum headers
carry it, and the byte budget of the parts in flight (see ``object_store``)."""

from __future__ import annotations

import base64
import bisect
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from gpumem._native import byte_view
from gpumem.checksum import crc32c


def crc32c_header(value: int) -> str:
    """A CRC32C as the S3 checksum headers carry it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def parse_crc32c_header(text: str) -> int | None:
    """The CRC32C of an ``x-amz-checksum-crc32c`` value (None: a composite ``...-N`` one)."""
    if "-" in text:
        return None
    raw = base64.b64decode(text)
    if len(raw) != 4:
        raise ValueError(f"{text!r} is not a CRC32C checksum header")
    return int.from_bytes(raw, "big")


class Budget:
    """Bytes of parts in flight: ``take`` waits until they fit (one part larger than the whole
    budget goes alone)."""

    def __init__(self, nbytes: int):
        self._total = self._free = nbytes
        self._cv = threading.Condition()

    def take(self, n: int) -> int:
        need = min(n, self._total)
        with self._cv:
            self._cv.wait_for(lambda: self._free >= need)
            self._free -= need
        return need

    def give(self, n: int) -> None:
        with self._cv:
            self._free += n
            self._cv.notify_all()


class Body:
    """A read-only, seekable file over memoryview segments whose ``read`` returns slices of
    them: the HTTP stack sends the caller's memory as it is (no host copy; a read may be short,
    ending at a segment's end), and botocore can rewind it to sign the payload or to retry."""

    def __init__(self, segments: Sequence[memoryview]):
        self._segs = [s for s in segments if len(s)]
        self._starts = list(itertools.accumulate((len(s) for s in self._segs), initial=0))
        self._len, self._pos = self._starts[-1], 0

    def read(self, n: int | None = -1) -> memoryview:
        if self._pos >= self._len or n == 0:
            return memoryview(b"")
        i = bisect.bisect_right(self._starts, self._pos) - 1
        seg, at = self._segs[i], self._pos - self._starts[i]
        end = len(seg) if n is None or n < 0 else min(len(seg), at + n)
        self._pos += end - at
        return seg[at:end]

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, self._len)[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


_ZEROS = memoryview(bytes(1 << 20))


def zeros(n: int) -> list[memoryview]:
    """``n`` zero bytes as views of one shared buffer."""
    return [_ZEROS[: min(len(_ZEROS), n - i)] for i in range(0, n, len(_ZEROS))]


def crc_of(segments: Sequence[memoryview]) -> int:
    crc = 0
    for seg in segments:
        crc = crc32c(seg, crc)
    return crc


def cut_parts(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """The concatenation of ``views`` cut into parts of ``part_bytes`` (the last shorter), each
    a list of slices of the views: a part may span several of them (small ones, the zero
    padding between extents), nothing is copied."""
    parts: list[list[memoryview]] = []
    cur: list[memoryview] = []
    cur_len = 0
    for v in views:
        pos = 0
        while pos < len(v):
            take = min(len(v) - pos, part_bytes - cur_len)
            cur.append(v[pos : pos + take])
            cur_len += take
            pos += take
            if cur_len == part_bytes:
                parts.append(cur)
                cur, cur_len = [], 0
    if cur:
        parts.append(cur)
    return parts


def as_bytes_view(data: Any, writable: bool = False) -> memoryview:
    """A flat ``uint8`` memoryview of bytes-like data, a numpy array or a CPU tensor (no copy)."""
    view = memoryview(byte_view(data, writable=writable))
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
