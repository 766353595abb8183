"""The communication a profile accounts: FSDP2 units' gathers, reshards and reduce-scatters.

What a unit's parameter group creates while it gathers, reshards or reduces is communication of
that unit (``fsdp_tp.py`` says which calls); its unsharded parameters stay communication when
autograd saves them. Live communication bytes are kept in all (communication buffers are no
module's scratch space, so the session leaves them out of the frames' levels) and per module
with its ancestors, whose peaks each step records.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpumem.profiler import fsdp_tp
from gpumem.profiler.categories import COMMUNICATION, TEMPORARY
from gpumem.profiler.records import ancestors, credit_kept
from gpumem.profiler.tracker import storages_of

if TYPE_CHECKING:
    from gpumem.profiler.records import Frame, StepAcc
    from gpumem.profiler.tracker import Entry, StorageTracker

_graph_task_id = torch._C._current_graph_task_id


class CommHost(Protocol):
    """What the communication account reads of the run's levels and tells them
    (``levels.Levels``)."""

    steps: list[StepAcc]
    bwd: list[Frame]
    in_step: bool

    def open_step(self) -> None: ...
    def reclassify(self, e: Entry, category: str, module: str) -> None: ...


class CommAccount:
    """The FSDP2 units of a profiled model and the communication bytes they hold."""

    def __init__(self, host: CommHost, tracker: StorageTracker, sync: Callable[[], None]) -> None:
        self.host = host
        self.tracker = tracker
        self._sync = sync  # the session's: bring the levels up to date
        # the units, found on entry; those gathering or reducing now (innermost last); the
        # entries of unsharded parameters (never activations)
        self.units: list[fsdp_tp.Unit] = []
        self._running: list[str] = []
        self._gathered: weakref.WeakSet[Entry] = weakref.WeakSet()
        self._unsharded_known: set[str] = set()  # units whose unsharded parameters are claimed
        # live communication bytes: in all, and per module with its ancestors
        self.total = 0
        self.live: dict[str, int] = {}
        self._chains: dict[str, list[str]] = {}  # module -> ancestors(module), computed once

    def find_units(self, model: torch.nn.Module, fqn_of: dict[int, str]) -> None:
        """On entry: the units, and their unsharded parameters (FSDP keeps those storages from
        the first step on, at size 0 while sharded: known from the start, resizes followed)."""
        self.units = fsdp_tp.fsdp_units(model, fqn_of)
        for u in self.units:
            self._claim_unsharded(u.fqn, u.group)

    def running_unit(self) -> str | None:
        """The unit whose collective creates the storages of now, if any."""
        return self._running[-1] if self._running else None

    def is_gathered(self, e: Entry) -> bool:
        """An unsharded parameter's storage (never an activation)."""
        return e in self._gathered

    def enter(self, fqn: str, group: Any, call: str) -> None:
        """A unit's parameter group starts ``call`` (one of ``fsdp_tp.GROUP_CALLS``)."""
        if call in fsdp_tp.GATHERS and not self.host.in_step and _graph_task_id() == -1:
            self.host.open_step()  # FSDP's pre-forward hook runs before the profiler's
        if call == "post_backward":
            # unsharded gradients wait for their reduce-scatter
            self.claim(fsdp_tp.unsharded_grads(group), fqn, credit=True)
        self._running.append(fqn)

    def exit(self, fqn: str, group: Any, call: str) -> None:
        self._running.pop()
        if call == "wait_for_unshard":
            self._claim_unsharded(fqn, group)
        elif call == "reshard":
            self.claim(fsdp_tp.post_forward_shards(group), fqn)
        self._sync()

    def _claim_unsharded(self, fqn: str, group: Any) -> None:
        """A unit's unsharded parameters, once they exist (FSDP creates them at its first
        gather and keeps them): claimed once per unit, their resizes are followed after."""
        if fqn not in self._unsharded_known:
            storages = list(fsdp_tp.unsharded_storages(group))
            if storages:
                self.claim(storages, fqn, gathered=True)
                self._unsharded_known.add(fqn)

    def claim(self, tensors: Any, fqn: str, gathered: bool = False, credit: bool = False) -> None:
        """Make the storages of ``tensors`` communication of unit ``fqn`` (registering those
        light mode has not seen); ``gathered``: unsharded parameters, never activations;
        ``credit``: kept beyond the running backward calls, so not their temporaries."""
        host = self.host
        tr = self.tracker
        for t in tensors:
            for st in storages_of(t):
                e = tr.lookup(st)
                if e is None:
                    e = tr.add(st, t.device.type, COMMUNICATION, fqn)
                elif e.category != COMMUNICATION:
                    if credit and e.category == TEMPORARY:
                        credit_kept(host.bwd, e)
                    host.reclassify(e, COMMUNICATION, fqn)
                if gathered:
                    self._gathered.add(e)

    def changed(self, e: Entry, delta: int) -> None:
        """The tracker's report of a change in live communication bytes."""
        self.total += delta
        live = self.live
        peaks = self.host.steps[-1].communication
        chain = self._chains.get(e.module)
        if chain is None:
            chain = self._chains[e.module] = ancestors(e.module)
        for a in chain:
            v = live[a] = live.get(a, 0) + delta
            if v > peaks.get(a, 0):
                peaks[a] = v
