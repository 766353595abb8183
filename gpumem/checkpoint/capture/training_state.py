"""What a training state is: the objects a save captures and a restore loads, declared once.

``TrainingState`` is the objects tuple (model, optimizer, scheduler, scaler, stateful objects,
extras, whether RNG states count) that ``Checkpointer.save`` and ``restore`` take as keywords;
every stage after the façade passes this one object on.

``capture`` asks each object for its ``state_dict()`` and encodes it (``codec``). Parameters and
optimizer state are marked *deferred*: only the optimizer step mutates them, so overlap mode may
copy them after save() returns. Everything else (buffers such as BatchNorm running statistics,
RNG states, user extras) is copied before save() returns. The class of the optimizer and of the
scheduler is recorded, so a restore into another class is refused (``restore.validate``). With
``replicated=True`` (DDP) the capture is split: each rank stages only the replicated tensors it
owns plus its own state (``replicated``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from ..errors import CheckpointStateError
from .codec import TensorTable, encode, numpy_module
from .replicated import REPLICATED_KEYS, Replication, split

_COMPILE_PREFIX = "_orig_mod."
CLASSES = "classes"  # tree key: the class names of the objects a restore must match
CHECKED_CLASSES = ("optimizer", "scheduler")


def unrequested(state: TrainingState) -> frozenset[str]:
    """The sections of a saved tree a restore into ``state`` does not load (its object is None;
    RNG when ``rng=False``): their tensors are verified but never held in memory."""
    skip = {
        k
        for k in ("model", "optimizer", "scheduler", "scaler", "extra")
        if getattr(state, k) is None
    }
    if state.stateful is None:
        skip.add("stateful")
    if not state.rng:
        skip.add("rng")
    return frozenset(skip)


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """The objects of one save or restore, as the caller passed them.

    Attributes:
        model: an ``nn.Module`` (DDP / DataParallel / torch.compile wrappers are looked through;
            FSDP2 and tensor-parallel modules are saved as their DTensor shards).
        optimizer, scheduler, scaler: objects with ``state_dict`` / ``load_state_dict``.
        stateful: name -> any object with ``state_dict`` / ``load_state_dict`` (a data loader,
            a sampler).
        extra: a dict of plain values saved as they are; restore() updates the dict it is given.
        rng: whether the RNG states of Python, NumPy, torch CPU and CUDA are saved / restored.
    """

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    stateful: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    rng: bool = True

    def objects(self) -> dict[str, Any]:
        """The keyword arguments of ``Checkpointer.save`` that reproduce this state."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass
class Capture:
    """A captured state: the JSON tree, the tensors this rank stages (not yet copied), and for a
    replicated save what this rank owns and records (``replicated.Replication``; else None)."""

    tree: dict[str, Any]
    table: TensorTable
    replication: Replication | None = None


def unwrap_model(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel wrappers: they add a ``module.``
    prefix to every key but hold the same replicated state, so wrapped and plain models save and
    restore the same checkpoint (as torch.compile'd and plain ones do through canonical_key)."""
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), torch.nn.Module
        ):
            model = model._orig_mod  # torch.compile(DDP(model)): look through both
        else:
            return model


def canonical_key(key: str) -> str:
    """Model key without torch.compile's ``_orig_mod.`` components, so wrapped and plain models
    match."""
    return key.replace(_COMPILE_PREFIX, "") if _COMPILE_PREFIX in key else key


def param_names(model: Any, optimizer: Any) -> dict[int, str]:
    """Optimizer parameter index (as ``optimizer.state_dict()`` numbers them: first appearance in
    ``param_groups``) -> the model's name for that parameter (the first, for tied ones)."""
    names: dict[int, str] = {}
    for name, p in unwrap_model(model).named_parameters():
        names.setdefault(id(p), canonical_key(name))
    out, seen = {}, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in names:
                out[len(seen) - 1] = names[id(p)]
    return out


def class_name(obj: Any) -> str:
    """What the checkpoint records of an object's class: its qualified name (module paths move
    between torch releases, class names do not)."""
    return type(obj).__qualname__


def sections(tree: dict[str, Any]) -> int:
    """Bit i set: the tree holds section ``REPLICATED_KEYS[i]`` (what the ranks of one save must
    agree on)."""
    return sum(1 << i for i, key in enumerate(REPLICATED_KEYS) if key in tree)


def capture(
    step: int, state: TrainingState, *, replicated: bool = False, rank: int = 0, world: int = 1
) -> Capture:
    """The state to save as a JSON tree plus its tensors (not yet copied); with ``replicated``
    only the tensors ``rank`` of ``world`` writes (``replicated.split``).

    Raises:
        CheckpointStateError: something cannot be stored, naming its key.
    """
    try:
        tree, table = _capture(step, state)
    except RecursionError:
        raise CheckpointStateError(
            "the state is nested too deeply to be stored (a container that contains itself?)"
        ) from None
    if not replicated:
        return Capture(tree, table)
    share, replication = split(table, rank, world)
    return Capture(tree, share, replication)


def _capture(step: int, state: TrainingState) -> tuple[dict[str, Any], TensorTable]:
    table = TensorTable()
    tree: dict[str, Any] = {"step": step}
    model, optimizer = state.model, state.optimizer
    if model is not None:
        sd = unwrap_model(model).state_dict(keep_vars=True)
        # parameters are deferred (only the optimizer step mutates them); buffers are copied at once
        tree["model"] = {
            canonical_key(k): encode(
                v, f"model.{canonical_key(k)}", table, isinstance(v, torch.nn.Parameter)
            )
            for k, v in sd.items()
        }
    if optimizer is not None:
        if model is not None:
            table.param_fqns = param_names(model, optimizer)
        tree["optimizer"] = encode(
            _state_dict_of(optimizer, "optimizer"), "optimizer", table, deferred=True
        )
    for key in ("scheduler", "scaler"):
        obj = getattr(state, key)
        if obj is not None:
            tree[key] = encode(_state_dict_of(obj, key), key, table)
    # REPLICATED_KEYS come first; the rank's own state follows
    table.replicated_count = len(table.names)
    classes = {k: class_name(getattr(state, k)) for k in CHECKED_CLASSES if k in tree}
    if classes:
        tree[CLASSES] = classes
    if state.extra is not None:
        if not isinstance(state.extra, dict):
            raise CheckpointStateError(f"extra must be a dict, got {type(state.extra).__name__}")
        tree["extra"] = encode(state.extra, "extra", table)
    if state.stateful:
        tree["stateful"] = {
            str(name): encode(_state_dict_of(obj, f"stateful[{name!r}]"), f"stateful.{name}", table)
            for name, obj in state.stateful.items()
        }
    if state.rng:
        tree["rng"] = encode(rng_state(), "rng", table)
    return tree, table


def _state_dict_of(obj: Any, what: str) -> Any:
    if not callable(getattr(obj, "state_dict", None)):
        raise CheckpointStateError(
            f"{what} ({type(obj).__name__}) has no state_dict(); "
            "pass objects with state_dict/load_state_dict"
        )
    return obj.state_dict()


def rng_state() -> dict[str, Any]:
    """RNG states of Python, NumPy (global), torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = numpy_module()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
