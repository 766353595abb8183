"""A shard manifest's tensor table decoded natively (``gpumem._C.build_tensors``), so that a
hundred thousand blocks do not cost a dozen Python objects each through ``json.loads`` first.

Accept-only, as ``format._fast_tensor`` is: the native decoder takes a strict subset of JSON
(ASCII strings without escapes, non-negative integers, each entry's keys once and all known) and
checks every rule of ``format._parse_tensor`` with the manifest's own ``chunk_bytes``,
``alignment``, ``files`` and meshes; the rest of the body goes through ``strict_json``. Anything
else (an error, a rare field, an odd spelling) returns None, and the caller decodes the whole
manifest the Python way, so every message stays the Python path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpumem import _strict_json as strict_json
from gpumem._native import load

_BIG = 1 << 62  # past int64 arithmetic: left to the Python path


@dataclass(frozen=True)
class Columns:
    """A decoded tensor table as arrays, for readers that need no object per entry.

    Attributes:
        extents: (extents, 5) int64: tensor index, position in the tensor, file (its index in
            the manifest's ``files``), offset, length; in tensor order, each tensor's in order.
        crcs: every chunk CRC32C of every tensor, in tensor order.
        counts: each tensor's number of chunk CRC32Cs.
    """

    extents: np.ndarray
    crcs: np.ndarray
    counts: np.ndarray


class Prebuilt(list):  # type: ignore[type-arg]
    """The entries (``format.TensorEntry``) of a tensor table, checked under ``rules``: (chunk,
    alignment, files, mesh dimensions, sharded), with its ``columns``. ``format.parse_shard``
    takes them as they are when its validated fields give the same rules."""

    def __init__(self, entries: list[Any], rules: tuple[Any, ...], columns: Columns):
        super().__init__(entries)
        self.rules = rules
        self.columns = columns


def decode(
    payload: bytes, version: int, sharded_version: int, types: tuple[type, type], itemsize: dict
) -> dict[str, Any] | None:
    """The body of a shard manifest with its ``tensors`` prebuilt, or None (decode it in Python).

    ``types``: the entry and box classes to build; ``itemsize``: dtype name -> bytes.
    """
    native = load()
    span = native.find_tensors(payload)
    if span is None:
        return None
    start, stop = span
    try:
        body = strict_json.loads(payload[:start] + b"[]" + payload[stop:])
    except (ValueError, RecursionError):
        return None  # the Python path reports it, at its own position
    rules = _rules(body, version >= sharded_version)
    if rules is None:
        return None
    chunk, align, files, ndims, sharded = rules
    built = native.build_tensors(
        payload, start, stop, chunk, align, files, itemsize, list(ndims), sharded, *types
    )
    if built is None:
        return None
    entries, extents, crcs, counts = built
    columns = Columns(
        np.frombuffer(extents, dtype=np.int64).reshape(-1, 5),
        np.frombuffer(crcs, dtype=np.int64),
        np.frombuffer(counts, dtype=np.int64),
    )
    body["tensors"] = Prebuilt(entries, rules, columns)
    return body


def _rules(body: Any, sharded: bool) -> tuple[Any, ...] | None:
    """The fields the tensor table is checked against, where they have the types the full check
    needs (it still checks their values: the prebuilt entries only count where they agree)."""
    if type(body) is not dict:
        return None
    chunk, align, files = body.get("chunk_bytes"), body.get("alignment"), body.get("files")
    meshes = body.get("meshes", [])
    if type(chunk) is not int or type(align) is not int or type(files) is not dict:
        return None
    if not (0 < chunk < _BIG and 0 < align < _BIG):
        return None
    if not all(type(k) is str and type(v) is int and 0 <= v < _BIG for k, v in files.items()):
        return None
    if type(meshes) is not list or not all(
        type(m) is dict and type(m.get("shape")) is list for m in meshes
    ):
        return None
    ndims = tuple(len(m["shape"]) for m in meshes)
    return chunk, align, files, ndims, sharded
