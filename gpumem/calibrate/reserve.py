"""The GPU memory a job cannot use for tensors: measured on this machine, or read from a profile.

Two sources, each honest about what it covers:

* :func:`measure_gpu_reserve` (this process, CUDA): the *context bytes* = device memory NVML
  attributes to this process minus what PyTorch's caching allocator has reserved, right after
  CUDA initialisation and one fp32 and one bf16 cuBLAS matmul. That covers the CUDA context
  (driver state, the kernels loaded so far under lazy module loading) and the cuBLAS / cuBLASLt
  handles. It does *not* cover the cuBLAS workspace, which PyTorch allocates through its caching
  allocator (so it is inside ``reserved``), nor cuDNN, NCCL, or kernels the job loads later. Also
  the pinned host-to-device and device-to-host bandwidth (``gpumem doctor``'s probe).
* :func:`from_report` (a ``gpumem.profile`` report of the user's own training step on CUDA, the
  most honest source): fragmentation = (reserved - allocated) / allocated at the allocated peak,
  and the memory outside the allocator at the end of the region (context, library workspaces
  and, in a distributed run, NCCL buffers).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpumem.calibrate._schema import CalibrationError, Fields
from gpumem.device import NVML_PROCESS_SOURCE

_MATMUL = 1024  # square matmul side: enough to create the cuBLAS handles and pick kernels


@dataclass(frozen=True)
class GpuReserve:
    """What :func:`measure_gpu_reserve` found on one CUDA device.

    Attributes:
        device_name: ``torch.cuda.get_device_name``.
        total_bytes: the device's total memory (``cudaMemGetInfo``).
        context_bytes: memory outside the caching allocator (see the module docs for what is in).
        context_source: how it was measured (NVML per process, or device-wide used memory, which
            also counts other processes on the same GPU).
        reserved_bytes: the allocator's reservation it was subtracted from.
        d2h_gb_per_s / h2d_gb_per_s: pinned copies, decimal GB/s (None when the probe failed).
        notes: what went wrong in the bandwidth probe, if anything.
    """

    device_name: str
    total_bytes: int
    context_bytes: int
    context_source: str
    reserved_bytes: int
    d2h_gb_per_s: float | None
    h2d_gb_per_s: float | None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes)}

    @classmethod
    def from_fields(cls, f: Fields) -> GpuReserve:
        notes = tuple(_note(v, f, i) for i, v in enumerate(f.list("notes", 64)))
        out = cls(
            device_name=f.str("device_name"),
            total_bytes=f.int("total_bytes", minimum=1),
            context_bytes=f.int("context_bytes"),
            context_source=f.str("context_source"),
            reserved_bytes=f.int("reserved_bytes"),
            d2h_gb_per_s=f.float("d2h_gb_per_s", optional=True),
            h2d_gb_per_s=f.float("h2d_gb_per_s", optional=True),
            notes=notes,
        )
        f.done()
        return out


@dataclass(frozen=True)
class ReportReserve:
    """The allocator's view of the user's own training step (a CUDA ``gpumem.profile`` report).

    Attributes:
        device: the GPU the step ran on.
        allocated_peak_bytes / reserved_peak_bytes: the allocator's peaks in the region.
        fragmentation_bytes: reserved minus allocated at the allocated peak.
        fragmentation: ``fragmentation_bytes / allocated_peak_bytes``.
        outside_allocator_bytes: device memory of the process beyond the allocator's reservation
            (None where it could not be read).
        outside_allocator_source: how (NVML per process, or device-wide used memory).
        world_size: ranks of the profiled job (None: not distributed); with more than one, the
            outside bytes include NCCL buffers.
    """

    device: str
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    fragmentation_bytes: int
    fragmentation: float
    outside_allocator_bytes: int | None
    outside_allocator_source: str
    world_size: int | None

    @property
    def context_bytes(self) -> int | None:
        """The outside-allocator bytes when they measure one process's context and libraries
        alone: per-process NVML figure of a single-process run; else None."""
        single = self.world_size is None or self.world_size <= 1
        if single and self.outside_allocator_source == NVML_PROCESS_SOURCE:
            return self.outside_allocator_bytes
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_fields(cls, f: Fields) -> ReportReserve:
        out = cls(
            device=f.str("device"),
            allocated_peak_bytes=f.int("allocated_peak_bytes", minimum=1),
            reserved_peak_bytes=f.int("reserved_peak_bytes"),
            fragmentation_bytes=f.int("fragmentation_bytes"),
            fragmentation=f.float("fragmentation"),
            outside_allocator_bytes=f.int("outside_allocator_bytes", optional=True),
            outside_allocator_source=f.str("outside_allocator_source"),
            world_size=f.int("world_size", minimum=1, optional=True),
        )
        f.done()
        if out.fragmentation > 100:
            raise CalibrationError(
                f"{f.where}.fragmentation: {out.fragmentation} (over 100x the allocated peak) "
                "is not plausible; profile the training step again"
            )
        return out


def _note(v: Any, f: Fields, i: int) -> str:
    if not isinstance(v, str) or len(v) > 4096:
        raise CalibrationError(
            f"{f.path('notes')}[{i}]: expected a string; re-run `gpumem calibrate`"
        )
    return v


def measure_gpu_reserve(device: int | None = None, nbytes: int = 256 << 20) -> GpuReserve:
    """Measure the context bytes and pinned copy bandwidth of a CUDA device in this process.

    Call it before the process does other CUDA work: whatever it has already loaded or
    allocated outside the caching allocator is counted too.

    Args:
        device: CUDA device index (default: the current one).
        nbytes: bytes per pinned copy in the bandwidth probe.

    Raises:
        CalibrationError: no CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise CalibrationError(
            "measuring the GPU reserve needs a CUDA device and torch sees none; "
            "run `gpumem calibrate --device cuda` on the GPU machine"
        )
    from gpumem.doctor import gpu_bandwidth
    from gpumem.profiler.cuda import outside_allocator

    dev = torch.cuda.current_device() if device is None else int(device)
    with torch.cuda.device(dev):
        torch.cuda.init()
        a = torch.randn(_MATMUL, _MATMUL, device=dev)
        (a @ a).sum().item()  # creates the cuBLAS(Lt) handles; .item() synchronises
        if torch.cuda.is_bf16_supported():
            b = a.to(torch.bfloat16)
            (b @ b).float().sum().item()
        torch.cuda.synchronize(dev)
        reserved = int(torch.cuda.memory_reserved(dev))
        context, source = outside_allocator(dev, reserved)
        total = int(torch.cuda.mem_get_info(dev)[1])
        name = torch.cuda.get_device_name(dev)
    if context is None:
        raise CalibrationError(f"could not read the memory of this process on GPU {dev} ({source})")
    problems: list[str] = []
    rates = {
        b.what: b.gb_per_s for b in gpu_bandwidth(nbytes, problems, dev)
    }  # gpumem doctor's probe
    notes = list(problems)
    return GpuReserve(
        device_name=name,
        total_bytes=total,
        context_bytes=int(context),
        context_source=source,
        reserved_bytes=reserved,
        d2h_gb_per_s=rates.get("GPU device-to-host (pinned)"),
        h2d_gb_per_s=rates.get("GPU host-to-device (pinned)"),
        notes=tuple(notes),
    )


def from_report(report: Any) -> ReportReserve:
    """Fragmentation and memory outside the allocator from a CUDA ``gpumem.profile`` report.

    Args:
        report: a ``gpumem.profiler.report.Report``, its ``to_dict()``, or the path of the JSON
            it wrote (``rep.to_json(path)``, ``gpumem profile ... --json FILE``). JSON is read
            as plain data; nothing in it runs.

    Raises:
        CalibrationError: the report has no allocator data (it did not run on CUDA), or its
            numbers are unusable.
    """
    where = "report"
    if isinstance(report, (str, os.PathLike)):
        where = str(report)
        try:
            data = json.loads(Path(report).read_text())
        except (OSError, ValueError) as exc:
            raise CalibrationError(f"{where}: cannot read a profile JSON: {exc}") from None
    elif isinstance(report, dict):
        data = report
    else:
        data = {k: getattr(report, k, None) for k in ("allocator", "device", "world_size")}
    if not isinstance(data, dict):
        raise CalibrationError(f"{where}: expected a profile report (a JSON object)")
    alloc = data.get("allocator")
    if not alloc:
        raise CalibrationError(
            f"{where}: no CUDA allocator data (device {data.get('device')!r}); "
            "fragmentation is measured only by profiling the training step on "
            "a CUDA device: gpumem.profile(model, optimizer) around it, there"
        )
    f = Fields(alloc, f"{where}.allocator")
    peak = f.int("allocated_peak", minimum=0)
    assert peak is not None
    if peak <= 0:
        raise CalibrationError(
            f"{f.path('allocated_peak')}: 0 bytes: the profiled region allocated nothing"
        )
    frag = f.int("fragmentation_at_peak")
    assert frag is not None
    outside = alloc.get("outside_allocator")
    world = data.get("world_size")
    return ReportReserve(
        device=str(alloc.get("device") or data.get("device") or "cuda"),
        allocated_peak_bytes=peak,
        reserved_peak_bytes=f.int("reserved_peak") or 0,
        fragmentation_bytes=frag,
        fragmentation=frag / peak,
        outside_allocator_bytes=None if outside is None else f.int("outside_allocator"),
        outside_allocator_source=str(alloc.get("outside_allocator_source") or "unknown"),
        world_size=world
        if isinstance(world, int) and not isinstance(world, bool) and world >= 1
        else None,
    )
