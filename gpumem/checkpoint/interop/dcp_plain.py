"""Plain DCP directories (``FileSystemWriter``'s ``.metadata`` + ``*.distcp``), read without running
their pickles.

DCP pickles its ``Metadata`` into ``.metadata`` and stores each tensor with ``torch.save`` (a zip
holding ``data.pkl`` and the raw storage bytes) inside the ``.distcp`` files. Unpickling either
can run code. Here ``.metadata`` goes through a restricted unpickler that admits only DCP's
metadata classes, torch sizes, dtypes and the strided layout (anything else is refused, naming
the class; ``trust_pickle=True`` lifts that for directories you trust), and a tensor record's
``data.pkl`` through one that admits only ``_rebuild_tensor_v2`` over a storage of a known dtype:
it builds the tensor from the record's raw bytes itself, checking offset, size and strides
against the storage. Byte items (objects DCP's planner ``torch.save``d) are never unpickled: they
are checked as zip archives and carried as opaque bytes.

What can be checked: the metadata, every item's file, offset and length, every tensor record
against its chunk in the metadata (dtype, shape), that each tensor's chunks tile it, and each zip
record's CRC-32 (torch.save stores one per record unless that was turned off). What cannot: DCP
stores no checksum of its own, so a record whose bytes and CRC-32 were both rewritten, or a byte
item's pickled content, is beyond any check short of loading it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpumem.reader import read_file

from ..capture.boxes import Box, Planned, TilingError, tile
from ..capture.codec import DTYPES
from ..errors import CheckpointCorruptError, CheckpointStateError
from ..restore.files import open_checkpoint
from ..storage.safe_fs import Dir, describe, read_error

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
_META_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}
_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


def is_plain_dcp(path: Path) -> bool:
    return (Path(path) / METADATA).is_file()


def not_plain_reason(path: Path) -> str:
    """Why ``path`` is no plain DCP directory, saying what it is when it is gpumem's own."""
    from ..storage.format import LATEST, MAIN_MANIFEST, STEP_DIR

    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if names & {MAIN_MANIFEST, LATEST} or any(STEP_DIR.match(n) for n in names):
        return (
            f"{path} is a gpumem checkpoint already, not a plain DCP directory: nothing to "
            "import (gpumem.dcp.StorageReader and Checkpointer.restore read it; `gpumem ckpt "
            f"verify {path}` checks it)"
        )
    return (
        f"{path} is not a plain DCP directory: it has no {METADATA} (FileSystemWriter writes "
        f"{METADATA} and *.distcp files)"
    )


def _open(path: Path) -> Dir:
    """The DCP directory the caller named; inside it nothing is reached through a link."""
    return open_checkpoint(path)


def _path_str(*parts: Any) -> str:
    return os.path.join(*[str(p) for p in parts]) if parts else ""


def _layout(name: Any) -> torch.layout:
    if name != "torch.strided":
        raise pickle.UnpicklingError(f"layout {str(name)[:40]!r} is not admitted")
    return torch.strided


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _META_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or name in DTYPES):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath"):
            return _path_str
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not admitted in DCP metadata")


def read_metadata(path: Path, trust_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` of a plain DCP directory.

    Raises:
        CheckpointCorruptError: unreadable, too large, or (without ``trust_pickle``) referring to
            classes outside DCP's metadata, naming it.
    """
    file = Path(path) / METADATA
    with _open(Path(path)) as d:  # a regular file under the size cap, never through a link
        data = d.read_small(METADATA, MAX_METADATA_BYTES, "DCP metadata")
    try:
        meta = pickle.loads(data) if trust_pickle else _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        hint = (
            "" if trust_pickle else " (--trust-pickle reads it with plain pickle, which runs code)"
        )
        raise CheckpointCorruptError(f"{file}: {exc}{hint}", path=str(file)) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise CheckpointCorruptError(f"{file}: not DCP metadata", path=str(file))
    return meta


@dataclasses.dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not admitted in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, dtype, key, _location, numel = pid
        if (
            not isinstance(dtype, torch.dtype)
            or not isinstance(key, str)
            or not isinstance(numel, int)
        ):
            raise pickle.UnpicklingError("malformed storage reference")
        return _Storage(dtype, key, numel)

    def _rebuild(self, storage, offset, size, stride, requires_grad, hooks, metadata=None):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("a tensor without a storage")
        if not all(isinstance(x, int) and x >= 0 for x in (offset, *size, *stride)):
            raise pickle.UnpicklingError("negative or non-integer geometry")
        if len(size) != len(stride):
            raise pickle.UnpicklingError("size and stride differ in length")
        extent = offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True)) + 1
        if math.prod(size) and extent > storage.numel:
            raise pickle.UnpicklingError(f"the tensor reaches element {extent} of {storage.numel}")
        raw = self.archive.read(f"{self.prefix}data/{storage.key}")  # checks the zip CRC-32
        item = torch.empty((), dtype=storage.dtype).element_size()
        if len(raw) != storage.numel * item:
            raise pickle.UnpicklingError(
                f"storage {storage.key} holds {len(raw)} bytes, not {storage.numel * item}"
            )
        flat = (
            torch.frombuffer(bytearray(raw), dtype=storage.dtype)
            if raw
            else torch.empty(0, dtype=storage.dtype)
        )
        return torch.as_strided(flat, tuple(size), tuple(stride), offset).clone()


def _archive(blob: bytes, where: str) -> tuple[zipfile.ZipFile, str]:
    try:
        z = zipfile.ZipFile(io.BytesIO(blob))
        names = z.namelist()
    except zipfile.BadZipFile as exc:
        raise CheckpointCorruptError(f"{where}: not a torch.save record ({exc})") from None
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise CheckpointCorruptError(f"{where}: not a torch.save record (no data.pkl)")
    return z, pkl[0][: -len("data.pkl")]


def _slice(path: Path, info: Any) -> tuple[bytes, str]:
    rel = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
        raise CheckpointCorruptError(f"{path}: storage entry names {str(rel)[:80]!r}, not a file")
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
        raise CheckpointCorruptError(f"{path}/{rel}: invalid offset {offset!r} / length {length!r}")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointCorruptError(
            f"{path}/{rel}: stored through transforms {info.transform_descriptors} "
            "(compression), which gpumem does not read"
        )
    file = path / rel
    with _open(path) as d:
        try:
            st = d.lstat(rel)
        except OSError as exc:
            raise read_error(exc, file, "reading") from None
        if st is None or not stat.S_ISREG(st.st_mode):
            what = "missing" if st is None else f"{describe(st.st_mode)}, not a regular file"
            raise CheckpointCorruptError(f"{file}: {what}: refused", path=str(file))
        if offset + length > st.st_size:
            raise CheckpointCorruptError(
                f"{file}: ends before bytes {offset}-{offset + length} (truncated)", path=str(file)
            )
        buf = np.empty(length, dtype=np.uint8)
        try:  # checked again once open: a regular file of that size, not a link
            read_file(rel, [(offset, buf)], threads=1, dir_fd=d.fd, expect_size=st.st_size)
        except OSError as exc:
            raise read_error(exc, file, "reading") from None
    return buf.tobytes(), f"{file} bytes {offset}-{offset + length}"


def read_tensor(path: Path, info: Any) -> torch.Tensor:
    """One tensor record of a plain DCP directory, built without running its pickle."""
    blob, where = _slice(path, info)
    z, prefix = _archive(blob, where)
    try:
        t = _TensorUnpickler(z.read(f"{prefix}data.pkl"), z, prefix).load()
    except (
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        KeyError,
        EOFError,
        ValueError,
        TypeError,
        RuntimeError,
    ) as exc:
        raise CheckpointCorruptError(f"{where}: {exc}") from None
    if not isinstance(t, torch.Tensor):
        raise CheckpointCorruptError(f"{where}: the record is not a tensor")
    return t


def read_bytes_item(path: Path, info: Any) -> bytes:
    """A byte item's bytes, checked as a zip archive (every member's CRC-32), not unpickled."""
    return _bytes_item(path, info)[0]


def _bytes_item(path: Path, info: Any) -> tuple[bytes, str | None]:
    """A byte item's bytes and what its pickle needs beyond plain data (None: only numbers,
    strings, bytes, lists, tuples, dicts, sets: what DCP stores for a learning rate or a step
    count; else the first class or storage it would load, which ``dcp.load`` would run)."""
    blob, where = _slice(path, info)
    z, prefix = _archive(blob, where)
    try:
        bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointCorruptError(f"{where}: {exc}") from None
    if bad is not None:
        raise CheckpointCorruptError(f"{where}: zip member {bad} fails its CRC-32")
    try:
        _PlainDataUnpickler(io.BytesIO(z.read(f"{prefix}data.pkl"))).load()
    except _NeedsCode as exc:
        return blob, str(exc)
    except (pickle.UnpicklingError, KeyError, EOFError, ValueError, TypeError) as exc:
        raise CheckpointCorruptError(f"{where}: the pickled item does not load: {exc}") from None
    return blob, None


class _NeedsCode(Exception):
    pass


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds plain data only: any class, function or persistent id (a storage) is refused, so a
    pickle that loads here runs no code when ``torch.load`` loads it either."""

    def find_class(self, module: str, name: str) -> Any:
        raise _NeedsCode(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NeedsCode("a tensor storage")


@dataclasses.dataclass
class PlainReport:
    tensors: int = 0
    chunks: int = 0
    bytes_items: int = 0
    nbytes: int = 0
    pickled: dict[str, str] = dataclasses.field(default_factory=dict)
    """Byte items whose pickles need more than plain data, and the first class each loads: DCP's
    own planner ``torch.load``s byte items on ``dcp.load``, running that code."""


class PickledItemsError(CheckpointStateError):
    """A plain DCP directory holds byte items (pickles ``dcp.load`` would run) and the caller did
    not say it trusts them."""


def verify_plain(path: Path, trust_pickle: bool = False) -> PlainReport:
    """Check a plain DCP directory as far as it can be without unpickling its objects (see the
    module docs). Raises CheckpointCorruptError naming the item at fault."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    path = Path(path)
    meta = read_metadata(path, trust_pickle)
    report = PlainReport()
    by_fqn: dict[str, list[Any]] = {}
    for index, info in meta.storage_data.items():
        by_fqn.setdefault(index.fqn, []).append((index, info))
    for fqn, md in meta.state_dict_metadata.items():
        entries = by_fqn.get(fqn, [])
        if isinstance(md, BytesStorageMetadata):
            if len(entries) != 1:
                raise CheckpointCorruptError(
                    f"{path}: byte item {fqn!r} has {len(entries)} records"
                )
            blob, needs = _bytes_item(path, entries[0][1])
            report.nbytes += len(blob)
            report.bytes_items += 1
            if needs is not None:
                report.pickled[fqn] = needs
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointCorruptError(f"{path}: item {fqn!r} has unknown metadata")
        shape = tuple(int(d) for d in md.size)
        boxes = [Box(shape, tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        _check_tiling(path, fqn, shape, boxes)
        where = {tuple(i.offset or ()): info for i, info in entries}
        for box in boxes:
            info = where.get(box.offsets)
            if info is None:
                raise CheckpointCorruptError(f"{path}: chunk {box.text()} of {fqn!r} has no record")
            t = read_tensor(path, info)
            if tuple(t.shape) != box.shape or t.dtype != md.properties.dtype:
                raise CheckpointCorruptError(
                    f"{path}: the record of {fqn!r} at {list(box.offsets)} holds {t.dtype} "
                    f"{tuple(t.shape)}, the metadata says {md.properties.dtype} {box.shape}"
                )
            report.chunks += 1
            report.nbytes += t.numel() * t.element_size()
        report.tensors += 1
    return report


def pickled_items(report: PlainReport, limit: int = 5) -> str:
    """``2 byte item(s) ('a' loads os.system, 'b' loads ...)`` for messages."""
    named = [f"{n!r} loads {c}" for n, c in list(report.pickled.items())[:limit]]
    more = f" and {len(report.pickled) - limit} more" if len(report.pickled) > limit else ""
    return f"{len(report.pickled)} byte item(s) ({', '.join(named)}{more})"


def _check_tiling(path: Path, fqn: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The chunks of ``fqn`` tile its shape exactly once (``boxes.tile``; no chunk twice)."""
    try:
        if boxes:
            tile(fqn, [Planned(i, box, "") for i, box in enumerate(boxes)], copies=False)
        elif math.prod(shape):
            raise TilingError("no chunks")
    except TilingError:
        raise CheckpointCorruptError(f"{path}: the chunks of {fqn!r} do not tile {shape}") from None


def import_plain(
    src: Path, out: Path, step: int = 0, trust_pickle: bool = False, chunk_bytes: int = 1 << 20
) -> Path:
    """Convert a plain DCP directory into a gpumem checkpoint ``out/step-<step>`` (the layout
    ``gpumem.dcp`` writes, as one shard), item by item: tensors rebuilt without running their
    pickles, byte items carried as opaque checksummed bytes. Returns the committed directory.

    ``dcp.load(..., storage_reader=gpumem.dcp.StorageReader(out))`` then loads it on any number
    of ranks, with every chunk verified; ``gpumem ckpt export`` reads its model weights.

    Byte items are pickles that ``dcp.load`` unpickles (DCP's default load planner
    ``torch.load``s each): those that build plain data only (numbers, strings, containers:
    what a learning rate or a step count is) are proved so by an unpickler that admits no class
    and carried as they are; one that loads a class or a storage would run its author's code
    when loaded from the checksummed gpumem checkpoint, and is refused unless
    ``trust_pickle=True`` (the same trust that reads ``.metadata`` with plain pickle).

    Raises:
        PickledItemsError: byte items that load classes, without ``trust_pickle``, naming them
            and the class.
        CheckpointCorruptError: the directory fails ``verify_plain``.
        CheckpointStateError: ``src`` has no ``.metadata`` (saying when it is a gpumem
            checkpoint already).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from .dcp_items import Chunk, commit, prepare_tmp, write_shard

    src = Path(src)
    if not is_plain_dcp(src):
        raise CheckpointStateError(not_plain_reason(src))
    meta = read_metadata(src, trust_pickle)
    report = verify_plain(src, trust_pickle)  # the whole directory checked before any write
    if report.pickled and not trust_pickle:
        raise PickledItemsError(
            f"{src}: {pickled_items(report)} are pickles that load classes, which dcp.load "
            "would run when it loads them; nothing was imported. Pass trust_pickle=True (gpumem "
            "ckpt import --trust-pickle) only for a directory whose author you trust"
        )

    def chunks():
        for index, info in meta.storage_data.items():
            md = meta.state_dict_metadata.get(index.fqn)
            if isinstance(md, BytesStorageMetadata):
                raw = read_bytes_item(src, info)
                yield Chunk(index.fqn, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            else:
                t = read_tensor(src, info)
                yield Chunk(index.fqn, t, tuple(int(d) for d in md.size), tuple(index.offset))

    prepare_tmp(Path(out), step)
    write_shard(Path(out), step, 0, 1, chunks(), chunk_bytes=chunk_bytes, direct=False)
    return commit(Path(out), step, 1, meta, keep=None)
