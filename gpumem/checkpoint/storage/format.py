"""The on-disk format, reader and writer: manifests framed with their own CRC32C and version, built
by one writer and validated field by field by one reader.

A checkpoint is a directory ``step-<N>`` holding::

    MANIFEST              main manifest: step, world size, versions, one entry per rank's shard
    manifest-r00000       shard manifest of rank 0: tensor table + non-tensor state as JSON
    data-r00000-0000.bin  raw tensor bytes of rank 0, each extent aligned, zero padding between

Each manifest is one header line and a JSON body::

    gpumem-checkpoint 1 000000001234 1a2b3c4d\\n{...json...}

version, body length (12 digits) and the CRC32C (hex) of everything before the CRC field plus the
body, so a flipped byte anywhere in the file is detected before the JSON is parsed. Nothing in the
format is executed on load: JSON only, tensors are raw bytes whose dtype comes from an allow-list.
The layout inside data files is canonical (first extent at 0, each next one at the aligned end of
the previous one, the file ends with the last extent), so there is no room for hidden bytes.

A *replicated* checkpoint (``Checkpointer(..., replicated=True)``) stores each tensor of the
replicated sections (``REPLICATED_KEYS``) in one shard only: every manifest carries
``"replicated": true`` and every shard manifest an ``owners`` map from each such tensor to the
rank whose shard holds it. Its manifests are framed as version 2, so a reader that predates the
field refuses them by version instead of reporting missing tensors; version 1 is still read.

A *sharded* checkpoint (DTensor state: FSDP2, tensor parallel) adds to each tensor entry that is
a block of a global tensor a ``global`` field: the global shape, the block's offsets, the mesh
(an index into the shard manifest's ``meshes``) and the placements (see ``capture.dtensor``). Its
state tree refers to such tensors as ``{"__dtensor__": name}``, resolved over all shards. The main
manifest carries ``"sharded": true``; its manifests are framed as version 3 (a sharded save's
rank that holds no DTensor writes its own shard manifest as version 1 or 2).

The version is explicit on both sides: the writer (``shard_manifest``, ``main_manifest``) states
it from what the checkpoint holds (``format_version``), never from the body's keys, and the reader
checks that a manifest uses only the fields its version has and carries the marker its version
requires (``_check_version``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpumem import _strict_json as strict_json
from gpumem._version import __version__
from gpumem.checksum import crc32c
from gpumem.units import align_up

from ..capture.boxes import Box, Mesh
from ..capture.codec import DTYPE_NAMES, DTYPES, ITEMSIZE
from ..errors import CheckpointCorruptError
from . import tensor_table

FORMAT_VERSION = 1  # written for every checkpoint that is not replicated
REPLICATED_VERSION = 2  # written for replicated ones: adds the "replicated" and "owners" fields
SHARDED_VERSION = 3  # written for sharded ones: adds "sharded", "meshes" and tensors' "global"
READ_VERSIONS = (FORMAT_VERSION, REPLICATED_VERSION, SHARDED_VERSION)
MAIN_MANIFEST = "MANIFEST"
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{1,19})$")

MAX_MANIFEST_BYTES = 1 << 28  # 256 MiB of JSON: far above any real state, bounds a hostile file
MAX_FILE_BYTES = 1 << 50
MAX_TENSORS = 1 << 24
MAX_NDIM = 64
MAX_NAME = 1024
MAX_WORLD = 1 << 20
MAX_CREATED = 253402300799  # seconds since the epoch at the end of year 9999: what dates can show
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEADER = re.compile(rb"^gpumem-checkpoint (\d{1,4}) (\d{12}) ([0-9a-f]{8})\n")
# the marker fields each version adds, and the version that brought them (``owners`` needs
# ``replicated``, a tensor's ``global`` needs version 3: both checked where they are parsed)
_SINCE = {"replicated": 2, "sharded": 3, "meshes": 3}


def shard_manifest_name(rank: int) -> str:
    return f"manifest-r{rank:05d}"


def data_file_name(rank: int, batch: int) -> str:
    return f"data-r{rank:05d}-{batch:04d}.bin"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


# ---------------------------------------------------------------------------------------------
# framing


def format_version(*, replicated: bool, sharded: bool) -> int:
    """The version a manifest is written as: 3 for sharded state, else 2 for replicated, else 1."""
    if sharded:
        return SHARDED_VERSION
    return REPLICATED_VERSION if replicated else FORMAT_VERSION


def encode_manifest(body: dict[str, Any], version: int) -> tuple[bytes, int]:
    """Serialize a manifest body framed as ``version``; returns (file bytes, manifest CRC32C)."""
    if version not in READ_VERSIONS:
        raise ValueError(f"manifest version {version} is not one of {READ_VERSIONS}")
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False, sort_keys=False).encode()
    prefix = f"gpumem-checkpoint {version} {len(payload):012d} ".encode()
    crc = crc32c(payload, crc32c(prefix))
    return prefix + f"{crc:08x}\n".encode() + payload, crc


def decode_manifest(
    data: bytes, path: str, *, native_tensors: bool = False
) -> tuple[dict[str, Any], int, int]:
    """Check framing and CRC of manifest bytes, then parse the JSON body; returns (body, CRC,
    version). Its fields are checked against the version by ``parse_main``/``parse_shard``.

    ``native_tensors`` (a shard manifest): decode its tensor table natively where it can
    (``tensor_table``); the body's ``tensors`` is then a ``tensor_table.Prebuilt`` of entries
    that ``parse_shard`` takes as they are. Where it cannot, the same body as without it."""
    m = _HEADER.match(data[:64])
    if not m:
        raise CheckpointCorruptError(
            f"{path}: not a gpumem checkpoint manifest (bad header line)", path=path
        )
    length, stored = int(m.group(2)), int(m.group(3), 16)
    payload = data[m.end() :]
    if len(payload) != length:
        raise CheckpointCorruptError(
            f"{path}: manifest body is {len(payload)} bytes, "
            f"header says {length} (truncated or damaged)",
            path=path,
        )
    crc = crc32c(payload, crc32c(data[: m.start(3)]))
    if crc != stored:
        raise CheckpointCorruptError(
            f"{path}: manifest CRC32C mismatch (stored {stored:08x}, computed {crc:08x})", path=path
        )
    version = int(m.group(1))
    if version not in READ_VERSIONS:
        raise CheckpointCorruptError(
            f"{path}: manifest format version {version}; this gpumem reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}",
            path=path,
        )
    if native_tensors:
        types = (TensorEntry, Box)
        body = tensor_table.decode(payload, version, SHARDED_VERSION, types, ITEMSIZE)
        if body is not None:
            return body, crc, version
    try:
        body = strict_json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(
            f"{path}: manifest JSON is invalid: {exc}", path=path
        ) from None
    if not isinstance(body, dict):
        raise CheckpointCorruptError(f"{path}: manifest body is not a JSON object", path=path)
    return body, crc, version


def _check_version(c: _Checker, body: dict[str, Any], version: int, marker: str) -> None:
    """The manifest uses only fields its version has, and a version 2 / 3 manifest carries what
    makes it one (``replicated``; ``marker``: ``sharded`` in a main, ``meshes`` in a shard
    manifest)."""
    for key, since in _SINCE.items():
        if key in body and version < since:
            raise c.fail(f"manifest has field {key!r}, which version {version} does not have")
    if version == REPLICATED_VERSION and body.get("replicated") is not True:
        raise c.fail("manifest is framed as version 2 (replicated) but not marked replicated")
    if version == SHARDED_VERSION and marker not in body:
        raise c.fail(f"manifest is framed as version 3 (sharded) but lacks field {marker!r}")


# ---------------------------------------------------------------------------------------------
# validated views of manifests


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: where its bytes are and what they must hash to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32c: tuple[int, ...]  # one per chunk_bytes chunk of the tensor's bytes
    extents: tuple[tuple[str, int, int], ...]  # (file, offset, length), in tensor byte order
    # a block of a global tensor (sharded checkpoints): where it lies, on which mesh, how placed
    box: Box | None = None
    mesh: int = -1  # index into the shard manifest's meshes (-1: unknown, written through DCP)
    placements: tuple[str, ...] = ()
    tensor: str = ""  # the global tensor this block belongs to (its name; usually ``name``)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ShardManifest:
    rank: int
    world_size: int
    step: int
    chunk_bytes: int
    alignment: int
    files: dict[str, int]
    tensors: tuple[TensorEntry, ...]
    state: Any  # tagged JSON tree; tensor references are checked against `tensors` by the decoder
    crc: int = 0
    replicated: bool = False  # part of a replicated checkpoint: see `owners`
    # replicated checkpoints: every replicated tensor -> the rank whose shard holds it (the same
    # map in every shard); the tensors listed here are exactly those it maps to this rank
    owners: dict[str, int] = field(default_factory=dict)
    meshes: tuple[Mesh, ...] = ()  # sharded checkpoints: the meshes its global blocks lie on
    version: int = FORMAT_VERSION
    # ``tensors`` as arrays where the native decoder built them (``tensor_table.Columns``)
    table: tensor_table.Columns | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ShardRef:
    rank: int
    file: str
    crc32c: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint is, from its main manifest (``verify`` also checked every byte).

    Attributes:
        step: training step it was saved at.
        path: the checkpoint directory.
        nbytes: tensor bytes over all ranks.
        created: save time, seconds since the epoch.
        world_size: number of ranks that wrote shards.
        manifest_crc32c: CRC32C of the main manifest (what ``latest`` carries).
        versions: gpumem / torch / python versions that wrote it.
        shards: one reference per rank.
        replicated: the replicated state was written once, spread over the shards.
        sharded: holds blocks of global (DTensor) tensors, which restore reshards.
        format_version: the version its main manifest is framed as.
    """

    step: int
    path: str
    nbytes: int
    created: float
    world_size: int
    manifest_crc32c: int
    versions: dict[str, str] = field(default_factory=dict)
    shards: tuple[ShardRef, ...] = ()
    replicated: bool = False
    sharded: bool = False
    format_version: int = FORMAT_VERSION


class _Checker:
    """Field accessors that raise CheckpointCorruptError naming the file and the field."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, what: str, tensor: str | None = None) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: {what}", path=self.path, tensor=tensor)

    def get(
        self, obj: Any, key: str, kind: type | tuple[type, ...], where: str = "manifest"
    ) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"{where} lacks field {key!r}")
        value = obj[key]
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.fail(f"{where} field {key!r} has type {type(value).__name__}")
        return value

    def int_in(self, obj: Any, key: str, lo: int, hi: int, where: str = "manifest") -> int:
        value = self.get(obj, key, int, where)
        if not lo <= value <= hi:
            raise self.fail(f"{where} field {key!r} = {value} is outside [{lo}, {hi}]")
        return value

    def file_name(self, name: Any, where: str) -> str:
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in (".", ".."):
            raise self.fail(f"{where}: file name {name!r} is not a plain file name")
        return name


def parse_main(body: dict[str, Any], path: str, crc: int, version: int) -> CheckpointInfo:
    """Validate a main manifest body (framed as ``version``)."""
    c = _Checker(path)
    if c.get(body, "format", str) != "gpumem-checkpoint":
        raise c.fail("manifest is not a gpumem main manifest")
    _check_version(c, body, version, "sharded")
    step = c.int_in(body, "step", 0, 2**63 - 1)
    world = c.int_in(body, "world_size", 1, MAX_WORLD)
    created = c.get(body, "created", (int, float))
    if not 0 <= created <= MAX_CREATED:  # also refuses inf (1e400 parses as inf)
        raise c.fail(f"manifest field 'created' = {str(created)[:40]} is not a time up to 9999")
    versions = c.get(body, "versions", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        raise c.fail("manifest field 'versions' must map names to strings")
    shards_raw = c.get(body, "shards", list)
    if len(shards_raw) != world:
        raise c.fail(f"manifest lists {len(shards_raw)} shards for world size {world}")
    shards = []
    for i, s in enumerate(shards_raw):
        where = f"shard {i}"
        if c.int_in(s, "rank", 0, MAX_WORLD, where) != i:
            raise c.fail(f"{where} has rank {s['rank']}")
        name = c.file_name(c.get(s, "file", str, where), where)
        shards.append(
            ShardRef(
                i,
                name,
                c.int_in(s, "crc32c", 0, 2**32 - 1, where),
                c.int_in(s, "nbytes", 0, MAX_FILE_BYTES, where),
            )
        )
    nbytes = sum(s.nbytes for s in shards)
    replicated = c.get(body, "replicated", bool) if "replicated" in body else False
    sharded = c.get(body, "sharded", bool) if "sharded" in body else False
    return CheckpointInfo(
        step,
        str(Path(path).parent),
        nbytes,
        float(created),
        world,
        crc,
        dict(versions),
        tuple(shards),
        replicated,
        sharded,
        version,
    )


def parse_shard(body: dict[str, Any], path: str, crc: int, version: int) -> ShardManifest:
    """Validate a shard manifest body (framed as ``version``): every field typed and bounded, the
    layout canonical."""
    c = _Checker(path)
    if c.get(body, "format", str) != "gpumem-checkpoint-shard":
        raise c.fail("manifest is not a gpumem shard manifest")
    _check_version(c, body, version, "meshes")
    world = c.int_in(body, "world_size", 1, MAX_WORLD)
    rank = c.int_in(body, "rank", 0, world - 1)
    step = c.int_in(body, "step", 0, 2**63 - 1)
    chunk = c.int_in(body, "chunk_bytes", 4096, 1 << 30)
    align = c.int_in(body, "alignment", 1, 1 << 20)
    for value, key in ((chunk, "chunk_bytes"), (align, "alignment")):
        if value & (value - 1):
            raise c.fail(f"manifest field {key!r} = {value} is not a power of two")
    files_raw = c.get(body, "files", dict)
    files = {}
    for name, size in files_raw.items():
        c.file_name(name, "files")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            raise c.fail(f"file {name!r} has invalid size {size!r}")
        files[name] = size
    meshes = _parse_meshes(c, body) if "meshes" in body else ()
    raw = c.get(body, "tensors", list)
    if len(raw) > MAX_TENSORS:
        raise c.fail(f"manifest lists {len(raw)} tensors, over the {MAX_TENSORS} limit")
    tensors, names = [], set()
    per_file: dict[str, list[tuple[int, int, str]]] = {f: [] for f in files}
    sharded = version >= SHARDED_VERSION
    rules = (chunk, align, files, tuple(len(m.shape) for m in meshes), sharded)
    native = raw if isinstance(raw, tensor_table.Prebuilt) else None
    if native is not None and native.rules != rules:  # cannot happen: both read this body
        raise c.fail("manifest tensor table was checked under other fields")
    if native is not None:  # built natively: each name once and each file's layout checked
        tensors, names, per_file = list(native), {t.name for t in native}, {}
    for i, t in enumerate(raw if native is None else ()):
        # the fast path only accepts; anything it does not accept gets the full check and its
        # message (a hundred thousand blocks decode in a fraction of the full check's time)
        entry = _fast_tensor(t, chunk, align, files, meshes, sharded) or _parse_tensor(
            c, t, i, chunk, align, files, meshes, sharded
        )
        if entry.name in names:
            raise c.fail(f"tensor name {entry.name!r} appears twice", entry.name)
        names.add(entry.name)
        for f, off, length in entry.extents:
            per_file[f].append((off, length, entry.name))
        tensors.append(entry)
    for f, extents in per_file.items():
        extents.sort()
        expected = 0
        for off, length, name in extents:
            if off != align_up(expected, align):
                raise c.fail(
                    f"{f}: tensor {name!r} at offset {off}, the "
                    f"layout puts it at {align_up(expected, align)}",
                    name,
                )
            expected = off + length
        if files[f] != expected:
            raise c.fail(f"{f}: listed as {files[f]} bytes, its extents end at {expected}")
    replicated, owners = _parse_owners(c, body, rank, world, names)
    return ShardManifest(
        rank,
        world,
        step,
        chunk,
        align,
        files,
        tuple(tensors),
        body.get("state"),
        crc,
        replicated,
        owners,
        meshes,
        version,
        native.columns if native is not None else None,
    )


_PLACEMENT = re.compile(r"^(R|S\(\d{1,2}\)|SS\(\d{1,2},\d{1,9}\))$")


def _parse_meshes(c: _Checker, body: dict[str, Any]) -> tuple[Mesh, ...]:
    """The ``meshes`` of a sharded shard manifest: shape, optional dimension names, ranks."""
    raw = c.get(body, "meshes", list)
    if len(raw) > MAX_TENSORS:
        raise c.fail(f"manifest lists {len(raw)} meshes, over the {MAX_TENSORS} limit")
    out = []
    for i, m in enumerate(raw):
        where = f"mesh {i}"
        shape = c.get(m, "shape", list, where)
        ranks = c.get(m, "ranks", list, where)
        names = c.get(m, "names", (list, type(None)), where)
        if not 0 < len(shape) <= MAX_NDIM or not all(
            _is_int(d) and 0 < d <= MAX_WORLD for d in shape
        ):
            raise c.fail(f"{where}: shape {shape[:8]!r} is invalid")
        if len(ranks) != math.prod(shape) or len(ranks) > MAX_WORLD:
            raise c.fail(f"{where}: {len(ranks)} ranks for shape {shape}")
        if not all(_is_int(r) and 0 <= r < MAX_WORLD for r in ranks) or len(set(ranks)) != len(
            ranks
        ):
            raise c.fail(f"{where}: ranks must be distinct integers in [0, {MAX_WORLD})")
        if names is not None and (
            len(names) != len(shape)
            or not all(isinstance(n, str) and 0 < len(n) <= 64 for n in names)
        ):
            raise c.fail(f"{where}: names {names[:8]!r} do not name its {len(shape)} dimensions")
        out.append(Mesh(tuple(shape), tuple(names) if names is not None else None, tuple(ranks)))
    return tuple(out)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_global(
    c: _Checker, g: Any, name: str, shape: tuple[int, ...], meshes: tuple[Mesh, ...]
) -> tuple[Box, int, tuple[str, ...], str]:
    """A tensor entry's ``global`` field: the block ``shape`` lies at ``offsets`` inside a global
    tensor of shape ``shape`` (field), on mesh ``mesh`` with ``placements`` (both absent for
    blocks written through DCP), optionally naming the global tensor (``tensor``; default: the
    entry's name)."""
    where = f"tensor {name!r} global"
    gshape = c.get(g, "shape", list, where)
    offsets = c.get(g, "offsets", list, where)
    if len(gshape) != len(shape) or len(offsets) != len(shape):
        raise c.fail(
            f"{where}: shape {gshape[:8]} / offsets {offsets[:8]} for a block of "
            f"{len(shape)} dimensions",
            name,
        )
    for o, s, d in zip(offsets, shape, gshape, strict=True):
        if not (_is_int(o) and _is_int(d) and o >= 0 and 0 <= d <= MAX_FILE_BYTES) or o + s > d:
            raise c.fail(
                f"{where}: block at {offsets[:8]} of shape {list(shape)[:8]} lies "
                f"outside the global shape {gshape[:8]}",
                name,
            )
    tensor = name
    if "tensor" in g:  # the global tensor's name, where a shard holds several blocks of it
        tensor = c.get(g, "tensor", str, where)
        _check_name(c, tensor, where)
    if "mesh" not in g and "placements" not in g:  # written through DCP: the layout is unknown
        return Box(tuple(gshape), tuple(offsets), shape), -1, (), tensor
    mesh = c.get(g, "mesh", int, where)
    if not 0 <= mesh < len(meshes):
        raise c.fail(f"{where}: mesh {mesh} is not one of the manifest's {len(meshes)}", name)
    placements = c.get(g, "placements", list, where)
    if len(placements) != len(meshes[mesh].shape) or not all(
        isinstance(p, str) and _PLACEMENT.match(p) for p in placements
    ):
        raise c.fail(f"{where}: placements {placements[:8]!r} do not fit mesh {mesh}", name)
    return Box(tuple(gshape), tuple(offsets), shape), mesh, tuple(placements), tensor


def _parse_owners(
    c: _Checker, body: dict[str, Any], rank: int, world: int, names: set[str]
) -> tuple[bool, dict[str, int]]:
    """The optional replicated fields: ``"replicated": true`` and ``owners``, which must map each
    replicated tensor to a rank of this world, and list here exactly the tensors it maps to this
    rank (so, with the same map in every shard, each is stored exactly once)."""
    replicated = c.get(body, "replicated", bool) if "replicated" in body else False
    if not replicated:
        if "owners" in body:
            raise c.fail("manifest has field 'owners' but is not marked replicated")
        return False, {}
    raw = c.get(body, "owners", dict)
    if len(raw) > MAX_TENSORS:
        raise c.fail(f"manifest lists {len(raw)} tensor owners, over the {MAX_TENSORS} limit")
    owners: dict[str, int] = {}
    for name, owner in raw.items():
        _check_name(c, name, "owners")
        where = f"owner of tensor {name!r}"
        if isinstance(owner, bool) or not isinstance(owner, int) or not 0 <= owner < world:
            raise c.fail(f"{where} is {owner!r}, not a rank in [0, {world - 1}]", name)
        if owner == rank and name not in names:
            raise c.fail(
                f"tensor {name!r} is owned by this shard "
                f"(rank {rank}) but missing from its tensors",
                name,
            )
        if owner != rank and name in names:
            raise c.fail(
                f"tensor {name!r} is listed here (rank {rank}) but owned by rank "
                f"{owner}: a replicated tensor is stored in exactly one shard",
                name,
            )
        owners[name] = owner
    return True, owners


def _check_name(c: _Checker, name: str, where: str) -> None:
    if not 0 < len(name) <= MAX_NAME or any(ch in name for ch in "/\\\0"):
        raise c.fail(f"{where}: name {name[:80]!r} is empty, too long or has a path separator")


def _parse_tensor(
    c: _Checker,
    t: Any,
    i: int,
    chunk: int,
    align: int,
    files: dict[str, int],
    meshes: tuple[Mesh, ...],
    sharded: bool,
) -> TensorEntry:
    where = f"tensor #{i}"
    name = c.get(t, "name", str, where)
    _check_name(c, name, where)
    where = f"tensor {name!r}"
    dtype = c.get(t, "dtype", str, where)
    if dtype not in DTYPES:
        raise c.fail(f"{where}: dtype {dtype[:40]!r} is not allowed", name)
    shape_raw = c.get(t, "shape", list, where)
    if len(shape_raw) > MAX_NDIM or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_FILE_BYTES
        for d in shape_raw
    ):
        raise c.fail(f"{where}: shape {shape_raw[:8]!r} is invalid", name)
    if math.prod(max(d, 1) for d in shape_raw) * ITEMSIZE.get(dtype, 1) >= 2**63:
        # torch multiplies every dimension, zeros last, when it allocates: (2^40, 2^40, 0)
        # overflows there although it holds nothing; refused alike by verify and restore
        raise c.fail(f"{where}: shape {shape_raw[:8]!r} overflows a tensor's size", name)
    nbytes = c.int_in(t, "nbytes", 0, MAX_FILE_BYTES, where)
    if math.prod(shape_raw) * ITEMSIZE[dtype] != nbytes:
        raise c.fail(
            f"{where}: shape {shape_raw} x {ITEMSIZE[dtype]} bytes != nbytes {nbytes}", name
        )
    crcs = c.get(t, "crc32c", list, where)
    if len(crcs) != -(-nbytes // chunk) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in crcs
    ):
        raise c.fail(
            f"{where}: needs {-(-nbytes // chunk)} chunk CRCs in [0, 2^32), has {len(crcs)}", name
        )
    extents_raw = c.get(t, "extents", list, where)
    extents, total = [], 0
    for j, e in enumerate(extents_raw):
        if not (
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], str)
            and e[0] in files
            and all(isinstance(x, int) and not isinstance(x, bool) for x in e[1:])
        ):
            raise c.fail(f"{where}: extent {j} is not [known file, offset, length]", name)
        f, off, length = e
        if off < 0 or length <= 0 or off % align or off + length > files[f]:
            raise c.fail(
                f"{where}: extent {j} ({off}, {length}) lies outside {f} or is misaligned", name
            )
        if j < len(extents_raw) - 1 and length % chunk:
            raise c.fail(
                f"{where}: extent {j} length {length} is not a multiple of chunk_bytes", name
            )
        extents.append((f, off, length))
        total += length
    if total != nbytes:
        raise c.fail(f"{where}: extents cover {total} bytes, tensor has {nbytes}", name)
    if "global" not in t:
        return TensorEntry(name, dtype, tuple(shape_raw), nbytes, tuple(crcs), tuple(extents))
    if not sharded:
        raise c.fail(f"{where}: field 'global' needs a version 3 (sharded) manifest", name)
    box, mesh, placements, tensor = _parse_global(c, t["global"], name, tuple(shape_raw), meshes)
    return TensorEntry(
        name,
        dtype,
        tuple(shape_raw),
        nbytes,
        tuple(crcs),
        tuple(extents),
        box,
        mesh,
        placements,
        tensor,
    )


def _fast_tensor(
    t: Any,
    chunk: int,
    align: int,
    files: dict[str, int],
    meshes: tuple[Mesh, ...],
    sharded: bool,
) -> TensorEntry | None:
    """``_parse_tensor``'s entry if every rule of it holds, else None (then ``_parse_tensor``
    says what is wrong). The same rules, inlined and on exact types (JSON gives ``int``,
    ``str``, ``list``, ``dict``; ``type(x) is int`` also refuses ``bool``), so that a manifest of
    a hundred thousand blocks decodes in a fraction of a second. It must never accept what
    ``_parse_tensor`` refuses: ``tests/checkpoint/test_many_blocks.py`` checks both on mutated
    entries."""
    if type(t) is not dict:
        return None
    name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
    nbytes, crcs, raw_ext = t.get("nbytes"), t.get("crc32c"), t.get("extents")
    if (
        not _fast_name(name)
        or type(dtype) is not str
        or dtype not in DTYPES
        or type(shape) is not list
        or len(shape) > MAX_NDIM
        or type(nbytes) is not int
        or not 0 <= nbytes <= MAX_FILE_BYTES
        or type(crcs) is not list
        or type(raw_ext) is not list
    ):
        return None
    size, nonzero = 1, 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_FILE_BYTES:
            return None
        size *= d
        nonzero *= d or 1
    itemsize = ITEMSIZE[dtype]
    if nonzero * itemsize >= 2**63 or size * itemsize != nbytes:
        return None
    if len(crcs) != -(-nbytes // chunk):
        return None
    for x in crcs:
        if type(x) is not int or not 0 <= x < 2**32:
            return None
    extents = _fast_extents(raw_ext, files, align, chunk, nbytes)
    if extents is None:
        return None
    fields = {
        "name": name,
        "dtype": dtype,
        "shape": tuple(shape),
        "nbytes": nbytes,
        "crc32c": tuple(crcs),
        "extents": tuple(extents),
        "box": None,
        "mesh": -1,
        "placements": (),
        "tensor": "",
    }
    if "global" in t:
        placed = _fast_global(t["global"], name, fields["shape"], meshes) if sharded else None
        if placed is None:
            return None
        fields.update(placed)
    entry = object.__new__(TensorEntry)  # every field checked above: no __init__ to rerun
    entry.__dict__.update(fields)
    return entry


def _fast_name(x: Any) -> bool:
    """``_fast_tensor``'s check of a name (``_parse_tensor``'s rule for names)."""
    return (
        type(x) is str
        and 0 < len(x) <= MAX_NAME
        and "/" not in x
        and "\\" not in x
        and "\0" not in x
    )


def _fast_extents(
    raw_ext: list[Any], files: dict[str, int], align: int, chunk: int, nbytes: int
) -> tuple[tuple[str, int, int], ...] | None:
    """``_fast_tensor``'s extents, or None where ``_parse_tensor`` would refuse them."""
    extents, total, last = [], 0, len(raw_ext) - 1
    for j, e in enumerate(raw_ext):
        if type(e) is not list or len(e) != 3:
            return None
        f, off, length = e
        if (
            type(f) is not str
            or type(off) is not int
            or type(length) is not int
            or f not in files
            or off < 0
            or length <= 0
            or off % align
            or off + length > files[f]
            or (j < last and length % chunk)
        ):
            return None
        extents.append((f, off, length))
        total += length
    return tuple(extents) if total == nbytes else None


def _fast_global(
    g: Any, name: str, shape: tuple[int, ...], meshes: tuple[Mesh, ...]
) -> dict[str, Any] | None:
    """``_fast_tensor``'s fields of a sharded block's ``global`` record, or None where
    ``_parse_tensor`` would refuse it."""
    if type(g) is not dict:
        return None
    gshape, offsets = g.get("shape"), g.get("offsets")
    if type(gshape) is not list or type(offsets) is not list:
        return None
    if len(gshape) != len(shape) or len(offsets) != len(shape):
        return None
    for o, n, d in zip(offsets, shape, gshape, strict=True):
        if type(o) is not int or type(d) is not int or o < 0 or not 0 <= d <= MAX_FILE_BYTES:
            return None
        if o + n > d:
            return None
    tensor = name
    if "tensor" in g:
        tensor = g["tensor"]
        if not _fast_name(tensor):
            return None
    mesh, placements = -1, ()
    if "mesh" in g or "placements" in g:
        mesh, raw_pl = g.get("mesh"), g.get("placements")
        if type(mesh) is not int or not 0 <= mesh < len(meshes) or type(raw_pl) is not list:
            return None
        if len(raw_pl) != len(meshes[mesh].shape) or not all(
            type(p) is str and _PLACEMENT.match(p) for p in raw_pl
        ):
            return None
        placements = tuple(raw_pl)
    return {
        "box": Box(tuple(gshape), tuple(offsets), shape),
        "mesh": mesh,
        "placements": placements,
        "tensor": tensor,
    }


# ---------------------------------------------------------------------------------------------
# the writer


@dataclass(frozen=True)
class Manifest:
    """A manifest to write: its body and the version it is framed as (``format_version``)."""

    body: dict[str, Any]
    version: int


def tensor_entry(
    name: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    crcs: list[int],
    extents: list[list[Any]],
    *,
    block: Box | None = None,
    mesh: int | None = None,
    placements: Sequence[str] = (),
    tensor: str | None = None,
) -> dict[str, Any]:
    """One entry of a shard manifest's ``tensors``: ``extents`` are ``[file, offset, length]``
    in tensor byte order. A block of a global tensor adds its ``block`` (global shape and
    offsets), the ``mesh`` index and ``placements`` where the save knows them (not through
    DCP), and the global tensor's name where it is not the entry's (``tensor``)."""
    entry: dict[str, Any] = {
        "name": name,
        "dtype": DTYPE_NAMES[dtype],
        "shape": list(shape),
        "nbytes": math.prod(shape) * ITEMSIZE[DTYPE_NAMES[dtype]],
        "crc32c": crcs,
        "extents": extents,
    }
    if block is not None:
        where: dict[str, Any] = {"shape": list(block.global_shape), "offsets": list(block.offsets)}
        if mesh is not None:
            where.update(mesh=mesh, placements=list(placements))
        if tensor is not None:
            where["tensor"] = tensor
        entry["global"] = where
    return entry


def shard_manifest(
    *,
    rank: int,
    world_size: int,
    step: int,
    chunk_bytes: int,
    alignment: int,
    files: dict[str, int],
    tensors: list[dict[str, Any]],
    state: Any,
    meshes: Sequence[Mesh] | None = None,
    owners: dict[str, int] | None = None,
) -> Manifest:
    """A rank's shard manifest: its data files, tensor entries (``tensor_entry``) and state tree;
    ``owners`` for a replicated save, ``meshes`` for one that holds DTensor blocks."""
    body: dict[str, Any] = {
        "format": "gpumem-checkpoint-shard",
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "chunk_bytes": chunk_bytes,
        "alignment": alignment,
        "files": files,
        "tensors": tensors,
    }
    if owners is not None:
        body.update(replicated=True, owners=owners)
    if meshes is not None:
        body["meshes"] = [m.as_json() for m in meshes]
    body["state"] = state  # last (the large part), after the fields that describe the shard
    version = format_version(replicated=owners is not None, sharded=meshes is not None)
    return Manifest(body, version)


def main_manifest(
    *,
    step: int,
    world_size: int,
    shards: Sequence[tuple[int, int]],
    replicated: bool = False,
    sharded: bool = False,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """The main manifest of a step: ``shards[r]`` is rank r's shard manifest (CRC32C, tensor
    bytes); ``extra`` adds fields a reader of this version ignores (``gpumem.dcp``'s metadata)."""
    body: dict[str, Any] = {
        "format": "gpumem-checkpoint",
        "step": step,
        "world_size": world_size,
        "created": time.time(),
        "versions": software_versions(),
        "shards": [
            {"rank": r, "file": shard_manifest_name(r), "crc32c": crc, "nbytes": n}
            for r, (crc, n) in enumerate(shards)
        ],
    }
    if replicated:
        body["replicated"] = True
    if sharded:
        body["sharded"] = True
    body.update(extra or {})
    return Manifest(body, format_version(replicated=replicated, sharded=sharded))


def software_versions() -> dict[str, str]:
    """What a main manifest records as the software that wrote it."""
    return {
        "gpumem": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pid": str(os.getpid()),
    }
