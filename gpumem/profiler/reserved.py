"""What the caching allocator would reserve for a profiled region: the storages' allocations and
frees, in order, replayed through ``gpumem.allocator``'s simulator.

The tracker logs every storage it counts (exact mode only: light mode misses the temporaries);
the storages alive at entry (weights, gradients, optimizer state) come first, in the order they
were registered, since when they were really allocated is not known. Every event is on one
stream (the profiler does not see streams). On any device, fake mode included: the figures are
what a CUDA device would reserve for the same storages.
"""

from __future__ import annotations

from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.allocator.caching import Event, simulate


def log_events(log: list[tuple[int, int, str]]) -> list[Event]:
    """The tracker's log as simulator events: the CUDA storages when there are any (a run
    that also holds CPU tensors reserves device memory only for those), else every storage."""
    on_cuda = any(dev == "cuda" for _, n, dev in log if n >= 0)
    live: set[int] = set()
    out: list[Event] = []
    for hid, n, dev in log:
        if n >= 0:
            if n > 0 and (dev == "cuda" or not on_cuda):
                live.add(hid)
                out.append(("alloc", hid, n))
        elif hid in live:
            live.remove(hid)
            out.append(("free", hid))
    return out


def simulated_reserved(log: list[tuple[int, int, str]], conf: AllocConf) -> dict[str, Any]:
    """The simulator's figures for ``log`` (bytes): peak reserved and allocated, fragmentation
    (reserved less allocated) and the largest cached block at the peak, the segments then."""
    events = log_events(log)
    r = simulate(events, conf, segment_map=True)
    segs = r.segments_at_peak or []
    return {
        "peak_reserved_bytes": r.peak_reserved,
        "peak_allocated_bytes": r.peak_allocated,
        "fragmentation_bytes": r.fragmentation,
        "largest_free_block_bytes": r.largest_free_at_peak,
        "segments_at_peak": len(segs),
        "small_segments_at_peak": sum(1 for s in segs if s.pool == "small"),
        "reserved_at_end_bytes": r.reserved_at_end,
        "events": len(events),
        "alloc_conf": conf.text,
    }


__all__ = ["log_events", "simulated_reserved"]
