"""What every save of one Checkpointer is staged and committed with: its parts (staging, the
optimizer hooks, the workers, the storage root and commit options), held by the façade and
passed to the stages as one declared argument instead of the façade's private members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .capture.training_state import Capture, TrainingState
from .optimizer_hooks import OptimizerHooks
from .save import Save
from .stage.snapshot import Mode, Snapshot, pipelines
from .stage.staging import Staging
from .stats import SaveStats
from .storage.backend import StorageRoot
from .storage.commit import CommitOptions
from .workers import Worker


@dataclass(frozen=True)
class SaveSetup:
    """What every save of one Checkpointer is staged and committed with (its parts, held by
    the façade, passed to the stages as one declared argument)."""

    overlap: bool  # the config's: copy parameters and optimizer state after save() returns
    staging: Staging
    hooks: OptimizerHooks
    persister: Worker
    copier: Worker
    root: StorageRoot
    options: CommitOptions
    in_flight: Callable[[], Snapshot | None]  # the snapshot overlap's fence waits for

    def stage_and_commit(
        self,
        step: int,
        captured: Capture,
        state: TrainingState,
        blocking: bool,
        t0: float,
        new_memory: int | None,
        wait_previous: Callable[[], None],
    ) -> Save:
        """The save's snapshot (its mode and staging slot) and its commit, ready to run;
        ``wait_previous``: the back-pressure a streaming save needs with coalescing."""
        table, staging = captured.table, self.staging
        overlap = self.overlap and not blocking and state.optimizer is not None
        plan = staging.plan(table, pipelines(table, overlap), new_memory)
        if plan.streaming and staging.coalescer is not None:
            wait_previous()  # one slot streams through the whole budget: no second one
        mode = Mode.STREAMING if plan.streaming else Mode.OVERLAP if overlap else Mode.BLOCKING
        if mode is Mode.OVERLAP:
            self.hooks.fence(state.optimizer, self.in_flight)
        stats = SaveStats(step, sum(p.nbytes for p in plan.pieces), mode.value)
        snap, slot, victim = staging.snapshot(
            table, plan, mode, stats=stats, t0=t0, copier=self.copier
        )
        commit = self.root.commit(self.options, step, captured, snap)
        return Save(snap, commit, self.persister, staging.coalescer, slot, victim)
