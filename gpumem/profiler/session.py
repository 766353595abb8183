"""``gpumem.profile``: the context manager and its accounting.

The tracker (``tracker.py``) keeps live bytes per category; the hooks (``hooks.py``) tell this
module which phase, step and module is running. Here those two streams become peaks per phase and
step, per-module activations and temporaries, and a timeline.

Definitions (issue #3):

- a step ends at ``optimizer.step()``; the next step opens at the model's next forward, so
  ``zero_grad`` and anything else after the step belong to the step they follow. Without an
  optimizer a step ends when a backward pass finishes. With gradient accumulation a step holds
  several forward/backward passes.
- a module's *activations* are the storages first saved for backward while it is the innermost
  running module (parameters, buffers and inputs excluded); parents add up their children.
- a module's *temporary* is the high-water mark of live bytes during one forward (or backward)
  call above the level at entry, minus the activations (in backward: the gradients) it added.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpumem.profiler.categories import (
    ACTIVATIONS,
    BACKWARD,
    FORWARD,
    GRADIENTS,
    INPUTS,
    OPTIMIZER,
    OPTIMIZER_PHASE,
    PHASES,
    TEMPORARY,
    WEIGHTS,
)
from gpumem.profiler.hooks import HookSet, _tensors
from gpumem.profiler.tracker import Entry, StorageTracker, storages_of

_PHASE_CODE = {FORWARD: 0, BACKWARD: 1, OPTIMIZER_PHASE: 2}
_graph_task_id = torch._C._current_graph_task_id
_ACTIVE = threading.local()


class DataDependentError(RuntimeError):
    """An op whose output size depends on tensor values ran under ``gpumem.fake()``."""


@dataclass
class Frame:
    """One running module call (forward or backward)."""

    fqn: str
    level: int
    event0: int
    in_backward: bool
    t0: int
    hwm: int = 0
    kept: int = 0  # bytes created in this call that became activations (backward: gradients)
    alloc: Any = None  # allocator probe state on CUDA

    def __post_init__(self) -> None:
        self.hwm = self.level


@dataclass
class Snapshot:
    bytes: int = 0
    at: dict[str, int] = field(default_factory=dict)
    event: int = -1
    phase: str = FORWARD
    step: int = 0
    n_opt_new: int = 0


@dataclass
class StepAcc:
    """Everything measured in one step (raw, per module without rollup)."""

    index: int
    phase_peak: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(PHASES))
    peak: Snapshot = field(default_factory=Snapshot)
    forwards: int = 0
    backwards: int = 0
    activations: dict[str, int] = field(default_factory=dict)
    fwd_temp: dict[str, int] = field(default_factory=dict)
    bwd_temp: dict[str, int] = field(default_factory=dict)
    gradients: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    opt_new: list[Entry] = field(default_factory=list)
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)


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
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        snapshot: str | None = None,
        timeline: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"gpumem.profile(model, ...) needs a torch.nn.Module, got {type(model).__name__}; "
                "wrap a plain function in an nn.Module or pass the model that owns the parameters"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.snapshot_path = snapshot
        self.record_timeline = timeline
        self.fqn_of: dict[int, str] = {}
        for fqn, mod in model.named_modules(remove_duplicate=False):
            self.fqn_of.setdefault(id(mod), fqn)
        self.module_names = [fqn for fqn, _ in model.named_modules()]
        # id(param) -> (param, owner fqn); shared parameters belong to their first owner
        self.param_owner: dict[int, tuple[torch.Tensor, str]] = {}
        for fqn, mod in model.named_modules():
            for p in mod.parameters(recurse=False):
                self.param_owner.setdefault(id(p), (p, fqn))
        self._check_optimizer()
        self.tracker = StorageTracker(self._context, self._after_op, self._where)
        self.hooks = HookSet(self)
        self.steps: list[StepAcc] = [StepAcc(0)]
        self.peak = Snapshot()
        self.weights: dict[str, int] = {}
        self.assumptions: list[str] = []
        self.error: str | None = None
        self.device_types: set[str] = set()
        self.allocator: Any = None
        self.fwd: list[Frame] = []
        self.bwd: list[Frame] = []
        self.spans: list[tuple[str, str, int, int, int]] = []  # (fqn, phase, t0, t1, step)
        self.timeline: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self._in_step = False
        self._in_zero_grad = 0
        self._tail: str | None = None
        self._closed = False
        self._bw_tasks: set[int] = set()
        self._entered = False
        self._exited = False
        self.t_start = 0
        self.t_end = 0

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in self.param_owner:
                    raise ValueError(
                        f"optimizer param_groups[{gi}]['params'][{pi}] (shape "
                        f"{tuple(p.shape)}) is not a parameter of the profiled "
                        f"{type(self.model).__name__}; pass the optimizer built from "
                        "model.parameters(), or profile the module that owns it"
                    )

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
        self.t_start = time.perf_counter_ns()
        self._register_existing()
        from gpumem.profiler import cuda

        self.allocator = cuda.AllocatorProbe.maybe(self.device_types, self.snapshot_path)
        self.hooks.install()
        try:
            self.tracker.__enter__()
        except BaseException:
            self.hooks.remove()
            raise
        _ACTIVE.profile = self
        self._after_op()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _ACTIVE.profile = None
        self._exited = True
        self.t_end = time.perf_counter_ns()
        try:
            self.tracker.__exit__(exc_type, exc, tb)
        finally:
            self.hooks.remove()
        for frame in reversed(self.fwd):
            self._close_forward(frame)
        self.fwd.clear()
        if self.bwd or self._bw_tasks:  # an exception inside backward
            self._backward_end()
        if self._in_step:  # an exception inside optimizer.step(): resolve what was created
            self.optimizer_exit()
        if exc is not None:
            self.error = f"{exc_type.__name__}: {exc}"
        if self.allocator is not None:
            self.allocator.finish(self, exc)
        return False  # never swallow the exception

    def report(self):
        """The :class:`~gpumem.profiler.report.Report` of everything measured so far."""
        from gpumem.profiler.report import build_report

        return build_report(self)

    # -- state at entry ------------------------------------------------------------------------
    def _register_existing(self) -> None:
        tr = self.tracker
        seen: set[int] = set()
        for fqn, mod in self.model.named_modules():
            direct = 0
            for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                self.device_types.add(t.device.type)
                for e in tr.track(t, WEIGHTS, fqn):
                    if id(e) not in seen:
                        seen.add(id(e))
                        direct += e.nbytes
            self.weights[fqn] = direct
        for p, owner in self.param_owner.values():
            if p.grad is not None:
                for e in tr.track(p.grad, GRADIENTS, owner):
                    tr.reclassify(e, GRADIENTS, owner)
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                owner = self.param_owner.get(id(p), (None, ""))[1]
                for t in _tensors(state):
                    tr.track(t, OPTIMIZER, owner)

    # -- tracker callbacks ---------------------------------------------------------------------
    def _phase(self) -> str:
        if self._in_step or self._in_zero_grad:
            return OPTIMIZER_PHASE
        if _graph_task_id() != -1:
            return BACKWARD
        # after a backward pass or an optimizer step, until the next forward (grad clipping,
        # zero_grad, logging) belongs to the phase that just ended
        return self._tail or FORWARD

    def _context(self) -> tuple[str, str]:
        return (OPTIMIZER if self._in_step else TEMPORARY), ""

    def _where(self) -> str:
        if self.fwd:
            return self.fwd[-1].fqn
        return self.bwd[-1].fqn if self.bwd else ""

    def _after_op(self) -> None:
        tr = self.tracker
        level = tr.level
        phase = self._phase()
        step = self.steps[-1]
        if phase == BACKWARD:
            task = _graph_task_id()
            if task != -1 and task not in self._bw_tasks:
                self._backward_start(task)
        if self.record_timeline:
            ts, lv, ph, st = self.timeline
            code = _PHASE_CODE[phase]
            if not lv or lv[-1] != level or ph[-1] != code or st[-1] != step.index:
                ts.append(time.perf_counter_ns())
                lv.append(level)
                ph.append(code)
                st.append(step.index)
        pp = step.phase_peak[phase]
        if pp is None or level > pp:
            step.phase_peak[phase] = level
        if level > step.peak.bytes or step.peak.event < 0:
            step.peak = self._snap(level, phase, step)
        if level > self.peak.bytes or self.peak.event < 0:
            self.peak = step.peak
        for f in self.fwd:
            f.hwm = max(f.hwm, level)
        for f in self.bwd:
            f.hwm = max(f.hwm, level)

    def _snap(self, level: int, phase: str, step: StepAcc) -> Snapshot:
        return Snapshot(
            level, dict(self.tracker.by_category), self.tracker.events, phase, step.index,
            len(step.opt_new) if self._in_step else 0,
        )

    def _reclassify(self, e: Entry, category: str, module: str) -> None:
        """Change an entry's category; snapshots taken at this very event follow it."""
        old = e.category
        if old == category:
            return
        self.tracker.reclassify(e, category, module)
        if e.died is None:
            for snap in {id(s): s for s in (self.peak, self.steps[-1].peak)}.values():
                if snap.event == self.tracker.events:
                    snap.at[old] -= e.nbytes
                    snap.at[category] += e.nbytes

    # -- hook callbacks ------------------------------------------------------------------------
    def forward_enter(self, fqn: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        in_bw = _graph_task_id() != -1
        if fqn == "" and not self.fwd and not in_bw:
            self._root_forward(args, kwargs)
        frame = Frame(fqn, self.tracker.level, self.tracker.events, in_bw, time.perf_counter_ns())
        if self.allocator is not None:
            self.allocator.enter(self, frame)
        self.fwd.append(frame)

    def forward_exit(self, fqn: str) -> Frame | None:
        for i in range(len(self.fwd) - 1, -1, -1):
            if self.fwd[i].fqn == fqn:
                frames = self.fwd[i:]
                del self.fwd[i:]
                for f in reversed(frames):
                    self._close_forward(f)
                return frames[0]
        return None

    def _close_forward(self, f: Frame) -> None:
        step = self.steps[-1]
        temp = max(0, f.hwm - f.level - f.kept)
        if temp > step.fwd_temp.get(f.fqn, -1):
            step.fwd_temp[f.fqn] = temp
        phase = BACKWARD if f.in_backward else FORWARD
        if self.allocator is not None:
            self.allocator.exit(self, f, phase)
        if self.record_timeline:
            self.spans.append((f.fqn, phase, f.t0, time.perf_counter_ns(), step.index))

    def _root_forward(self, args: Any, kwargs: Any) -> None:
        if self._closed:
            self.steps.append(StepAcc(len(self.steps)))
            self._closed = False
        self.steps[-1].forwards += 1
        self._tail = None
        for t in _tensors((args, kwargs)):
            for st in storages_of(t):
                e = self.tracker.lookup(st)
                if e is None:
                    self.tracker.track(t, INPUTS, "")
                    break
                if e.category == TEMPORARY:
                    self._reclassify(e, INPUTS, "")
        self._after_op()

    def backward_enter(self, fqn: str) -> Frame:
        frame = Frame(fqn, self.tracker.level, self.tracker.events, True, time.perf_counter_ns())
        if self.allocator is not None:
            self.allocator.enter(self, frame)
        self.bwd.append(frame)
        return frame

    def backward_exit(self, frame: Frame) -> None:
        if frame in self.bwd:
            self.bwd.remove(frame)
            self._close_backward(frame)

    def _close_backward(self, f: Frame) -> None:
        step = self.steps[-1]
        temp = max(0, f.hwm - f.level - f.kept)
        if temp > step.bwd_temp.get(f.fqn, -1):
            step.bwd_temp[f.fqn] = temp
        if self.allocator is not None:
            self.allocator.exit(self, f, BACKWARD)
        if self.record_timeline:
            self.spans.append((f.fqn, BACKWARD, f.t0, time.perf_counter_ns(), step.index))

    def _backward_start(self, task: int) -> None:
        self._bw_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._backward_task_done(task)
        )

    def _backward_task_done(self, task: int) -> None:
        self._bw_tasks.discard(task)
        if not self._bw_tasks:
            self._backward_end()

    def _backward_end(self) -> None:
        """A backward pass finished: close open module frames, read the gradients."""
        for f in reversed(self.bwd):
            self._close_backward(f)
        self.bwd.clear()
        self._bw_tasks.clear()
        step = self.steps[-1]
        step.backwards += 1
        self._tail = BACKWARD
        self._record_gradients(step)
        if self.optimizer is None:
            self._closed = True

    def _record_gradients(self, step: StepAcc) -> None:
        seen: set[int] = set()
        per: dict[str, int] = {}
        for p, owner in self.param_owner.values():
            if p.grad is None:
                continue
            for st in storages_of(p.grad):
                e = self.tracker.lookup(st)
                if e is not None and id(e) not in seen:
                    seen.add(id(e))
                    per[owner] = per.get(owner, 0) + e.nbytes
        for k, v in per.items():
            step.gradients[k] = max(v, step.gradients.get(k, 0))

    def gradient_ready(self, grad: torch.Tensor, owner: str) -> None:
        for st in storages_of(grad):
            e = self.tracker.lookup(st)
            if e is None:  # created outside the dispatcher (e.g. by a C++ extension)
                e = self.tracker.track(grad, GRADIENTS, owner)[0]
                self._after_op()
            if e.category != GRADIENTS:
                self._credit(self.bwd, e)
                self._reclassify(e, GRADIENTS, owner)

    def saved_for_backward(self, t: torch.Tensor, module: str | None = None) -> None:
        if self._in_step or _graph_task_id() != -1:
            return  # recomputation in backward stays temporary
        if module is None:
            module = self.fwd[-1].fqn if self.fwd else ""
        for st in storages_of(t):
            e = self.tracker.lookup(st)
            if e is not None and e.category == TEMPORARY and e.died is None:
                self._mark_activation(e, module)

    def checkpoint_inputs(self, fn: Any, tensors: list[torch.Tensor]) -> None:
        """The inputs a non-reentrant checkpoint keeps for recomputation are activations, of the
        checkpointed module when ``fn`` is one of the model's modules."""
        module = self.fqn_of.get(id(fn)) if isinstance(fn, torch.nn.Module) else None
        for t in tensors:
            self.saved_for_backward(t, module)

    @staticmethod
    def _credit(frames: list[Frame], e: Entry) -> None:
        """Storages created inside a call and kept beyond it are not its temporaries."""
        for f in frames:
            if e.born > f.event0:
                f.kept += e.nbytes

    def _mark_activation(self, e: Entry, module: str) -> None:
        self._credit(self.fwd, e)
        acts = self.steps[-1].activations
        acts[module] = acts.get(module, 0) + e.nbytes
        self._reclassify(e, ACTIVATIONS, module)

    def optimizer_enter(self) -> None:
        self._in_step = True
        self.tracker.on_new = self.steps[-1].opt_new.append
        if self.allocator is not None:
            self.allocator.boundary(self)

    def optimizer_exit(self) -> None:
        """Sort what the step created into optimizer state and scratch, then close the step."""
        step = self.steps[-1]
        self.tracker.on_new = None
        state: dict[int, str] = {}
        per: dict[str, int] = {}
        seen: set[int] = set()
        for p, s in self.optimizer.state.items():
            owner = self.param_owner.get(id(p), (None, ""))[1]
            for t in _tensors(s):
                for st in storages_of(t):
                    e = self.tracker.lookup(st)
                    if e is None:
                        continue
                    state[id(e)] = owner
                    if id(e) not in seen:
                        seen.add(id(e))
                        per[owner] = per.get(owner, 0) + e.nbytes
        for k, v in per.items():
            step.optimizer[k] = max(v, step.optimizer.get(k, 0))
        scratch = [e for e in step.opt_new if id(e) not in state]
        for snap in {id(s): s for s in (self.peak, step.peak)}.values():
            if snap.phase == OPTIMIZER_PHASE and snap.step == step.index:
                moved = sum(
                    e.nbytes
                    for e in step.opt_new[: snap.n_opt_new]
                    if id(e) not in state and (e.died is None or e.died > snap.event)
                )
                snap.at[OPTIMIZER] -= moved
                snap.at[TEMPORARY] += moved
        for e in scratch:
            self.tracker.reclassify(e, TEMPORARY)
        for e in step.opt_new:
            if id(e) in state:
                e.module = state[id(e)]
        step.opt_new.clear()
        self._in_step = False
        self._tail = OPTIMIZER_PHASE
        self._closed = True
        if self.allocator is not None:
            self.allocator.boundary(self)

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        self._in_zero_grad += 1
        try:
            yield
        finally:
            self._after_op()
            self._in_zero_grad -= 1

    def note_assumption(self, text: str) -> None:
        if text not in self.assumptions:
            self.assumptions.append(text)


def active() -> Profile | None:
    """The profile region active on this thread, if any."""
    return getattr(_ACTIVE, "profile", None)


def profile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    snapshot: str | None = None,
    timeline: bool = True,
) -> Profile:
    """Measure the memory of the training steps run inside a ``with`` block.

    Args:
        model: the module trained in the region; its forward marks the phases and names layers.
        optimizer: the optimizer stepping ``model``'s parameters, or ``None`` (forward and
            backward phases only; a step then ends with each backward pass).
        snapshot: on CUDA, where to write PyTorch's allocator snapshot if the region raises
            ``torch.OutOfMemoryError`` (open it at https://pytorch.org/memory_viz).
        timeline: keep the memory-over-time samples for ``plot`` and ``to_chrome_trace``.

    Returns:
        A :class:`Profile`; call ``.report()`` on it during or after the region.

    Example:
        >>> with gpumem.profile(model, optimizer=opt) as prof:
        ...     loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
        >>> print(prof.report().table())
    """
    return Profile(model, optimizer, snapshot=snapshot, timeline=timeline)
