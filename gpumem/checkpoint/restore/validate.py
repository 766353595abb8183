"""Does a decoded state tree fit the objects it is to be loaded into? Checked before any is touched.

Two answers besides yes. ``CheckpointStateError`` when the checkpoint was written by other code
than the caller's: other model keys or shapes, other optimizer group sizes, another optimizer or
scheduler class, a section the caller asks for but the checkpoint lacks. That is a mismatch, not
damage, so restore() raises it without falling back. ``CheckpointCorruptError`` when the saved
state itself is malformed: a value of another type than the object holds (``betas`` a string, a
dict where a list belongs), an integer out of range, state for a parameter no group lists, an
optimizer state tensor of another shape than its parameter, an RNG state no generator takes.
That is damage (or a hostile checkpoint), so restore() falls back to an older checkpoint.

What is checked is what the objects' ``load_state_dict`` would accept silently and the next
training step would trip over, or what would make loading fail halfway; ``state.apply`` then
loads with a rollback for whatever is left to the objects' own code (``load.apply``).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ..capture.codec import numpy_module
from ..capture.training_state import (
    CHECKED_CLASSES,
    CLASSES,
    TrainingState,
    canonical_key,
    class_name,
    unwrap_model,
)
from ..errors import CheckpointCorruptError, CheckpointStateError

_MAX_SCALAR_INT = 1 << 63  # hyperparameters and counters: anything larger is not one
# torch.optim classes whose per-parameter state tensors all have their parameter's shape (or are
# 0-d, like "step"); others (LBFGS, Adafactor) keep state of other shapes
_STATE_LIKE_PARAMS = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "Rprop",
        "SparseAdam",
    }
)


def check_targets(tree: dict[str, Any], state: TrainingState | None = None) -> None:
    """Raise unless the objects of ``state`` (None: no objects, RNG states checked) can take the
    saved state; touches nothing.

    Raises:
        CheckpointStateError: the checkpoint does not fit the objects (another model, optimizer
            class, group sizes, a missing section).
        CheckpointCorruptError: the saved state is malformed.
    """
    where = f"checkpoint of step {tree.get('step')}"
    classes = tree.get(CLASSES, {})
    if not isinstance(classes, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in classes.items()
    ):
        raise CheckpointCorruptError(f"{where}: the recorded classes are malformed")
    state = state if state is not None else TrainingState()
    model, optimizer, extra = state.model, state.optimizer, state.extra
    for key in ("model", "optimizer", "scheduler", "scaler"):
        obj = getattr(state, key)
        if obj is None:
            continue
        if key not in tree:
            raise CheckpointStateError(
                f"{where} has no {key} state; do not pass {key}= to restore()"
            )
        if key != "model" and not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointStateError(f"{key} ({type(obj).__name__}) has no load_state_dict()")
        if key in CHECKED_CLASSES and key in classes and classes[key] != class_name(obj):
            raise CheckpointStateError(
                f"{where} holds the state of a {classes[key][:100]} {key}, and the {key} given "
                f"is a {class_name(obj)}: restore into the class that saved it"
            )
    if model is not None:
        _check_model(tree["model"], model, where)
    if optimizer is not None:
        _check_optimizer(tree["optimizer"], optimizer, where)
    for key in ("scheduler", "scaler"):
        obj = getattr(state, key)
        if obj is not None:
            _check_object_state(tree[key], obj, f"{where}: {key} state")
    _check_stateful(tree, state.stateful, where)
    if extra is not None:
        if not isinstance(extra, dict):
            raise CheckpointStateError(
                f"extra= must be a dict for restore() to update, got {type(extra).__name__}"
            )
        if not isinstance(tree.get("extra", {}), dict):
            raise CheckpointCorruptError(f"{where}: the saved extra is not a dict")
    if state.rng and "rng" in tree:
        _check_rng(tree["rng"], where)


def model_entries(saved: Any, model: Any, where: str) -> dict[str, Any]:
    """The model's state by canonical key, once the saved model state is a mapping with exactly
    those keys (CheckpointCorruptError / CheckpointStateError otherwise)."""
    if not isinstance(saved, dict):
        raise CheckpointCorruptError(f"{where}: model state is not a mapping")
    target = {canonical_key(k): v for k, v in unwrap_model(model).state_dict().items()}
    missing, unexpected = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
    if missing or unexpected:
        raise CheckpointStateError(
            f"{where} does not match the model: missing keys "
            f"{missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    return target


def _check_model(saved: Any, model: Any, where: str) -> None:
    target = model_entries(saved, model, where)
    for k, t in target.items():
        if not isinstance(t, torch.Tensor):
            continue  # extra state (get_extra_state): the module's own business
        s = saved[k]
        if not isinstance(s, torch.Tensor):
            raise CheckpointCorruptError(
                f"{where}: model key {k!r} holds a {type(s).__name__}, not a tensor"
            )
        if tuple(s.shape) != tuple(t.shape):
            raise CheckpointStateError(
                f"{where}: model key {k!r} has shape {tuple(s.shape)}, "
                f"the model has {tuple(t.shape)}"
            )
        if s.is_complex() and not t.is_complex():
            raise CheckpointStateError(
                f"{where}: model key {k!r} is {s.dtype}, the model's is {t.dtype}"
            )


def _check_optimizer(saved: Any, optimizer: Any, where: str) -> None:
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("state"), dict)
        or not isinstance(saved.get("param_groups"), list)
        or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]
        )
    ):
        raise CheckpointCorruptError(f"{where}: optimizer state has no state or param_groups")
    groups = saved["param_groups"]
    saved_sizes = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointStateError(
            f"{where}: optimizer param groups have sizes {saved_sizes}, the optimizer has {sizes}"
        )
    ids = [i for g in groups for i in g["params"]]
    if not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
        raise CheckpointCorruptError(f"{where}: optimizer parameter ids are not distinct ints")
    params = dict(zip(ids, (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    for i, (sg, tg) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        for key in sorted(set(sg) & set(tg) - {"params"}):
            _fits(sg[key], tg[key], f"{where}: optimizer param group {i} {key!r}")
    like_params = class_name(optimizer) in _STATE_LIKE_PARAMS
    for pid, st in saved["state"].items():
        if pid not in params:
            raise CheckpointCorruptError(
                f"{where}: optimizer state for parameter id {str(pid)[:40]}, "
                "which no param group lists"
            )
        if not isinstance(st, dict) or not all(isinstance(n, str) for n in st):
            raise CheckpointCorruptError(
                f"{where}: optimizer state of parameter {pid} is not a mapping of names"
            )
        if not like_params:
            continue
        shape = tuple(params[pid].shape)
        for name, value in st.items():
            bad = (
                tuple(value.shape) not in ((), shape)
                if isinstance(value, torch.Tensor)
                else not (value is None or _number(value))
            )
            if bad:
                what = (
                    f"shape {tuple(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise CheckpointCorruptError(
                    f"{where}: optimizer state {name!r} of parameter {pid} is a {what}; "
                    f"its parameter has shape {shape}"
                )


def _check_object_state(saved: Any, obj: Any, where: str) -> None:
    """A scheduler's or scaler's saved state against its current one: the same types where both
    have a key, and no key that would overwrite an attribute the state does not hold (such as a
    scheduler's ``optimizer``)."""
    if not callable(getattr(obj, "state_dict", None)):
        return  # nothing to compare against; its load_state_dict runs under the rollback
    current = obj.state_dict()
    if not isinstance(saved, dict) or not all(isinstance(k, str) for k in saved):
        raise CheckpointCorruptError(f"{where} is not a mapping of names")
    if isinstance(current, dict):
        for key in saved:
            if key not in current and hasattr(obj, key):
                raise CheckpointCorruptError(
                    f"{where} sets {key!r}, which is not part of its state (a hostile checkpoint?)"
                )
    _fits(saved, current, where)


def _check_stateful(tree: dict[str, Any], stateful: dict[str, Any] | None, where: str) -> None:
    if not stateful:
        return
    saved = tree.get("stateful", {})
    if not isinstance(saved, dict):
        raise CheckpointCorruptError(f"{where}: the saved stateful objects are not a mapping")
    for name, obj in stateful.items():
        if str(name) not in saved:
            raise CheckpointStateError(
                f"{where} has no stateful object {name!r} (saved: {sorted(saved)[:10]})"
            )
        if not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointStateError(
                f"stateful[{name!r}] ({type(obj).__name__}) has no load_state_dict()"
            )


def _number(v: Any) -> bool:
    return isinstance(v, float) or (
        isinstance(v, int) and not isinstance(v, bool) and -_MAX_SCALAR_INT <= v < _MAX_SCALAR_INT
    )


def _fits(saved: Any, current: Any, where: str) -> None:
    """Raise CheckpointCorruptError unless ``saved`` has the shape of ``current``: the same kind
    of value (numbers for numbers, a string for a string, a tensor or a number for a one-element
    tensor, a sequence of as many fitting items for a sequence), recursively through dicts (keys
    both have). Values the object does not hold (None) take any scalar."""
    problem = _misfit(saved, current)
    if problem is not None:
        at, what = problem
        raise CheckpointCorruptError(f"{where}{at}: {what}")


def _misfit(saved: Any, current: Any, at: str = "") -> tuple[str, str] | None:
    np = numpy_module()
    if np is not None and isinstance(current, np.generic):
        current = current.item()
    got = type(saved).__name__

    def expected(kind: str) -> tuple[str, str]:
        return at, f"holds a {got}, expected {kind}"

    if isinstance(current, torch.Tensor):
        if isinstance(saved, torch.Tensor):
            if saved.shape == current.shape or saved.numel() == current.numel() == 1:
                return None
            return at, f"a tensor of shape {tuple(saved.shape)}, expected {tuple(current.shape)}"
        return None if _number(saved) and current.numel() == 1 else expected("a tensor")
    if isinstance(saved, torch.Tensor) and saved.numel() == 1 and _number(current):
        return None  # a number the code now keeps as a tensor (or back)
    if current is None:
        scalar = saved is None or isinstance(saved, (bool, str)) or _number(saved)
        return None if scalar else expected("a scalar")
    if isinstance(current, bool):
        return None if saved is None or isinstance(saved, bool) else expected("a bool")
    if isinstance(current, (int, float)):
        return None if _number(saved) else expected("a number")
    if isinstance(current, (str, bytes)):
        return None if type(saved) is type(current) else expected(type(current).__name__)
    if isinstance(current, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            return expected(f"a sequence of {len(current)}")
        for i, (s, c) in enumerate(zip(saved, current, strict=True)):
            problem = _misfit(s, c, f"{at}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(current, dict):
        if not isinstance(saved, dict):
            return expected("a mapping")
        for key in current:
            if key in saved:
                problem = _misfit(saved[key], current[key], f"{at}.{key}")
                if problem is not None:
                    return problem
        return None
    if np is not None and isinstance(current, np.ndarray):
        ok = isinstance(saved, np.ndarray) and saved.shape == current.shape
        return None if ok else expected(f"an array of shape {current.shape}")
    return None  # nothing the format stores: nothing to compare


def _check_rng(state: Any, where: str) -> None:
    """Load the saved RNG states into throwaway generators, so a bad one fails before anything is
    touched."""
    try:
        if not isinstance(state, dict):
            raise TypeError("the RNG states are not a mapping")
        random.Random().setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        np = numpy_module()
        if np is not None and "numpy" in state:
            np.random.RandomState().set_state(state["numpy"])
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda
        ):
            raise ValueError("CUDA RNG states must be a list of uint8 tensors")
        if cuda and torch.cuda.is_available():
            # torch.cuda.set_rng_state checks the size only when it runs, after the model and
            # optimizer were loaded (or, before CUDA is initialized, later still): check it now
            for i, t in enumerate(cuda[: torch.cuda.device_count()]):
                want = torch.cuda.get_rng_state(i).numel()
                if t.numel() != want:
                    raise ValueError(
                        f"CUDA RNG state {i} has {t.numel()} bytes, this torch's has {want}"
                    )
    except Exception as exc:  # whatever a generator refuses: OverflowError, TypeError, ...
        raise CheckpointCorruptError(
            f"{where}: saved RNG state is invalid: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
