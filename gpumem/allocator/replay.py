"""Replay a recorded run: ``torch.cuda.memory._snapshot()`` (the dict, or its pickle) after
``torch.cuda.memory._record_memory_history()``, its ``device_traces`` turned into simulator
events.

Each trace entry is a dict with ``action`` and ``addr``/``size``/``stream``:

- ``alloc`` (the bytes asked for) becomes a malloc; ``free_requested`` a free. When its
  ``free_completed`` is not the very next entry of that address, the block was used on other
  streams (``record_stream``): the free is held until that ``free_completed``.
- ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap`` are what the real
  allocator reserved; summed, they give the trace's own reserved peak to compare with. The
  first ``segment_free``/``segment_unmap`` of a run of them also empties the simulated cache
  (``empty_cache()`` and the out-of-memory retry both call ``release_cached_blocks``; the
  garbage collector and ``release_available_cached_blocks`` free less, which this
  over-approximates).
- ``snapshot``, ``oom`` and ``user_defined`` entries are skipped.

A free of an address the trace never allocated (the tensor predates the recording) is
counted in ``unmatched_frees`` and skipped. The settings are ``alloc_conf=`` when given, else
the snapshot's ``allocator_settings`` (the run's own ``PYTORCH_CUDA_ALLOC_CONF``), else none:
never this machine's environment, which is not the recorded run's.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf, resolve
from gpumem.allocator.caching import Event, SimResult, round_size, simulate

_SKIP = frozenset({"snapshot", "oom", "user_defined"})
_SEGMENT = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_RELEASES = ("segment_free", "segment_unmap")
_ACTIONS = ("alloc", "free_requested", "free_completed", *_SEGMENT, *sorted(_SKIP))


@dataclass
class ReplayResult:
    """The simulator's verdict on a recorded trace, beside what the trace itself says."""

    sim: SimResult
    trace_reserved_peak: int
    """Peak of the trace's own segment_alloc/map less segment_free/unmap (from 0 at the first
    entry: the real ``reserved_bytes.all.peak`` when recording began on a fresh allocator)."""
    trace_allocated_peak: int
    """Peak of the trace's allocs less frees, each rounded as ``round_size`` rounds it (the
    real ``allocated_bytes`` is higher by the remainders of blocks handed out unsplit, which a
    trace does not show)."""
    unmatched_frees: int
    entries: int
    device: int
    events: list[Event]


class _PlainUnpickler(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers only: any class or function the pickle
    names (the way a hostile pickle runs code) is refused, never imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"it names {module}.{name}; a memory snapshot holds only plain data, so nothing it "
            "names is loaded"
        )


def load_snapshot(snapshot: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The snapshot dict: given as it is, or read from a pickle file (plain data only:
    ``_PlainUnpickler``)."""
    if isinstance(snapshot, dict):
        return snapshot
    path = Path(snapshot)
    try:
        with path.open("rb") as f:
            obj = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"{path}: not a memory snapshot pickle ({e})") from None
    if not isinstance(obj, dict) or "device_traces" not in obj:
        raise ValueError(
            f"{path}: not a memory snapshot (a dict with 'device_traces', as "
            "torch.cuda.memory._snapshot() returns); was history recorded?"
        )
    return obj


def _field(e: dict[str, Any], key: str, where: str) -> int:
    v = e.get(key)
    if type(v) is not int:
        raise ValueError(f"{where}: {e.get('action')!r} entry needs an integer {key!r}, got {v!r}")
    return v


def snapshot_conf(snap: dict[str, Any]) -> AllocConf:
    """The recorded run's settings, from ``allocator_settings`` (default when absent)."""
    settings = snap.get("allocator_settings") or {}
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF") or settings.get("PYTORCH_ALLOC_CONF") or ""
    if not text:
        return AllocConf()
    return AllocConf.parse(text, source="the snapshot's allocator_settings")


def trace_events(
    snap: dict[str, Any], device: int, conf: AllocConf
) -> tuple[list[Event], int, int, int]:
    """``device``'s trace as events, with the trace's reserved and allocated peaks and its
    unmatched frees."""
    traces = snap.get("device_traces")
    if not isinstance(traces, list) or not 0 <= device < len(traces):
        n = len(traces) if isinstance(traces, list) else 0
        raise ValueError(f"the snapshot has device_traces for {n} device(s), not device {device}")
    trace = traces[device]
    if not isinstance(trace, list):
        raise ValueError(f"device_traces[{device}] is not a list of entries")
    events: list[Event] = []
    live: dict[int, tuple[int, int]] = {}  # addr -> (handle, rounded size)
    held: dict[int, int] = {}  # addr -> handle of a free waiting for its free_completed
    reserved = res_peak = allocated = alloc_peak = unmatched = 0
    skip_next = -1
    prev_action = ""
    for i, e in enumerate(trace):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: a trace entry is a dict, got {type(e).__name__}")
        action = e.get("action")
        if action not in _ACTIONS:
            raise ValueError(
                f"{where}: unknown action {action!r}; the actions are {', '.join(_ACTIONS)}"
            )
        if action in _SKIP or i == skip_next:
            continue
        if action in _SEGMENT:
            sign = _SEGMENT[action]
            reserved += sign * _field(e, "size", where)
            res_peak = max(res_peak, reserved)
            if sign < 0 and prev_action not in _RELEASES:
                # the allocator gave memory back: empty_cache, or the release before a retry
                # (release_cached_blocks is what both do); the simulated cache is emptied too
                events.append(("empty_cache",))
            prev_action = action
            continue
        prev_action = action
        addr = _field(e, "addr", where)
        if action == "alloc":
            size = _field(e, "size", where)
            stream = e.get("stream", 0)
            if type(stream) is not int:
                raise ValueError(f"{where}: 'stream' must be an integer, got {stream!r}")
            h = i
            rounded = round_size(size, conf) if size else 0
            live[addr] = (h, rounded)
            allocated += rounded
            alloc_peak = max(alloc_peak, allocated)
            events.append(("alloc", h, size, stream))
        elif action == "free_requested":
            got = live.pop(addr, None)
            if got is None:
                unmatched += 1
                continue
            h, rounded = got
            allocated -= rounded
            nxt = trace[i + 1] if i + 1 < len(trace) else None
            if (
                isinstance(nxt, dict)
                and nxt.get("action") == "free_completed"
                and nxt.get("addr") == addr
            ):
                skip_next = i + 1
            else:  # used on another stream: held until its free_completed
                events.append(("record_stream", h, -1))
                held[addr] = h
            events.append(("free", h))
        else:  # a free_completed that did not follow its free_requested
            h2 = held.pop(addr, None)
            if h2 is not None:
                events.append(("free_completed", h2))
    return events, res_peak, alloc_peak, unmatched


def replay_snapshot(
    snapshot: str | Path | dict[str, Any],
    alloc_conf: str | AllocConf | None = None,
    *,
    device: int = 0,
    capacity: int | None = None,
    segment_map: bool = True,
) -> ReplayResult:
    """Replay ``snapshot``'s trace of ``device`` through the simulator.

    Example:
        >>> snap = {"device_traces": [[
        ...     {"action": "segment_alloc", "addr": 0, "size": 2097152, "stream": 0},
        ...     {"action": "alloc", "addr": 0, "size": 1000, "stream": 0}]]}
        >>> r = replay_snapshot(snap)
        >>> r.sim.peak_reserved, r.trace_reserved_peak
        (2097152, 2097152)
    """
    snap = load_snapshot(snapshot)
    conf = snapshot_conf(snap) if alloc_conf is None else resolve(alloc_conf)
    events, res_peak, alloc_peak, unmatched = trace_events(snap, device, conf)
    sim = simulate(events, conf, capacity=capacity, record_stream_lag=None, segment_map=segment_map)
    return ReplayResult(
        sim=sim,
        trace_reserved_peak=res_peak,
        trace_allocated_peak=alloc_peak,
        unmatched_frees=unmatched,
        entries=len(snap["device_traces"][device]),
        device=device,
        events=events,
    )


__all__ = ["ReplayResult", "load_snapshot", "replay_snapshot", "snapshot_conf", "trace_events"]
