"""PyTorch's CUDA caching allocator, simulated on the CPU: what a run *reserves*, not only what
its tensors hold (rounding, 2 MiB / 20 MiB segments, splitting, fragmentation).

    from gpumem.allocator import simulate
    events = [("alloc", 0, 3 << 20), ("alloc", 1, 5000), ("free", 0)]
    r = simulate(events, "expandable_segments:True")
    r.peak_reserved, r.peak_allocated, r.fragmentation, r.largest_free_at_peak

Feeding it: events are plain tuples, ``("alloc", handle, nbytes[, stream])`` and ``("free",
handle)`` (plus ``record_stream``, ``free_completed``, ``synchronize``, ``empty_cache``), sizes as
asked for (``storage.nbytes()``): the simulator rounds. An estimator builds one layer's events
once with a ``Trace`` and stamps them per layer (``Trace.extend(layer, times=n)``, handles
renumbered per copy, the offsets returned so a backward trace can free a forward copy's
tensors); a planner shares a prefix with ``CachingAllocatorSim.fork()`` and
``simulate(..., sim=fork)``; ``segment_map=False`` halves the cost when only the figures matter.

Modules:

    alloc_conf ``PYTORCH_CUDA_ALLOC_CONF`` parsed (``AllocConf``; errors name the option)
    caching   the simulator (``CachingAllocatorSim``, ``simulate``), rule by rule after the C++
    compiled  its plain case compiled (``gpumem._C.PlainSim``): what the estimator's traces run on
    trace     building event lists cheaply (``Trace``): what the profiler and an estimator feed
    replay    a ``torch.cuda.memory._snapshot()``'s ``device_traces`` replayed through it
"""

from __future__ import annotations

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.allocator.caching import (
    CachingAllocatorSim,
    OutOfMemory,
    SegmentInfo,
    SimResult,
    get_allocation_size,
    round_size,
    simulate,
)
from gpumem.allocator.replay import ReplayResult, replay_snapshot
from gpumem.allocator.trace import Trace

__all__ = [
    "AllocConf",
    "CachingAllocatorSim",
    "OutOfMemory",
    "ReplayResult",
    "SegmentInfo",
    "SimResult",
    "Trace",
    "get_allocation_size",
    "replay_snapshot",
    "round_size",
    "simulate",
]
