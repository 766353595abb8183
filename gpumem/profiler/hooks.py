"""The wiring: every hook the profiler installs, and its guaranteed removal.

Phases come from hooks, so users add no markers:

- module forward pre/post hooks (``always_call`` so an exception still pops the frame);
- per-call multi-grad hooks for each module's backward: the first gradient of any output starts
  it, the gradients of all inputs end it (modules whose inputs need no grad end with backward);
- ``saved_tensors_hooks``: which storages autograd keeps for backward (activations);
- ``register_post_accumulate_grad_hook`` on parameters: when a storage becomes a ``.grad``;
- the optimizer's step pre/post hooks, and ``zero_grad`` (counted in the optimizer phase);
- ``torch.utils.checkpoint``'s non-reentrant generator: the inputs it keeps for recomputation are
  the activations of a checkpointed region (the reentrant variant saves them through autograd,
  which the saved-tensor hooks already see);
- FSDP2: each unit's parameter group's gather, reshard and reduce calls, and the ``allocate`` of
  its gather and reduce-scatter buffers (instance attributes: FSDP calls them through the
  instance, and removing ours brings back the class's);
- DTensor's sharding propagation, whose fake tensors are no memory of the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpumem.profiler import fsdp_tp
from gpumem.profiler.tracker import tensors_in

if TYPE_CHECKING:
    from gpumem.profiler.records import Frame
    from gpumem.profiler.tracker import StorageTracker


class ProfileEvents(Protocol):
    """What the hooks read of a profile and tell it: the session's ``Profile`` implements it.

    The hooks know this interface, never the session, so the wiring stays below the accounting
    (as torch's ``MemTracker`` builds on ``ModTracker``'s callbacks).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    fqn_of: dict[int, str]
    """id(module) -> the fully qualified name it is reported under (its first)."""
    param_owner: dict[int, tuple[torch.Tensor, str]]
    """id(param) -> (param, the fqn of the module that owns it)."""
    tracker: StorageTracker
    """Paused (``tracker.paused``) around work that is no memory of the run."""

    @property
    def fsdp_units(self) -> list[fsdp_tp.Unit]: ...
    @property
    def measures_temporary(self) -> bool: ...

    # module calls
    def forward_enter(self, fqn: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None: ...
    def forward_exit(self, fqn: str) -> Frame | None: ...
    def backward_enter(self, fqn: str) -> Frame: ...
    def backward_exit(self, frame: Frame) -> None: ...

    # tensors becoming gradients, activations, communication
    def gradient_ready(self, grad: torch.Tensor, owner: str) -> None: ...
    def saved_for_backward(self, t: torch.Tensor) -> None: ...
    def checkpoint_inputs(self, fn: Any, tensors: list[torch.Tensor]) -> None: ...

    # the optimizer
    def optimizer_enter(self) -> None: ...
    def optimizer_exit(self) -> None: ...
    def optimizer_phase(self) -> AbstractContextManager[None]: ...

    # FSDP2 units
    def fsdp_enter(self, fqn: str, group: Any, call: str) -> None: ...
    def fsdp_exit(self, fqn: str, group: Any, call: str) -> None: ...
    def unsharded_grad_ready(self, grad: torch.Tensor, fqn: str) -> None: ...
    def communication_buffer(self, t: torch.Tensor, fqn: str) -> None: ...


def _gradtensors_in(obj: Any) -> list[torch.Tensor]:
    return [t for t in tensors_in(obj) if t.requires_grad]


class HookSet:
    """Installs the hooks for one profile region; ``remove()`` undoes every one of them."""

    def __init__(self, prof: ProfileEvents) -> None:
        self.prof = prof
        self._undo: list[Callable[[], None]] = []
        self._saved_hooks: Any = None
        self._hooked: set[int] = set()  # ids of FSDP's unsharded parameters given a grad hook

    def install(self) -> None:
        try:
            self._install_modules()
            self._install_params()
            self._install_optimizer()
            self._install_checkpoint()
            self._install_fsdp()
            self._install_dtensor()
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
            self._undo.append(lambda: self._saved_hooks.__exit__(None, None, None))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Undo in reverse order; every step runs even if one fails."""
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- modules -------------------------------------------------------------------------------
    def _install_modules(self) -> None:
        prof = self.prof
        for fqn, mod in prof.model.named_modules(remove_duplicate=False):
            if id(mod) in prof.fqn_of and prof.fqn_of[id(mod)] != fqn:
                continue  # a module reachable under two names is reported under the first
            pre = mod.register_forward_pre_hook(
                functools.partial(self._fw_pre, fqn), with_kwargs=True
            )
            post = mod.register_forward_hook(
                functools.partial(self._fw_post, fqn), with_kwargs=True, always_call=True
            )
            self._undo.append(pre.remove)
            self._undo.append(post.remove)

    def _fw_pre(self, fqn: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.prof.forward_enter(fqn, module, args, kwargs)

    def _fw_post(self, fqn: str, module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        prof = self.prof
        frame = prof.forward_exit(fqn)
        if frame is None or frame.in_backward or not torch.is_grad_enabled():
            return
        if fqn and not prof.measures_temporary:
            return  # light mode on CPU: only the root's backward is needed (to see the pass start)
        outs = _gradtensors_in(out)
        if not outs:
            return
        holder: list[Any] = [None]
        torch.autograd.graph.register_multi_grad_hook(
            outs, functools.partial(self._bw_pre, fqn, holder), mode="any"
        )
        # leaves are left out: autograd.grad() cannot ask whether it will reach a leaf node, and
        # a module fed only by leaves ends its backward when the pass ends anyway
        ins = [t for t in _gradtensors_in((args, kwargs)) if t.grad_fn is not None]
        if ins:
            torch.autograd.graph.register_multi_grad_hook(
                ins, functools.partial(self._bw_post, holder)
            )

    def _bw_pre(self, fqn: str, holder: list[Any], _grads: Any) -> None:
        holder[0] = self.prof.backward_enter(fqn)

    def _bw_post(self, holder: list[Any], _grads: Any) -> None:
        if holder[0] is not None:
            self.prof.backward_exit(holder[0])
            holder[0] = None

    # -- parameters ----------------------------------------------------------------------------
    def _install_params(self) -> None:
        for p, owner in self.prof.param_owner.values():
            if p.requires_grad:
                h = p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, owner))
                self._undo.append(h.remove)

    def _grad_ready(self, owner: str, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.prof.gradient_ready(p.grad, owner)

    # -- optimizer -----------------------------------------------------------------------------
    def _install_optimizer(self) -> None:
        opt = self.prof.optimizer
        if opt is None:
            return
        pre = opt.register_step_pre_hook(lambda *_: self.prof.optimizer_enter())
        post = opt.register_step_post_hook(lambda *_: self.prof.optimizer_exit())
        self._undo.append(pre.remove)
        self._undo.append(post.remove)
        self._wrap(opt, "zero_grad", self._zero_grad)

    def _zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        prof = self.prof

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            with prof.optimizer_phase():
                return original(*args, **kwargs)

        return zero_grad

    # -- FSDP2 -------------------------------------------------------------------------------------
    def _install_fsdp(self) -> None:
        prof = self.prof
        for fqn, _, group in prof.fsdp_units:
            for call in fsdp_tp.GROUP_CALLS:
                self._wrap(group, call, functools.partial(self._fsdp_call, fqn, group, call))
            for comm in fsdp_tp.comm_allocators(group):
                self._wrap(comm, "allocate", functools.partial(self._fsdp_allocate, fqn))

    def _install_dtensor(self) -> None:
        propagator = fsdp_tp.dtensor_propagator()
        if propagator is not None:
            self._wrap(propagator, fsdp_tp.PROPAGATES, self._untracked)

    def _untracked(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self.prof.tracker

        def untracked(*args: Any, **kwargs: Any) -> Any:
            paused, tracker.paused = tracker.paused, True
            try:
                return original(*args, **kwargs)
            finally:
                tracker.paused = paused

        return untracked

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
        """Replace ``obj.name`` by ``make(original)`` on the instance; undone on removal."""
        had_own = name in vars(obj)
        original = getattr(obj, name)
        setattr(obj, name, functools.wraps(original)(make(original)))

        def restore() -> None:
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

        self._undo.append(restore)

    def _fsdp_call(
        self, fqn: str, group: Any, call: str, original: Callable[..., Any]
    ) -> Callable[..., Any]:
        prof = self.prof

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            prof.fsdp_enter(fqn, group, call)
            try:
                return original(*args, **kwargs)
            finally:
                if call == "wait_for_unshard":
                    self._hook_unsharded(fqn, group)
                prof.fsdp_exit(fqn, group, call)

        return wrapped

    def _hook_unsharded(self, fqn: str, group: Any) -> None:
        """FSDP creates a unit's unsharded parameters at its first gather: from then on autograd
        accumulates their gradients, which wait there for the reduce-scatter."""
        for p in fsdp_tp.unsharded_params(group):
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                h = p.register_post_accumulate_grad_hook(
                    functools.partial(self._unsharded_grad_ready, fqn)
                )
                self._undo.append(h.remove)

    def _unsharded_grad_ready(self, fqn: str, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.prof.unsharded_grad_ready(p.grad, fqn)

    def _fsdp_allocate(self, fqn: str, original: Callable[..., Any]) -> Callable[..., Any]:
        prof = self.prof

        def allocate(*args: Any, **kwargs: Any) -> Any:
            t = original(*args, **kwargs)
            prof.communication_buffer(t, fqn)
            return t

        return allocate

    # -- activation checkpointing --------------------------------------------------------------
    def _install_checkpoint(self) -> None:
        import torch.utils.checkpoint as ckpt

        original = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
        if original is None:  # pragma: no cover - present in every supported torch (2.5+)
            return
        prof = self.prof

        @functools.wraps(original)
        def generator(fn: Any, *args: Any, **kwargs: Any):
            prof.checkpoint_inputs(fn, tensors_in((args, kwargs)))
            return (yield from original(fn, *args, **kwargs))

        ckpt._checkpoint_without_reentrant_generator = generator
        self._undo.append(
            lambda: setattr(ckpt, "_checkpoint_without_reentrant_generator", original)
        )

    # -- saved tensors -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.prof.saved_for_backward(t)
        # Hand autograd a detached alias, never ``t`` itself: a saved output holding its own
        # grad_fn would form a reference cycle that outlives the graph. Autograd rebuilds the
        # grad_fn/leaf metadata on unpack, so double backward is unaffected.
        tracker = self.prof.tracker
        paused, tracker.paused = tracker.paused, True
        try:
            return t.detach()
        finally:
            tracker.paused = paused

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t
