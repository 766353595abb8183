"""The hooks a Checkpointer puts on optimizers, and their removal when it closes.

- overlap mode's fence: a pre-step hook on each optimizer a save was given, that waits for (or
  on CUDA fences the optimizer's stream behind) the background copy of the save in flight, so
  ``step()`` never mutates a tensor mid-copy (``stage.snapshot.fence_hook``);
- prepare()'s (and so restore()'s) prepare-ahead: a one-shot post-step hook that sizes and starts
  the first save's staging arena once the first ``step()`` has made the optimizer's state (AdamW
  makes it there).

Each hook holds only what it is given (a callable that looks the Checkpointer up through a weak
reference), so a dropped Checkpointer is never kept alive by the optimizer it hooked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .stage.snapshot import Snapshot, fence_hook


class OptimizerHooks:
    """The fence of each hooked optimizer and the pending prepare-ahead, removed together."""

    def __init__(self) -> None:
        self._fences: dict[int, Any] = {}  # id(optimizer) -> its pre-step hook handle
        self._prepare: Any = None

    def fence(self, optimizer: Any, snapshot: Callable[[], Snapshot | None]) -> None:
        """Fence ``optimizer.step()`` behind the copy of ``snapshot()`` (once per optimizer)."""
        if id(optimizer) not in self._fences:
            self._fences[id(optimizer)] = optimizer.register_step_pre_hook(fence_hook(snapshot))

    @property
    def prepare_pending(self) -> bool:
        """A prepare-ahead waits for the optimizer's first step."""
        return self._prepare is not None

    def prepare_ahead(self, optimizer: Any, prepare: Callable[[Any], None]) -> None:
        """Call ``prepare(optimizer)`` once after its next ``step()``, which makes its state
        (AdamW's moments); a second call while one is pending is ignored."""
        if self._prepare is not None:
            return

        def once(opt: Any, args: Any, kwargs: Any) -> None:
            if self._prepare is None:
                return
            self._prepare.remove()
            self._prepare = None
            prepare(opt)

        self._prepare = optimizer.register_step_post_hook(once)

    def remove(self) -> None:
        for handle in self._fences.values():
            handle.remove()
        self._fences.clear()
        if self._prepare is not None:
            self._prepare.remove()
            self._prepare = None


def prepare_quietly(prepare: Callable[[Any, Any], Any], model: Any, optimizer: Any) -> None:
    """``prepare(model, optimizer)`` on restore()'s behalf: an ahead-of-time allocation, so a
    failure to size or start it is a warning (the first save() allocates its arena then); a
    failure of the background allocation itself is raised by the next save() or wait(), as for
    ``Checkpointer.prepare()``."""
    try:
        prepare(model, optimizer)
    except Exception as exc:  # never the reason a restore or a training step fails
        warnings.warn(
            f"gpumem: could not prepare the staging arena ahead of the first save ({exc}); "
            "the first save() allocates it instead",
            RuntimeWarning,
            stacklevel=3,
        )


def prepare_first_save(ckpt: Any, model: Any, optimizer: Any) -> None:
    """``ckpt.prepare(model, optimizer)`` when a job starts (restore(), the trainer callbacks on a
    fresh run), unless the Checkpointer is read-only or has nothing to size; quietly."""
    if (model is not None or optimizer is not None) and ckpt.read_only is None:
        prepare_quietly(ckpt.prepare, model, optimizer)
