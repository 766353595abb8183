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
in https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpumem.profiler.session import Frame, Profile

_HISTORY_ENTRIES = 200_000


class AllocatorProbe:
    """Allocator peaks per interval between hook boundaries on the current CUDA device."""

    @classmethod
    def maybe(cls, device_types: set[str], snapshot: str | None) -> AllocatorProbe | None:
        """A probe when the model lives on a usable CUDA device, else ``None``."""
        if "cuda" not in device_types or not torch.cuda.is_available():
            return None
        from torch._guards import active_fake_mode

        if active_fake_mode() is not None:  # fake CUDA tensors allocate nothing
            return None
        return cls(snapshot)

    def __init__(self, snapshot: str | None) -> None:
        self.device = torch.cuda.current_device()
        self.snapshot = snapshot
        stats = torch.cuda.memory_stats(self.device)
        self.start_allocated = stats.get("allocated_bytes.all.current", 0)
        self.start_reserved = stats.get("reserved_bytes.all.current", 0)
        self.allocated_peak = self.start_allocated
        self.reserved_peak = self.start_reserved
        self.reserved_at_allocated_peak = self.start_reserved
        self.num_alloc_retries = stats.get("num_alloc_retries", 0)
        self.num_ooms = stats.get("num_ooms", 0)
        self.summary: dict[str, Any] = {}
        torch.cuda.reset_peak_memory_stats(self.device)
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)

    def _sample(self) -> tuple[int, int, int, int]:
        """(allocated peak, reserved peak) since the last sample, and the current values."""
        s = torch.cuda.memory_stats(self.device)
        ap, rp = s.get("allocated_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0)
        torch.cuda.reset_peak_memory_stats(self.device)
        if ap > self.allocated_peak:
            self.allocated_peak = ap
            self.reserved_at_allocated_peak = rp
        self.reserved_peak = max(self.reserved_peak, rp)
        return ap, rp, s.get("allocated_bytes.all.current", 0), s.get("reserved_bytes.all.current", 0)

    def boundary(self, prof: Profile, extra: Frame | None = None) -> tuple[int, int]:
        """Close the current interval: every running frame and the current phase see its peak."""
        ap, rp, ac, rc = self._sample()
        frames = [*prof.fwd, *prof.bwd] + ([extra] if extra is not None else [])
        for f in frames:
            if f.alloc is not None:
                f.alloc[2] = max(f.alloc[2], ap)
                f.alloc[3] = max(f.alloc[3], rp)
        phases = prof.steps[-1].allocator.setdefault("phases", {})
        cur = phases.setdefault(prof._phase(), {"allocated_peak": 0, "reserved_peak": 0})
        cur["allocated_peak"] = max(cur["allocated_peak"], ap)
        cur["reserved_peak"] = max(cur["reserved_peak"], rp)
        return ac, rc

    def enter(self, prof: Profile, frame: Frame) -> None:
        ac, rc = self.boundary(prof)
        frame.alloc = [ac, rc, ac, rc]

    def exit(self, prof: Profile, frame: Frame, phase: str) -> None:
        self.boundary(prof, extra=frame)
        if frame.alloc is None:
            return
        layers = prof.steps[-1].allocator.setdefault("layers", {})
        rec = layers.setdefault(
            frame.fqn, {"allocated_peak_delta": 0, "reserved_peak_delta": 0}
        )
        rec["allocated_peak_delta"] = max(rec["allocated_peak_delta"], frame.alloc[2] - frame.alloc[0])
        rec["reserved_peak_delta"] = max(rec["reserved_peak_delta"], frame.alloc[3] - frame.alloc[1])

    def finish(self, prof: Profile, exc: BaseException | None) -> None:
        self.boundary(prof)
        stats = torch.cuda.memory_stats(self.device)
        reserved_now = stats.get("reserved_bytes.all.current", 0)
        outside, source = outside_allocator(self.device, reserved_now)
        self.summary = {
            "device": torch.cuda.get_device_name(self.device),
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "fragmentation_at_peak": max(0, self.reserved_at_allocated_peak - self.allocated_peak),
            "outside_allocator": outside,
            "outside_allocator_source": source,
            "alloc_retries": stats.get("num_alloc_retries", 0) - self.num_alloc_retries,
            "ooms": stats.get("num_ooms", 0) - self.num_ooms,
            "out_of_memory": isinstance(exc, torch.OutOfMemoryError),
            "snapshot": None,
        }
        if self.snapshot:
            try:
                torch.cuda.memory._dump_snapshot(self.snapshot)
                self.summary["snapshot"] = str(self.snapshot)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)


def outside_allocator(device: int, reserved: int) -> tuple[int | None, str]:
    """Bytes this process holds on ``device`` beyond the allocator's reservation.

    NVML's per-process figure when the driver reports it; otherwise the device-wide used memory
    from ``cudaMemGetInfo``, which also includes other processes on the same GPU (labelled).
    """
    from gpumem.device import process_used_bytes

    used = process_used_bytes()
    if len(used) == 1:
        (value,) = used.values()
    else:
        value = used.get(device)
    if value is not None:
        return max(0, value - reserved), "nvml process used - reserved"
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved), "device used (cudaMemGetInfo, all processes) - reserved"
