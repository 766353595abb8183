"""CRC32C checksums of buffers and tensors: native (CPU) or Triton (on the GPU, where data lives).

CRC32C is the Castagnoli CRC (reflected polynomial 0x82F63B78, init and xorout 0xFFFFFFFF), the
value ``google-crc32c`` and ``crc32c`` compute. On the CPU the native core uses SSE4.2 / ARMv8 CRC
instructions (three interleaved streams) or a slicing-by-8 table, and splits large buffers over
threads; see :func:`cpu_features`.

Example:
    >>> from gpumem.checksum import crc32c, crc32c_combine
    >>> crc32c(b"123456789")
    3808858755
    >>> a = crc32c(b"1234"); b = crc32c(b"56789")
    >>> crc32c(b"56789", a) == crc32c_combine(a, b, 5) == crc32c(b"123456789")
    True
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from gpumem._native import byte_view, load, resolve_threads, tensor_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["chunk_crc32c", "cpu_features", "crc32c", "crc32c_combine"]

_BACKENDS = ("auto", "native", "triton")


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data``'s bytes, extending the running CRC ``value``.

    Args:
        data: bytes-like object, numpy array or contiguous CPU torch tensor (any dtype; its bytes
            in memory order are checksummed).
        value: a previous result to extend: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

    Returns:
        The CRC as an int in ``[0, 2**32)``.

    Raises:
        ValueError: non-contiguous data, a CUDA tensor (use :func:`chunk_crc32c`), or ``value``
            outside ``[0, 2**32)``.
    """
    return load().crc32c(byte_view(data), _crc_arg(value, "value"))


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (O(log len_b)).

    Lets independently checksummed pieces (per chunk, per thread, per rank) be merged into the
    checksum of the whole without reading the data again.
    """
    n = _index(len_b)
    if n is None or n < 0:
        raise ValueError(f"len_b must be a byte count >= 0, got {len_b!r}")
    return load().crc32c_combine(_crc_arg(crc_a, "crc_a"), _crc_arg(crc_b, "crc_b"), n)


def chunk_crc32c(
    tensor: torch.Tensor, chunk_bytes: int, backend: str = "auto", *, threads: int | None = None
) -> torch.Tensor:
    """One CRC32C per fixed-size chunk of a contiguous tensor's bytes.

    Chunk ``i`` covers bytes ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of the tensor viewed as
    bytes; the last chunk may be shorter. Each entry equals ``crc32c`` of that byte range.

    Args:
        tensor: a contiguous tensor of any dtype, on the CPU or a CUDA device.
        chunk_bytes: chunk size in bytes (> 0).
        backend: ``"auto"`` (Triton for CUDA tensors, native for CPU ones), ``"native"`` (CPU
            only) or ``"triton"`` (``gpumem.kernels.crc32c``; on a CPU tensor only under
            ``TRITON_INTERPRET=1``).
        threads: native threads for a CPU tensor (default: GPUMEM_THREADS or the number of cores).

    Returns:
        An int64 tensor of ``ceil(nbytes / chunk_bytes)`` CRCs on the tensor's device (empty for
        an empty tensor).

    Raises:
        ValueError: non-contiguous tensor, ``chunk_bytes <= 0``, unknown backend, or
            ``backend="native"`` on a non-CPU tensor.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"chunk_crc32c takes a torch.Tensor, got {type(tensor).__name__}; "
            "for bytes-like data use crc32c() or torch.frombuffer(data, dtype=torch.uint8)"
        )
    chunk = _index(chunk_bytes)
    if chunk is None or chunk <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    chunk_bytes = chunk
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    data = tensor_bytes(tensor)
    if backend == "auto":
        backend = "triton" if tensor.device.type == "cuda" else "native"
    if backend == "native" and tensor.device.type != "cpu":
        raise ValueError(
            f"backend='native' needs a CPU tensor but the tensor is on {tensor.device}; "
            "use backend='auto' or 'triton' to checksum it on the device"
        )
    count = -(-data.numel() // chunk_bytes)
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=tensor.device)
    if backend == "triton":
        from gpumem.kernels.crc32c import chunk_crc32c_triton

        return chunk_crc32c_triton(data, chunk_bytes)
    out = torch.empty(count, dtype=torch.int64)
    load().chunk_crc32c(data.numpy(), chunk_bytes, out.numpy(), "auto", resolve_threads(threads))
    return out


def cpu_features() -> dict[str, Any]:
    """What the native core uses on this CPU.

    Returns:
        ``{"crc32c": "sse4.2" | "armv8-crc" | "table", "crc32c_fold": "vpclmulqdq" |
        "pclmulqdq" | "none", "threads": N}``: ``crc32c_fold`` is how long buffers are folded
        with carry-less multiplies (x86-64; GPUMEM_CRC32C_FOLD=none|pclmulqdq caps it);
        ``threads`` is the default worker count (GPUMEM_THREADS or the number of cores).
    """
    C = load()
    return {
        "crc32c": C.crc32c_hardware(),
        "crc32c_fold": C.crc32c_fold(),
        "threads": C.num_threads(),
    }


def _index(value: Any) -> int | None:
    """``value`` as an int if it is an integer (int, numpy or 0-dim torch integer), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _crc_arg(value: Any, name: str) -> int:
    v = _index(value)
    if v is None or not 0 <= v < 2**32:
        raise ValueError(f"{name} must be a CRC32C value in [0, 2**32), got {value!r}")
    return v
