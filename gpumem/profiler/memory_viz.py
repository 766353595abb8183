"""The profile as PyTorch's memory snapshot, for https://pytorch.org/memory_viz.

What it contains: the profile's timeline (live tensor bytes, sampled after every op in exact
mode, at hook boundaries in light mode) replayed as allocation events on one device trace. Each
rise of the live total is one synthetic block, labelled with its step and phase (the frame
names); each fall frees the most recent blocks (splitting the last one where the fall is
smaller). The "Active Memory Timeline" view therefore shows the same curve as ``Report.plot``,
coloured by step and phase, to the byte. It does *not* contain the real allocations: addresses
are synthetic, no Python stacks, no allocator caching (the profiler counts tensor storages, not
the CUDA allocator's blocks; on CUDA, ``gpumem.profile(snapshot=...)`` keeps the allocator's own
snapshot of an out-of-memory error). Its one segment is synthetic too: as large as the peak,
holding at the end the blocks still alive and one free block, so that torch's
``python -m torch.cuda._memory_viz stats`` and ``trace_plot`` read the file.

The file is a pickle of plain dicts, lists, ints and strings, as memory_viz expects.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Protocol

from gpumem.profiler.categories import PHASES


class TimelineLike(Protocol):
    """What the snapshot reads of a report: its timeline. Typed by shape rather than by import:
    ``Report.to_memory_snapshot`` calls into this module, which must not import ``report`` back."""

    timeline: dict[str, list[int]]


_BASE = 1 << 32  # synthetic addresses start here; blocks are laid out without gaps


def memory_snapshot(rep: TimelineLike) -> dict[str, Any]:
    """``{"segments": [...], "device_traces": [[event, ...]]}`` from ``rep.timeline``.

    Raises:
        ValueError: the profile kept no timeline (``gpumem.profile(..., timeline=False)``).
    """
    tl = rep.timeline
    if not tl.get("t_ns"):
        raise ValueError(
            "this profile has no timeline to export; profile with timeline=True (the default)"
        )
    events: list[dict[str, Any]] = []
    live: list[list[Any]] = []  # [addr, size, frames] of the blocks alive, oldest first
    top = _BASE
    prev = 0

    def event(action: str, addr: int, size: int, frames: list, t_ns: int) -> None:
        events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "frames": frames,
                "time_us": t_ns // 1000,
            }
        )

    for t, level, phase, step in zip(tl["t_ns"], tl["bytes"], tl["phase"], tl["step"], strict=True):
        delta = level - prev
        prev = level
        if delta > 0:
            frames = [{"filename": "gpumem", "line": step, "name": f"step {step} {PHASES[phase]}"}]
            live.append([top, delta, frames])
            event("alloc", top, delta, frames, t)
            top += delta
        while delta < 0 and live:
            addr, size, frames = live.pop()
            for action in ("free_requested", "free_completed"):
                event(action, addr, size, frames, t)
            top -= size
            delta += size
            if delta > 0:  # the fall ended inside this block: its lower part stays alive
                live.append([addr, delta, frames])
                event("alloc", addr, delta, frames, t)
                top += delta
                delta = 0
    return {"segments": [_segment(live, max(tl["bytes"]))], "device_traces": [events]}


def _segment(live: list[list[Any]], peak: int) -> dict[str, Any]:
    """One segment as large as the peak, in its state at the end of the trace: the blocks still
    alive (laid out from ``_BASE`` without gaps), then one free block. Its blocks sum to its
    size, which ``torch.cuda._memory_viz stats`` checks."""
    blocks = [
        {
            "address": addr,
            "size": size,
            "requested_size": size,
            "state": "active_allocated",
            "frames": frames,
        }
        for addr, size, frames in live
    ]
    used = sum(b["size"] for b in blocks)
    if peak > used:
        blocks.append(
            {
                "address": _BASE + used,
                "size": peak - used,
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            }
        )
    return {
        "device": 0,
        "address": _BASE,
        "total_size": peak,
        "allocated_size": used,
        "active_size": used,
        "requested_size": used,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }


def write_memory_snapshot(rep: TimelineLike, path: Path) -> Path:
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(rep), f)
    return path
