"""The records a profile keeps while it runs: module call frames, peak snapshots, steps.

Plain data: ``session.py`` fills them; ``cuda.py`` reads and extends the frames and the step's
``allocator`` record it is handed (a ``ProbeView``); ``report.py`` rolls a finished
``ProfileRecord`` up into a ``Report``. Nobody else reaches into the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from gpumem.profiler.categories import BACKWARD, FORWARD, OPTIMIZER_PHASE, PHASES

if TYPE_CHECKING:
    from gpumem.profiler.tracker import Entry

MODES = ("exact", "light")
PHASE_CODE = {FORWARD: 0, BACKWARD: 1, OPTIMIZER_PHASE: 2}  # timeline encoding


def ancestors(name: str) -> list[str]:
    """A module's fully qualified name, its parents' and the root's (``""``), innermost first."""
    if name == "":
        return [""]
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


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


def credit_kept(frames: list[Frame], e: Entry) -> None:
    """Storages created inside a call and kept beyond it are not its temporaries."""
    for f in frames:
        if e.born > f.event0:
            f.kept += e.nbytes


@dataclass
class PeakRecord:
    """The live bytes at a peak, by category (``at``), and when it was: event, phase, step."""

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
    peak: PeakRecord = field(default_factory=PeakRecord)
    forwards: int = 0
    backwards: int = 0
    activations: dict[str, int] = field(default_factory=dict)
    fwd_temp: dict[str, int] = field(default_factory=dict)
    bwd_temp: dict[str, int] = field(default_factory=dict)
    gradients: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    communication: dict[str, int] = field(default_factory=dict)
    """Per module and its ancestors: the most communication bytes of its subtree alive at once
    (already rolled up: peaks of children at different moments do not add)."""
    opt_new: list[Entry] = field(default_factory=list)
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)


class ProbeView(NamedTuple):
    """What the CUDA allocator probe needs at a hook boundary."""

    frames: list[Frame]
    """The module calls running now (forward, then backward), outermost first."""
    phase: str
    """The training phase the interval that ends belongs to."""
    step: StepAcc
    """The running step; the probe records its per-phase and per-layer peaks in ``allocator``."""


@dataclass
class ProfileRecord:
    """Everything a profile measured, as plain data: what ``report.build_report`` rolls up.

    Per-module dicts are keyed by fully qualified module name (``""`` is the model itself).
    """

    mode: str
    """``"exact"`` or ``"light"``."""
    model_name: str
    fake: bool
    """The model's parameters are fake tensors (the numbers are an estimate of a real run)."""
    device_types: list[str]
    module_names: list[str]
    """Every module of the model, in ``named_modules`` order."""
    weights: dict[str, int]
    """Bytes of each module's own parameters and buffers."""
    steps: list[StepAcc]
    peak: PeakRecord
    """The region's highest moment (one of the steps' peaks)."""
    measured: list[str]
    """The categories measured (light mode on CPU leaves out ``temporary``)."""
    measures_temporary: bool
    timeline: tuple[list[int], list[int], list[int], list[int], list[int]]
    """Samples (perf_counter ns, bytes, phase code, step index, communication bytes), each one
    list."""
    t_start: int
    """perf_counter ns at the region's entry: the timeline's zero."""
    spans: list[tuple[str, str, int, int, int]]
    """Module calls: (module, phase, start ns, end ns, step index)."""
    assumptions: list[str]
    error: str | None
    allocator: dict[str, Any] | None
    """The CUDA allocator's and driver's summary, when the model runs on CUDA."""
    reserved: dict[str, Any] | None = None
    """The caching allocator simulator's figures for the storages' allocations and frees
    (exact mode; ``profiler.reserved``)."""
