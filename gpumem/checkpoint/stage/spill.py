"""Device-side spill at the optimizer fence: which of the parameters not yet copied to host
fit the fixed spill buffer (copied device to device, at HBM speed, so the optimizer step waits
for that instead of the D2H copy) and which must still be copied to host before the step.

``plan_spill`` is the accounting, kept apart from the streams so it can be tested on its own:
pieces are taken in copy order (the order the copy engine would have reached them), each at
the next ``alignment`` boundary of the buffer, until one does not fit; it and every later piece
wait (taking a later, smaller piece out of order would leave the copy engine reading a range
the optimizer might already be writing: the D2H copies must stay a prefix of the order).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gpumem._native import as_bytes
from gpumem.units import align_up


@dataclass
class SpillPlan:
    """``spilled``: (piece, offset in the spill buffer) copied device to device; ``waiting``:
    pieces the fence still waits for (copied to host before the step); ``spill_bytes``: bytes
    copied into the buffer (without alignment gaps); ``used``: bytes of the buffer taken."""

    spilled: list[tuple[Any, int]] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)
    spill_bytes: int = 0
    used: int = 0


def plan_spill(remaining: list[Any], cap: int, alignment: int = 256) -> SpillPlan:
    """Split ``remaining`` (pieces with ``nbytes``, in copy order) into what fits a ``cap``-byte
    spill buffer and what waits (see the module docstring). ``cap`` 0: everything waits."""
    plan = SpillPlan()
    for i, p in enumerate(remaining):
        at = align_up(plan.used, alignment)
        if at + p.nbytes > cap:
            plan.waiting = list(remaining[i:])
            break
        plan.spilled.append((p, at))
        plan.used = at + p.nbytes
        plan.spill_bytes += p.nbytes
    return plan


class SpillControl:
    """The handshake between the copier thread, which enqueues a save's device-to-host copies in
    waves, and the optimizer fence, which may stop it and spill what is left.

    Without a fence the copier enqueues every wave (keeping at most two in flight, so that
    whatever is enqueued but not done when a fence comes is bounded) and finishes. When the
    fence comes first it asks the copier to stop at the next wave boundary, waits for it
    (``stopped_at``: the rows enqueued so far), then takes the rows left: those that fit the
    spill buffer are copied device to device on the fence's stream, the rest are enqueued
    device to host at once, and the fenced stream waits for those and for every earlier wave;
    the copier then drains the spill buffer to the arena (``drain``) behind the D2D copies.
    """

    def __init__(self, buffer: Any, wave_bytes: int):
        self.buffer = buffer  # the fixed-size device spill buffer (uint8), made once
        self.wave_bytes = wave_bytes
        self.cond = threading.Condition()
        self.stop_requested = False
        self.stopped_at: int | None = None  # rows enqueued when the copier stopped
        self.finished = False  # the copier enqueued every row without being stopped
        self.drain: tuple[Any, Any] | None = None  # (event after the D2D copies, rows to drain)
        self.spill_bytes = 0
        # set by the copier before its first wave: (fast pieces, copy rows, copying stream,
        # arena, the CRCs' event)
        self.context: tuple[Any, Any, Any, Any, Any] | None = None

    # -- the copier thread

    def should_stop(self) -> bool:
        with self.cond:
            return self.stop_requested

    def stop_and_wait(self, rows_enqueued: int) -> tuple[Any, Any] | None:
        """The copier stopped after ``rows_enqueued`` rows: wait for the fence's drain order."""
        with self.cond:
            self.stopped_at = rows_enqueued
            self.cond.notify_all()
            while self.drain is None:
                self.cond.wait()
            return self.drain

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    # -- the fence (training thread)

    def request_stop(self) -> int | None:
        """Ask the copier to stop; the rows it enqueued, or None when it had already finished."""
        with self.cond:
            self.stop_requested = True
            while self.stopped_at is None and not self.finished:
                self.cond.wait()
            return None if self.finished else self.stopped_at

    def order_drain(self, after: Any, rows: Any) -> None:
        with self.cond:
            self.drain = (after, rows)
            self.cond.notify_all()


def spill_at_fence(control: SpillControl, stream: Any) -> Any | None:
    """The optimizer fence with a spill buffer, on the fenced ``stream`` (the current one): stop
    the copier, copy what fits of the rows it had not enqueued into the buffer (device to
    device, on ``stream``), enqueue the rest device to host, make ``stream`` wait for every
    device-to-host copy of the parameters and for their CRCs, and order the drain of the buffer.
    Returns the event ``stream`` waits for, or None when the copier had already enqueued
    everything (the caller then fences as without a spill)."""
    import numpy as np
    import torch

    at = control.request_stop()
    if at is None:
        return None
    drain_after, drain_rows = None, np.empty((0, 3), dtype=np.uint64)
    try:
        assert control.context is not None  # set before the copier's first wave
        fast, copies, copying, arena, hashed = control.context
        rest = fast[at:]
        plan = plan_spill([p for p, _, _ in rest], control.buffer.numel())
        rows = []
        base = control.buffer.data_ptr()
        for (p, off), (_, t, dst) in zip(plan.spilled, rest, strict=False):
            src = as_bytes(t)[p.src_offset : p.src_offset + p.nbytes]
            control.buffer[off : off + p.nbytes].copy_(src, non_blocking=True)
            rows.append((base + off, p.nbytes, dst))
        if rows:
            drain_after = torch.cuda.Event()
            drain_after.record()  # on the fenced stream, after the D2D copies
            drain_rows = np.array(rows, dtype=np.uint64)
        waiting = copies[at + len(plan.spilled) :]
        with torch.cuda.stream(copying):
            if len(waiting):
                arena.enqueue_d2h(waiting, copying.cuda_stream)
            copied = torch.cuda.Event()
            copied.record()  # every wave the copier enqueued, then the rows that did not fit
        control.spill_bytes = plan.spill_bytes
        stream.wait_event(copied)
        if hashed is not None:
            stream.wait_event(hashed)
        return copied
    finally:  # the copier waits for this order, whatever happened here
        control.order_drain(drain_after, drain_rows)
