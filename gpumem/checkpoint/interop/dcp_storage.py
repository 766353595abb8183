"""torch.distributed.checkpoint (DCP) storage in gpumem's format: checksummed, atomically committed,
no pickle in the metadata.

    import torch.distributed.checkpoint as dcp
    import gpumem.dcp

    dcp.save(state, storage_writer=gpumem.dcp.StorageWriter("ckpts"))          # also async_save
    dcp.load(state, storage_reader=gpumem.dcp.StorageReader("ckpts"))          # newest valid

DCP plans what each rank writes and reads (its planners reshard: a checkpoint saved by N ranks
loads on M); these classes store it. ``StorageWriter`` writes each rank's items with the native
parallel writer into a gpumem checkpoint directory ``step-<N>`` (the shard manifests record
every tensor chunk as a block of its global tensor, with one CRC32C per chunk), and the
coordinator commits it as ``Checkpointer`` does: rename, ``latest`` pointer, retention.
``StorageReader`` rebuilds DCP's ``Metadata`` from the JSON manifests and reads the byte ranges
each request needs, verifying the CRC32C of every chunk it touches. ``gpumem ckpt ls / verify /
inspect / export`` work on such directories.

DCP's default planners store non-tensor items (optimizer ``param_groups``, ``step`` counters,
anything that is not a tensor) with ``torch.save``, and load them with ``torch.load(...,
weights_only=False)``: gpumem keeps those bytes opaque and checksummed, and **loading through DCP
unpickles them**, so load only checkpoints you trust that way. ``Checkpointer.restore`` never
unpickles anything.

The step: ``checkpoint_id`` (a ``step-<N>`` path or an int), else ``step=`` of the writer, else
one more than the newest committed step (0 in an empty directory).

Both classes take every argument of DCP's ``FileSystemWriter`` / ``FileSystemReader``, in the
same order, so either swaps in for the other:

    overwrite               honoured as FileSystemWriter does (RuntimeError on every rank):
                            False refuses a named step that is already committed, and a
                            directory that holds any committed step when no step is named;
                            True replaces a named step, or writes one more than the newest.
    thread_count            accepted: the native writer writes each file in parallel with
                            ``GPUMEM_THREADS`` threads (default: the core count).
    cache_staged_state_dict honoured: the writer stages ``dcp.async_save`` state as DCP's
                            ``BlockingAsyncStager`` does, keeping the CPU copy when True.
    sync_files              accepted: gpumem always syncs each file before the commit, its
                            atomicity rests on that.
    single_file_per_rank    accepted: a rank writes segments of about 256 MiB whatever the value.
    per_thread_copy_ahead   accepted: items are copied to the host one by one as they are written.
    serialization_format    accepted: tensors are stored as raw bytes with CRC32Cs (no torch.save,
                            no safetensors); byte items are the planner's bytes, stored opaque.
    _extensions             accepted, warned about when not empty: no stream transform
                            (compression) is applied to gpumem's files.
    _extension_registry     (reader) accepted: nothing in gpumem's files needs one.

A plain DCP directory (``.metadata``) given to ``StorageReader`` is refused with the command
that converts it (``gpumem ckpt import``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointStateError
from .dcp_items import (
    Chunk,
    Located,
    commit,
    has_step,
    load_items,
    next_step,
    parse_checkpoint_id,
    prepare_tmp,
    read_items,
    write_shard,
)
from .dcp_plain import is_plain_dcp

__all__ = ["StorageReader", "StorageWriter"]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the coordinator tells every rank before it writes (DCP pickles plans between its
    ranks; nothing of this reaches the disk)."""

    step: int
    rank: int
    world_size: int


class StorageWriter(_StorageWriter, BlockingAsyncStager):
    """Write DCP checkpoints as gpumem checkpoints (see the module docs).

    Args:
        path: the checkpoint directory (holds ``step-<N>`` and ``latest``), or a ``step-<N>``
            directory inside it.
        single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
            cache_staged_state_dict, overwrite, _extensions, serialization_format: DCP's
            ``FileSystemWriter`` arguments, in its order (what each does here: module docs).
        step: the step to write when ``checkpoint_id`` does not name one.
        keep: checkpoints to keep after each commit (newest first); None keeps all.
        chunk_bytes: CRC32C granularity (power of two >= 4096).
        direct_io: O_DIRECT writes where the buffer is aligned.

    Example:
        >>> writer = gpumem.dcp.StorageWriter("ckpts", keep=3)                 # doctest: +SKIP
        >>> dcp.save({"model": model}, storage_writer=writer)                  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
        *,
        step: int | None = None,
        keep: int | None = 3,
        chunk_bytes: int = 1 << 20,
        direct_io: bool = True,
    ) -> None:
        _StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if not isinstance(thread_count, int) or thread_count < 1:
            raise CheckpointStateError(f"thread_count={thread_count!r} must be a positive int")
        if _extensions:
            warnings.warn(
                "gpumem.dcp.StorageWriter applies no stream extensions (_extensions): its files "
                "hold raw bytes with a CRC32C per chunk",
                stacklevel=2,
            )
        self.single_file_per_rank, self.sync_files = single_file_per_rank, sync_files
        self.thread_count, self.per_thread_copy_ahead = thread_count, per_thread_copy_ahead
        self.overwrite, self.serialization_format = overwrite, serialization_format
        if chunk_bytes < 4096 or chunk_bytes & (chunk_bytes - 1):
            raise CheckpointStateError(f"chunk_bytes={chunk_bytes} must be a power of two >= 4096")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise CheckpointStateError(f"keep={keep!r}: keep at least 1 checkpoint, or None")
        self.root, self.step = parse_checkpoint_id(path, step)
        self.keep, self.chunk_bytes, self.direct_io = keep, chunk_bytes, direct_io
        self.is_coordinator = False
        self._prepared = -1  # the step prepare_global_plan chose (the coordinator's)
        self.save_id = f"{os.getpid()}-{time.time_ns()}"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.root, self.step = parse_checkpoint_id(checkpoint_id, self.step)
        self.save_id = f"{os.getpid()}-{time.time_ns()}"

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # every rank, as FileSystemWriter checks: DCP gathers the error onto all of them
        if not self.overwrite:
            if self.step is not None and has_step(self.root, self.step):
                where = f"step {self.step} in {self.root}"
            elif self.step is None and next_step(self.root) > 0:
                # FileSystemWriter(path) refuses a path that holds a checkpoint: the same path
                # given to this writer must too, though it would write a new step there
                where = f"{self.root} holds committed steps (name a new one: {self.root}/step-N)"
            else:
                return plan
            raise RuntimeError(f"Checkpoint already exists and self.overwrite=False: {where}")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        step = self.step if self.step is not None else next_step(self.root)
        prepare_tmp(self.root, step)
        self._prepared = step
        return [
            dataclasses.replace(p, storage_data=_Plan(step, i, len(plans)))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info: _Plan = plan.storage_data

        def chunks() -> Iterator[Chunk]:  # resolved one by one: DCP may allocate for each
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                    yield Chunk(item.index.fqn, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                else:
                    td = item.tensor_data
                    yield Chunk(item.index.fqn, data, tuple(td.size), tuple(td.chunk.offsets))

        located = write_shard(
            self.root,
            info.step,
            info.rank,
            info.world_size,
            chunks(),
            chunk_bytes=self.chunk_bytes,
            direct=self.direct_io,
        )
        results = [
            WriteResult(index=item.index, size_in_bytes=loc.nbytes, storage_data=loc)
            for item, loc in zip(plan.items, located, strict=True)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        commit(self.root, self._prepared, len(results), metadata, self.keep)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.root), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class StorageReader(_StorageReader):
    """Read gpumem checkpoints written through DCP (see the module docs).

    Args:
        path: the checkpoint directory (its newest checkpoint that verifies is read, as
            ``latest`` names it), or one ``step-<N>`` directory.
        _extension_registry: ``FileSystemReader``'s argument, accepted: gpumem's files need none.

    Example:
        >>> reader = gpumem.dcp.StorageReader("ckpts")                         # doctest: +SKIP
        >>> dcp.load({"model": model}, storage_reader=reader)                  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.load_id = f"{os.getpid()}-{time.time_ns()}"
        self._layout: Any = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self._layout = None
        self.load_id = f"{os.getpid()}-{time.time_ns()}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        layout = self._load()
        sdm: dict[str, Any] = {}
        storage: dict[MetadataIndex, Located] = {}
        for fqn, item in layout.items.items():
            if item.is_bytes:
                sdm[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = item.blocks[0].located
                continue
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=item.dtype),
                size=torch.Size(item.global_shape),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(b.box.offsets), sizes=torch.Size(b.box.shape)
                    )
                    for b in item.blocks
                ],
            )
            for b in item.blocks:
                storage[MetadataIndex(fqn, b.box.offsets)] = b.located
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=layout.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(layout.path), load_id=self.load_id),
            version=layout.version,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        layout = self._load()
        requests = []
        for req in plan.items:
            loc = self._storage[req.storage_index]
            requests.append((req, loc, req.type == LoadItemType.BYTE_IO))
        staged = read_items(
            layout, [(loc, req.storage_offsets, req.lengths, b) for req, loc, b in requests]
        )
        for (req, _, is_bytes), data in zip(requests, staged, strict=True):
            if is_bytes:
                planner.load_bytes(req, io.BytesIO(data.numpy().tobytes()))
                continue
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(data.shape):
                raise CheckpointStateError(
                    f"{layout.path}: DCP asks for {tuple(data.shape)} of {req.storage_index.fqn!r} "
                    f"into a tensor of shape {tuple(target.shape)}"
                )
            target.copy_(data)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _load(self) -> Any:
        if self._layout is None:
            if is_plain_dcp(self.path):
                raise CheckpointStateError(
                    f"{self.path} is a plain DCP checkpoint (FileSystemWriter's .metadata), not a "
                    "gpumem one: read it with dcp.FileSystemReader, or convert it once with "
                    f"`gpumem ckpt import {self.path} OUT` and read OUT here"
                )
            self._layout = load_items(self.path)
        return self._layout

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
