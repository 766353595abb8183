"""The native core ``gpumem._C``: loading it, the CUDA runtime it found, and byte views for it.

Everything that hands user data to ``_C`` goes through :func:`byte_view`, so that bytes, numpy
arrays and CPU torch tensors of any dtype arrive as one zero-copy 1-D ``uint8`` view, and every
module states the same errors for non-contiguous or GPU inputs.
"""

from __future__ import annotations

import functools
import importlib
import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gpumem._env import env_flag, env_int, env_str

_BUILD_HINT = (
    "gpumem's native extension gpumem._C is not built. Build it from the source tree with "
    "`pip install -e .` (or `pip install --no-build-isolation -e .` offline); this needs cmake, "
    "ninja or make, a C++17 compiler (gcc/clang) and nanobind. No CUDA toolkit is needed."
)


@functools.cache
def load() -> ModuleType:
    """Import ``gpumem._C`` once and apply GPUMEM_THREADS.

    Returns:
        The extension module.

    Raises:
        ImportError: the extension is missing or does not load, with how to build it.
    """
    try:
        module = importlib.import_module("gpumem._C")
    except ImportError as exc:
        raise ImportError(f"{_BUILD_HINT} (import error: {exc})") from exc
    threads = env_int("GPUMEM_THREADS", 0)
    if threads is not None and threads < 0:
        raise ValueError(f"GPUMEM_THREADS={threads} must be >= 0 (0: all cores)")
    module.set_num_threads(threads or 0)
    return module


def resolve_threads(threads: int | None) -> int:
    """Thread count argument for ``_C`` calls: None -> 0 (the default pool size)."""
    if threads is None:
        return 0
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    return threads


@dataclass(frozen=True)
class CudaRuntime:
    """Whether the CUDA runtime (libcudart) is usable from the native core, and why not.

    Attributes:
        available: libcudart loaded, its symbols resolved and at least one device visible.
        library: path of the loaded libcudart ("" when none).
        device_count: devices the runtime reports.
        message: one line for users: empty when available, else what is missing and what is off.
    """

    available: bool
    library: str
    device_count: int
    message: str


@functools.cache
def cuda_runtime() -> CudaRuntime:
    """Load the CUDA runtime once (dlopen, reusing torch's copy) and report what happened.

    torch is imported first when installed, so that the libcudart it links is already in the
    process and gets reused rather than a second copy found on the library path.
    GPUMEM_DISABLE_CUDA=1 turns this off; GPUMEM_CUDA_LIBRARY names the library to use (and then
    only that one is tried, so a wrong path is reported rather than silently replaced).
    """
    C = load()
    disabled = env_flag("GPUMEM_DISABLE_CUDA")
    library = env_str("GPUMEM_CUDA_LIBRARY") or ""
    torch_note = ""
    if not disabled:
        try:
            import torch

            if torch.version.cuda is None:
                torch_note = " (torch is a CPU build)"
        except ImportError:
            torch_note = " (torch is not installed)"
    status = C.cuda_load(disabled, library)
    if status["available"]:
        return CudaRuntime(True, status["library"], status["device_count"], "")
    reason = status["reason"]
    # libcudart answers "driver version is insufficient" also when there is no driver at all
    if "insufficient" in reason and not nvidia_driver_present():
        reason = "no NVIDIA driver on this machine (libcuda.so.1 not found)"
    message = (
        f"CUDA runtime not loaded: {reason}{torch_note}; "
        "CUDA paths (pinned host memory) are disabled"
    )
    return CudaRuntime(False, status["library"], status["device_count"], message)


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA driver's user-space library (libcuda) can be loaded."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _is_torch_tensor(obj: Any) -> bool:
    # No torch import here: a tensor's type lives in the torch package.
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def tensor_bytes(tensor: Any, what: str = "tensor") -> Any:
    """A contiguous tensor's bytes as a flat ``uint8`` tensor on the same device (no copy).

    Raises:
        ValueError: the tensor is not contiguous, is sparse/meta, or has a conjugate/negative bit.
    """
    import torch

    if tensor.layout != torch.strided:
        raise ValueError(
            f"{what} has layout {tensor.layout}; only dense (strided) tensors are supported"
        )
    if tensor.device.type == "meta":
        raise ValueError(f"{what} is a meta tensor and has no data")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, "
            f"stride {tuple(tensor.stride())}); pass tensor.contiguous()"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(
            f"{what} has a lazy conjugate/negative bit; call .resolve_conj()/.resolve_neg()"
        )
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def as_bytes(t: Any) -> Any:
    """``tensor_bytes`` without the checks, for hot paths whose tensors are known to be plain,
    contiguous and resolved (any dtype, any rank including 0-d)."""
    import torch

    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(obj: Any, *, writable: bool = False, what: str = "data") -> Any:
    """A zero-copy 1-D ``uint8`` view of ``obj`` for ``_C``: a numpy array or a memoryview.

    Args:
        obj: bytes-like object (bytes, bytearray, memoryview, mmap, array), numpy array or
            contiguous CPU torch tensor of any dtype.
        writable: the view is written to (``_C`` rejects read-only buffers then).
        what: the name used in error messages.

    Raises:
        ValueError: non-contiguous data, or a tensor that is not on the CPU.
        TypeError: ``obj`` exposes no buffer.
    """
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(
                f"{what} is on {obj.device}; this native path needs a CPU tensor "
                "(copy it with .cpu() or use the device path)"
            )
        return tensor_bytes(obj, what).numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what} must be bytes-like, a numpy array or "
            f"a CPU torch tensor, got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass a contiguous copy")
    if writable and view.readonly:
        raise ValueError(
            f"{what} is read-only; pass a writable buffer (bytearray, numpy array, tensor)"
        )
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:
        return memoryview(bytearray() if writable else b"")
    try:
        return view.cast("B")
    except (TypeError, ValueError, NotImplementedError):
        # formats memoryview cannot cast (non-native byte order, ...): numpy can view them
        import numpy as np

        return np.asarray(obj).reshape(-1).view(np.uint8)


def split_pieces(
    pieces: Iterable[tuple[int, Any]], *, writable: bool
) -> tuple[list[int], list[Any]]:
    """File offsets and byte views of ``(file_offset, buffer)`` pairs, each checked (the pieces
    that ``gpumem.writer`` writes and ``gpumem.reader`` fills)."""
    offsets: list[int] = []
    buffers: list[Any] = []
    for i, piece in enumerate(pieces):
        try:
            offset, buffer = piece
        except (TypeError, ValueError):
            raise TypeError(
                f"pieces[{i}] must be a (file_offset, buffer) pair, got {piece!r:.80}"
            ) from None
        offsets.append(nonneg(offset, f"pieces[{i}] file offset"))
        buffers.append(byte_view(buffer, writable=writable, what=f"pieces[{i}] buffer"))
    return offsets, buffers


def fs_path(path: str | bytes | os.PathLike) -> bytes:
    """A path as the bytes the OS takes (``os.fsencode``): any name works, UTF-8 or not."""
    return os.fsencode(path)


def dir_fd_arg(dir_fd: int | None) -> int:
    """``dir_fd`` argument for ``_C`` calls: None -> -1 (paths relative to the working
    directory)."""
    if dir_fd is None:
        return -1
    return nonneg(dir_fd, "dir_fd")


def nonneg(value: Any, name: str) -> int:
    """``value`` as an int >= 0, or TypeError / ValueError naming ``name``."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def copy_many(
    sources: Iterable[Any], destinations: Iterable[Any], threads: int | None = None
) -> None:
    """Copy each source's bytes into its destination of the same size (contiguous CPU tensors or
    buffers), in 8 MiB pieces on the native pool: one call for hundreds of tensors, without the
    intra-op thread hand-offs of a ``copy_`` each."""
    srcs = [byte_view(s, what=f"sources[{i}]") for i, s in enumerate(sources)]
    dsts = [
        byte_view(d, writable=True, what=f"destinations[{i}]") for i, d in enumerate(destinations)
    ]
    load().copy_many(srcs, dsts, resolve_threads(threads))
