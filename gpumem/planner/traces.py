"""Spot-capacity traces read from files: when a source of GPUs could be had, tick by tick.

Every format becomes one :class:`CapacityTrace`: a tick length ``gap_s`` and, per tick, whether
a job of ``nodes`` nodes could *not* run during it (``unavailable``), with an optional price per
tick.
Formats (the file is untrusted input: every problem is a :class:`TraceError`, one line naming
the file and the field):

* JSON, the format of the Can't Be Late traces (Wu et al., NSDI 2024) and of
  ``shared/data/spot-traces``: ``{"metadata": {"gap_seconds": 600}, "data": [0, 1, ...]}`` with
  **1 = not available** (the paper's simulator convention), optionally ``"prices": [...]`` in
  dollars per GPU-hour, one per tick. One instance type's 0/1: a job of N instances is taken to
  get all N or none.
* CSV of samples, with a header that says what the value means (0/1 is ambiguous, so a header
  is required): ``t_s,available`` (1 = can run), ``t_s,unavailable`` (1 = cannot, as the JSON),
  or ``t_s,nodes`` (a count of nodes); ``t_ms`` instead of ``t_s`` for milliseconds. Each value
  holds until the next sample; the last for one median spacing.
* CSV of events ``t_ms,add|remove,node`` (Bamboo's traces, NSDI 2023, headerless and in
  milliseconds; a header ``t_s,event,node`` switches to seconds).

Resampling to ticks is pessimistic: a tick during any part of which the job could not run is
unavailable. A job of N nodes is preempted when any of *its* nodes is: with events the replay
knows which nodes it holds (it takes the longest-standing N); with counts it does not, and every
drop in the count while the job runs is taken as hitting it (an upper bound on preemptions).
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpumem import _strict_json

MAX_TRACE_BYTES = 64 << 20
DEFAULT_EVENT_GAP_S = 60.0


class TraceError(ValueError):
    """A trace file that cannot be read as a capacity trace (the message names file and field)."""


@dataclass(frozen=True)
class CapacityTrace:
    """Tick-by-tick capacity: ``unavailable[k]`` is True when the job cannot run in tick k.

    Attributes:
        source: where it came from (a path), for messages.
        gap_s: seconds per tick.
        unavailable: bool array, one per tick.
        prices: dollars per GPU-hour per tick, or None (the capacity's constant price).
        nodes: the job size the availability is for.
        notes: assumptions the reader should know (how counts were read, ...).
    """

    source: str
    gap_s: float
    unavailable: np.ndarray
    prices: np.ndarray | None = None
    nodes: int = 1
    notes: tuple[str, ...] = ()

    @property
    def ticks(self) -> int:
        return len(self.unavailable)

    @property
    def hours(self) -> float:
        return self.ticks * self.gap_s / 3600.0


def load_trace(
    path: str | os.PathLike[str], *, nodes: int = 1, gap_s: float | None = None
) -> CapacityTrace:
    """Read a trace file (module doc) for a job of ``nodes`` nodes.

    Args:
        gap_s: tick length for CSV traces (default: the median sample spacing, or 60 s for
            events); a JSON trace states its own.

    Raises:
        TraceError: unreadable file, unknown format, no ticks, a gap of 0, bad values.
    """
    name = str(path)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise TraceError(f"{name}: nodes must be a whole number >= 1, got {nodes!r}")
    if gap_s is not None and not (gap_s > 0 and math.isfinite(gap_s)):
        raise TraceError(f"{name}: the tick gap must be a positive number of seconds, got {gap_s}")
    text = _read(Path(path), name)
    if text.lstrip().startswith("{"):
        return _from_json(text, name, nodes)
    if name.endswith(".json"):
        raise TraceError(f"{name}: not a JSON object (expected {{'metadata': ..., 'data': ...}})")
    return _from_csv(text, name, nodes, gap_s)


def _read(path: Path, name: str) -> str:
    try:
        if not path.is_file():
            raise TraceError(f"{name}: no such trace file (give a .json or .csv trace)")
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{name}: {size} bytes is larger than a trace may be (64 MiB)")
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{name}: cannot read the trace ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{name}: not a text file (expected a JSON or CSV trace)") from None


def _from_json(text: str, name: str, nodes: int) -> CapacityTrace:
    try:
        doc = _strict_json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{name}: invalid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise TraceError(f"{name}: expected an object with 'metadata' and 'data'")
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or "gap_seconds" not in meta:
        raise TraceError(f"{name}: metadata.gap_seconds is missing (seconds per tick)")
    gap = _positive_number(meta["gap_seconds"], f"{name}: metadata.gap_seconds")
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise TraceError(f"{name}: data must be a non-empty list of 0/1 (1 = not available)")
    if any(isinstance(v, bool) or v not in (0, 1) for v in data):
        bad = next(v for v in data if isinstance(v, bool) or v not in (0, 1))
        raise TraceError(f"{name}: data holds {bad!r}; expected 0 (available) or 1 (not available)")
    prices = None
    if "prices" in doc:
        prices = _prices(doc["prices"], len(data), name)
    notes = ()
    if nodes > 1:
        notes = (f"{name} is one instance type's 0/1: the {nodes} nodes are taken together",)
    return CapacityTrace(name, gap, np.asarray(data, dtype=bool), prices, nodes, notes)


def _positive_number(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise TraceError(f"{what} must be a positive number of seconds, got {v!r}")
    return float(v)


def _prices(v: object, n: int, name: str) -> np.ndarray:
    if not isinstance(v, list) or len(v) != n:
        raise TraceError(f"{name}: prices must be a list with one price per tick ({n})")
    for p in v:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 <= p < math.inf):
            raise TraceError(f"{name}: prices holds {p!r}; expected dollars per GPU-hour >= 0")
    return np.asarray(v, dtype=np.float64)


_SAMPLE_KINDS = ("available", "unavailable", "nodes")


def _from_csv(text: str, name: str, nodes: int, gap_s: float | None) -> CapacityTrace:
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    rows = [[c.strip() for c in r] for r in rows if not r[0].lstrip().startswith("#")]
    if not rows:
        raise TraceError(f"{name}: no rows (a trace needs at least one tick)")
    head = [c.lower() for c in rows[0]]
    has_header = not _is_number(head[0])
    scale = 1e-3 if (not has_header or head[0] in ("t_ms", "time_ms")) else 1.0
    if has_header and head[0] not in ("t_s", "t_ms", "time", "time_s", "time_ms"):
        first = ",".join(rows[0])
        raise TraceError(
            f"{name}: unknown format: not a JSON trace, and its first line {first[:40]!r} is not "
            "a CSV header starting with t_s or t_ms"
        )
    body = rows[1:] if has_header else rows
    if not body:
        raise TraceError(f"{name}: no rows after the header (a trace needs at least one tick)")
    width = len(body[0])
    if width == 3 and body[0][1].lower() in ("add", "remove"):
        return _from_events(body, name, nodes, scale, gap_s or DEFAULT_EVENT_GAP_S)
    if width != 2:
        raise TraceError(
            f"{name}: unknown format: expected 't,value' samples or 't_ms,add|remove,node' "
            f"events, got {width} columns"
        )
    kind = head[1] if has_header else ""
    if kind not in _SAMPLE_KINDS:
        raise TraceError(
            f"{name}: say what the second column is in a header: t_s,available (1 = can run), "
            "t_s,unavailable (1 = cannot) or t_s,nodes (a count)"
        )
    times = _times(body, name, scale)
    values = [_number(r[1], name, i + 1 + has_header) for i, r in enumerate(body)]
    return _from_samples(times, values, kind, name, nodes, gap_s)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _number(s: str, name: str, line: int) -> float:
    try:
        v = float(s)
    except ValueError:
        raise TraceError(f"{name}: line {line}: {s!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise TraceError(f"{name}: line {line}: {s!r} must be a finite number >= 0")
    return v


def _times(body: list[list[str]], name: str, scale: float) -> np.ndarray:
    t = np.array([_number(r[0], name, i + 1) for i, r in enumerate(body)]) * scale
    if np.any(np.diff(t) < 0):
        i = int(np.argmax(np.diff(t) < 0)) + 2
        raise TraceError(f"{name}: line {i}: times must not go backwards")
    return t


def _from_samples(
    t: np.ndarray, v: list[float], kind: str, name: str, nodes: int, gap_s: float | None
) -> CapacityTrace:
    vals = np.asarray(v)
    if kind != "nodes" and np.any((vals != 0) & (vals != 1)):
        raise TraceError(f"{name}: the {kind} column must hold 0 or 1")
    steps = np.diff(t)
    spacing = float(np.median(steps[steps > 0])) if np.any(steps > 0) else 0.0
    gap = gap_s if gap_s is not None else spacing
    if not gap > 0:
        raise TraceError(f"{name}: a gap of 0: give at least two distinct times or --gap")
    end = t[-1] + (spacing if spacing > 0 else gap)
    if kind == "available":
        down = vals == 0
    elif kind == "unavailable":
        down = vals == 1
    else:
        down = vals < nodes
    ticks = _tick_marks(t, end, down, gap)
    notes: tuple[str, ...] = ()
    if kind == "nodes":
        drops = np.concatenate([[False], np.diff(vals) < 0])
        _mark_points(ticks, t, t[drops], gap)  # a drop is taken as one of the job's nodes
        notes = (f"{name}: counts do not say which nodes left; every drop is taken as the job's",)
    return CapacityTrace(name, float(gap), ticks, None, nodes, notes)


def _mark_points(ticks: np.ndarray, t: np.ndarray, at: np.ndarray, gap: float) -> None:
    """Mark the tick holding each time in ``at`` (a preemption: that tick is lost)."""
    idx = np.floor((at - t[0]) / gap).astype(np.int64)
    ticks[np.clip(idx, 0, len(ticks) - 1)] = True


def _tick_marks(t: np.ndarray, end: float, down: np.ndarray, gap: float) -> np.ndarray:
    """Ticks of ``gap`` from t[0] to ``end``; a tick is marked when any marked interval
    [t_i, t_{i+1}) overlaps it (pessimistic resampling)."""
    n = max(1, math.ceil((end - t[0]) / gap - 1e-9))
    stops = np.append(t[1:], end)
    first = np.floor((t - t[0]) / gap).astype(np.int64)
    last = np.ceil((stops - t[0]) / gap - 1e-9).astype(np.int64) - 1
    last = np.maximum(last, first)
    diff = np.zeros(n + 1, dtype=np.int64)
    sel = down.astype(bool) & (stops > t)  # an instant (two rows at one time) holds no tick
    np.add.at(diff, np.clip(first[sel], 0, n), 1)
    np.add.at(diff, np.clip(last[sel] + 1, 0, n), -1)
    return np.cumsum(diff[:n]) > 0


def _from_events(
    body: list[list[str]], name: str, nodes: int, scale: float, gap: float
) -> CapacityTrace:
    t = _times(body, name, scale)
    up: dict[str, float] = {}  # node -> time added (insertion order = seniority)
    held: set[str] = set()
    short, hits = [], []
    for when, row in zip(t, body, strict=True):
        op, node = row[1].lower(), row[2]
        if op not in ("add", "remove"):
            raise TraceError(f"{name}: event {row[1]!r} must be add or remove")
        hit = False
        if op == "add":
            up.setdefault(node, when)
        else:
            up.pop(node, None)
            hit = node in held
            held.discard(node)
        if hit:
            held.clear()  # the job is preempted: it takes nodes again below
        if not held and len(up) >= nodes:
            held = set(sorted(up, key=up.__getitem__)[:nodes])
        short.append(len(up) < nodes)
        if hit:
            hits.append(when)
    ticks = _tick_marks(t, t[-1] + gap, np.asarray(short), gap)
    _mark_points(ticks, t, np.asarray(hits, dtype=np.float64), gap)
    return CapacityTrace(name, float(gap), ticks, None, nodes)


__all__ = ["CapacityTrace", "TraceError", "load_trace"]
