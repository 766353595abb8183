"""DCP's items in a gpumem checkpoint: what ``gpumem.dcp`` writes and reads, without pickle.

Each rank's shard manifest lists its tensor chunks as blocks of their global tensors (``global``
field without a mesh: DCP does not say how the chunks were placed) and its byte items (what DCP's
planners ``torch.save``: ``param_groups``, counters, objects) as opaque uint8 entries, each with
its chunk CRC32Cs like any tensor. Its state tree is ``{"step": N, "dcp": {"items": [...]}}``,
one ``{"fqn", "data"}`` per item, ``data`` a reference to the entry (``__dtensor__`` for a tensor
chunk, ``__tensor__`` with ``"bytes": true`` for a byte item). The main manifest adds
``"dcp": {"version", "planner_data"}``: DCP's metadata version and the default planner's key
mappings (JSON: key -> list of path components). DCP's ``Metadata`` is rebuilt from these.

Everything inside the checkpoint directory is created, read and renamed through ``safe_fs``
descriptors, as ``Checkpointer`` does: reading never follows a symbolic link or opens a FIFO, and
the byte ranges the manifests name must lie inside their files.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gpumem._native import as_bytes
from gpumem.checksum import chunk_crc32c
from gpumem.units import align_up

from ..capture.boxes import Box
from ..capture.codec import DTYPE_NAMES
from ..errors import (
    CheckpointCorruptError,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
)
from ..restore.files import open_checkpoint
from ..restore.reshard import GlobalIndex, Reader, SavedBlock, data_files
from ..storage import directory
from ..storage.directory import load_shard_manifest
from ..storage.format import (
    MAIN_MANIFEST,
    STEP_DIR,
    data_file_name,
    main_manifest,
    parse_shard,
    shard_manifest,
    shard_manifest_name,
    step_dir_name,
    tensor_entry,
)
from ..storage.safe_fs import Dir, io_threads

DCP_KEY = "dcp"
_ALIGN = 4096
_UNSAFE = re.compile(r"[/\\\0]")


@dataclasses.dataclass(frozen=True)
class Located:
    """Where one DCP item lies: rank ``rank``'s entry ``name`` of step ``step``. DCP keeps these in
    its in-memory ``Metadata.storage_data``; on disk there are only the manifests."""

    step: int
    rank: int
    name: str
    nbytes: int


def parse_checkpoint_id(path: Any, step: int | None) -> tuple[Path, int | None]:
    """(checkpoint directory, step): a ``step-<N>`` path names its step (written as gpumem's
    ``step-<9 digits>``, however many digits it has: torchtitan's ``step-100`` is ``step 100``),
    else ``step``."""
    p = Path(path)
    m = STEP_DIR.match(p.name)
    if m:
        return p.parent, int(m.group(1))
    return p, step


def next_step(root: Path) -> int:
    """One more than the newest committed step, 0 in an empty or missing directory."""
    try:
        d = Dir.open(root)
    except CheckpointIOError as exc:
        if exc.errno == errno.ENOENT:
            return 0
        raise
    with d:
        found = directory.step_dirs(d)
    return found[0][0] + 1 if found else 0


def has_step(root: Path, step: int) -> bool:
    """Whether ``step`` is committed in ``root`` (a missing directory holds none)."""
    try:
        d = Dir.open(root)
    except CheckpointIOError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    with d:
        return any(s == step for s, _ in directory.step_dirs(d))


def prepare_tmp(root: Path, step: int) -> None:
    """The coordinator, before any rank writes: a fresh temporary directory for ``step``."""
    with Dir.open(root, create=True) as d:
        directory.prepare_tmp(d, step).close()


def _open_tmp(root: Path, step: int) -> tuple[Dir, Dir]:
    d = Dir.open(root)
    try:
        return d, d.sub(directory.tmp_name(step))
    except BaseException:
        d.close()
        raise


def _unique(name: str, taken: set[str]) -> str:
    base = _UNSAFE.sub("_", name)[:900] or "item"
    out, n = base, 1
    while out in taken:
        out, n = f"{base}~{n}", n + 1
    taken.add(out)
    return out


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One item to write: a tensor chunk (its global shape and offsets) or a byte item (both
    None, ``data`` its uint8 bytes)."""

    fqn: str
    data: torch.Tensor
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None


def write_shard(
    root: Path,
    step: int,
    rank: int,
    world: int,
    items: Iterable[Chunk],
    *,
    chunk_bytes: int,
    direct: bool,
    segment_bytes: int = 256 << 20,
) -> list[Located]:
    """Write one rank's items into the step's temporary directory: data files of about
    ``segment_bytes`` each (native parallel writer, fdatasync'ed; an item is dropped once its
    file is written, so memory stays near one segment), then the shard manifest."""
    rootd, tmp = _open_tmp(root, step)
    with rootd, tmp:
        return _write_shard(tmp, step, rank, world, items, chunk_bytes, direct, segment_bytes)


def _write_shard(
    tmp: Dir,
    step: int,
    rank: int,
    world: int,
    items: Iterable[Chunk],
    chunk_bytes: int,
    direct: bool,
    segment_bytes: int,
) -> list[Located]:
    taken: set[str] = set()
    entries, refs, out = [], [], []
    files: dict[str, int] = {}
    pending: list[tuple[int, torch.Tensor]] = []
    pos, batch = 0, 0

    def flush() -> None:
        nonlocal pos, batch, pending
        if pos or not files:
            name = data_file_name(rank, batch)
            tmp.write_pieces(name, pending, pos, direct)
            files[name] = pos
            batch, pos, pending = batch + 1, 0, []

    for item in items:
        t = item.data.detach()
        if not t.is_cpu:
            t = t.cpu()
        t = t.contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointStateError(
                f"{item.fqn}: dtype {t.dtype} cannot be stored; convert the tensor first"
            )
        if pos >= segment_bytes:
            flush()
        name = _unique(item.fqn, taken)
        nbytes = t.numel() * t.element_size()
        offset = align_up(pos, _ALIGN)
        crcs = [int(x) for x in chunk_crc32c(as_bytes(t), chunk_bytes).tolist()]
        extents = [[data_file_name(rank, batch), offset, nbytes]] if nbytes else []
        ref: dict[str, Any] = {"fqn": item.fqn}
        if item.global_shape is not None:
            tensor = _UNSAFE.sub("_", item.fqn)[:900] or "item"
            block = Box(item.global_shape, tuple(item.offsets or ()), tuple(t.shape))
            entry = tensor_entry(name, t.dtype, t.shape, crcs, extents, block=block, tensor=tensor)
            ref["data"] = {"__dtensor__": tensor}
        else:
            entry = tensor_entry(name, t.dtype, t.shape, crcs, extents)
            ref["data"], ref["bytes"] = {"__tensor__": name}, True
        if nbytes:
            pending.append((offset, as_bytes(t)))
            pos = offset + nbytes
        entries.append(entry)
        refs.append(ref)
        out.append(Located(step, rank, name, nbytes))
    flush()
    manifest = shard_manifest(
        rank=rank,
        world_size=world,
        step=step,
        chunk_bytes=chunk_bytes,
        alignment=_ALIGN,
        files=files,
        tensors=entries,
        state={"step": step, DCP_KEY: {"items": refs}},
        meshes=[],  # DCP does not say how the chunks were placed
    )
    directory.write_manifest(tmp, shard_manifest_name(rank), manifest)
    return out


def commit(root: Path, step: int, world: int, metadata: Any, keep: int | None) -> Path:
    """The coordinator, once every rank has written: the main manifest (each shard manifest's
    CRC and size as read back), the rename, ``latest`` and retention."""

    rootd, tmp = _open_tmp(root, step)
    with rootd, tmp:
        return _commit(rootd, tmp, step, world, metadata, keep)


def _commit(rootd: Dir, tmp: Dir, step: int, world: int, metadata: Any, keep: int | None) -> Path:
    shards = []
    for rank in range(world):
        name = shard_manifest_name(rank)
        body, crc, version = directory.read_manifest(tmp, name)
        shard = parse_shard(body, str(tmp.path / name), crc, version)
        shards.append((crc, sum(t.nbytes for t in shard.tensors)))
    dcp = {
        "version": str(getattr(metadata, "version", None) or "1.0.0"),
        "planner_data": _planner_json(getattr(metadata, "planner_data", None)),
    }
    manifest = main_manifest(
        step=step, world_size=world, shards=shards, sharded=True, extra={DCP_KEY: dcp}
    )
    crc = directory.write_manifest(tmp, MAIN_MANIFEST, manifest)
    done = directory.commit(rootd, tmp, step, crc)
    if done.pointer_error is not None:
        err = done.pointer_error
        warnings.warn(
            f"step {step} is committed, but the latest pointer was not updated: "
            f"{err.strerror or err}; readers take the newest step that verifies",
            CheckpointPointerWarning,
            stacklevel=3,
        )
    directory.apply_retention(rootd, keep, done.name)
    return rootd.path / done.name


def _planner_json(data: Any) -> Any:
    """DCP's default planner data (flattened key -> path tuple) as JSON; None stays None."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
        for k, v in data.items()
    ):
        return [[k, list(v)] for k, v in data.items()]
    raise CheckpointStateError(
        f"the planner's metadata (a {type(data).__name__}) is not the default planner's key "
        "mapping; gpumem stores metadata as JSON only: use DCP's default planners"
    )


# ---------------------------------------------------------------------------------------------
# reading


@dataclasses.dataclass
class DcpItem:
    fqn: str
    is_bytes: bool
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    blocks: list[Any]  # _Chunk


@dataclasses.dataclass(frozen=True)
class _Chunk:
    located: Located
    block: SavedBlock

    @property
    def box(self) -> Box:
        return self.block.box


@dataclasses.dataclass
class DcpCheckpoint:
    """Every DCP item of one checkpoint written through ``gpumem.dcp``, from its manifests."""

    dir: Dir  # the step directory, open: every data file is read through it
    path: Path
    step: int
    items: dict[str, DcpItem]
    planner_data: Any
    version: str
    shards: list[Any]
    files: dict[str, int]


def open_step_dir(path: Path) -> Dir:
    """A ``step-<N>`` directory, or a checkpoint directory's newest one whose main manifest
    reads (``latest`` first), opened; inside the directory the caller named, no symbolic link is
    followed.

    Raises:
        CheckpointCorruptError: nothing readable there.
        CheckpointIOError: the operating system refused (errno and path kept).
    """
    m = STEP_DIR.match(path.name)
    if m and not os.path.lexists(path):  # the step as DCP's callers name it (step-5)
        with open_checkpoint(path.parent) as parent:
            return directory.open_step(parent, step_dir_name(int(m.group(1))))
    d = open_checkpoint(path)
    if d.lstat(MAIN_MANIFEST) is not None:
        return d
    if m:  # the step named, as gpumem names its directory (step-100 -> step-000000100)
        d.close()
        with open_checkpoint(path.parent) as parent:
            return directory.open_step(parent, step_dir_name(int(m.group(1))))
    with d:
        try:
            ptr = directory.read_latest(d)
        except CheckpointCorruptError:
            ptr = None
        names = [n for _, n in directory.step_dirs(d)]
        if ptr is not None and ptr["path"] in names:
            names.insert(0, ptr["path"])
        for name in names:
            try:
                step = directory.open_step(d, name)
            except CheckpointCorruptError:
                continue
            try:
                directory.load_info(step)
                return step
            except CheckpointCorruptError:
                step.close()
    raise CheckpointCorruptError(f"{path} holds no readable checkpoint", path=str(path))


def load_items(path: Path) -> DcpCheckpoint:
    """Every DCP item of a checkpoint written by ``gpumem.dcp.StorageWriter``, from the
    manifests (no data read; each chunk is verified when read).

    Raises:
        CheckpointCorruptError: damaged manifests, or not written through DCP.
    """
    step = open_step_dir(Path(path))
    step_dir = step.path
    info = directory.load_info(step)
    body, _, _ = directory.read_manifest(step, MAIN_MANIFEST)
    meta = body.get(DCP_KEY)
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(
            f"{step_dir}: not written through gpumem.dcp (no DCP metadata); restore it with "
            "gpumem.Checkpointer",
            path=str(step_dir),
        )
    shards = [load_shard_manifest(step, info, r) for r in range(info.world_size)]
    index = GlobalIndex(step_dir, shards)
    items: dict[str, DcpItem] = {}
    files = data_files(step_dir, shards)
    for shard in shards:
        state = shard.state if isinstance(shard.state, dict) else {}
        refs = state.get(DCP_KEY, {}).get("items") if isinstance(state.get(DCP_KEY), dict) else None
        if not isinstance(refs, list):
            raise CheckpointCorruptError(f"{step_dir}: rank {shard.rank} lists no DCP items")
        held = {e.name: e for e in shard.tensors}
        for ref in refs:
            _add_item(items, ref, shard, held, index, step_dir, info.step)
    return DcpCheckpoint(
        step,
        step_dir,
        info.step,
        items,
        _planner_data(meta.get("planner_data"), step_dir),
        str(meta.get("version") or "1.0.0")[:32],
        shards,
        files,
    )


def _add_item(items, ref, shard, held, index, step_dir, step) -> None:
    bad = CheckpointCorruptError(
        f"{step_dir}: rank {shard.rank}: malformed DCP item {str(ref)[:80]}"
    )
    if (
        not isinstance(ref, dict)
        or not isinstance(ref.get("fqn"), str)
        or not isinstance(ref.get("data"), dict)
    ):
        raise bad
    fqn, data = ref["fqn"], ref["data"]
    if ref.get("bytes") is True:
        name = data.get("__tensor__")
        entry = held.get(name) if isinstance(name, str) else None
        if entry is None or entry.box is not None or entry.dtype != "uint8" or fqn in items:
            raise bad
        block = SavedBlock(shard.rank, entry, Box.full(entry.shape), shard.chunk_bytes)
        loc = Located(step, shard.rank, entry.name, entry.nbytes)
        items[fqn] = DcpItem(fqn, True, torch.uint8, entry.shape, [_Chunk(loc, block)])
        return
    tensor = data.get("__dtensor__")
    if not isinstance(tensor, str) or tensor not in index:
        raise bad
    if fqn in items:
        return  # another rank's chunk of the same tensor listed it already
    blocks = index.check(tensor)
    chunks = [_Chunk(Located(step, b.rank, b.entry.name, b.entry.nbytes), b) for b in blocks]
    items[fqn] = DcpItem(
        fqn, False, blocks[0].entry.torch_dtype, blocks[0].box.global_shape, chunks
    )


def _planner_data(raw: Any, step_dir: Path) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], list)
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in p[1])
        for p in raw
    ):
        raise CheckpointCorruptError(f"{step_dir}: malformed DCP planner data", path=str(step_dir))
    return {k: tuple(v) for k, v in raw}


def read_items(
    layout: DcpCheckpoint, requests: list[tuple[Located, Any, Any, bool]]
) -> list[torch.Tensor]:
    """Read (and verify) each request: (located chunk, offsets within it, lengths, is_bytes).
    Returns host tensors: the requested part of each chunk, a byte item's whole bytes."""
    by_key: dict[tuple[int, str], SavedBlock] = {}
    for item in layout.items.values():
        for c in item.blocks:
            by_key[(c.located.rank, c.located.name)] = c.block
    reader = Reader(layout.dir)
    out = []
    for loc, offsets, lengths, is_bytes in requests:
        block = by_key.get((loc.rank, loc.name))
        if block is None:
            raise CheckpointCorruptError(
                f"{layout.path}: DCP asks for rank {loc.rank}'s {loc.name!r}, which it lacks",
                path=str(layout.path),
            )
        if is_bytes:
            buf = torch.empty(block.entry.nbytes, dtype=torch.uint8)
            box = Box.full(block.box.shape)
        else:
            start = tuple(o + s for o, s in zip(block.box.offsets, offsets, strict=True))
            box = Box(block.box.global_shape, start, tuple(int(x) for x in lengths))
            buf = torch.empty(box.shape, dtype=block.entry.torch_dtype)
        reader.add(loc.name, buf, box, [block])
        out.append(buf)
    reader.run(layout.files, io_threads())
    return out
