"""The CUDA half of a snapshot: one native call enqueues every copy, one Triton launch every CRC.

A save's CUDA pieces that are contiguous and on the copying stream's device (all of them, in a
training job) go through a ``DeviceProgram`` built once per layout and set of device addresses
and reused by every later save of the same tensors:

* ``copies``: an (n, 3) uint64 array of (device address, bytes, arena offset) that
  ``HostArena.enqueue_d2h`` turns into ``cudaMemcpyAsync`` calls on the copying stream, with the
  GIL released: no Python per tensor;
* ``crc``: the program tables of ``gpumem.kernels.crc32c.plan_many``, so the chunk CRC32Cs of
  every piece are one kernel launch (two when some piece is not word-aligned) on a second,
  high-priority stream.

Ordering: the copies are enqueued first and never wait for the checksums; the CRC stream starts
at the same point (an event recorded before the copies) and reads the same bytes in HBM, which
nothing changes until both are done; a ``DeviceCopy`` holds both completion events, and whoever
must not change the bytes (the optimizer's stream) or reuse the arena (the persist thread)
waits for both. Pieces that are not contiguous or live on another device are gathered on the
copying stream, hashed there and copied one by one (rare; correct).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpumem._native import as_bytes
from gpumem.checksum import chunk_crc32c

if TYPE_CHECKING:
    from gpumem.kernels.crc32c import ManyPlan

    from .pieces import Piece
    from .spill import SpillControl


@dataclass
class DeviceProgram:
    """What the fast CUDA pieces of one save need, in arrays (see the module docstring)."""

    copies: np.ndarray  # (n, 3) uint64: device address, bytes, arena offset
    crc: ManyPlan | None  # None: no CRC (chunk too small for the tiled kernel: never in a save)
    bases: list[int]  # per CRC launch: the fast piece whose bytes are its base
    starts: list[int]  # per fast piece: its first slot in the CRC buffer
    counts: list[int]  # per fast piece: its number of chunks
    total: int  # CRC slots in all


def build_program(addresses: list[int], sizes: list[int], offsets: list[int], chunk: int, device):
    """The DeviceProgram of pieces at device ``addresses`` (``sizes`` bytes, arena ``offsets``)."""
    from gpumem.kernels.crc32c import plan_many

    copies = np.array([addresses, sizes, offsets], dtype=np.uint64).T.copy()
    counts = [-(-n // chunk) for n in sizes]
    starts = np.cumsum([0, *counts]).tolist()
    crc = plan_many(addresses, sizes, starts[:-1], chunk, device) if addresses else None
    bases = [launch.base for launch in crc.launches] if crc is not None else []
    return DeviceProgram(copies, crc, bases, starts[:-1], counts, starts[-1])


@dataclass
class DeviceCopy:
    """The events of one save's device work: ``copied`` (the copies, on the copying stream) and
    ``hashed`` (the CRCs, on the CRC stream; None without any). ``synchronize()`` waits for both
    and hands each piece its CRC view; ``wait(stream)`` orders ``stream`` after both."""

    start: Any
    copied: Any  # set once every copy is enqueued
    hashed: Any = None
    crc_host: torch.Tensor | None = None
    crc_slices: list[tuple[Piece, int, int]] = field(default_factory=list)
    calls: int = 0  # cudaMemcpyAsync calls of the one native enqueue

    def synchronize(self) -> None:
        self.copied.synchronize()
        if self.hashed is not None:
            self.hashed.synchronize()
        host = self.crc_host
        if host is not None:
            for p, a, n in self.crc_slices:
                p.crc = host[a : a + n]
            self.crc_slices = []

    def wait(self, stream: Any) -> None:
        stream.wait_event(self.copied)
        if self.hashed is not None:
            stream.wait_event(self.hashed)

    def device_times(self) -> tuple[float, float]:
        """(copy seconds, CRC seconds) on the device from the common start; after synchronize()."""
        copy_s = self.start.elapsed_time(self.copied) / 1e3
        crc_s = self.start.elapsed_time(self.hashed) / 1e3 if self.hashed is not None else 0.0
        return copy_s, crc_s


_PROGRAMS_KEPT = 4  # programs cached per layout (blocking and overlap select different pieces)


def enqueue(
    arena: Any,
    programs: dict,
    pieces: list[tuple[Piece, Any, int]],
    chunk: int,
    stream: Any = None,
    wait_event: Any = None,
    spill: SpillControl | None = None,
) -> DeviceCopy:
    """Enqueue the copies and CRCs of CUDA ``pieces`` ((piece, tensor, arena offset) each) on
    ``stream`` (None: the current one), after ``wait_event``. ``programs`` caches the
    DeviceProgram per set of addresses (the plan's own dict: see StagingPlan.programs).
    With ``spill`` (overlap mode, a device spill buffer) the CRCs are launched first and the
    copies enqueued in waves that the optimizer fence can stop (see spill.py); this call then
    returns only once every copy, drained spill included, is enqueued."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        copying = torch.cuda.current_stream()
        device = getattr(copying, "device", None)
        fast, slow = [], []
        for item in pieces:
            t = item[1]
            (fast if t.is_contiguous() and t.device == device else slow).append(item)
        addresses = [t.data_ptr() + p.src_offset for p, t, _ in fast]
        sizes = [p.nbytes for p, _, _ in fast]
        offsets = [d for _, _, d in fast]
        key = (tuple(addresses), tuple(sizes), tuple(offsets))
        prog = programs.get(key)
        if prog is None:
            where = as_bytes(fast[0][1]).device if fast else device  # where the bytes are
            prog = build_program(addresses, sizes, offsets, chunk, where)
            if len(programs) >= _PROGRAMS_KEPT:
                programs.pop(next(iter(programs)))
            programs[key] = prog
        if wait_event is not None:
            copying.wait_event(wait_event)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        snap = DeviceCopy(start, None)
        if spill is not None and fast and not slow:
            _hash(snap, prog, fast, copying, start)
            spill.context = (fast, prog.copies, copying, arena, snap.hashed)
            snap.calls = _enqueue_waves(arena, prog.copies, copying, spill)
            snap.copied = torch.cuda.Event(enable_timing=True)
            snap.copied.record()
            return snap
        calls = arena.enqueue_d2h(prog.copies, copying.cuda_stream) if fast else 0
        for p, t, dst in slow:  # gathered into a temporary on this stream (or from another GPU)
            src = as_bytes(t.contiguous())[p.src_offset : p.src_offset + p.nbytes]
            p.crc = chunk_crc32c(src, chunk)
            arena.copy_from_device(src, dst)
            t.record_stream(copying)  # the temporary's memory is freed once this stream ran
        snap.copied = torch.cuda.Event(enable_timing=True)
        snap.copied.record()
        snap.calls = calls
        _hash(snap, prog, fast, copying, start)
    return snap


def _hash(snap: DeviceCopy, prog: DeviceProgram, fast: list, copying: Any, start: Any) -> None:
    """Launch ``prog``'s CRCs on the CRC stream from ``start`` on; their event and host buffer
    go into ``snap``."""
    if prog.crc is not None and prog.total:
        crc_stream = _crc_stream(copying)
        crc_stream.wait_event(start)
        with torch.cuda.stream(crc_stream):
            snap.crc_host, snap.hashed = _launch_crcs(prog, fast)
        snap.crc_slices = [
            (p, a, n) for (p, _, _), a, n in zip(fast, prog.starts, prog.counts, strict=True)
        ]


def _enqueue_waves(arena: Any, copies: np.ndarray, copying: Any, control: SpillControl) -> int:
    """Enqueue ``copies`` in waves of about ``control.wave_bytes``, at most two in flight,
    until done or until the fence stops it; then the drain the fence orders. Returns the number
    of cudaMemcpyAsync calls."""
    n, calls, i = len(copies), 0, 0
    in_flight: list[Any] = []
    while i < n and not control.should_stop():
        j, size = i, 0
        while j < n and (j == i or size < control.wave_bytes):
            size += int(copies[j, 1])
            j += 1
        calls += arena.enqueue_d2h(copies[i:j], copying.cuda_stream)
        wave = torch.cuda.Event()
        wave.record()
        in_flight.append(wave)
        i = j
        if len(in_flight) > 1:  # what is enqueued but not done when the fence comes stays small
            in_flight.pop(0).synchronize()
    if i == n:
        control.finish()
        return calls
    after, rows = control.stop_and_wait(i)
    if len(rows):
        copying.wait_event(after)  # the D2D copies into the spill buffer, on the fenced stream
        calls += arena.enqueue_d2h(rows, copying.cuda_stream)
    return calls


def _launch_crcs(prog: DeviceProgram, fast: list[tuple[Piece, Any, int]]) -> tuple[Any, Any]:
    """The CRC launches of ``prog`` on the current stream, their results copied into pinned
    host memory; returns (host int32 buffer, completion event)."""
    from gpumem.kernels.crc32c import launch_many

    bases = []
    for i in prog.bases:
        p, t, _ = fast[i]
        bases.append(as_bytes(t)[p.src_offset : p.src_offset + p.nbytes])
    device = bases[0].device
    out = torch.zeros(prog.total, dtype=torch.int32, device=device)
    assert prog.crc is not None
    launch_many(prog.crc, bases, out)
    host = torch.empty(prog.total, dtype=torch.int32, pin_memory=device.type == "cuda")
    host.copy_(out, non_blocking=True)
    hashed = torch.cuda.Event(enable_timing=True)
    hashed.record()
    return host, hashed


_CRC_STREAMS: dict[object, object] = {}


def _crc_stream(beside: object) -> Any:
    """The second stream of a copying stream's device (one per device, made once), at high
    priority: its kernels are few and short, and the optimizer step waits for them, so they take
    SMs ahead of the training kernels queued beside them (measured on an H200: at default
    priority they finished only after the whole forward/backward queued before them)."""
    device = getattr(beside, "device", None)
    s = _CRC_STREAMS.get(device)
    if s is None:
        s = _CRC_STREAMS[device] = torch.cuda.Stream(device=device, priority=-1)
    return s


def device_crcs(sources: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """Chunk CRC32Cs of CUDA byte tensors, enqueued on the current stream in one launch (two if
    some are not word-aligned), copied into pinned host memory. Returns a host int32 view per
    source (raw bits: ``& 0xFFFFFFFF``), valid once the current stream has reached this point.
    (For tests and benchmarks; a save goes through ``enqueue``.)"""
    from gpumem.kernels.crc32c import crc32c_many_into

    counts = [-(-s.numel() // chunk) for s in sources]
    starts = np.cumsum([0, *counts]).tolist()
    device = sources[0].device if sources else torch.device("cpu")
    out = torch.zeros(starts[-1], dtype=torch.int32, device=device)
    crc32c_many_into(sources, out, starts[:-1], chunk)
    host = torch.empty(out.numel(), dtype=torch.int32, pin_memory=device.type == "cuda")
    host.copy_(out, non_blocking=True)
    return [host[a : a + n] for a, n in zip(starts, counts, strict=False)]
