"""Restoring plain (non-DTensor) state: one saved rank's tree, read and verified, then loaded.

``PlainRestore`` is the restore of a checkpoint whose state is plain on both sides (DDP, single
process, pipeline stages): ``prepare`` reads this rank's source shard whole into host memory
(saved rank ``rank mod N`` on another world size, once every saved rank is shown to hold the
same model and optimizer state, or it was declared replicated at save time; what the live
objects take in place into the staging arena: ``into_live``), decodes it and checks it against
the objects; ``apply`` loads it all or nothing (``load.apply``);
``verify_loaded`` checks the loaded tensors where they now live.

A replicated checkpoint (``Checkpointer(..., replicated=True)``) holds each replicated tensor in
one shard: a rank reads its own shard whole, then from each other shard only the extents of the
replicated tensors it holds (``read_tensors``), each verified by its chunk CRC32Cs; the shards
must record the same owners and replicated trees (``check_same``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from gpumem._native import as_bytes, copy_many
from gpumem.checksum import chunk_crc32c

from ..capture.codec import TensorTable, decode, tensor_refs
from ..capture.replicated import REPLICATED_KEYS
from ..capture.training_state import (
    TrainingState,
    canonical_key,
    capture,
    unrequested,
    unwrap_model,
)
from ..errors import CheckpointCorruptError, CheckpointStateError
from ..storage.directory import load_shard_manifest
from ..storage.format import CheckpointInfo, ShardManifest, TensorEntry
from ..storage.step_reads import StepFiles, StepPath
from .files import read_tensors
from .into_live import (
    arena_views,
    clone_out,
    copy_optimizer_state,
    live_targets,
    optimizer_in_place,
    takes,
)
from .load import apply
from .validate import check_targets


class PlainRestore:
    """One plain checkpoint staged for this rank: ``prepare()`` reads, verifies and validates,
    ``apply()`` loads, ``verify_loaded()`` checks what was loaded.

    Args:
        step, info: the checkpoint directory (open: every file is read through it) and its main
            manifest.
        rank, world_size: this rank in the restoring job.
        state: the objects to restore into.
    """

    def __init__(
        self,
        step: StepFiles,
        info: CheckpointInfo,
        rank: int,
        world_size: int,
        state: TrainingState,
        stage: Callable[[int], torch.Tensor] | None = None,
    ):
        self.step, self.info, self.rank, self.world_size = step, info, rank, world_size
        self.state = state
        self.path = step.path
        self.tree: dict[str, Any] = {}
        self.shard: ShardManifest | None = None
        self._stage = stage
        self._arena: torch.Tensor | None = None  # what the model's and optimizer's reads used

    def prepare(self) -> PlainRestore:
        """Read, verify, decode and validate this rank's state; touch no object.

        Raises:
            CheckpointCorruptError: damage anywhere this rank reads, or saved values the objects
                cannot take.
            CheckpointStateError: the checkpoint does not fit the objects, or another world size
                without replicated state.
            CheckpointIOError: the operating system failed a read.
        """
        info, src = self.info, self.rank
        if info.world_size != self.world_size:
            if not info.replicated:  # replicated=True declared it at save time
                check_replicated(self.step, info, self.world_size)
            src = self.rank % info.world_size
        live = live_targets(self.state.model, self.state.optimizer) if self._stage else {}
        self.tree, self.shard, self._arena = restore_tree(
            self.step, info, src, unrequested(self.state), self._stage, live
        )
        check_targets(self.tree, self.state)
        return self

    def apply(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Load the prepared tree into the objects, all or nothing (``load.apply``).

        The model's tensors and the optimizer's state tensors that can take the verified bytes
        as they are (CPU, contiguous, the saved dtype and shape, a storage of their own) get
        them in one copy once every object that may refuse its state has taken it and every
        rank agreed (``commit``); the model's ``load_state_dict`` then finds them already in
        place (torch skips a copy of a tensor onto itself), the optimizer's keeps them. Why not
        read them straight into the live tensors: torch's allocator places a parameter 64 bytes
        past a page, so an O_DIRECT read cannot land there, and a read into live storage needs
        a rollback copy of what it overwrites: two copies where this takes one
        (``benchmarks/results/checkpoint_restore.md``).
        """
        tree, staged, live = in_place(self.tree, self.state.model)
        optimizer = self.state.optimizer
        tree, copies = optimizer_in_place(tree, optimizer)
        # what the objects keep must not point into the arena, which the next save overwrites
        tree = clone_out(tree, self._arena, {id(t) for t in staged} | {id(c[2]) for c in copies})

        def commit() -> None:
            if staged:
                copy_many([as_bytes(t) for t in staged], live)
            if copies:
                copy_optimizer_state(optimizer, copies)

        apply(tree, self.state, agree=agree, commit=commit if staged or copies else None)

    def release(self) -> None:
        """Drop the tree and the staging: the model's and the optimizer's tensors were copied
        into the live ones (a second copy of them until the next restore otherwise), the rest
        is the objects' now."""
        self.tree, self._arena = {}, None

    def verify_loaded(self) -> int:
        """CRC32C of the loaded tensors against the manifest, where they live; how many."""
        objects = dataclasses.replace(self.state, extra=None, rng=False)
        assert self.shard is not None
        return verify_loaded(self.path, self.shard, capture(self.info.step, objects).table)


def in_place(
    tree: dict[str, Any], model: Any
) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]:
    """``tree`` with each model tensor that the live tensor of its key can take byte for byte
    (CPU, strided, contiguous, the same dtype and shape, no storage shared with another key)
    replaced by that live tensor, the staged tensors and the live ones' bytes, to copy (pair by
    pair) before the model loads."""
    saved = tree.get("model") if model is not None else None
    if not isinstance(saved, dict):
        return tree, [], []
    module = unwrap_model(model)
    live = {canonical_key(k): v for k, v in module.state_dict().items()}
    fits = {}
    for k, v in saved.items():
        t = live.get(k)
        if takes(t, v):
            fits[k] = t
    storages: dict[int, int] = {}
    for t in live.values():
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            ptr = t.untyped_storage().data_ptr()
            storages[ptr] = storages.get(ptr, 0) + 1
    fits = {k: t for k, t in fits.items() if storages[t.untyped_storage().data_ptr()] == 1}
    if not fits:
        return tree, [], []
    model_tree = {k: fits.get(k, v) for k, v in saved.items()}
    staged = [saved[k] for k in fits]
    return {**tree, "model": model_tree}, staged, [as_bytes(t) for t in fits.values()]


def read_replicated(
    step: StepFiles,
    info: CheckpointInfo,
    shard: ShardManifest,
    out: dict[str, torch.Tensor],
    needed: set[str] | None = None,
) -> tuple[TensorEntry, ...]:
    """Add to ``out`` the replicated tensors ``shard`` refers to that other shards hold (of
    ``needed``, when given), each read and verified from its owner's shard, whose manifest must
    agree with ``shard``'s (``check_same``). Returns their manifest entries."""
    wanted: dict[int, list[str]] = {}
    for name, owner in shard.owners.items():
        if owner != shard.rank and (needed is None or name in needed):
            wanted.setdefault(owner, []).append(name)
    entries: list[TensorEntry] = []
    for owner, names in sorted(wanted.items()):
        other = load_shard_manifest(step, info, owner)
        check_same(shard, other, step.path)
        out.update(read_tensors(step, other, names))
        held = {e.name: e for e in other.tensors}
        entries.extend(held[n] for n in names)
    return tuple(entries)


def check_replicated(step: StepFiles, info: CheckpointInfo, world_size: int) -> None:
    """Check from the shard manifests alone (no data read) that every rank saved the same
    model, optimizer, scheduler and scaler state: the same tree and, tensor by tensor, the
    same dtype, shape and chunk CRC32Cs. Then any rank's shard can seed a job of another size.

    Raises:
        CheckpointStateError: a rank's state differs (sharded state, FSDP or ZeRO, or replicas
            that diverged), naming the first difference.
        CheckpointCorruptError: a shard manifest is damaged.
    """

    def replicated(shard: ShardManifest) -> tuple[dict[str, Any], dict[str, Any]]:
        tree = replicated_trees(shard)
        tensors = {
            t.name: (t.dtype, t.shape, t.crc32c)
            for t in shard.tensors
            if t.name.split(".", 1)[0] in REPLICATED_KEYS
        }
        return tree, tensors

    path = step.path
    ref_tree, ref_tensors = replicated(load_shard_manifest(step, info, 0))
    for rank in range(1, info.world_size):
        tree, tensors = replicated(load_shard_manifest(step, info, rank))
        diff = next((k for k in REPLICATED_KEYS if tree[k] != ref_tree[k]), None)
        if diff is None and tensors != ref_tensors:
            names = sorted(set(tensors) ^ set(ref_tensors)) or sorted(
                n for n in tensors if tensors[n] != ref_tensors[n]
            )
            diff = f"tensor {names[0]!r}"
        if diff is not None:
            raise CheckpointStateError(
                f"{path} was saved by {info.world_size} ranks, this job has {world_size}, and "
                f"rank {rank} saved another {diff} than rank 0: plain (non-DTensor) state that "
                "differs between ranks (sharded by hand, pipeline stages, or diverged replicas) "
                f"cannot be resharded. Restore with {info.world_size} ranks, or save sharded "
                "state as DTensors (FSDP2 / tensor parallel)"
            )


def restore_tree(
    step: StepFiles,
    info: CheckpointInfo,
    rank: int,
    skip: frozenset[str] = frozenset(),
    stage: Callable[[int], torch.Tensor] | None = None,
    live: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Any], ShardManifest, torch.Tensor | None]:
    """The verified, decoded state tree of ``rank``, its shard manifest and the staging buffer
    (``stage``) that the tensors the ``live`` ones will take were read into
    (``into_live.arena_views``; None: every tensor in fresh host memory), without the sections
    in ``skip`` (their bytes are verified, not held). For a replicated checkpoint, the
    replicated tensors other shards hold are read from them, and the returned manifest's
    ``tensors`` also lists their entries (every tensor the tree holds, for ``verify_loaded``)."""
    path = step.path
    shard = load_shard_manifest(step, info, rank)
    state = shard.state
    if skip and isinstance(state, dict):  # sections nobody asked for are never held
        state = {k: v for k, v in state.items() if k not in skip}
    needed = tensor_refs(state)
    # every byte of the shard is verified; only the tensors the kept sections refer to are held
    views, arena = arena_views(shard.tensors, needed, live, stage) if live and stage else ({}, None)
    tensors = read_tensors(step, shard, keep_only=needed, into=lambda e: views.get(e.name))
    if shard.replicated:
        foreign = read_replicated(step, info, shard, tensors, needed)
        shard = dataclasses.replace(shard, tensors=shard.tensors + foreign)
    # a plain checkpoint has no global tensors: a __dtensor__ reference is damage, as verify says
    tree = decode(state, tensors, f"{path.name}.rank{rank}", dtensors={})
    if not isinstance(tree, dict) or tree.get("step") != info.step:
        raise CheckpointCorruptError(
            f"{path}: rank {rank} state does not record step {info.step}", path=str(path)
        )
    return tree, shard, arena


def verify_loaded(path: StepPath, shard: ShardManifest, table: TensorTable) -> int:
    """Check the tensors now held by the restored objects (``table``: a capture of them) against
    the manifest's chunk CRC32Cs, where they live: CUDA tensors with the Triton kernel on the
    device, host tensors natively. Catches damage in the host-to-device copy or device memory.

    Returns:
        How many tensors were checked (those whose name and size match a manifest entry).

    Raises:
        CheckpointCorruptError: naming the tensor; the objects hold the damaged values.
    """
    entries = {e.name: e for e in shard.tensors}
    checked = 0
    for name, t in zip(table.names, table.tensors, strict=True):
        entry = entries.get(name)
        if entry is None or entry.nbytes != t.numel() * t.element_size() or not entry.nbytes:
            continue
        got = chunk_crc32c(as_bytes(t.contiguous()), shard.chunk_bytes).tolist()
        bad = next(
            (k for k, (a, b) in enumerate(zip(got, entry.crc32c, strict=True)) if a != b), None
        )
        if bad is not None:
            lo = bad * shard.chunk_bytes
            raise CheckpointCorruptError(
                f"{path}: after loading, tensor {name!r} on {t.device} holds "
                f"bytes {lo}-{min(lo + shard.chunk_bytes, entry.nbytes)} that "
                "fail their CRC32C (damaged in the copy to its device or in "
                "its memory); the objects now hold these values: restore again",
                path=str(path),
                tensor=name,
            )
        checked += 1
    return checked


def replicated_trees(shard: ShardManifest) -> dict[str, Any]:
    """The JSON trees of a shard's ``REPLICATED_KEYS`` sections (None where absent)."""
    state = shard.state if isinstance(shard.state, dict) else {}
    return {k: state.get(k) for k in REPLICATED_KEYS}


def check_same(own: ShardManifest, other: ShardManifest, path: StepPath) -> None:
    """Two shards of one replicated checkpoint must record the same owners, chunk size and
    replicated trees (the save checked this; a difference means the files do not belong together).

    Raises:
        CheckpointCorruptError: naming the rank and the key that differ.
    """
    where = f"{path}: rank {other.rank}'s shard and rank {own.rank}'s"
    if not other.replicated:
        raise CheckpointCorruptError(f"{where}: only one is marked replicated", path=str(path))
    if other.owners != own.owners:
        name = next(
            (
                n
                for n in sorted(set(own.owners) | set(other.owners))
                if own.owners.get(n) != other.owners.get(n)
            ),
            "?",
        )
        raise CheckpointCorruptError(
            f"{where} record other owners of the replicated tensor {name!r}",
            path=str(path),
            tensor=name,
        )
    if other.chunk_bytes != own.chunk_bytes:
        raise CheckpointCorruptError(
            f"{where} record chunk_bytes {other.chunk_bytes} and {own.chunk_bytes}", path=str(path)
        )
    mine, theirs = replicated_trees(own), replicated_trees(other)
    for key in REPLICATED_KEYS:
        if mine[key] != theirs[key]:
            raise CheckpointCorruptError(
                f"{where} record different {key} state, though the checkpoint is replicated "
                "(written once, spread over the shards): its shards do not belong together",
                path=str(path),
            )
