"""Training objects <-> state tree: capture for save(), the all-or-nothing load for restore().

``capture`` asks each object for its ``state_dict()`` and encodes it (``codec.py``). Parameters and
optimizer state are marked *deferred*: only the optimizer step mutates them, so overlap mode may
copy them after save() returns. Everything else (buffers such as BatchNorm running statistics,
RNG states, user extras) is copied before save() returns. The class of the optimizer and of the
scheduler is recorded, so a restore into another class is refused (``validate.py``).

``apply`` loads a decoded and validated tree (``validate.check_targets`` ran first) so that a
failure leaves the objects as they were: first the objects whose ``load_state_dict`` is someone
else's code and may still refuse the state (stateful objects, scaler, scheduler, optimizer), each
after taking its current ``state_dict()``, and rolled back from those in reverse order should one
of them (or, under torch.distributed, another rank) fail; then the model, whose keys, shapes and
dtypes were checked so that its load cannot fail on the values; then ``extra`` and, last, the RNG
states, checked in throwaway generators.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .codec import TensorTable, encode, numpy_module
from .errors import CheckpointCorruptError, CheckpointError, CheckpointStateError

_COMPILE_PREFIX = "_orig_mod."
CLASSES = "classes"  # tree key: the class names of the objects a restore must match
CHECKED_CLASSES = ("optimizer", "scheduler")


# ---------------------------------------------------------------------------------------------
# capture


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


def capture(
    step: int,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: dict[str, Any] | None = None,
    stateful: dict[str, Any] | None = None,
    rng: bool = True,
) -> tuple[dict[str, Any], TensorTable]:
    """The state to save as a JSON tree plus its tensors (not yet copied).

    Raises:
        CheckpointStateError: something cannot be stored, naming its key.
    """
    try:
        return _capture(step, model, optimizer, scheduler, scaler, extra, stateful, rng)
    except RecursionError:
        raise CheckpointStateError(
            "the state is nested too deeply to be stored (a container that contains itself?)"
        ) from None


def _capture(
    step: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    stateful: dict[str, Any] | None,
    rng: bool,
) -> tuple[dict[str, Any], TensorTable]:
    table = TensorTable()
    tree: dict[str, Any] = {"step": step}
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
    for key, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            tree[key] = encode(_state_dict_of(obj, key), key, table)
    table.replicated_count = len(
        table.names
    )  # REPLICATED_KEYS come first; the rank's own state follows
    classes = {k: class_name(o) for k, o in (("optimizer", optimizer), ("scheduler", scheduler))}
    classes = {k: v for k, v in classes.items() if k in tree}
    if classes:
        tree[CLASSES] = classes
    if extra is not None:
        if not isinstance(extra, dict):
            raise CheckpointStateError(f"extra must be a dict, got {type(extra).__name__}")
        tree["extra"] = encode(extra, "extra", table)
    if stateful:
        tree["stateful"] = {
            str(name): encode(_state_dict_of(obj, f"stateful[{name!r}]"), f"stateful.{name}", table)
            for name, obj in stateful.items()
        }
    if rng:
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


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np = numpy_module()
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    saved_cuda = state.get("cuda") or []
    if saved_cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(saved_cuda):
            warnings.warn(
                f"checkpoint has RNG states for {len(saved_cuda)} CUDA devices, this "
                f"process sees {n}; restoring the first {min(n, len(saved_cuda))}",
                stacklevel=3,
            )
        for i in range(min(n, len(saved_cuda))):
            torch.cuda.set_rng_state(saved_cuda[i], i)


# ---------------------------------------------------------------------------------------------
# apply


def apply(
    tree: dict[str, Any],
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    stateful: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
    agree: Callable[[bool], bool] | None = None,
    commit: Callable[[], None] | None = None,
) -> None:
    """Load a decoded tree that ``validate.check_targets`` accepted into the objects, all or
    nothing (see the module docs for the order).

    Args:
        agree: called once every object but the model is loaded, with whether this process
            loaded them; returns whether every rank did (``torch.distributed``: an all-reduce).
            On False every rank rolls back, so the ranks fail or succeed together.
        commit: called once every rank agreed, before the model is loaded: what may no longer
            fail on the content (a sharded restore copies its verified, staged bytes into the
            objects' storage here).

    Raises:
        CheckpointCorruptError: an object's ``load_state_dict`` refused the saved state (here or
            on another rank); every object is as it was.
        CheckpointStateError: the model's own loading code failed although its keys, shapes and
            dtypes fit (a load hook, ``set_extra_state``); the other objects were rolled back.
    """
    sections = [
        (obj, tree["stateful"][str(name)], f"stateful[{name!r}]")
        for name, obj in (stateful or {}).items()
    ]
    sections += [
        (obj, tree[key], key)
        for key, obj in (("scaler", scaler), ("scheduler", scheduler), ("optimizer", optimizer))
        if obj is not None
    ]
    undo: list[tuple[Any, Any, str]] = []
    failure: str | None = None
    for obj, saved, what in sections:
        try:
            undo.append((obj, obj.state_dict(), what))
            # a shallow copy: some load_state_dict pop keys from the dict they are given
            obj.load_state_dict(dict(saved) if isinstance(saved, dict) else saved)
        except Exception as exc:
            failure = f"{what}.load_state_dict refused the saved state: {type(exc).__name__}: {exc}"
            break
    everyone = agree(failure is None) if agree is not None else failure is None
    if failure is not None or not everyone:
        _roll_back(undo)
        raise CheckpointCorruptError(
            f"checkpoint of step {tree.get('step')}: "
            f"{failure or 'another rank could not load its state'}; nothing was changed"
        )
    if commit is not None:
        try:
            commit()
        except Exception as exc:  # the device, not the checkpoint (all of it was verified)
            raise CheckpointError(
                f"copying the verified state of step {tree.get('step')} into the objects failed "
                f"({type(exc).__name__}: {exc}); they may be partly loaded: restore again"
            ) from exc
    if model is not None:
        try:
            module = unwrap_model(model)
            names = {canonical_key(k): k for k in module.state_dict()}
            module.load_state_dict({names[k]: v for k, v in tree["model"].items()}, strict=True)
        except Exception as exc:
            _roll_back(undo)
            raise CheckpointStateError(
                f"loading the model failed in its own loading code although its keys, shapes "
                f"and dtypes fit ({type(exc).__name__}: {exc}); the other objects were left as "
                "they were, the model may be partly loaded: restore again"
            ) from exc
    if extra is not None:
        extra.update(tree.get("extra") or {})
    if rng and "rng" in tree:
        set_rng_state(tree["rng"])


def _roll_back(undo: list[tuple[Any, Any, str]]) -> None:
    """Reload the state each loaded object had before, newest first. torch's optimizers,
    schedulers and scalers replace their state on load, so their earlier ``state_dict()`` brings
    them back exactly; a stateful object whose ``state_dict()`` returns live references that its
    load then mutates cannot be restored this way (said in docs/checkpoint.md)."""
    failed = []
    for obj, old, what in reversed(undo):
        try:
            obj.load_state_dict(old)
        except Exception as exc:
            failed.append(f"{what} ({type(exc).__name__}: {exc})")
    if failed:
        raise CheckpointError(
            "restore failed, and rolling back failed too for " + ", ".join(failed)
        )
