"""The records a profile keeps while it runs: module call frames, peak snapshots, steps.

Plain data; ``session.py`` fills them, ``report.py`` and ``cuda.py`` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumem.profiler.categories import BACKWARD, FORWARD, OPTIMIZER_PHASE, PHASES

if TYPE_CHECKING:
    from gpumem.profiler.tracker import Entry

MODES = ("exact", "light")
PHASE_CODE = {FORWARD: 0, BACKWARD: 1, OPTIMIZER_PHASE: 2}  # timeline encoding


class DataDependentError(RuntimeError):
    """An op whose output size depends on tensor values ran under ``gpumem.fake()``."""


@dataclass
class Frame:
    """One running module call (forward or backward)."""

    fqn: str
    level: int
    event0: int
    in_backward: bool
    t0: int
    hwm: int = 0
    kept: int = 0  # bytes created in this call that became activations (backward: gradients)
    alloc: Any = None  # allocator probe state on CUDA

    def __post_init__(self) -> None:
        self.hwm = self.level


@dataclass
class Snapshot:
    bytes: int = 0
    at: dict[str, int | None] = field(default_factory=dict)
    event: int = -1
    phase: str = FORWARD
    step: int = 0
    n_opt_new: int = 0


@dataclass
class StepAcc:
    """Everything measured in one step (raw, per module without rollup)."""

    index: int
    phase_peak: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(PHASES))
    peak: Snapshot = field(default_factory=Snapshot)
    forwards: int = 0
    backwards: int = 0
    activations: dict[str, int] = field(default_factory=dict)
    fwd_temp: dict[str, int] = field(default_factory=dict)
    bwd_temp: dict[str, int] = field(default_factory=dict)
    gradients: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    opt_new: list[Entry] = field(default_factory=list)
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)
