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
  device; without one it falls back to the math kernel's shapes).
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
