"""A host staging arena: one page-aligned allocation, reused, pinned on CUDA machines.

Checkpoint staging copies GPU tensors into host memory; pinned (page-locked) memory lets those
copies run asynchronously at full PCIe/NVLink-C2C speed. ``HostArena`` makes one allocation up
front, registers it with ``cudaHostRegister`` in chunks of at most 1 GiB in a background thread
(registering tens of GiB takes seconds, so it is kept off the critical path), and hands out torch
tensors that alias it without copies. Device-to-host copies go through
:meth:`HostArena.copy_from_device`, which never lets one CUDA copy span two registration chunks
(see there).

Example:
    >>> import torch
    >>> from gpumem.arena import HostArena
    >>> with HostArena(1 << 20) as arena:          # pinned iff the CUDA runtime is available
    ...     w = arena.tensor(0, torch.float32, (16, 16))
    ...     arena.copy_in([torch.ones(16, 16)], [0])
    ...     float(w.sum())
    256.0
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpumem._native import byte_view, cuda_runtime, load, resolve_threads

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

__all__ = ["PREFAULT_CHUNK", "HostArena", "current_cuda_device"]

PREFAULT_CHUNK = 64 << 20  # HostArena.prefault's step: progress visible to a concurrent copy


class HostArena:
    """Page-aligned host memory allocated once, exposed as torch tensors, optionally pinned.

    Lifetime: :meth:`close` (or leaving the ``with`` block) drops the arena's hold on the memory;
    it is unregistered and freed as soon as no tensor returned by :meth:`view` / :meth:`tensor`
    is alive. Those tensors keep the memory valid, so they never dangle, but hold on to them
    only as long as needed: while any is alive the (pinned) memory stays allocated. After
    ``close()`` the arena's own methods raise ``RuntimeError``.

    Attributes:
        nbytes: size in bytes.
        pinned: whether the memory is being or has been registered with CUDA (see
            :meth:`wait_pinned`).
        alignment: alignment of the start of the arena in bytes.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pinned: bool | None = None,
        alignment: int = 4096,
        device: int | None = None,
    ) -> None:
        """Allocate the arena.

        Args:
            nbytes: size in bytes (> 0).
            pinned: ``None``: pin iff the CUDA runtime is available; ``True``: pin, or raise
                ``RuntimeError`` naming what is missing; ``False``: plain memory.
            alignment: power of two >= 64 (default a 4096-byte page, what O_DIRECT needs).
            device: CUDA device whose context registers the memory. ``None``: the calling
                thread's current device. A worker thread (current device 0) allocating for a
                rank on another GPU passes that rank's device (see :func:`current_cuda_device`),
                or it would create a context on GPU 0.

        Raises:
            ValueError: bad size, alignment or device. MemoryError: the allocation failed.
            RuntimeError: ``pinned=True`` without a usable CUDA runtime.
        """
        import torch

        nbytes = _int(nbytes, "nbytes")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if nbytes > sys.maxsize:  # the native core refuses sizes that do not fit once rounded
            raise ValueError(f"nbytes {nbytes} is more than this process can address")
        alignment = _int(alignment, "alignment")
        if alignment < 64 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 64, got {alignment}")
        if device is not None and _int(device, "device") < 0:
            raise ValueError(f"device must be a CUDA device index >= 0 or None, got {device}")
        if pinned is None:
            pinned = cuda_runtime().available
        elif pinned:
            runtime = cuda_runtime()
            if not runtime.available:
                raise RuntimeError(
                    f"HostArena(pinned=True) needs the CUDA runtime, but {runtime.message}. "
                    "Use pinned=None (pin only where CUDA is available) or pinned=False."
                )
        C = load()
        self._buf: Any = C.HostBuffer(nbytes, alignment)
        self._bytes: torch.Tensor | None = torch.from_numpy(self._buf.array())
        self._pin_chunk = int(C.PIN_CHUNK_BYTES)  # registration granularity (copy_from_device)
        if pinned:
            self._buf.start_pinning(-1 if device is None else int(device))
        self.nbytes = nbytes
        self._populate = True  # False: prefault touches pages instead of MADV_POPULATE_WRITE
        self.pinned = bool(pinned)
        self.alignment = alignment

    # ---- pinning ----

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait until the background registration finished.

        Args:
            timeout: seconds to wait at most (None: until done).

        Returns:
            True when the whole arena is pinned; False if not pinned or still pinning at timeout.

        Raises:
            RuntimeError: registration failed (the CUDA error text, e.g. out of lockable memory).
        """
        buf = self._live_buf()
        if not self.pinned:
            return False
        return bool(buf.wait_pinned(-1.0 if timeout is None else float(timeout)))

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered with CUDA so far (grows in steps of up to 1 GiB while pinning)."""
        return int(self._live_buf().pinned_bytes)

    @property
    def data_ptr(self) -> int:
        """Address of the first byte."""
        return int(self._live_buf().data_ptr)

    @property
    def closed(self) -> bool:
        return self._buf is None

    # ---- residency ----

    def lock(self) -> bool:
        """Fault in every page now and lock it in RAM (``mlock``) so that memory reclaim (swap,
        DAMON pageout) cannot take it back while the arena sits idle between uses: starts
        :meth:`prefault` and waits for it.

        Returns:
            True if the arena is locked, False if it was only pre-faulted (see :meth:`prefault`).
        """
        self.prefault()
        self.wait_ready()
        return bool(self.locked)

    def prefault(self, *, lock: bool = True, chunk_bytes: int = PREFAULT_CHUNK) -> None:
        """Start faulting in every page, and with ``lock`` locking it in RAM (``mlock``), in a
        native background thread that holds no GIL, ``chunk_bytes`` at a time from the end of
        the arena toward its start. Contents are kept, and copies into the arena may run
        meanwhile: a copy from the start faults its own pages while this works from the end
        (:meth:`cold_bytes` says which part is resident yet). Does nothing after the first call.

        Locking needs ``RLIMIT_MEMLOCK`` headroom (or CAP_IPC_LOCK). Without it the pages are only
        pre-faulted (``MADV_POPULATE_WRITE``, else one atomic no-op write per page), which is
        still off the first copy's path but may be reclaimed later. Pinned (CUDA-registered)
        memory is locked by the driver; there this does nothing.
        """
        buf = self._live_buf()
        if self.pinned:
            return
        chunk_bytes = _int(chunk_bytes, "chunk_bytes")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        buf.start_faulting(bool(lock), chunk_bytes, self._populate)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`prefault` (GIL released); True once it finished or never started."""
        return bool(self._live_buf().wait_faulted(-1.0 if timeout is None else float(timeout)))

    @property
    def ready_from(self) -> int:
        """The arena is resident from this offset on (``nbytes`` before :meth:`prefault`, 0 once
        it finished; pinned arenas: 0)."""
        return 0 if self.pinned else int(self._live_buf().ready_from)

    def cold_bytes(self, offset: int, nbytes: int) -> int:
        """Bytes of ``[offset, offset + nbytes)`` that :meth:`prefault` has not faulted in yet:
        a copy there faults those pages itself."""
        return max(0, min(offset + nbytes, self.ready_from) - offset)

    @property
    def locked(self) -> bool | None:
        """True: resident and locked (pinned, or :meth:`prefault` locked it); False: pre-faulted
        only; None: still faulting in, or never asked to."""
        if self.pinned:
            return True
        state = int(self._live_buf().locked)
        return None if state < 0 else bool(state)

    # ---- views ----

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes at ``offset`` as a uint8 tensor aliasing the arena (no copy)."""
        offset, nbytes = self._range(offset, nbytes)
        assert self._bytes is not None
        return self._bytes[offset : offset + nbytes]

    def tensor(self, offset: int, dtype: torch.dtype, shape: int | Sequence[int]) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at ``offset`` aliasing the arena.

        Raises:
            ValueError: ``offset`` not a multiple of the dtype's size, or out of bounds.
        """
        import torch

        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        offset = _int(offset, "offset")
        if offset % itemsize:
            raise ValueError(
                f"offset {offset} is not a multiple of the {dtype} item size {itemsize}"
            )
        raw = self.view(offset, math.prod(dims) * itemsize)
        return (raw if dtype == torch.uint8 else raw.view(dtype)).view(dims)

    # ---- copies ----

    def copy_in(
        self,
        sources: Sequence[Any],
        offsets: Sequence[int],
        *,
        threads: int | None = None,
        chunk_bytes: int = 0,
        crc_index: Sequence[int] | None = None,
        crc_out: Any = None,
    ) -> None:
        """Copy each source's bytes into the arena at the matching offset, on several threads.

        Args:
            sources: contiguous CPU tensors (any dtype), numpy arrays or bytes-like objects.
            offsets: arena byte offset of each source.
            threads: copy threads (default: GPUMEM_THREADS or the number of cores).
            chunk_bytes, crc_index, crc_out: with all three, the copy also computes the CRC32C of
                every ``chunk_bytes`` chunk of each source's copied bytes, block by block while
                they are in cache (one pass over memory, not two): source ``i``'s chunk ``k``
                goes to ``crc_out[crc_index[i] + k]`` (an int64 NumPy array; index -1: none).

        Raises:
            ValueError: counts differ, a source does not fit (named by index), a source is
                non-contiguous or not on the CPU, or a CRC slot lies outside ``crc_out``.
        """
        import numpy as np

        buf = self._live_buf()
        # Flat contiguous uint8 NumPy arrays are what byte_view would hand over; taking them as
        # they are keeps a copy of hundreds of tensors from spending milliseconds on re-checks.
        views = [
            s
            if type(s) is np.ndarray
            and s.dtype == np.uint8
            and s.ndim == 1
            and s.flags.c_contiguous
            else byte_view(s, what=f"sources[{i}]")
            for i, s in enumerate(sources)
        ]
        offs = [o if type(o) is int else _int(o, f"offsets[{i}]") for i, o in enumerate(offsets)]
        if len(views) != len(offs):
            raise ValueError(f"copy_in got {len(views)} sources but {len(offs)} offsets")
        if crc_out is None:
            buf.copy_in(views, offs, resolve_threads(threads))
        else:
            buf.copy_in(views, offs, resolve_threads(threads), chunk_bytes, crc_index, crc_out)

    def copy_from_device(self, src: torch.Tensor, offset: int) -> None:
        """Enqueue a copy of ``src``'s bytes into the arena at ``offset``, non-blocking on the
        current CUDA stream (synchronous for a CPU ``src``).

        A pinned arena is registered in chunks (:attr:`pin_chunk` bytes from its start), each a
        separate registration, and the CUDA driver rejects one copy that spans two of them, or a
        registered and a not-yet-registered range while pinning still runs, with
        ``cudaErrorInvalidValue`` ("memory regions spanning over allocations ... are not
        supported"). The copy is therefore issued as one copy per chunk it touches. The caller
        keeps ``src`` alive and unchanged until the stream has run the copies.

        Args:
            src: a contiguous tensor of any dtype (its bytes in memory order are copied).
            offset: arena byte offset of the first byte.

        Raises:
            ValueError: ``src`` is not contiguous, or does not fit at ``offset``.
        """
        from gpumem._native import tensor_bytes

        data = tensor_bytes(src, "src")
        offset, nbytes = self._range(offset, data.numel())
        step = self._pin_chunk if self.pinned else 0
        for lo, n in _split(offset, nbytes, step):
            self.view(lo, n).copy_(data[lo - offset : lo - offset + n], non_blocking=True)

    def enqueue_d2h(self, copies: Any, stream: int) -> int:
        """Enqueue a whole snapshot's device-to-host copies in one native call, without the GIL.

        Each row of ``copies`` is (device address, bytes, arena offset); every copy is issued
        with ``cudaMemcpyAsync`` on ``stream`` and cut at the registration chunks (see
        :meth:`copy_from_device`). Nothing waits: the caller records an event on ``stream`` and
        keeps the sources alive and unchanged until it completes.

        Args:
            copies: C-contiguous ``(n, 3)`` uint64 NumPy array.
            stream: the ``cudaStream_t`` as an int (``torch.cuda.Stream.cuda_stream``).

        Returns:
            The number of ``cudaMemcpyAsync`` calls made.

        Raises:
            ValueError: a copy does not fit in the arena (checked for all before any is issued).
            RuntimeError: no CUDA runtime, or a CUDA error naming the copy (those before it stay
                enqueued: synchronize ``stream`` before reusing their bytes).
        """
        buf = self._live_buf()
        runtime = cuda_runtime()
        if not runtime.available:
            raise RuntimeError(f"enqueue_d2h needs the CUDA runtime, but {runtime.message}")
        return int(buf.enqueue_d2h(copies, int(stream)))

    @property
    def pin_chunk(self) -> int:
        """Bytes per CUDA registration (the last one may be shorter); see
        :meth:`copy_from_device`."""
        return self._pin_chunk

    # ---- lifetime ----

    def close(self) -> None:
        """Drop the arena's hold on the memory (freed once no view is alive). Idempotent."""
        if self._buf is not None:
            # stop faulting and unlock now: views may outlive the arena, and memory it no longer
            # owns should not stay locked (RLIMIT_MEMLOCK is per process)
            self._buf.unlock()
        self._bytes = None
        self._buf = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.pinned_bytes}/{self.nbytes} bytes pinned"
        return f"HostArena(nbytes={self.nbytes}, pinned={self.pinned}, {state})"

    def _live_buf(self) -> Any:
        if self._buf is None:
            raise RuntimeError("this HostArena is closed; create a new one")
        return self._buf

    def _range(self, offset: Any, nbytes: Any) -> tuple[int, int]:
        self._live_buf()
        offset, nbytes = _int(offset, "offset"), _int(nbytes, "nbytes")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"range of {nbytes} bytes at offset {offset} is "
                f"outside the arena of {self.nbytes} bytes"
            )
        return offset, nbytes


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, as the runtime that pins arenas sees it (the
    libcudart torch loaded, so ``torch.cuda.set_device`` shows here), or None without a usable
    runtime. Read it on the thread that trains, and pass it as ``HostArena(device=...)`` when the
    arena is made on another thread."""
    if not cuda_runtime().available:
        return None
    device = int(load().cuda_get_device())
    return device if device >= 0 else None


def _split(offset: int, nbytes: int, step: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` cut at the multiples of ``step`` (0: not cut) into ``(start, size)``
    pieces; an empty range gives no piece."""
    pieces = []
    end = offset + nbytes
    while offset < end:
        n = end - offset if step <= 0 else min(end, (offset // step + 1) * step) - offset
        pieces.append((offset, n))
        offset += n
    return pieces


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
