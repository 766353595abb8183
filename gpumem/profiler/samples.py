"""What a k-block profile records for ``extrapolate.py``, beyond its report.

``runner.py`` hands a profile a ``SampleRecorder`` (``prof.recorder``) for each of the 1-, 2-
and 3-block profiles; the session then adds one vector per timeline sample and one line per
call of the root module, and keeps the vectors' categories as it keeps a peak snapshot's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem.profiler.categories import CATEGORIES, OPTIMIZER, OPTIMIZER_PHASE, TEMPORARY
from gpumem.profiler.records import PHASE_CODE

if TYPE_CHECKING:
    from gpumem.profiler.records import Frame, StepAcc

CAT0 = 6  # where the categories start in a sample (SampleRecorder.sample)
_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


class SampleRecorder:
    """The samples of one profile: ``samples`` (one vector per timeline sample) and
    ``root_calls`` (step, backward call, level, kept, high-water mark of each root call)."""

    def __init__(self) -> None:
        self.samples: list[list[int]] = []
        self._at: list[tuple[int, int]] = []  # per sample: the event, the optimizer's count
        self.root_calls: list[tuple[int, bool, int, int, int]] = []

    def sample(
        self,
        level: int,
        comm: int,
        phase: str,
        step: StepAcc,
        frames: tuple[list[Frame], list[Frame]],
        by_category: dict[str, int],
        event: int,
        n_opt: int,
    ) -> None:
        """One timeline sample with what a peak snapshot there would hold: level,
        communication, phase, step, whether the root's forward and backward calls are running,
        then the bytes per category. ``n_opt``: what the optimizer step created so far."""
        fwd, bwd = frames
        root_fwd = int(bool(fwd) and fwd[0].fqn == "")
        root_bwd = int(any(f.fqn == "" for f in bwd))
        self.samples.append(
            [level, comm, PHASE_CODE[phase], step.index, root_fwd, root_bwd, *by_category.values()]
        )
        self._at.append((event, n_opt))

    def root_call(self, step: int, backward_call: bool, f: Frame) -> None:
        self.root_calls.append((step, backward_call, f.level, f.kept, f.hwm))

    def reclassified(self, event: int, old: str, category: str, nbytes: int) -> None:
        """A live entry changed category at ``event``: a sample taken then follows it."""
        if self.samples and self._at[-1][0] == event:
            row = self.samples[-1]
            row[CAT0 + _CAT_INDEX[old]] -= nbytes
            row[CAT0 + _CAT_INDEX[category]] += nbytes

    def move_scratch(self, step: StepAcc, state: dict[int, str]) -> None:
        """The samples of this optimizer step get the correction its peak snapshots get: what
        the step created and did not keep, alive then, is temporary, not optimizer state."""
        code = PHASE_CODE[OPTIMIZER_PHASE]
        opt, tmp = CAT0 + _CAT_INDEX[OPTIMIZER], CAT0 + _CAT_INDEX[TEMPORARY]
        for row, (event, n_opt) in zip(self.samples, self._at, strict=True):
            if row[2] != code or row[3] != step.index or not n_opt:
                continue
            moved = sum(
                e.nbytes
                for e in step.opt_new[:n_opt]
                if id(e) not in state and (e.died is None or e.died > event)
            )
            row[opt] -= moved
            row[tmp] += moved
