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
5. ``apply`` is ``state.apply``'s transaction: scheduler, scaler, stateful objects and the
   optimizer (whose state then refers to the existing storage) are loaded, rolled back if any
   of them refuses on any rank; only once every rank agreed are the staged bytes copied into
   the existing parameter and optimizer storage (a DTensor's local shard in place); then
   extras, RNG.

A restore therefore raises or falls back with every object as it was, by ``checkpointer``'s one
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

from . import sharding
from .codec import decode
from .errors import CheckpointCorruptError, CheckpointStateError
from .format import REPLICATED_KEYS, CheckpointInfo, ShardManifest
from .reshard import Block, GlobalIndex, Reader, data_files
from .restore import _io_threads, load_shard_manifest, read_tensors
from .safe_fs import Dir
from .sharding import Box
from .state import apply, canonical_key, unwrap_model
from .validate import check_targets, model_entries


@dataclasses.dataclass(frozen=True)
class Ref:
    """Stands for a tensor of the checkpoint in a decoded tree until it is read."""

    name: str
    is_global: bool


class _Refs(Mapping[str, Any]):
    """What ``state.decode`` puts in place of each tensor name: the tensor if ``loaded`` has it,
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
class _Target:
    ref: Ref
    box: Box
    blocks: list[Block]
    staged: torch.Tensor
    live: torch.Tensor | None  # storage to copy into (a DTensor's local shard, a plain tensor)
    make: Callable[[torch.Tensor], torch.Tensor] | None = None  # storage to create instead
    created: torch.Tensor | None = None  # what ``make`` created (in prepare)
    slot: tuple[Any, str] | None = None  # optimizer state: (parameter, key)


def has_dtensors(model: Any, optimizer: Any) -> bool:
    """Whether the objects hold DTensors (then restore reshards into them)."""
    if sharding.dtensor_type() is None:
        return False
    if model is not None and any(
        sharding.is_dtensor(v) for v in unwrap_model(model).state_dict().values()
    ):
        return True
    return optimizer is not None and any(
        sharding.is_dtensor(p) for g in optimizer.param_groups for p in g["params"]
    )


class ShardedRestore:
    """One checkpoint staged for this rank: ``prepare()`` reads and verifies, ``apply()`` loads.

    Args:
        step, info: the checkpoint directory (open: every file is read through it) and its main
            manifest.
        rank, world_size: this rank in the restoring job.
        stage: allocates ``n`` bytes of host staging memory (a uint8 tensor).
        objects: model=, optimizer=, scheduler=, scaler=, stateful= as given to restore().
    """

    def __init__(
        self,
        step: Dir,
        info: CheckpointInfo,
        rank: int,
        world_size: int,
        stage: Callable[[int], torch.Tensor],
        **objects: Any,
    ):
        self.step, self.path = step, step.path
        self.info, self.rank, self.world_size = info, rank, world_size
        self._stage = stage
        self.objects = objects
        self.tree: dict[str, Any] = {}
        self.targets: dict[Ref, list[_Target]] = {}
        self.bytes_read = 0
        self.bytes_needed = 0

    # ------------------------------------------------------------------ prepare

    def prepare(self, *, extra: Any = None, rng: bool = True) -> ShardedRestore:
        """Read, verify, stage and validate everything this rank needs; touch no object.

        Raises:
            CheckpointCorruptError: damage anywhere this rank reads, or saved values the objects
                cannot take.
            CheckpointStateError: the checkpoint does not fit the objects (keys, dtypes, global
                shapes, coverage, classes), naming the tensor.
            CheckpointIOError: the operating system failed a read.
        """
        shards = [load_shard_manifest(self.step, self.info, r) for r in range(self.info.world_size)]
        self.index = GlobalIndex(self.path, shards)
        model, optimizer = self.objects.get("model"), self.objects.get("optimizer")
        src = _source_rank(shards, self.rank, model)
        self.source = shards[src]
        local = {e.name for e in self.source.tensors} | set(self.source.owners)
        refs = (_Refs(local, False), _Refs(self.index.blocks, True))
        tree = decode(self.source.state, refs[0], f"{self.path.name}.rank{src}", dtensors=refs[1])
        self._used = refs[0].used | refs[1].used
        if not isinstance(tree, dict) or tree.get("step") != self.info.step:
            raise CheckpointCorruptError(
                f"{self.path}: rank {src} state does not record step {self.info.step}",
                path=str(self.path),
            )
        self.tree, self._shards = tree, shards
        if self.info.world_size != self.world_size:
            self._check_plain_replicated(src, model)
        plans: list[tuple[Ref, Box, torch.Tensor | None, Any]] = []
        if model is not None:
            plans += self._model_targets(model)
        if optimizer is not None:
            plans += self._optimizer_targets(optimizer)
        self._stage_targets(plans)
        loaded_local, loaded_global = self._read_rest()
        # decoded again with the tensors read (a NumPy array is built from its tensor here);
        # the targets stay Refs until apply()
        self.tree = decode(
            self.source.state,
            _Refs(local, False, loaded_local),
            f"{self.path.name}.rank{src}",
            dtensors=_Refs(self.index.blocks, True, loaded_global),
        )
        for targets in self.targets.values():  # storage that does not exist yet, made once
            for t in targets:
                if t.make is not None:
                    t.created = t.make(t.staged)
        # every target stands in as an empty tensor of its global shape: the objects' state is
        # checked as for an unsharded restore, nothing read twice
        stand_ins = {
            ref: torch.empty(
                self._saved_shape(ref), dtype=self._blocks(ref)[0].entry.torch_dtype, device="meta"
            )
            for ref in self.targets
        }
        check_targets(_resolve(self.tree, stand_ins), **self.objects, extra=extra, rng=rng)
        return self

    def _blocks(self, ref: Ref) -> list[Block]:
        if ref.is_global:
            return self.index.check(ref.name)
        owner = self.source.owners.get(ref.name, self.source.rank)
        shard = self._shards[owner]
        entry = next((e for e in shard.tensors if e.name == ref.name), None)
        if entry is None:
            raise CheckpointCorruptError(
                f"{self.path}: rank {owner}'s shard lacks tensor {ref.name!r}",
                path=str(self.path),
                tensor=ref.name,
            )
        return [Block(owner, entry, Box.full(entry.shape), shard.chunk_bytes)]

    def _saved_shape(self, ref: Ref) -> tuple[int, ...]:
        return self._blocks(ref)[0].box.global_shape

    def _model_targets(self, model: Any) -> list[tuple[Ref, Box, torch.Tensor | None, Any]]:
        where = f"checkpoint of step {self.info.step}"
        if "model" not in self.tree:
            raise CheckpointStateError(f"{where} has no model state; do not pass model=")
        saved = self.tree["model"]
        live = model_entries(saved, model, where)
        plans = []
        for k, value in saved.items():
            target = live[k]
            if isinstance(value, Ref) != isinstance(target, torch.Tensor):
                kind = "a tensor" if isinstance(value, Ref) else "not a tensor"
                raise CheckpointStateError(
                    f"{where}: model key {k!r} is {kind} in the checkpoint, unlike in the model"
                )
            if isinstance(value, Ref):
                box, _ = sharding.target_box(target)
                self._check_shape(value, box, target, f"model key {k!r}")
                plans.append((value, box, target, None))
        return plans

    def _optimizer_targets(self, optimizer: Any) -> list[tuple[Ref, Box, torch.Tensor | None, Any]]:
        where = f"checkpoint of step {self.info.step}"
        if "optimizer" not in self.tree:
            raise CheckpointStateError(f"{where} has no optimizer state; do not pass optimizer=")
        saved = self.tree["optimizer"]
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
        plans = []
        for pid, entries in state.items():
            if (
                not isinstance(pid, int)
                or not 0 <= pid < len(params)
                or not isinstance(entries, dict)
            ):
                raise CheckpointCorruptError(f"{where}: optimizer state key {pid!r} is invalid")
            param = params[pid]
            current = optimizer.state.get(param, {})
            for key, value in entries.items():
                if not isinstance(value, Ref):
                    continue
                what = f"optimizer state {key!r} of parameter {pid}"
                shape = self._saved_shape(value)
                live = current.get(key)
                if isinstance(live, torch.Tensor):
                    box, _ = sharding.target_box(live)
                    self._check_shape(value, box, live, what)
                    plans.append((value, box, live, (param, key)))
                elif sharding.is_dtensor(param) and shape == tuple(param.shape):
                    layout = sharding.describe(param, what)
                    plans.append((value, layout.box, None, _as_dtensor_of(param)))
                else:
                    device = torch.device("cpu") if key == "step" else _device_of(param)
                    plans.append((value, Box.full(shape), None, _on(device)))
        return plans

    def _check_shape(self, ref: Ref, box: Box, target: torch.Tensor, what: str) -> None:
        blocks = self._blocks(ref)
        shape = blocks[0].box.global_shape
        if shape != box.global_shape:
            saved = ", ".join(blocks[0].entry.placements) or "plain"
            placed = "plain"
            if sharding.is_dtensor(target):
                placed = ", ".join(sharding.describe(target, what).placements)
            raise CheckpointStateError(
                f"checkpoint of step {self.info.step}: {what} ({ref.name!r}) has global shape "
                f"{shape} ({saved}) in the checkpoint, {box.global_shape} ({placed}) here"
            )
        dtype = blocks[0].entry.torch_dtype
        if target.dtype != dtype:
            raise CheckpointStateError(
                f"checkpoint of step {self.info.step}: {what} ({ref.name!r}) is {dtype} in the "
                f"checkpoint, {target.dtype} here; convert the object to the saved dtype first"
            )

    def _stage_targets(self, plans: list[tuple[Ref, Box, torch.Tensor | None, Any]]) -> None:
        """Staging for every target, then one pass of reads over all of them."""
        dtypes = [self._blocks(ref)[0].entry.torch_dtype for ref, *_ in plans]
        sizes = [box.numel * d.itemsize for (_, box, *_), d in zip(plans, dtypes, strict=True)]
        in_arena = [live is not None or make is not _KEEP_ON_HOST for (_, _, live, make) in plans]
        offsets, total = [], 0
        for size, arena in zip(sizes, in_arena, strict=True):
            offsets.append(total if arena else -1)
            if arena:
                total += -(-size // 64) * 64
        arena = self._stage(total) if total else None
        reader = Reader(self.step)
        for (ref, box, live, make), dtype, size, off in zip(
            plans, dtypes, sizes, offsets, strict=True
        ):
            if off >= 0:
                staged = arena[off : off + size].view(dtype).view(box.shape)
            else:
                staged = torch.empty(box.shape, dtype=dtype)
            blocks = self._blocks(ref)
            reader.add(ref.name, staged, box, blocks)
            if live is not None:  # ``make`` holds the optimizer slot, or None for the model
                t = _Target(ref, box, blocks, staged, live, slot=make)
            else:
                t = _Target(ref, box, blocks, staged, None, None if make is _KEEP_ON_HOST else make)
            self.targets.setdefault(ref, []).append(t)
        reader.run(data_files(self.path, self._shards), _io_threads())
        self.bytes_read, self.bytes_needed = reader.bytes_read, reader.bytes_needed

    def _read_rest(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Tensors outside the targets (scheduler, scaler, extras, stateful, RNG, and model or
        optimizer state when those objects were not passed), read whole from where they are:
        (local name -> tensor, global name -> tensor)."""
        rest: dict[Ref, torch.Tensor | None] = {
            r: None for r in self._used if r not in self.targets
        }
        by_rank: dict[int, list[str]] = {}
        reader = Reader(self.step)
        for ref in rest:
            if ref.is_global:  # a DTensor outside model/optimizer: restored whole, as a tensor
                blocks = self.index.check(ref.name)
                buf = torch.empty(blocks[0].box.global_shape, dtype=blocks[0].entry.torch_dtype)
                reader.add(ref.name, buf, Box.full(blocks[0].box.global_shape), blocks)
                rest[ref] = buf
            else:
                by_rank.setdefault(self.source.owners.get(ref.name, self.source.rank), []).append(
                    ref.name
                )
        reader.run(data_files(self.path, self._shards), _io_threads())
        local: dict[str, torch.Tensor] = {}
        for owner, names in by_rank.items():
            local.update(read_tensors(self.step, self._shards[owner], names))
        glob = {ref.name: t for ref, t in rest.items() if ref.is_global and t is not None}
        return local, glob

    def _check_plain_replicated(self, src: int, model: Any) -> None:
        """Another world size: the plain tensors of the model and optimizer sections come from
        the source rank alone, so every saved rank with the same model keys must hold the same
        ones (as DDP replicas and FSDP's plain buffers do)."""
        keys = _model_keys(self.source)
        mine = _plain_replicated(self.source)
        for shard in self._shards:
            if shard.rank == src or _model_keys(shard) != keys or shard.replicated:
                continue
            theirs = _plain_replicated(shard)
            diff = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
            if diff:
                raise CheckpointStateError(
                    f"{self.path} was saved by {self.info.world_size} ranks, this job has "
                    f"{self.world_size}, and rank {shard.rank} saved another plain tensor "
                    f"{diff[0]!r} than rank {src}: plain (non-DTensor) state that differs "
                    "between ranks cannot be resharded. Restore with "
                    f"{self.info.world_size} ranks, or save sharded state as DTensors "
                    "(FSDP2 / tensor parallel)"
                )

    # ------------------------------------------------------------------ apply

    def apply(
        self,
        *,
        extra: dict[str, Any] | None = None,
        rng: bool = True,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """Load the staged state into the objects, all or nothing (see the module docs).

        Args:
            agree: as for ``state.apply``: whether every rank loaded the objects that may
                refuse their state; on False every rank rolls back.

        Raises:
            CheckpointCorruptError: an object refused the saved state (here or on another rank);
                every object is as it was.
        """
        model, optimizer = self.objects.get("model"), self.objects.get("optimizer")
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
        self._loaded: dict[Ref, list[tuple[Box, torch.Tensor]]] = {}
        apply(
            tree,
            model=model if load_model else None,
            optimizer=optimizer,
            scheduler=self.objects.get("scheduler"),
            scaler=self.objects.get("scaler"),
            stateful=self.objects.get("stateful"),
            extra=extra,
            rng=rng,
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
                        local = sharding.local_tensor(dst)
                        local.copy_(t.staged, non_blocking=local.is_cuda)
                    local = sharding.local_tensor(dst)
                    sync = sync or local.is_cuda
                    self._loaded.setdefault(ref, []).append((t.box, local))
        if sync:
            torch.cuda.synchronize()  # the staging is released after this

    def verify_loaded(self) -> int:
        """CRC32C of the loaded tensors whose box is exactly one saved block, where they live.

        Returns:
            How many tensors were checked.
        """
        from ._core import as_bytes, chunk_crc32c

        checked = 0
        for ref, targets in self._loaded.items():
            for box, live in targets:
                block = next((b for b in self._blocks(ref) if b.box == box), None)
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


_KEEP_ON_HOST = object()  # a target whose staging buffer becomes its storage


def _on(device: torch.device) -> Any:
    if device.type == "cpu":
        return _KEEP_ON_HOST
    return lambda staged: staged.to(device)


def _device_of(param: torch.Tensor) -> torch.device:
    return sharding.local_tensor(param).device


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
