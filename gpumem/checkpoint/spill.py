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

from dataclasses import dataclass, field
from typing import Any

from .format import align_up


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
