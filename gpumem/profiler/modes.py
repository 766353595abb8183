"""The two ways a profile sees memory, as strategies the session holds (``mode_of``).

- ``ExactMode``: the tracker runs as a TorchDispatchMode and calls the session after every op;
  every storage is seen the moment it is created, temporaries included.
- ``LightMode``: no per-op dispatch; the tracker only keeps the registry of the storages the
  hooks hand it, and the session samples it at hook boundaries. On CUDA the caching
  allocator's peak between two boundaries gives the level (and so the temporaries); on CPU the
  tracked categories are the level and temporaries are not measured.

The session asks the same questions of either; each answer is the mode's, so the session holds
no ``if light`` of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpumem.profiler.categories import ACTIVATIONS, COMMUNICATION, TEMPORARY
from gpumem.profiler.tracker import storages_of

if TYPE_CHECKING:
    from gpumem.profiler.communication import CommAccount
    from gpumem.profiler.records import ProbeView
    from gpumem.profiler.tracker import Entry, StorageTracker


class ModeHost(Protocol):
    """What a mode reads of the session and tells it (``Profile``)."""

    tracker: StorageTracker
    allocator: Any
    """The CUDA allocator probe, or None."""
    comm: CommAccount

    def probe_view(self) -> ProbeView: ...
    def after_op(self, level: int | None = None) -> None: ...
    def sync(self) -> None: ...
    def mark_activation(self, e: Entry, module: str) -> None: ...


class ExactMode:
    """Every op: the tracker's dispatch mode calls ``Profile.after_op`` after each one."""

    # every allocation and free is seen, in order: the allocator simulator can replay them
    logs_allocations = True
    # every storage is seen when created: one the hooks do not know was never the model's
    registers_unseen = False
    # the allocator probe records a sample of its own at every module call
    samples_allocator = True

    def __init__(self, prof: ModeHost) -> None:
        self.prof = prof
        # what the tracker calls after every op: the session's peaks, with no call in between
        self.sync: Callable[[], None] = prof.after_op

    def start(self) -> None:
        """Entry, before the hooks are installed: nothing to measure yet."""

    def install(self) -> None:
        self.prof.tracker.__enter__()

    def stop(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.prof.tracker.__exit__(exc_type, exc, tb)

    def boundary(self) -> None:
        """A hook boundary: the ops already brought everything up to date."""

    def frame_opened(self) -> None:
        """A module call started: the ops number the events."""

    def registered(self) -> None:
        """A hook registered storages: the op that created them already synced."""

    def optimizer_boundary(self) -> None:
        prof = self.prof
        if prof.allocator is not None:
            prof.allocator.boundary(prof.probe_view())

    def level_now(self) -> int:
        return self.prof.tracker.level

    def snap_categories(self, level: int) -> dict[str, int | None]:
        return dict(self.prof.tracker.by_category)

    def measures_temporary(self) -> bool:
        return True

    def inputs_tracked(self, new: list[Entry]) -> None:
        """The root forward's new inputs: they are in the level like any storage."""

    def root_forward_seen(self) -> None:
        """The region's first forward started: nothing to remember."""

    def saved_for_backward(self, t: torch.Tensor, module: str) -> None:
        """A storage autograd keeps that was a temporary (or communication that is not an
        unsharded parameter) becomes an activation of ``module``."""
        prof = self.prof
        for st in storages_of(t):
            e = prof.tracker.lookup(st)
            if e is None or e.died is not None:
                continue
            if e.category == TEMPORARY or (
                e.category == COMMUNICATION and not prof.comm.is_gathered(e)
            ):
                prof.mark_activation(e, module)


class LightMode:
    """Hook boundaries only: the level is sampled there (on CUDA from the allocator)."""

    logs_allocations = False
    # storages the hooks meet first (a gradient assigned outside autograd, optimizer state)
    # are registered then: nothing saw them created
    registers_unseen = True
    samples_allocator = False

    def __init__(self, prof: ModeHost) -> None:
        self.prof = prof
        self.sync: Callable[[], None] = self.boundary
        # on CUDA: allocated bytes that are not the model's (other tensors alive at entry), the
        # allocator level at the last boundary, the categories there
        self.baseline = 0
        self.level = 0
        self.cats_prev: dict[str, int] = {}
        self.forwarded = False

    def start(self) -> None:
        prof = self.prof
        if prof.allocator is not None:
            self.baseline = prof.allocator.start_allocated - self._cuda_tracked()
            self.level = prof.tracker.level
        self.cats_prev = dict(prof.tracker.by_category)

    def install(self) -> None:
        self.prof.tracker.patch_resize()

    def stop(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.boundary()
        self.prof.tracker.unpatch_resize()

    def _cuda_tracked(self) -> int:
        return self.prof.tracker.by_device.get("cuda", 0)

    def boundary(self) -> None:
        """Bring peaks, frames and the timeline up to date at a hook boundary.

        On CPU the level is the tracked categories (exact at boundaries: they only grow at
        boundaries). On CUDA it is the caching allocator's peak since the previous boundary,
        less the bytes that were allocated at entry and are not the model's."""
        prof = self.prof
        tr = prof.tracker
        tr.events += 1
        if prof.allocator is None:
            prof.after_op()
        else:
            peak, now = prof.allocator.interval(prof.probe_view())
            other = tr.level - self._cuda_tracked()  # tracked bytes on other devices
            self.level = now - self.baseline + other
            prof.after_op(max(peak - self.baseline + other, tr.level))
        self.cats_prev = dict(tr.by_category)

    def frame_opened(self) -> None:
        self.prof.tracker.events += 1  # storages registered from now on are born inside the call

    def registered(self) -> None:
        self.prof.sync()

    def optimizer_boundary(self) -> None:
        # the new state, and on CUDA the step's peak, in the optimizer phase
        self.boundary()

    def level_now(self) -> int:
        return self.level if self.prof.allocator is not None else self.prof.tracker.level

    def snap_categories(self, level: int) -> dict[str, int | None]:
        at: dict[str, int | None] = dict(self.prof.tracker.by_category)
        if self.prof.allocator is None:
            at[TEMPORARY] = None  # not measured: nothing sees a temporary without the mode
            return at
        # the peak lies between two boundaries: per category, count what was alive at both
        # (the smaller of the two sums); the rest of the allocator's peak is temporary
        prev = self.cats_prev
        at = {c: min(v, prev.get(c, v)) for c, v in at.items()}
        at[TEMPORARY] = 0
        at[TEMPORARY] = max(0, level - sum(at.values()))
        return at

    def measures_temporary(self) -> bool:
        """Only where the allocator's peaks are available (CUDA)."""
        return self.prof.allocator is not None

    def inputs_tracked(self, new: list[Entry]) -> None:
        if self.prof.allocator is not None and not self.forwarded:
            # inputs of the region's first forward are taken to predate the region: their
            # blocks are in the allocator's level at entry, not the baseline
            self.baseline -= sum(x.nbytes for x in new if x.device == "cuda")

    def root_forward_seen(self) -> None:
        self.forwarded = True

    def saved_for_backward(self, t: torch.Tensor, module: str) -> None:
        """Nothing tracks temporaries here: a storage that is no weight, input, gradient,
        optimizer state or earlier activation is new, hence an activation."""
        prof = self.prof
        new = False
        for st in storages_of(t):
            if prof.tracker.lookup(st) is None:
                e = prof.tracker.add(st, t.device.type, ACTIVATIONS, module)
                prof.mark_activation(e, module)
                new = True
        if new:
            self.boundary()


def mode_of(name: str, prof: ModeHost) -> ExactMode | LightMode:
    """The strategy of ``gpumem.profile(mode=name)`` (``name`` checked by the session)."""
    return LightMode(prof) if name == "light" else ExactMode(prof)
