"""The simulator's plain case compiled (``gpumem._C.PlainSim``, csrc/alloc_sim.cpp): what the
estimator's step traces and the planner's candidates run on, some 30x faster than
``CachingAllocatorSim``, which stays the reference (tests/allocator/test_compiled.py checks the
two event by event).

Plain means no expandable segments, no capacity (so no garbage collection, release-and-retry or
out-of-memory) and no ``record_stream``: the estimator's traces, simulated with ample memory.
Everything else in the settings is simulated (``max_split_size_mb``,
``max_non_split_rounding_mb``, ``roundup_power2_divisions``, ``large_segment_size_mb``).
``plain_sim`` returns ``None`` where the Python simulator must run instead: expandable segments,
the native core not built, or ``GPUMEM_PY_ALLOCATOR=1``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from gpumem._env import env_flag
from gpumem.allocator.alloc_conf import SIZE_MAX, AllocConf
from gpumem.allocator.caching import BlockInfo, SegmentInfo

_INT64_MAX = 2**63 - 1


@functools.cache
def _native() -> Any:
    try:  # by name: `from gpumem import _C` would be an import of the package above
        native = importlib.import_module("gpumem._C")
    except ImportError:  # not built: the Python simulator does the work, slower
        return None
    return native if hasattr(native, "alloc_sim") else None


def plain_sim(conf: AllocConf) -> Any:
    """A fresh ``gpumem._C.PlainSim`` for ``conf``, or ``None`` (see the module)."""
    if conf.expandable_segments or env_flag("GPUMEM_PY_ALLOCATOR"):
        return None
    native = _native()
    if native is None:
        return None
    ms = _INT64_MAX if conf.max_split_size >= SIZE_MAX else conf.max_split_size
    return native.alloc_sim(
        ms,
        conf.max_non_split_rounding_size,
        conf.large_segment_size,
        list(conf.roundup_power2_divisions),
    )


def compiled_segments(sim: Any) -> list[SegmentInfo]:
    """A ``PlainSim``'s segment map as ``CachingAllocatorSim.segments`` gives it."""
    return [
        SegmentInfo(
            address=address,
            size=size,
            stream=stream,
            pool="small" if small else "large",
            expandable=False,
            blocks=tuple(BlockInfo(b[0], bool(b[1]), b[2]) for b in blocks),
        )
        for address, size, stream, small, blocks in sim.segments()
    ]


__all__ = ["compiled_segments", "plain_sim"]
