"""Restoring sharded state: map a checkpoint onto the caller's model and optimizer as they are laid
out now, stage and verify every byte on the host, then copy into the objects' own storage.

Used whenever the checkpoint holds global (DTensor) tensors or the objects do (FSDP2, tensor
parallel), whatever the world sizes and meshes on either side. For each rank:

1. every shard manifest is read; the *source* rank, whose tree (structure, plain tensors, RNG,
   extras) this rank takes, is saved rank ``rank mod N``, or the next one whose model keys are
   this rank's (pipeline stages hold different keys);
2. each tensor of the model and optimizer sections becomes a *target*: the live tensor it belongs
   in (a parameter, a buffer, an optimizer state tensor), its box (the local shard of a DTensor,
   all of a plain tensor) and the saved blocks that cover it. Optimizer state follows its
   parameter: where the optimizer has no state yet, a DTensor parameter's state is placed as the
   parameter is. Dtypes, global shapes and coverage are checked here, before anything is read;
3. every target is read into host staging memory (the Checkpointer's arena; fresh host memory
   for tensors that will stay on the host and have no storage yet) and every chunk's CRC32C
   verified (``reshard.Reader``, files opened through ``safe_fs`` only); the other sections are
   read from the source shard as before; storage that does not exist yet (optimizer state of a
   fresh optimizer) is created, once, on its final device, from the staged bytes;
4. the whole tree is validated against the objects as an unsharded restore is
   (``validate.check_targets``, each target standing in as an empty tensor of its global shape),
   so what the objects' own loading code would refuse fails here, before anything changed;
5. ``apply`` is ``load.apply``'s transaction: scheduler, scaler, stateful objects and the
   optimizer (whose state then refers to the existing storage) are loaded, rolled back if any
   of them refuses on any rank; only once every rank agreed are the staged bytes copied into
   the existing parameter and optimizer storage (a DTensor's local shard in place); then
   extras, RNG.

A restore therefore raises or falls back with every object as it was, by ``candidates``' one
rule: damage (anything the content makes fail) is CheckpointCorruptError and falls back to an
older checkpoint; a checkpoint that does not fit the objects (keys, dtypes, global shapes,
placements that cannot be covered) is CheckpointStateError; an operating-system error is
CheckpointIOError.

Peak memory of a restore per rank: host, the staging of this rank's share of model and optimizer
(its local shards) plus at most two chunks per overlapping saved block; device, nothing beyond
the objects' own storage (optimizer state that did not exist yet is allocated once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from gpumem._gc import paused as paused_gc
from gpumem._native import as_bytes
from gpumem.checksum import chunk_crc32c

from ..capture import dtensor
from ..capture.boxes import Box
from ..capture.codec import decode
from ..capture.replicated import REPLICATED_KEYS
from ..capture.training_state import TrainingState, canonical_key, unwrap_model
from ..errors import CheckpointCorruptError, CheckpointStateError
from ..storage.directory import load_shard_manifest
from ..storage.format import CheckpointInfo, ShardManifest
from ..storage.safe_fs import io_threads
from ..storage.step_reads import StepFiles
from .files import read_tensors
from .load import apply
from .reshard import GlobalIndex, Reader, SavedBlock, data_files
from .validate import check_targets, model_entries


@dataclasses.dataclass(frozen=True)
class Ref:
    """Stands for a tensor of the checkpoint in a decoded tree until it is read."""

    name: str
    is_global: bool


class _Refs(Mapping[str, Any]):
    """What ``codec.decode`` puts in place of each tensor name: the tensor if ``loaded`` has it,
    else a Ref."""

    def __init__(self, names: Any, is_global: bool, loaded: dict[str, torch.Tensor] | None = None):
        self._names, self._global, self._loaded = names, is_global, loaded or {}
        self.used: set[Ref] = set()  # every name the tree refers to (a NumPy array's too)

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        if name in self._loaded:
            return self._loaded[name]
        ref = Ref(name, self._global)
        self.used.add(ref)
        return ref

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclasses.dataclass
class _Wanted:
    """A tensor the objects want from the checkpoint: ``box`` of ``ref``, copied into ``live``
    (its optimizer ``slot`` (parameter, key) for optimizer state), or into storage ``make``
    creates from the staged bytes; neither: the staging buffer itself becomes the storage."""

    ref: Ref
    box: Box
    live: torch.Tensor | None = None
    slot: tuple[Any, str] | None = None
    make: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclasses.dataclass
class _Target:
    ref: Ref
    box: Box
    blocks: list[SavedBlock]
    staged: torch.Tensor
    live: torch.Tensor | None  # storage to copy into (a DTensor's local shard, a plain tensor)
    make: Callable[[torch.Tensor], torch.Tensor] | None = None  # storage to create instead
    created: torch.Tensor | None = None  # what ``make`` created (in prepare)
    slot: tuple[Any, str] | None = None  # optimizer state: (parameter, key)


def has_dtensors(model: Any, optimizer: Any) -> bool:
    """Whether the objects hold DTensors (then restore reshards into them)."""
    if dtensor.dtensor_type() is None:
        return False
    if model is not None and any(
        dtensor.is_dtensor(v) for v in unwrap_model(model).state_dict().values()
    ):
        return True
    return optimizer is not None and any(
        dtensor.is_dtensor(p) for g in optimizer.param_groups for p in g["params"]
    )


class ShardedRestore:
    """One checkpoint staged for this rank: ``prepare()`` reads, verifies and validates,
    ``apply()`` loads, ``verify_loaded()`` checks what was loaded.

    Args:
        step, info: the checkpoint directory (open: every file is read through it) and its main
            manifest.
        rank, world_size: this rank in the restoring job.
        state: the objects to restore into.
        stage: allocates ``n`` bytes of host staging memory (a uint8 tensor).
    """

    def __init__(
        self,
        step: StepFiles,
        info: CheckpointInfo,
        rank: int,
        world_size: int,
        state: TrainingState,
        stage: Callable[[int], torch.Tensor],
    ):
        self.step, self.path = step, step.path
        self.info, self.rank, self.world_size = info, rank, world_size
        self.state = state
        self._stage = stage
        self.tree: dict[str, Any] = {}
        self.targets: dict[Ref, list[_Target]] = {}
        self._loaded: dict[Ref, list[tuple[Box, torch.Tensor]]] = {}
        self.bytes_read = 0
        self.bytes_needed = 0

    # ------------------------------------------------------------------ prepare

    def prepare(self) -> ShardedRestore:
        """Read, verify, stage and validate everything this rank needs; touch no object.

        Raises:
            CheckpointCorruptError: damage anywhere this rank reads, or saved values the objects
                cannot take.
            CheckpointStateError: the checkpoint does not fit the objects (keys, dtypes, global
                shapes, coverage, classes), naming the tensor.
            CheckpointIOError: the operating system failed a read.
        """
        shards = [load_shard_manifest(self.step, self.info, r) for r in range(self.info.world_size)]
        with paused_gc():  # a hundred thousand blocks make as many boxes (gpumem._gc)
            index = GlobalIndex(self.path, shards)
        model, optimizer = self.state.model, self.state.optimizer
        src = _source_rank(shards, self.rank, model)
        source = shards[src]
        local = {e.name for e in source.tensors} | set(source.owners)
        refs = (_Refs(local, False), _Refs(index.blocks, True))
        where = f"{self.path.name}.rank{src}"
        tree = decode(source.state, refs[0], where, dtensors=refs[1])
        if not isinstance(tree, dict) or tree.get("step") != self.info.step:
            raise CheckpointCorruptError(
                f"{self.path}: rank {src} state does not record step {self.info.step}",
                path=str(self.path),
            )
        self._saved = saved = _Saved(self.path, self.info, shards, index, source, tree)
        if self.info.world_size != self.world_size:
            saved.check_plain_replicated(self.world_size)
        wanted = saved.model_targets(model) if model is not None else []
        if optimizer is not None:
            wanted += saved.optimizer_targets(optimizer)
        self._stage_targets(wanted)
        loaded_local, loaded_global = self._read_rest(refs[0].used | refs[1].used)
        # decoded again with the tensors read (a NumPy array is built from its tensor here);
        # the targets stay Refs until apply()
        self.tree = decode(
            source.state,
            _Refs(local, False, loaded_local),
            where,
            dtensors=_Refs(index.blocks, True, loaded_global),
        )
        for targets in self.targets.values():  # storage that does not exist yet, made once
            for t in targets:
                if t.make is not None:
                    t.created = t.make(t.staged)
        # every target stands in as an empty tensor of its global shape: the objects' state is
        # checked as for an unsharded restore, nothing read twice
        stand_ins = {
            ref: torch.empty(saved.shape(ref), dtype=saved.dtype(ref), device="meta")
            for ref in self.targets
        }
        check_targets(_resolve(self.tree, stand_ins), self.state)
        return self

    def _stage_targets(self, wanted: list[_Wanted]) -> None:
        """Staging for every target, then one pass of reads over all of them: in the arena (the
        caller's ``stage``), except a target whose staging becomes its storage on the host."""
        saved = self._saved
        dtypes = [saved.dtype(w.ref) for w in wanted]
        sizes = [w.box.numel * d.itemsize for w, d in zip(wanted, dtypes, strict=True)]
        offsets, total = [], 0
        for w, size in zip(wanted, sizes, strict=True):
            in_arena = w.live is not None or w.make is not None
            offsets.append(total if in_arena else -1)
            if in_arena:
                total += -(-size // 64) * 64
        arena = self._stage(total) if total else None
        reader = Reader(self.step)
        for w, dtype, size, off in zip(wanted, dtypes, sizes, offsets, strict=True):
            if arena is not None and off >= 0:
                staged = arena[off : off + size].view(dtype).view(w.box.shape)
            else:
                staged = torch.empty(w.box.shape, dtype=dtype)
            blocks = saved.blocks(w.ref)
            reader.add(w.ref.name, staged, w.box, blocks)
            t = _Target(w.ref, w.box, blocks, staged, w.live, w.make, slot=w.slot)
            self.targets.setdefault(w.ref, []).append(t)
        reader.run(data_files(self.path, saved.shards), io_threads())
        self.bytes_read, self.bytes_needed = reader.bytes_read, reader.bytes_needed

    def _read_rest(self, used: set[Ref]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Tensors outside the targets (scheduler, scaler, extras, stateful, RNG, and model or
        optimizer state when those objects were not passed), read whole from where they are:
        (local name -> tensor, global name -> tensor)."""
        saved = self._saved
        rest: dict[Ref, torch.Tensor | None] = {r: None for r in used if r not in self.targets}
        by_rank: dict[int, list[str]] = {}
        reader = Reader(self.step)
        for ref in rest:
            if ref.is_global:  # a DTensor outside model/optimizer: restored whole, as a tensor
                blocks = saved.index.check(ref.name)
                buf = torch.empty(blocks[0].box.global_shape, dtype=blocks[0].entry.torch_dtype)
                reader.add(ref.name, buf, Box.full(blocks[0].box.global_shape), blocks)
                rest[ref] = buf
            else:
                owner = saved.source.owners.get(ref.name, saved.source.rank)
                by_rank.setdefault(owner, []).append(ref.name)
        reader.run(data_files(self.path, saved.shards), io_threads())
        local: dict[str, torch.Tensor] = {}
        for owner, names in by_rank.items():
            local.update(read_tensors(self.step, saved.shards[owner], names))
        glob = {ref.name: t for ref, t in rest.items() if ref.is_global and t is not None}
        return local, glob

    # ------------------------------------------------------------------ apply

    def apply(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Load the staged state into the objects, all or nothing (see the module docs).

        Args:
            agree: as for ``load.apply``: whether every rank loaded the objects that may
                refuse their state; on False every rank rolls back.

        Raises:
            CheckpointCorruptError: an object refused the saved state (here or on another rank);
                every object is as it was.
        """
        model, optimizer = self.state.model, self.state.optimizer
        final: dict[Ref, torch.Tensor] = {}
        for ref, targets in self.targets.items():
            for t in targets:
                if t.live is not None:
                    final[ref] = t.live
                elif t.created is not None:
                    final[ref] = t.created
                else:
                    final[ref] = t.staged
        tree = _resolve(self.tree, final)
        # the model is loaded by copying into its storage; its own load_state_dict runs only for
        # values that are not tensors (a module's extra state)
        load_model = model is not None and any(
            not isinstance(v, torch.Tensor) for v in tree["model"].values()
        )
        self._loaded = {}
        apply(
            tree,
            dataclasses.replace(self.state, model=model if load_model else None),
            agree=agree,
            commit=lambda: self._copy_in(final, optimizer),
        )
        self.targets.clear()

    def _copy_in(self, final: dict[Ref, torch.Tensor], optimizer: Any) -> None:
        """Every rank agreed: copy the staged bytes into the objects' storage (for optimizer state,
        the tensor the optimizer holds now, should its loading have replaced ours)."""
        sync = False
        with torch.no_grad():
            for ref, targets in self.targets.items():
                for t in targets:
                    dst = final[ref] if t.live is None else t.live
                    if t.live is not None:
                        if t.slot is not None:
                            param, key = t.slot
                            held = optimizer.state.get(param, {}).get(key)
                            if isinstance(held, torch.Tensor) and held.shape == t.live.shape:
                                dst = held
                        local = dtensor.local_tensor(dst)
                        local.copy_(t.staged, non_blocking=local.is_cuda)
                    local = dtensor.local_tensor(dst)
                    sync = sync or local.is_cuda
                    self._loaded.setdefault(ref, []).append((t.box, local))
        if sync:
            torch.cuda.synchronize()  # the staging is released after this

    def release(self) -> None:
        """Drop the staged blocks and the references to the loaded tensors: what was read stays
        in ``bytes_read``/``bytes_needed``."""
        self.tree, self._loaded = {}, {}
        self.targets.clear()

    def verify_loaded(self) -> int:
        """CRC32C of the loaded tensors whose box is exactly one saved block, where they live.

        Returns:
            How many tensors were checked.
        """
        checked = 0
        for ref, targets in self._loaded.items():
            for box, live in targets:
                block = next((b for b in self._saved.blocks(ref) if b.box == box), None)
                if block is None or not block.entry.nbytes:
                    continue
                got = chunk_crc32c(as_bytes(live.contiguous()), block.chunk).tolist()
                if [x & 0xFFFFFFFF for x in got] != list(block.entry.crc32c):
                    raise CheckpointCorruptError(
                        f"{self.path}: after loading, tensor {ref.name!r} on {live.device} fails "
                        "its CRC32C (damaged in the copy to its device or in its memory); the "
                        "objects now hold these values: restore again",
                        path=str(self.path),
                        tensor=ref.name,
                    )
                checked += 1
        return checked


class _Saved:
    """The checkpoint as the targets see it: every shard manifest, the index of global blocks,
    the source shard and its decoded tree (tensors as Refs); what each target's blocks are and
    whether the objects' tensors fit them."""

    def __init__(
        self,
        path: Any,
        info: CheckpointInfo,
        shards: list[ShardManifest],
        index: GlobalIndex,
        source: ShardManifest,
        tree: dict[str, Any],
    ):
        self.path, self.info, self.shards, self.index = path, info, shards, index
        self.source, self.tree = source, tree
        self.where = f"checkpoint of step {info.step}"

    def blocks(self, ref: Ref) -> list[SavedBlock]:
        if ref.is_global:
            return self.index.check(ref.name)
        owner = self.source.owners.get(ref.name, self.source.rank)
        shard = self.shards[owner]
        entry = next((e for e in shard.tensors if e.name == ref.name), None)
        if entry is None:
            raise CheckpointCorruptError(
                f"{self.path}: rank {owner}'s shard lacks tensor {ref.name!r}",
                path=str(self.path),
                tensor=ref.name,
            )
        return [SavedBlock(owner, entry, Box.full(entry.shape), shard.chunk_bytes)]

    def shape(self, ref: Ref) -> tuple[int, ...]:
        return self.blocks(ref)[0].box.global_shape

    def dtype(self, ref: Ref) -> torch.dtype:
        return self.blocks(ref)[0].entry.torch_dtype

    def model_targets(self, model: Any) -> list[_Wanted]:
        where = self.where
        if "model" not in self.tree:
            raise CheckpointStateError(f"{where} has no model state; do not pass model=")
        saved = self.tree["model"]
        live = model_entries(saved, model, where)
        wanted = []
        for k, value in saved.items():
            target = live[k]
            if isinstance(value, Ref) != isinstance(target, torch.Tensor):
                kind = "a tensor" if isinstance(value, Ref) else "not a tensor"
                raise CheckpointStateError(
                    f"{where}: model key {k!r} is {kind} in the checkpoint, unlike in the model"
                )
            if isinstance(value, Ref):
                box, _ = dtensor.target_box(target)
                self._check_shape(value, box, target, f"model key {k!r}")
                wanted.append(_Wanted(value, box, live=target))
        return wanted

    def optimizer_targets(self, optimizer: Any) -> list[_Wanted]:
        wanted = []
        for pid, param, entries in _saved_optimizer_state(self.tree, optimizer, self.where):
            current = optimizer.state.get(param, {})
            for key, value in entries.items():
                if not isinstance(value, Ref):
                    continue
                what = f"optimizer state {key!r} of parameter {pid}"
                shape = self.shape(value)
                live = current.get(key)
                if isinstance(live, torch.Tensor):
                    box, _ = dtensor.target_box(live)
                    self._check_shape(value, box, live, what)
                    wanted.append(_Wanted(value, box, live=live, slot=(param, key)))
                elif dtensor.is_dtensor(param) and shape == tuple(param.shape):
                    block = dtensor.describe(param, what)
                    wanted.append(_Wanted(value, block.box, make=_as_dtensor_of(param)))
                else:
                    device = torch.device("cpu") if key == "step" else _device_of(param)
                    make = None if device.type == "cpu" else _to(device)
                    wanted.append(_Wanted(value, Box.full(shape), make=make))
        return wanted

    def _check_shape(self, ref: Ref, box: Box, target: torch.Tensor, what: str) -> None:
        blocks = self.blocks(ref)
        shape = blocks[0].box.global_shape
        if shape != box.global_shape:
            saved = ", ".join(blocks[0].entry.placements) or "plain"
            placed = "plain"
            if dtensor.is_dtensor(target):
                placed = ", ".join(dtensor.describe(target, what).placements)
            raise CheckpointStateError(
                f"{self.where}: {what} ({ref.name!r}) has global shape {shape} ({saved}) in the "
                f"checkpoint, {box.global_shape} ({placed}) here"
            )
        dtype = blocks[0].entry.torch_dtype
        if target.dtype != dtype:
            raise CheckpointStateError(
                f"{self.where}: {what} ({ref.name!r}) is {dtype} in the checkpoint, "
                f"{target.dtype} here; convert the object to the saved dtype first"
            )

    def check_plain_replicated(self, world_size: int) -> None:
        """Another world size: the plain tensors of the model and optimizer sections come from
        the source rank alone, so every saved rank with the same model keys must hold the same
        ones (as DDP replicas and FSDP's plain buffers do)."""
        src = self.source.rank
        keys = _model_keys(self.source)
        mine = _plain_replicated(self.source)
        for shard in self.shards:
            if shard.rank == src or _model_keys(shard) != keys or shard.replicated:
                continue
            theirs = _plain_replicated(shard)
            diff = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
            if diff:
                raise CheckpointStateError(
                    f"{self.path} was saved by {self.info.world_size} ranks, this job has "
                    f"{world_size}, and rank {shard.rank} saved another plain tensor "
                    f"{diff[0]!r} than rank {src}: plain (non-DTensor) state that differs "
                    "between ranks cannot be resharded. Restore with "
                    f"{self.info.world_size} ranks, or save sharded state as DTensors "
                    "(FSDP2 / tensor parallel)"
                )


def _saved_optimizer_state(
    tree: dict[str, Any], optimizer: Any, where: str
) -> Iterator[tuple[int, Any, dict[str, Any]]]:
    """(parameter index, the optimizer's parameter, its saved state entries) for each saved
    parameter state, once the saved optimizer state is shown to fit the optimizer's groups."""
    if "optimizer" not in tree:
        raise CheckpointStateError(f"{where} has no optimizer state; do not pass optimizer=")
    saved = tree["optimizer"]
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointCorruptError(f"{where}: optimizer state has no param_groups")
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in groups] != sizes:
        raise CheckpointStateError(
            f"{where}: optimizer param groups have sizes "
            f"{[len(g['params']) for g in groups]}, the optimizer has {sizes}"
        )
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{where}: optimizer state is not a mapping")
    params, seen = [], set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    for pid, entries in state.items():
        if not isinstance(pid, int) or not 0 <= pid < len(params) or not isinstance(entries, dict):
            raise CheckpointCorruptError(f"{where}: optimizer state key {pid!r} is invalid")
        yield pid, params[pid], entries


def _to(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda staged: staged.to(device)


def _device_of(param: torch.Tensor) -> torch.device:
    return dtensor.local_tensor(param).device


def _as_dtensor_of(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Optimizer state placed as ``param`` is: a DTensor with its mesh and placements whose local
    shard is the staged bytes on the parameter's device."""

    def make(staged: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        device = _device_of(param)
        local = staged.clone() if device.type == "cpu" else staged.to(device)
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    return make


def _resolve(node: Any, tensors: dict[Ref, torch.Tensor]) -> Any:
    """``node`` with every Ref that ``tensors`` holds replaced by its tensor."""
    if isinstance(node, Ref):
        return tensors.get(node, node)
    if isinstance(node, dict):
        return {k: _resolve(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, tensors) for v in node]
    if isinstance(node, tuple):
        return tuple(_resolve(v, tensors) for v in node)
    return node


def _model_keys(shard: ShardManifest) -> frozenset[str] | None:
    state = shard.state if isinstance(shard.state, dict) else {}
    model = state.get("model")
    return frozenset(model) if isinstance(model, dict) else None


def _source_rank(shards: list[ShardManifest], rank: int, model: Any) -> int:
    """Saved rank ``rank mod N``, or the next one whose model keys are this rank's."""
    n = len(shards)
    start = rank % n
    if model is None:
        return start
    keys = frozenset(canonical_key(k) for k in unwrap_model(model).state_dict())
    for k in range(n):
        if _model_keys(shards[(start + k) % n]) == keys:
            return (start + k) % n
    return start


def _plain_replicated(shard: ShardManifest) -> dict[str, tuple]:
    """The plain tensors of a shard's model and optimizer sections: name -> (dtype, shape, CRCs)."""
    return {
        e.name: (e.dtype, e.shape, e.crc32c)
        for e in shard.tensors
        if e.box is None and e.name.split(".", 1)[0] in REPLICATED_KEYS[:2]
    }
