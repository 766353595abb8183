"""Assumptions a running model follows instead of data, for whoever measures it.

Under fake tensors some layers cannot read values (MoE routing, say) and follow a stated
assumption instead. They call :func:`note_assumption`; a ``gpumem.profile`` region running on the
same thread listens and labels its report an estimate. This module sits below both sides, so a
model never imports the profiler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_LOCAL = threading.local()


def note_assumption(text: str) -> None:
    """Record that the running code followed an assumption instead of data (report = estimate)."""
    for listener in getattr(_LOCAL, "listeners", ()):
        listener(text)


def listen(listener: Callable[[str], None]) -> None:
    """Hand every assumption noted on this thread to ``listener`` until :func:`unlisten`."""
    _LOCAL.__dict__.setdefault("listeners", []).append(listener)


def unlisten(listener: Callable[[str], None]) -> None:
    """Stop handing assumptions to ``listener`` (no error when it was not listening)."""
    listeners = getattr(_LOCAL, "listeners", [])
    if listener in listeners:
        listeners.remove(listener)
