"""Loading a verified, validated state tree into the training objects, all or nothing.

``apply`` runs after ``validate.check_targets`` accepted the tree, so that a failure leaves the
objects as they were: first the objects whose ``load_state_dict`` is someone else's code and may
still refuse the state (stateful objects, scaler, scheduler, optimizer), each after taking its
current ``state_dict()``, and rolled back from those in reverse order should one of them (or,
under torch.distributed, another rank) fail; then the model, whose keys, shapes and dtypes were
checked so that its load cannot fail on the values; then ``extra`` and, last, the RNG states,
checked in throwaway generators.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..capture.codec import numpy_module
from ..capture.training_state import TrainingState, canonical_key, unwrap_model
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointStateError


def apply(
    tree: dict[str, Any],
    state: TrainingState,
    *,
    agree: Callable[[bool], bool] | None = None,
    commit: Callable[[], None] | None = None,
) -> None:
    """Load a decoded tree that ``validate.check_targets`` accepted into the objects of ``state``,
    all or nothing (see the module docs for the order).

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
        for name, obj in (state.stateful or {}).items()
    ]
    sections += [
        (obj, tree[key], key)
        for key in ("scaler", "scheduler", "optimizer")
        if (obj := getattr(state, key)) is not None
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
    if state.model is not None:
        try:
            module = unwrap_model(state.model)
            names = {canonical_key(k): k for k in module.state_dict()}
            module.load_state_dict({names[k]: v for k, v in tree["model"].items()}, strict=True)
        except Exception as exc:
            _roll_back(undo)
            raise CheckpointStateError(
                f"loading the model failed in its own loading code although its keys, shapes "
                f"and dtypes fit ({type(exc).__name__}: {exc}); the other objects were left as "
                "they were, the model may be partly loaded: restore again"
            ) from exc
    if state.extra is not None:
        state.extra.update(tree.get("extra") or {})
    if state.rng and "rng" in tree:
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
