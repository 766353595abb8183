"""``gpumem.fake()``: profile any model size without allocating memory.

Inside the block tensors are PyTorch ``FakeTensor``s: they carry shape, dtype, device and storage
size but no data, so models, optimizers and inputs built there cost nothing, and
``gpumem.profile`` counts exactly the bytes a real run would create (same ops, same storages).

What follows from having no data:

- ops whose output size depends on values (``nonzero``, boolean masking, ``.item()`` used for
  control flow) raise :class:`gpumem.profiler.DataDependentError` naming the op and the module;
  layers may instead follow a stated assumption and call
  :func:`gpumem.profiler.note_assumption`, which labels the report as an estimate (the built-in
  MoE assumes uniform top-k routing);
- ``device="cuda"`` builds fake CUDA tensors even on a machine without a GPU. Emulated: CUDA
  storages are counted in the allocator's 512-byte blocks, CUDA dtype rules, the code that picks
  a path by device in Python (optimizers take their CUDA default, the foreach path, and keep
  their step counters on the host), and where eager CUDA puts the RNG seed and offset that
  memory-efficient attention saves for backward (on the host; the meta kernels say device; the
  same for flash attention before torch moved its RNG state to the device). Not emulated: the
  caching allocator's reserved memory and fragmentation, workspaces, and the SDPA backend
  choice, which PyTorch makes from the real GPU (on a GPU machine the fake run asks the real
  device; without one it falls back to the math kernel's shapes). Without a usable CUDA device
  only no-grad work is possible: ops that would record autograd are refused with an error,
  because PyTorch itself would abort the process. :func:`cuda_kernels_on_cpu` instead makes a
  CPU pass save what CUDA's kernels save where they differ (autocast's fp32 softmax and norms,
  dropout's bool mask): the nn.Module path prices a CUDA job that way without a GPU.
- models that read values for control flow may take another branch when they see fake tensors.
  transformers does so in one place that changes memory: without a KV cache (training, and
  always under gradient checkpointing) it checks whether ``position_ids`` describe packed
  sequences, and a fake tensor makes it build an explicit ``(b, 1, s, s)`` mask, which SDPA
  turns into an fp32 copy that every layer saves (a real run with its default positions finds
  no packing and passes ``is_causal``). :func:`real_branches`, entered by ``gpumem.profile``
  for a fake model, takes the real run's branch and notes the assumption.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from gpumem._env import env_flag
from gpumem.profiler.tracker import views_of


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
    mode = _fake_mode_class()(allow_non_fake_inputs=False)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        stack.enter_context(_optimizer_defaults_by_device())
        if device is not None:
            stack.enter_context(_default_device(device))
            if torch.device(device).type == "cuda" and not torch.cuda.is_available():
                stack.enter_context(_NoRandomFill())
                stack.enter_context(_no_autograd_without_cuda())
        yield mode


# Fused-attention outputs that eager CUDA creates as 0-dim int64 host tensors (the philox seed
# and offset; ``Note [Seed and Offset Device]`` in PyTorch's attention.cu), by output position.
# Flash attention's newer (2,) uint64 RNG state lives on the device, as its meta kernel says.
_HOST_RNG_OUTPUTS = {
    "_scaled_dot_product_efficient_attention": (2, 3),
    "_efficient_attention_forward": (2, 3),
    "_scaled_dot_product_flash_attention": (6, 7),
    "_flash_attention_forward": (2, 3),
}
_MODE_CLASS: list[type] = []


def _fake_mode_class() -> type:
    """``FakeTensorMode`` that places fused-attention RNG state where eager CUDA does."""
    if _MODE_CLASS:
        return _MODE_CLASS[0]
    from torch._subclasses import fake_tensor as ft
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the pieces of FakeTensorMode's cache a hit is answered from; on a torch without them
    # hits take torch's own path (the key memo still applies)
    state_cls = getattr(ft, "_CacheKeyState", None)
    valid_entry = getattr(ft, "_DispatchCacheValidEntry", None)
    answers_hits = (
        state_cls is not None
        and valid_entry is not None
        and _takes(
            FakeTensorMode._output_from_cache_entry, ("state", "entry", "key", "func", "args")
        )
    )
    # metadata queries FakeTensorMode answers first thing (prim.device: half the calls of a
    # training step, autograd asks every tensor's device), answered here before the cache path
    meta_handlers = getattr(ft, "_DISPATCH_META_HANDLERS", {})
    host_outputs = {}
    for name, slots in _HOST_RNG_OUTPUTS.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            host_outputs[packet.default] = slots

    class CudaFaithfulFakeTensorMode(FakeTensorMode):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # fast key -> FakeTensorMode's dispatch cache key (see _cache_key below)
            self._gpumem_keys: dict[tuple, object] | None = (
                None if env_flag("GPUMEM_FAKE_FULL_DISPATCH") else {}
            )

        def _cache_key(self, *a):
            """FakeTensorMode's cache key, memoised on a cheaper key of the same inputs.

            Building torch's key (every tensor argument's metadata flattened into a list) costs
            more than the cached dispatch it guards: a third of a fake profile's time. The
            identical blocks of a model repeat the same calls, so the key computed once is
            looked up by a tuple of the same inputs (``_fast_key``) taken with C getters. Every
            input torch's key reads is in the fast key, so equal fast keys mean equal torch
            keys; calls it cannot describe (symbolic shapes, other tensor types) take torch's
            own path. ``GPUMEM_FAKE_FULL_DISPATCH=1`` turns the memo off."""
            memo = self._gpumem_keys
            func, args, kwargs = a[-3:]  # (state,) func, args, kwargs across torch versions
            fast = None if memo is None else _fast_key(self, func, args, kwargs)
            if fast is None:
                return super()._cache_key(*a)
            key = memo.get(fast)
            if key is None:
                key = super()._cache_key(*a)  # may raise torch's bypass: nothing memoised
                if not getattr(a[0], "known_symbols", None):
                    memo[fast] = key
            return key

        def _memo_hit(self, func, args, kwargs):
            """The output of a call whose key is memoised and cached, made as torch makes a
            cache hit's, without building torch's key; ``_MISS`` otherwise."""
            memo = self._gpumem_keys
            if memo is None or not self.cache_enabled or self.cache_crosscheck_enabled:
                return _MISS
            fast = _fast_key(self, func, args, kwargs)
            key = None if fast is None else memo.get(fast)
            if key is None:
                return _MISS
            entry = FakeTensorMode.cache.get(key)
            if type(entry) is not valid_entry:  # absent, evicted, or torch's bypass entry
                return _MISS
            FakeTensorMode.cache_hits += 1
            return self._output_from_cache_entry(state_cls(None), entry, key, func, args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            handler = meta_handlers.get(func) if self._gpumem_keys is not None else None
            if handler is not None:
                return handler(args)
            out = self._memo_hit(func, args, kwargs or {}) if answers_hits else _MISS
            if out is _MISS:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            slots = host_outputs.get(func)
            if slots is None:
                return out
            out = list(out)
            for i in slots:
                t = out[i]
                if (
                    isinstance(t, torch.Tensor)
                    and t.device.type == "cuda"
                    and t.dim() == 0
                    and t.dtype == torch.int64
                ):
                    out[i] = self.from_tensor(torch.empty((), dtype=torch.int64, device="cpu"))
            return tuple(out)

    _MODE_CLASS.append(CudaFaithfulFakeTensorMode)
    return CudaFaithfulFakeTensorMode


_MISS = object()


def _takes(fn: object, names: tuple[str, ...]) -> bool:
    """Whether ``fn`` (a method) takes exactly these parameters after ``self``."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return tuple(params[1:]) == names


_KEY_LEAVES = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)


def _fast_key(mode: object, func: object, args: object, kwargs: object) -> tuple | None:
    """A hashable tuple of everything FakeTensorMode's cache key reads for this call, or
    ``None`` when a call has something it does not describe (then torch builds its own key).

    Global state: the default dtype and device, inference and grad mode, the thread's
    dispatch-key sets (autocast and the like) and whether a proxy mode traces. Per tensor
    argument (plain strided fake tensors of this mode only): dtype, shape, strides, device,
    storage offset and bytes, ``requires_grad``, quantized, conjugate, negative and inference
    bits, the tensor metadata torch's key is made of."""
    if getattr(mode, "shape_env", None) is not None:
        return None  # symbolic shapes: torch's key converts them, never memoised
    out: list[object] = [
        func,
        torch.get_default_dtype(),
        torch._C._get_default_device(),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
        torch._C._dispatch_tls_local_include_set().raw_repr(),
        torch._C._dispatch_tls_local_exclude_set().raw_repr(),
        _proxy_mode() is not None,
    ]
    if not _flatten_key(mode, args, out):
        return None
    if kwargs:
        out.append(tuple(kwargs))
        if not _flatten_key(mode, tuple(kwargs.values()), out):
            return None
    return tuple(out)


def _flatten_key(mode: object, values: object, out: list[object]) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(values, (list, tuple)):
        return False
    out.append(type(values))
    out.append(len(values))
    for v in values:
        cls = type(v)
        if cls is FakeTensor:
            if v.fake_mode is not mode or v.constant is not None or v.layout is not torch.strided:
                return False
            out.append(
                (
                    v.dtype,
                    v.shape,
                    v.stride(),
                    v.device,
                    v.storage_offset(),
                    v.untyped_storage().nbytes(),
                    v.requires_grad,
                    v.is_quantized,
                    v.is_conj(),
                    v.is_neg(),
                    v.is_inference(),
                )
            )
        elif cls in _KEY_LEAVES:
            out.append(cls)
            out.append(v)
        elif cls is list or cls is tuple:
            if not _flatten_key(mode, v, out):
                return False
        else:
            return False  # SymInts, other tensors, callables, dicts: torch's own key
    return True


def _proxy_mode() -> object:
    """``torch.fx.experimental.proxy_tensor.get_proxy_mode()`` without its import and checks."""
    key = torch._C._TorchDispatchModeKey.PROXY
    return torch._C._get_dispatch_mode(key) or torch._ops._get_dispatch_mode_pre_dispatch(key)


@contextlib.contextmanager
def _optimizer_defaults_by_device() -> Iterator[None]:
    """Optimizers pick their default implementation (foreach on CUDA) only for plain tensors and
    parameters; a fake parameter would always take the per-tensor loop, whose scratch memory is
    a single tensor's instead of the whole list's. Inside the block they choose by device, as
    real tensors do."""
    import torch.optim.optimizer as optimizer_module
    from torch._subclasses.fake_tensor import FakeTensor

    supported = getattr(optimizer_module, "_foreach_supported_types", None)
    if not isinstance(supported, list) or FakeTensor in supported:
        yield
        return
    supported.append(FakeTensor)
    try:
        yield
    finally:
        supported.remove(FakeTensor)


_DISPATCH_MODULES = ("torch.overrides", "torch.utils._device")


def _default_device(device: str | torch.device) -> object:
    """``torch.device(device)`` as a context, except for tensors ``torch.optim`` creates itself.

    An eager run has no default device: optimizers of every torch version keep their step
    counters on the host (older versions by creating them without a device) and read them with
    ``.item()``, which a fake CUDA counter cannot answer. Their factory calls keep torch's own
    default here, so fake runs place those counters where real runs do.
    """
    from torch.utils._device import DeviceContext, _device_constructors

    factories = _device_constructors()

    def from_optim() -> bool:
        # the Python code that called the factory (a C function), past the function modes
        f = sys._getframe(2)
        while f is not None and (
            f.f_code.co_name == "__torch_function__"
            or f.f_globals.get("__name__", "").startswith(_DISPATCH_MODULES)
        ):
            f = f.f_back
        return f is not None and f.f_globals.get("__name__", "").startswith("torch.optim")

    class FakeBlockDevice(DeviceContext):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in factories and from_optim():
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)

    return FakeBlockDevice(device)


_RANDOM_FILLS = (
    "uniform_",
    "normal_",
    "bernoulli_",
    "random_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
)


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
            exempt = (
                getattr(func, "__name__", "") in ("__get__", "__set__")
                or getattr(func, "__module__", "") == "torch.nn.init"
            )  # initialisers run under no_grad themselves
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


_PACKED_ASSUMPTION = (
    "transformers: position_ids taken as one sequence per row (no packed sequences), as its "
    "default positions are; a real run checks the values"
)


@contextlib.contextmanager
def real_branches() -> Iterator[None]:
    """Make libraries that branch on "is this a fake tensor?" take the branch a real run takes,
    where that branch is known without the data, noting the assumption
    (:func:`gpumem._assumptions.note_assumption`).

    transformers' ``find_packed_sequence_indices`` (``masking_utils``) answers "not packed" for
    fake ``position_ids``: transformers creates them as ``arange(s)`` per row, which a real run
    checks and finds unpacked. Without this a fake profile of a model trained without a cache
    counts an explicit attention mask and each layer's fp32 copy of it that the real run never
    creates (8 KiB + 32 KiB per layer for 2 x 64 tokens; ``b·s²·(1 + 4 per layer)`` bytes).
    Only libraries already imported are patched (a fake model's classes are imported by then).
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_gpumem_real_branch", False):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    from gpumem._assumptions import note_assumption

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor):
            note_assumption(_PACKED_ASSUMPTION)
            return None
        return original(position_ids, *args, **kwargs)

    find_packed_sequence_indices._gpumem_real_branch = True  # type: ignore[attr-defined]
    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def is_fake_model(model: torch.nn.Module) -> bool:
    """True when the model's parameters are fake tensors (built under :func:`fake`), also when
    sharding made them DTensors around fake local tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(view, FakeTensor) for p in model.parameters() for view, _ in views_of(p))


# CUDA autocast's fp32 policies (aten/src/ATen/autocast_mode.cpp) for the ops whose saved
# tensors change with them; CPU autocast leaves them in the input's dtype. ``fp32_set_opt_dtype``
# (softmax, log_softmax: the op's own dtype argument set to fp32 when not given) and ``fp32``
# (the norms: floating inputs cast to fp32).
_CUDA_FP32_OPT_DTYPE = ("softmax.int", "log_softmax.int")
_CUDA_FP32 = ("layer_norm", "group_norm")


@contextlib.contextmanager
def cuda_kernels_on_cpu() -> Iterator[None]:
    """Run a CPU pass with what CUDA's kernels and autocast save where the CPU's differ:
    CUDA autocast's fp32 ops (softmax and log_softmax in fp32 when no dtype is given, the
    norms on fp32 inputs; CPU autocast runs them in 16 bits) and dropout's bool mask
    (``native_dropout``; the CPU's ``dropout`` saves its float noise). For a pass that prices
    a CUDA job on a machine without a GPU (the nn.Module path of ``gpumem.estimate``).

    The kernels are registered for the duration of the block (process-wide) and removed on
    exit.

    Example:
        >>> with gpumem.fake(), cuda_kernels_on_cpu(), torch.autocast("cpu", torch.float16):
        ...     probs = torch.softmax(torch.randn(4, 4).half(), -1)   # float32, as on CUDA
    """
    autocast_key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    low = (torch.float16, torch.bfloat16)

    def fp32_opt_dtype(op):
        def kernel(x, dim, dtype=None):
            with torch._C._ExcludeDispatchKeyGuard(autocast_key):
                if dtype is None and x.dtype in low:
                    dtype = torch.float32
                return op(x, dim, dtype)

        return kernel

    def fp32(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(autocast_key):
                args = tuple(
                    a.float() if isinstance(a, torch.Tensor) and a.dtype in low else a for a in args
                )
                return op(*args, **kwargs)

        return kernel

    def dropout(x, p, train):
        if not train or p == 0:
            return x
        return torch.ops.aten.native_dropout.default(x, p, train)[0]

    import warnings

    libs = [torch.library.Library("aten", "IMPL") for _ in range(2)]
    try:
        with warnings.catch_warnings():  # dropout's composite kernel is replaced on purpose
            warnings.simplefilter("ignore", UserWarning)
            for name in _CUDA_FP32_OPT_DTYPE:
                base, overload = name.split(".")
                op = getattr(getattr(torch.ops.aten, base), overload)
                libs[0].impl(name, fp32_opt_dtype(op), "AutocastCPU")
            for name in _CUDA_FP32:
                libs[0].impl(name, fp32(getattr(torch.ops.aten, name).default), "AutocastCPU")
            libs[1].impl("dropout", dropout, "CompositeImplicitAutograd")
        yield
    finally:
        for lib in libs:
            lib._destroy()
