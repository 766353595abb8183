"""Event lists for the simulator, built cheaply: a profile's storages, an estimator's synthetic
tensors, a layer's events stamped once per layer.

    t = Trace()
    w = t.alloc(4 << 20)                 # a handle (an int)
    layer = Trace(); a = layer.alloc(1 << 20); layer.free(a)
    t.extend(layer, times=32)            # the layer's events 32 times, handles renumbered
    t.free(w)
    t.simulate("expandable_segments:True").peak_reserved

A trace file is JSON lines, one event a line (``["alloc", 7, 4096, 0]``, ``["free", 7]``);
``Trace.load`` names the line of anything it cannot read.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from gpumem.allocator.caching import Event, SimResult, simulate

_ARITY = {
    "alloc": (3, 4),
    "free": (2, 2),
    "record_stream": (3, 3),
    "free_completed": (2, 2),
    "synchronize": (1, 1),
    "empty_cache": (1, 1),
}


def check_event(ev: Any, where: str) -> Event:
    """``ev`` as a valid event tuple, or a ``ValueError`` naming ``where``."""
    if not isinstance(ev, list | tuple) or not ev or ev[0] not in _ARITY:
        raise ValueError(
            f"{where}: {ev!r} is not an allocator event; an event is a list whose first item is "
            f"one of {', '.join(_ARITY)}"
        )
    lo, hi = _ARITY[ev[0]]
    if not lo <= len(ev) <= hi:
        raise ValueError(f"{where}: {ev[0]!r} takes {lo - 1}..{hi - 1} arguments, got {ev!r}")
    if ev[0] == "alloc" and (type(ev[2]) is not int or ev[2] < 0):
        raise ValueError(f"{where}: an alloc's size must be a non-negative integer, got {ev!r}")
    if len(ev) > 2 and ev[0] != "alloc" and type(ev[2]) is not int:
        raise ValueError(f"{where}: a stream must be an integer, got {ev!r}")
    if ev[0] == "alloc" and len(ev) == 4 and type(ev[3]) is not int:
        raise ValueError(f"{where}: a stream must be an integer, got {ev!r}")
    if len(ev) > 1 and isinstance(ev[1], list):
        return (ev[0], tuple(ev[1]), *ev[2:])  # JSON has no tuples: a list handle, hashable
    return tuple(ev)


class Trace:
    """An allocation/free sequence under construction (``events``: the tuples
    :func:`~gpumem.allocator.caching.simulate` takes)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes (as asked for, before rounding); returns the handle."""
        h = self._next
        self._next += 1
        self.events.append(("alloc", h, size, stream))
        return h

    def free(self, handle: Hashable) -> None:
        self.events.append(("free", handle))

    def record_stream(self, handle: Hashable, stream: int) -> None:
        self.events.append(("record_stream", handle, stream))

    def synchronize(self) -> None:
        self.events.append(("synchronize",))

    def empty_cache(self) -> None:
        self.events.append(("empty_cache",))

    def extend(self, other: Trace, times: int = 1) -> list[int]:
        """Append ``other``'s events ``times`` times; its integer handles are renumbered each
        time (other handles, e.g. strings naming tensors that outlive a layer, are kept).
        Returns the offset added to ``other``'s handles, per copy."""
        offsets = []
        for _ in range(times):
            off = self._next
            offsets.append(off)
            for ev in other.events:
                h = ev[1] if len(ev) > 1 else None
                if type(h) is int:
                    self.events.append((ev[0], h + off, *ev[2:]))
                else:
                    self.events.append(ev)
            self._next += other._next
        return offsets

    def simulate(self, alloc_conf: Any = None, **kw: Any) -> SimResult:
        """:func:`~gpumem.allocator.caching.simulate` of these events."""
        return simulate(self.events, alloc_conf, **kw)

    def dump(self, path: str | Path) -> None:
        """Write the events as JSON lines."""
        Path(path).write_text("".join(json.dumps(list(ev)) + "\n" for ev in self.events))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a JSON-lines trace; a line that is not an event is a ``ValueError`` naming it."""
        t = cls()
        top = -1
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            ev = check_event(raw, where)
            if ev[0] == "alloc" and type(ev[1]) is int:
                top = max(top, ev[1])
            t.events.append(ev)
        t._next = top + 1
        return t


__all__ = ["Trace", "check_event"]
