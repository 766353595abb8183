"""``gpumem.fake()``: profile any model size without allocating memory.

Inside the block tensors are PyTorch ``FakeTensor``s: they carry shape, dtype, device and storage
size but no data, so models, optimizers and inputs built there cost nothing, and
``gpumem.profile`` counts exactly the bytes a real run would create (same ops, same storages).

What follows from having no data:

- ops whose output size depends on values (``nonzero``, boolean masking, ``.item()`` used for
  control flow) raise :class:`gpumem.profiler.DataDependentError` naming the op and the module;
  layers may instead follow a stated assumption and call :func:`note_assumption`, which labels
  the report as an estimate (the built-in MoE assumes uniform top-k routing);
- ``device="cuda"`` builds fake CUDA tensors even on a machine without a GPU. Emulated: CUDA
  storages are counted in the allocator's 512-byte blocks, CUDA dtype rules, and the ops that
  dispatch on device in Python (optimizers pick their CUDA foreach paths). Not emulated: the
  caching allocator's reserved memory and fragmentation, workspaces, and the SDPA backend
  choice, which PyTorch makes from the real GPU (on a GPU machine the fake run asks the real
  device; without one it falls back to the math kernel's shapes). Without a usable CUDA device
  only no-grad work is possible: ops that would record autograd are refused with an error,
  because PyTorch itself would abort the process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def fake(device: str | torch.device | None = None) -> Iterator[object]:
    """Build and run models on fake tensors: full-size profiles at no memory cost.

    Args:
        device: default device for tensors created inside (``"cuda"`` to emulate a GPU run);
            ``None`` keeps the current default (CPU).

    Yields:
        The active ``torch._subclasses.fake_tensor.FakeTensorMode``.

    Example:
        >>> with gpumem.fake():
        ...     model = build_model("llama", "70b"); opt = torch.optim.AdamW(model.parameters())
        ...     with gpumem.profile(model, opt) as prof:
        ...         model(ids).float().mean().backward(); opt.step()
        >>> prof.report().peak_bytes
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        if device is not None:
            stack.enter_context(torch.device(device))
            if torch.device(device).type == "cuda" and not torch.cuda.is_available():
                stack.enter_context(_NoRandomFill())
                stack.enter_context(_no_autograd_without_cuda())
        yield mode


_RANDOM_FILLS = ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
                 "cauchy_", "log_normal_")


def _no_random_fill_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoRandomFill(TorchDispatchMode):
        """Fake tensors hold no values: in-place random fills (weight init) become no-ops, so
        fake CUDA modules can be built on a machine without the CUDA RNG."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in _RANDOM_FILLS:
                return args[0]
            return func(*args, **(kwargs or {}))

    return NoRandomFill()


class _NoRandomFill:
    def __enter__(self):
        self.mode = _no_random_fill_mode()
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _no_autograd_without_cuda():
    """Recording autograd on a fake CUDA tensor makes PyTorch ask the device guard of a torch
    without a usable CUDA device; that throws inside C++ code that cannot propagate it and the
    process aborts (std::terminate). Refuse such ops with an error naming the way out instead.

    An op with a grad-requiring input, run in grad mode, is first run under no_grad: when it
    returns tensors the real call would have recorded autograd, so it is refused; metadata
    queries (``dim``, ``size``) return no tensor and pass."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    refused = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

    def needs_grad(args, kwargs) -> bool:
        flat, _ = tree_flatten((args, kwargs))
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)

    class NoAutograd(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in refused:
                self._refuse(func)
            exempt = getattr(func, "__name__", "") in ("__get__", "__set__") or getattr(
                func, "__module__", ""
            ) == "torch.nn.init"  # initialisers run under no_grad themselves
            if exempt or not torch.is_grad_enabled() or not needs_grad(args, kwargs):
                return func(*args, **kwargs)
            with torch.no_grad():
                out = func(*args, **kwargs)
            if any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                self._refuse(func)
            return out

        @staticmethod
        def _refuse(func):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"gpumem.fake(device='cuda'): {name} would record autograd on fake CUDA tensors, "
                "which needs a torch build with a usable CUDA device (without one PyTorch aborts "
                "the process). Here, profile training with gpumem.fake() on CPU, or run forward "
                "passes under torch.no_grad(); or run on a machine with a GPU."
            )

    return NoAutograd()


def note_assumption(text: str) -> None:
    """Record that the running code followed an assumption instead of data (report = estimate)."""
    from gpumem.profiler.session import active

    prof = active()
    if prof is not None:
        prof.note_assumption(text)


def is_fake_model(model: torch.nn.Module) -> bool:
    """True when the model's parameters are fake tensors (built under :func:`fake`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in model.parameters())
