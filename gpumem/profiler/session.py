"""``gpumem.profile``: the context manager and its accounting.

The tracker (``tracker.py``) keeps live bytes per category; the hooks (``hooks.py``) tell this
module which phase, step and module is running. Here those two streams become per-module
activations, gradients, optimizer state and inputs; the levels (``levels.py``) make the peaks per
phase and step, the temporaries and the timeline of them, in the way of the mode (``modes.py``).

Definitions (issue #3):

- a step ends at ``optimizer.step()``; the next step opens at the model's next forward, so
  ``zero_grad`` and anything else after the step belong to the step they follow. Without an
  optimizer a step ends when a backward pass finishes. With gradient accumulation a step holds
  several forward/backward passes.
- a module's *activations* are the storages first saved for backward while it is the innermost
  running module (parameters, buffers and inputs excluded); parents add up their children.
- a module's *temporary* is the high-water mark of live bytes during one forward (or backward)
  call above the level at entry, minus the activations (in backward: the gradients) it added;
  communication buffers are left out of these levels (they are no module's scratch space).
- under FSDP2 what a unit's parameter group creates while it gathers, reshards or reduces is
  *communication* of that unit (``fsdp_tp.py`` says which calls); its unsharded parameters stay
  communication when autograd saves them, while other collective outputs that autograd saves
  (tensor parallelism's gathered inputs) are activations.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from gpumem._assumptions import listen, unlisten
from gpumem.allocator.alloc_conf import AllocConf, NotSimulated
from gpumem.allocator.alloc_conf import resolve as resolve_alloc_conf
from gpumem.profiler import cuda, fsdp_tp
from gpumem.profiler.categories import (
    ACTIVATIONS,
    CATEGORIES,
    COMMUNICATION,
    GRADIENTS,
    INPUTS,
    OPTIMIZER,
    TEMPORARY,
    WEIGHTS,
)
from gpumem.profiler.communication import CommAccount
from gpumem.profiler.fake import is_fake_model, real_branches
from gpumem.profiler.headroom import warn_if_short
from gpumem.profiler.hooks import HookSet
from gpumem.profiler.levels import Levels
from gpumem.profiler.modes import mode_of
from gpumem.profiler.records import (
    MODES,
    Frame,
    ProbeView,
    ProfileRecord,
    StepAcc,
    credit_kept,
)
from gpumem.profiler.report import Report, build_report
from gpumem.profiler.reserved import simulated_reserved
from gpumem.profiler.samples import SampleRecorder
from gpumem.profiler.tracker import Entry, StorageTracker, storages_of, tensors_in, views_of

_graph_task_id = torch._C._current_graph_task_id
_ACTIVE = threading.local()


class Profile:
    """Profile the memory of training steps run inside a ``with`` block.

    Create it with :func:`gpumem.profile`. Counted in ``peak_bytes``: parameters, buffers,
    gradients, optimizer state, the tensors passed to the model's forward, and every storage
    created inside the region. Tensors that existed before the region and never flow into the model
    (a teacher model, a cached dataset, targets only the loss reads) are not counted.

    Example:
        >>> with gpumem.profile(model, optimizer=opt) as prof:
        ...     loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        >>> rep = prof.report()
        >>> rep.peak_bytes, rep.at_peak["activations"], rep.layers["layers.0"].temporary

    The session sorts storages into categories as the hooks report them
    (``hooks.ProfileEvents``); the steps, peaks, frames and timeline are its ``levels``
    (``levels.py``), what differs between the two modes its ``strategy`` (``modes.py``), FSDP2's
    communication its ``comm`` (``communication.py``), and a k-block profile's samples its
    ``recorder`` (``samples.py``, set by ``runner.py``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        snapshot: str | None = None,
        timeline: bool = True,
        mode: str = "exact",
        alloc_conf: str | AllocConf | None = None,
    ) -> None:
        _check_arguments(model, optimizer, snapshot, mode)
        self.model = model
        self.optimizer = optimizer
        self.snapshot_path = snapshot
        self.mode = mode
        self.fqn_of: dict[int, str] = {}
        for fqn, mod in model.named_modules(remove_duplicate=False):
            self.fqn_of.setdefault(id(mod), fqn)
        self.module_names = [fqn for fqn, _ in model.named_modules()]
        # id(param) -> (param, owner fqn); shared parameters belong to their first owner
        self.param_owner: dict[int, tuple[torch.Tensor, str]] = {}
        for fqn, mod in model.named_modules():
            for p in mod.parameters(recurse=False):
                self.param_owner.setdefault(id(p), (p, fqn))
        _check_optimizer(optimizer, self.param_owner, model)
        self.levels = Levels(self, timeline)
        self.after_op = self.levels.after_op  # what exact mode's tracker calls after every op
        self.strategy = mode_of(mode, self)
        self.tracker = StorageTracker(self._context, self.strategy.sync, self.levels.where)
        self.comm = CommAccount(self.levels, self.tracker, self.strategy.sync)
        self.tracker.on_comm = self.comm.changed
        self.alloc_conf, conf_note = _alloc_conf(alloc_conf)
        if self.strategy.logs_allocations and self.alloc_conf is not None:
            self.tracker.alloc_log = []  # every allocation and free, for the simulator
        self._reserved: tuple[int, dict[str, Any]] | None = None  # (log length, figures)
        self.hooks = HookSet(self)
        self.weights: dict[str, int] = {}
        self.assumptions: list[str] = [conf_note] if conf_note else []
        self.error: str | None = None
        self.device_types: set[str] = set()
        self.allocator: Any = None
        self._entered = False
        self._real_branches: Any = None
        self._exited = False
        self.t_start = 0
        self.t_end = 0

    @property
    def fsdp_units(self) -> list[fsdp_tp.Unit]:
        """The model's FSDP2 units, found on entry."""
        return self.comm.units

    @property
    def recorder(self) -> SampleRecorder | None:
        """A k-block profile's samples (``runner.py`` sets one before entry)."""
        return self.levels.recorder

    @recorder.setter
    def recorder(self, recorder: SampleRecorder | None) -> None:
        self.levels.recorder = recorder

    # -- context manager -----------------------------------------------------------------------
    def __enter__(self) -> Profile:
        if getattr(_ACTIVE, "profile", None) is not None:
            raise RuntimeError(
                "gpumem.profile regions cannot be nested: one is already active on this thread; "
                "profile the outer region once and read per-layer numbers from rep.layers"
            )
        if self._entered:
            raise RuntimeError("this gpumem.profile object was already used; create a new one")
        self._entered = True
        if not is_fake_model(self.model):
            warn_if_short(self.model, self.optimizer)
        self.t_start = time.perf_counter_ns()
        self.weights = register_existing(self, self.device_types)
        self.comm.find_units(self.model, self.fqn_of)
        self.allocator = cuda.AllocatorProbe.maybe(
            self.model, self.device_types, self.snapshot_path
        )
        self.strategy.start()
        try:
            self.hooks.install()
            self.strategy.install()
        except BaseException:
            self.hooks.remove()
            if self.allocator is not None:
                self.allocator.close()
            raise
        if is_fake_model(self.model):  # the branch a real run takes, where a library asks
            self._real_branches = real_branches()
            self._real_branches.__enter__()
        _ACTIVE.profile = self
        listen(self.note_assumption)
        self.strategy.sync()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _ACTIVE.profile = None
        unlisten(self.note_assumption)
        self._exited = True
        self.t_end = time.perf_counter_ns()
        try:
            self.strategy.stop(exc_type, exc, tb)
        finally:
            self.hooks.remove()
            self._leave_real_branches()
        levels = self.levels
        frames, levels.fwd = levels.fwd, []
        levels.close_forwards(frames)
        if levels.bwd or levels.bw_tasks:  # an exception inside backward
            levels.backward_end()
        if levels.in_step:  # an exception inside optimizer.step(): resolve what was created
            self.optimizer_exit()
        if exc is not None:
            self.error = f"{exc_type.__name__}: {exc}"
        if self.allocator is not None:
            self.allocator.finish(self.probe_view(), exc)
        return False  # never swallow the exception

    def _leave_real_branches(self) -> None:
        if self._real_branches is not None:
            self._real_branches.__exit__(None, None, None)
            self._real_branches = None

    def report(self) -> Report:
        """The :class:`~gpumem.profiler.report.Report` of everything measured so far."""
        return build_report(self.record())

    def record(self) -> ProfileRecord:
        """Everything measured so far as plain data (the report is built from it)."""
        levels = self.levels
        return ProfileRecord(
            mode=self.mode,
            model_name=type(self.model).__name__,
            fake=is_fake_model(self.model),
            device_types=sorted(self.device_types),
            module_names=self.module_names,
            weights=self.weights,
            steps=levels.steps,
            peak=levels.peak,
            measured=self.measured,
            measures_temporary=self.measures_temporary,
            timeline=levels.timeline,
            t_start=self.t_start,
            spans=levels.spans,
            assumptions=list(self.assumptions),
            error=self.error,
            allocator=dict(self.allocator.summary)
            if self.allocator is not None and self.allocator.summary
            else None,
            reserved=self._simulated_reserved(),
        )

    def _simulated_reserved(self) -> dict[str, Any] | None:
        log = self.tracker.alloc_log
        if log is None or self.alloc_conf is None:
            return None
        if self._reserved is None or self._reserved[0] != len(log):
            self._reserved = (len(log), simulated_reserved(log, self.alloc_conf))
        return dict(self._reserved[1])

    def probe_view(self) -> ProbeView:
        """What the CUDA allocator probe reads at a boundary: running frames, phase, step."""
        return self.levels.probe_view()

    def sync(self) -> None:
        """Bring peaks, frames and the timeline up to date (light mode: a boundary)."""
        self.strategy.sync()

    def _context(self) -> tuple[str, str]:
        """The tracker's question: what the storages an op creates now are, and whose."""
        unit = self.comm.running_unit()
        if unit is not None:
            return COMMUNICATION, unit
        return (OPTIMIZER if self.levels.in_step else TEMPORARY), ""

    # -- hook callbacks ------------------------------------------------------------------------
    def forward_enter(self, fqn: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        in_bw = _graph_task_id() != -1
        if fqn == "" and not self.levels.fwd and not in_bw:
            self._root_forward(args, kwargs)
        frame = self.levels.new_frame(fqn, in_bw)
        self.levels.fwd.append(frame)

    def forward_exit(self, fqn: str) -> Frame | None:
        return self.levels.forward_exit(fqn)

    def _root_forward(self, args: Any, kwargs: Any) -> None:
        self.levels.open_step()
        self.levels.steps[-1].forwards += 1
        for t in tensors_in((args, kwargs)):
            for st in storages_of(t):
                e = self.tracker.lookup(st)
                if e is None:
                    self.strategy.inputs_tracked(self.tracker.track(t, INPUTS, ""))
                    break
                if e.category == TEMPORARY:
                    self.levels.reclassify(e, INPUTS, "")
        self.strategy.root_forward_seen()
        self.sync()

    def backward_enter(self, fqn: str) -> Frame:
        frame = self.levels.new_frame(fqn, True)
        self.levels.bwd.append(frame)
        return frame

    def backward_exit(self, frame: Frame) -> None:
        self.levels.backward_exit(frame)

    def backward_done(self, step: StepAcc) -> None:
        """A backward pass finished (its frames closed): read the gradients."""
        per = gradient_bytes(self.tracker, self.param_owner, self.strategy.registers_unseen)
        for k, v in per.items():
            step.gradients[k] = max(v, step.gradients.get(k, 0))
        if self.optimizer is None:
            self.levels.closed = True

    def gradient_ready(self, grad: torch.Tensor, owner: str) -> None:
        for st in storages_of(grad):
            e = self.tracker.lookup(st)
            if e is None:  # light mode, or created outside the dispatcher (a C++ extension)
                e = self.tracker.add(st, grad.device.type, GRADIENTS, owner)
                if self.strategy.registers_unseen:
                    credit_kept(self.levels.bwd, e)
                self.sync()
            if e.category != GRADIENTS:
                credit_kept(self.levels.bwd, e)
                self.levels.reclassify(e, GRADIENTS, owner)

    def saved_for_backward(self, t: torch.Tensor, module: str | None = None) -> None:
        if self.levels.in_step or _graph_task_id() != -1:
            return  # recomputation in backward stays temporary
        if module is None:
            module = self.levels.fwd[-1].fqn if self.levels.fwd else ""
        self.strategy.saved_for_backward(t, module)

    def checkpoint_inputs(self, fn: Any, tensors: list[torch.Tensor]) -> None:
        """The inputs a non-reentrant checkpoint keeps for recomputation are activations, of the
        checkpointed module when ``fn`` is one of the model's modules."""
        module = self.fqn_of.get(id(fn)) if isinstance(fn, torch.nn.Module) else None
        for t in tensors:
            self.saved_for_backward(t, module)

    def mark_activation(self, e: Entry, module: str) -> None:
        credit_kept(self.levels.fwd, e)
        acts = self.levels.steps[-1].activations
        acts[module] = acts.get(module, 0) + e.nbytes
        self.levels.reclassify(e, ACTIVATIONS, module)

    def optimizer_enter(self) -> None:
        self.strategy.optimizer_boundary()  # the interval before the step under its own phase
        self.levels.in_step = True
        self.tracker.on_new = self.levels.steps[-1].opt_new.append

    def optimizer_exit(self) -> None:
        """Sort what the step created into optimizer state and scratch, then close the step."""
        step = self.levels.steps[-1]
        self.tracker.on_new = None
        assert self.optimizer is not None
        state, per = optimizer_state(
            self.tracker, self.optimizer, self.param_owner, self.strategy.registers_unseen
        )
        for k, v in per.items():
            step.optimizer[k] = max(v, step.optimizer.get(k, 0))
        self.levels.move_scratch(step, state)
        for e in step.opt_new:
            if id(e) not in state:
                self.tracker.reclassify(e, TEMPORARY)
        for e in step.opt_new:
            if id(e) in state:
                e.module = state[id(e)]
        step.opt_new.clear()
        self.strategy.optimizer_boundary()
        self.levels.optimizer_done()

    # -- FSDP2: the communication account's ------------------------------------------------------
    def fsdp_enter(self, fqn: str, group: Any, call: str) -> None:
        self.comm.enter(fqn, group, call)

    def fsdp_exit(self, fqn: str, group: Any, call: str) -> None:
        self.comm.exit(fqn, group, call)

    def unsharded_grad_ready(self, grad: torch.Tensor, fqn: str) -> None:
        """Autograd accumulated the gradient of an unsharded parameter of unit ``fqn``."""
        self.comm.claim([grad], fqn, credit=True)
        self.sync()

    def communication_buffer(self, t: torch.Tensor, fqn: str) -> None:
        """FSDP allocated a gather or reduce-scatter buffer for unit ``fqn``."""
        self.comm.claim([t], fqn)
        self.strategy.registered()

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        self.levels.in_zero_grad += 1
        try:
            yield
        finally:
            self.sync()
            self.levels.in_zero_grad -= 1

    @property
    def measures_temporary(self) -> bool:
        """Exact mode always; light mode only where the allocator's peaks are available (CUDA)."""
        return self.strategy.measures_temporary()

    @property
    def measured(self) -> list[str]:
        """The categories this profile measures (light mode on CPU: all but ``temporary``)."""
        return [c for c in CATEGORIES if c != TEMPORARY or self.measures_temporary]

    def note_assumption(self, text: str) -> None:
        if text not in self.assumptions:
            self.assumptions.append(text)


def _check_optimizer(
    optimizer: torch.optim.Optimizer | None,
    param_owner: dict[int, tuple[torch.Tensor, str]],
    model: torch.nn.Module,
) -> None:
    if optimizer is None:
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in param_owner:
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape "
                    f"{tuple(p.shape)}) is not a parameter of the profiled "
                    f"{type(model).__name__}; pass the optimizer built from "
                    "model.parameters(), or profile the module that owns it"
                )


def register_existing(prof: Profile, device_types: set[str]) -> dict[str, int]:
    """On entry: the weights, gradients and optimizer state that exist already, in the
    tracker; returns each module's own weight bytes and adds their device types."""
    tr = prof.tracker
    weights: dict[str, int] = {}
    seen: set[int] = set()
    for fqn, mod in prof.model.named_modules():
        direct = 0
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            device_types.add(t.device.type)
            for e in tr.track(t, WEIGHTS, fqn):
                if id(e) not in seen:
                    seen.add(id(e))
                    direct += e.nbytes
        weights[fqn] = direct
    for p, owner in prof.param_owner.values():
        if p.grad is not None:
            for e in tr.track(p.grad, GRADIENTS, owner):
                tr.reclassify(e, GRADIENTS, owner)
    if prof.optimizer is not None:
        for p, state in prof.optimizer.state.items():
            owner = prof.param_owner.get(id(p), (None, ""))[1]
            for t in tensors_in(state):
                tr.track(t, OPTIMIZER, owner)
    return weights


def gradient_bytes(
    tracker: StorageTracker,
    param_owner: dict[int, tuple[torch.Tensor, str]],
    register_unseen: bool,
) -> dict[str, int]:
    """Each module's bytes of its parameters' gradients now (``register_unseen``: a gradient
    assigned outside autograd, which nothing saw yet, is registered)."""
    # storage -> the parameters whose gradients view it, with the bytes of their views
    shares: dict[int, tuple[Entry, list[tuple[str, int]]]] = {}
    for p, owner in param_owner.values():
        if p.grad is None:
            continue
        for view, st in views_of(p.grad):
            e = tracker.lookup(st)
            if e is None and register_unseen:
                e = tracker.add(st, p.grad.device.type, GRADIENTS, owner)
            if e is not None:
                n = view.numel() * view.element_size()
                shares.setdefault(id(e), (e, []))[1].append((owner, n))
    per: dict[str, int] = {}
    for e, owners in shares.values():
        # FSDP2 makes a unit's sharded gradients views of one reduce-scatter output: each
        # parameter's module gets its view, the first also what no view covers (padding)
        rest = e.nbytes
        for owner, n in owners[1:]:
            n = min(n, rest)
            per[owner] = per.get(owner, 0) + n
            rest -= n
        per[owners[0][0]] = per.get(owners[0][0], 0) + rest
    return per


def optimizer_state(
    tracker: StorageTracker,
    optimizer: torch.optim.Optimizer,
    param_owner: dict[int, tuple[torch.Tensor, str]],
    register_unseen: bool,
) -> tuple[dict[int, str], dict[str, int]]:
    """id(entry) -> owner of every storage in the optimizer's state, and each owner's bytes of
    it (``register_unseen``: storages nothing saw created are registered)."""
    state: dict[int, str] = {}
    per: dict[str, int] = {}
    for p, s in optimizer.state.items():
        owner = param_owner.get(id(p), (None, ""))[1]
        for t in tensors_in(s):
            for st in storages_of(t):
                e = tracker.lookup(st)
                if e is None:
                    if not register_unseen:
                        continue
                    e = tracker.add(st, t.device.type, OPTIMIZER, owner)
                if id(e) not in state:
                    per[owner] = per.get(owner, 0) + e.nbytes
                state[id(e)] = owner
    return state, per


def _check_arguments(model: Any, optimizer: Any, snapshot: str | None, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(
            f"gpumem.profile(mode={mode!r}) is not a mode; use 'exact' (every storage, every "
            "op) or 'light' (hook boundaries only, no per-op dispatch)"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"gpumem.profile(model, ...) needs a torch.nn.Module, got {type(model).__name__}; "
            "wrap a plain function in an nn.Module or pass the model that owns the parameters"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if snapshot is not None:
        _check_snapshot_path(snapshot)


def _alloc_conf(alloc_conf: str | AllocConf | None) -> tuple[AllocConf | None, str]:
    """The allocator setting exact mode simulates, and the note to make when there is none."""
    try:
        return resolve_alloc_conf(alloc_conf), ""
    except NotSimulated as exc:
        if alloc_conf is not None:  # the caller asked for a simulation of it
            raise
        # the environment's valid setting the simulator does not reproduce (torch's
        # backend:cudaMallocAsync) must not stop a profile: no reserved figure, said so
        return None, f"peak_reserved_bytes not simulated: {exc}"


def _check_snapshot_path(path: str) -> None:
    """Refuse a snapshot path that cannot be written before the region starts: the snapshot is
    written on exit, often while an OOM propagates, when it is too late to ask again."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"snapshot must be a file path (str or os.PathLike), got {type(path).__name__}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(
            f"snapshot={str(path)!r} is a directory; give a file path such as 'oom.pickle'"
        )
    if not os.path.isdir(parent):
        raise ValueError(
            f"snapshot={str(path)!r}: directory {parent} does not exist; create it first or "
            "choose a path in an existing directory"
        )


def active() -> Profile | None:
    """The profile region active on this thread, if any."""
    return getattr(_ACTIVE, "profile", None)
