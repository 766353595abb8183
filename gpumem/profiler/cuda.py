"""CUDA: what the caching allocator and the driver say, beside the exact tensor tracking.

The tracker counts tensor storages (rounded to the allocator's 512-byte blocks). The allocator
knows more: memory it reserved from the driver but has not handed out (fragmentation and cached
blocks), and the driver knows what lives outside the allocator altogether (the CUDA context,
cuBLAS/cuDNN workspaces, NCCL buffers). This module samples ``torch.cuda.memory_stats`` at every
hook boundary (module forward/backward enter and exit, optimizer step), resets the peak counters
there, and so attributes the allocator's allocated and reserved peaks to every module and phase
that was running in each interval. Resolution is therefore the hook boundary: work between two
boundaries (say, the loss computed outside the model) lands in the interval that contains it.

On ``torch.OutOfMemoryError`` the region's report survives; with ``snapshot=path`` the allocator
history (``torch.cuda.memory._record_memory_history``) is dumped to ``path`` on exit, which opens
in https://pytorch.org/memory_viz. The history keeps Python stacks only: C++ frames are
symbolized when the snapshot is dumped, which takes minutes on a real training job.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from gpumem.profiler.fake import is_fake_model

if TYPE_CHECKING:
    from gpumem.profiler.records import Frame, ProbeView

_HISTORY_ENTRIES = 200_000
# torch.OutOfMemoryError is the device-generic name (2.5+); torch.cuda's is the same class
OutOfMemoryError: type[BaseException] = getattr(
    torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError
)


def _stats(device: int) -> dict[str, Any]:
    """The allocator's statistics as a nested dict (``memory_stats`` flattens and sorts the same
    dict in Python, which costs more than the sampling itself)."""
    return torch.cuda.memory_stats_as_nested_dict(device)


def _stat(stats: dict[str, Any], name: str, kind: str) -> int:
    return int(stats.get(name, {}).get("all", {}).get(kind, 0))


class AllocatorProbe:
    """Allocator peaks per interval between hook boundaries on the model's CUDA device."""

    @classmethod
    def maybe(
        cls, model: torch.nn.Module, device_types: set[str], snapshot: str | None
    ) -> AllocatorProbe | None:
        """A probe when the model lives on a usable CUDA device, else ``None``."""
        if "cuda" not in device_types or not torch.cuda.is_available():
            return None
        from torch._guards import active_fake_mode

        if active_fake_mode() is not None or is_fake_model(model):  # fake tensors allocate nothing
            return None
        device = next(
            (t.device for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"),
            torch.device("cuda", torch.cuda.current_device()),
        )
        return cls(
            device.index if device.index is not None else torch.cuda.current_device(), snapshot
        )

    def __init__(self, device: int, snapshot: str | None) -> None:
        self.device = device
        self.snapshot = snapshot
        stats = _stats(device)
        self.start_allocated = _stat(stats, "allocated_bytes", "current")
        self.start_reserved = _stat(stats, "reserved_bytes", "current")
        self.allocated_peak = self.start_allocated
        self.reserved_peak = self.start_reserved
        self.reserved_at_allocated_peak = self.start_reserved
        self.num_alloc_retries = int(stats.get("num_alloc_retries", 0))
        self.num_ooms = int(stats.get("num_ooms", 0))
        self.last = (self.start_allocated, self.start_reserved)  # current values at last sample
        self.summary: dict[str, Any] = {}
        torch.cuda.reset_peak_memory_stats(device)
        if snapshot:
            torch.cuda.memory._record_memory_history(
                "all", context="all", stacks="python", max_entries=_HISTORY_ENTRIES
            )

    def close(self) -> None:
        """Stop recording the allocator history (the region failed to start)."""
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _sample(self) -> tuple[int, int, int, int]:
        """(allocated peak, reserved peak) since the last sample, and the current values."""
        s = _stats(self.device)
        ap, rp = _stat(s, "allocated_bytes", "peak"), _stat(s, "reserved_bytes", "peak")
        ac, rc = _stat(s, "allocated_bytes", "current"), _stat(s, "reserved_bytes", "current")
        torch.cuda.reset_peak_memory_stats(self.device)
        if ap > self.allocated_peak:
            self.allocated_peak = ap
            self.reserved_at_allocated_peak = rp
        self.reserved_peak = max(self.reserved_peak, rp)
        self.last = (ac, rc)
        return ap, rp, ac, rc

    def boundary(self, view: ProbeView, extra: Frame | None = None) -> tuple[int, int, int]:
        """Close the current interval: every running frame and the current phase see its peak.

        Returns the interval's allocated peak and the current allocated and reserved bytes."""
        ap, rp, ac, rc = self._sample()
        frames = view.frames + ([extra] if extra is not None else [])
        for f in frames:
            if f.alloc is not None:
                f.alloc[2] = max(f.alloc[2], ap)
                f.alloc[3] = max(f.alloc[3], rp)
        phases = view.step.allocator.setdefault("phases", {})
        cur = phases.setdefault(view.phase, {"allocated_peak": 0, "reserved_peak": 0})
        cur["allocated_peak"] = max(cur["allocated_peak"], ap)
        cur["reserved_peak"] = max(cur["reserved_peak"], rp)
        return ap, ac, rc

    def interval(self, view: ProbeView) -> tuple[int, int]:
        """Light mode: close the interval; (its allocated peak, allocated bytes now)."""
        ap, ac, _ = self.boundary(view)
        return ap, ac

    def enter(self, view: ProbeView, frame: Frame, sample: bool = True) -> None:
        """A module call starts; ``sample=False`` when a boundary was just taken (light mode)."""
        ac, rc = self.boundary(view)[1:] if sample else self.last
        frame.alloc = [ac, rc, ac, rc]

    def exit(self, view: ProbeView, frame: Frame, sample: bool = True) -> None:
        """A module call ends: its allocator peak above the level at entry."""
        if sample:
            self.boundary(view, extra=frame)
        if frame.alloc is None:
            return
        layers = view.step.allocator.setdefault("layers", {})
        rec = layers.setdefault(frame.fqn, {"allocated_peak_delta": 0, "reserved_peak_delta": 0})
        rec["allocated_peak_delta"] = max(
            rec["allocated_peak_delta"], frame.alloc[2] - frame.alloc[0]
        )
        rec["reserved_peak_delta"] = max(
            rec["reserved_peak_delta"], frame.alloc[3] - frame.alloc[1]
        )

    def finish(self, view: ProbeView, exc: BaseException | None) -> None:
        """The region's summary. Never raises: it runs in ``__exit__``, where an error here would
        replace the exception the region is propagating (an OOM) and lose the report."""
        self.boundary(view)
        stats = _stats(self.device)
        reserved_now = _stat(stats, "reserved_bytes", "current")
        try:
            outside, source = outside_allocator(self.device, reserved_now)
        except Exception as e:
            outside, source = None, f"unavailable ({type(e).__name__}: {e})"
        self.summary = {
            "device": torch.cuda.get_device_name(self.device),
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "fragmentation_at_peak": max(0, self.reserved_at_allocated_peak - self.allocated_peak),
            "outside_allocator": outside,
            "outside_allocator_source": source,
            "alloc_retries": int(stats.get("num_alloc_retries", 0)) - self.num_alloc_retries,
            "ooms": int(stats.get("num_ooms", 0)) - self.num_ooms,
            "out_of_memory": isinstance(exc, OutOfMemoryError),
            "snapshot": None,
            "snapshot_error": None,
        }
        if self.snapshot:
            try:
                torch.cuda.memory._dump_snapshot(str(self.snapshot))
                self.summary["snapshot"] = str(self.snapshot)
            except Exception as e:
                self.summary["snapshot_error"] = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"gpumem.profile: the memory snapshot could not be written to "
                    f"{self.snapshot}: {self.summary['snapshot_error']}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)


def _nvml_index(device: int) -> int | None:
    """NVML's index of torch's CUDA ``device`` (they differ under CUDA_VISIBLE_DEVICES), by
    UUID; ``None`` when it cannot be matched."""
    from gpumem.device import query

    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "")).removeprefix("GPU-")
    if not uuid:
        return None
    for gpu in query().gpus:
        if gpu.uuid.removeprefix("GPU-") == uuid:
            return gpu.index
    return None


def outside_allocator(device: int, reserved: int) -> tuple[int | None, str]:
    """Bytes this process holds on ``device`` beyond the allocator's reservation.

    NVML's per-process figure when the driver reports it; otherwise the device-wide used memory
    from ``cudaMemGetInfo``, which also includes other processes on the same GPU (labelled).
    NVML finds no entry for this process when the container's PID namespace hides its host PID,
    and some drivers (vGPU, MIG, WDDM) report no or partial usage: a figure below the
    allocator's own reservation cannot be the process's total and is not used.
    """
    from gpumem.device import NVML_PROCESS_SOURCE, process_used_bytes

    used = process_used_bytes()
    value = None
    if len(used) == 1:
        (value,) = used.values()
    elif used:
        index = _nvml_index(device)
        value = used.get(index) if index is not None else None
    if value is not None and value >= reserved:
        return value - reserved, NVML_PROCESS_SOURCE
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved), "device used (cudaMemGetInfo, all processes) - reserved"
