"""The storage seam: what a Checkpointer asks of the root it saves to and restores from.

Two backends implement it: ``root.Root`` (a directory every rank shares, or one per node:
``nodes``) and ``s3.object_backend.ObjectBackend`` (an ``s3://`` root each rank writes directly);
``checkpoint.factory`` picks one from the configuration. The tiers (``checkpoint.tiers``) sit
beside a directory root and copy what it committed; they are not a root.

A save asks, in order (``Checkpointer.save``, then ``save.Save`` on the persist thread):

1. ``StorageRoot.check_writable()``, on the caller's thread: a refused save fails before
   anything is captured;
2. ``StorageRoot.commit(options, step, captured, snapshot)``: the save's ``SaveCommit``,
   nothing done yet;
3. ``SaveCommit.run()``, on the persist thread, every rank:

   a. begin: the save's own place (``.tmp-step-<N>/``; a fresh save id under ``step-<N>/``);
   b. agree: one collective on the step, the sections, the replicated state and the layout,
      before anything is written;
   c. write this rank's files (its data files from the staging memory, its shard manifest);
   d. agree: every rank's outcome gathered (node-local: every node's copy completed);
   e. commit: the leader writes the main manifest and makes the step visible in one atomic
      act (the rename; the conditional put of ``COMMIT``), then moves ``latest``;
   f. retain: checkpoints beyond ``keep`` removed, after every rank knows of the commit;
4. ``SaveCommit.close()``, whatever happened.

A restore asks, in order (``restore.candidates.restore``):

1. ``StorageRoot.candidates()``: None where nothing was ever saved (on this rank);
2. ``Candidates.check_pointer()`` (``latest`` is cross-checked, never relied on), then
   ``Candidates.names()``: the committed steps, newest first;
3. ``Candidates.open(name)``: the step's ``StepFiles``; manifests are read with
   ``read_small`` (size-capped, then framed and CRC-checked by ``directory.load_info``), data
   in ranges into the caller's memory, each chunk verified against its manifest's CRC32C
   (``restore.files``: ``gpumem.reader`` on a directory, the object's own ranged reads);
4. ``Candidates.gone(name)``: a step that failed to read was removed by a writer's retention
   (not damage) when it no longer stands.

``StorageRoot.list()`` serves ``Checkpointer.list()``; ``close()`` releases the root.
"""

from __future__ import annotations

from typing import Protocol

from ..capture.training_state import Capture
from ..stage.snapshot import Snapshot
from .commit import CommitOptions
from .format import CheckpointInfo
from .step_reads import StepFiles


class SaveCommit(Protocol):
    """One save's storage side (step 3 of a save, the module docstring)."""

    step: int

    def run(self) -> None:
        """Begin, agree, write this rank's files, agree, commit, retain; raise what failed,
        on every rank alike."""
        ...

    def close(self) -> None:
        """Release what the save holds open (its temporary directory)."""
        ...


class Candidates(Protocol):
    """A root's committed steps as a restore walks them (steps 2-4 of a restore)."""

    def check_pointer(self) -> None:
        """Warn when ``latest`` names no committed step (restore does not depend on it)."""
        ...

    def names(self) -> list[str]:
        """The committed steps' names (``step-<N>``), newest first."""
        ...

    def open(self, name: str) -> StepFiles:
        """The step ``name``, opened for reading; damage raises CheckpointCorruptError."""
        ...

    def gone(self, name: str) -> bool:
        """The step ``name`` no longer stands (a writer's retention removed it)."""
        ...


class StorageRoot(Protocol):
    """The root of one Checkpointer (the module docstring's call sequence).

    Attributes:
        read_only: why save() is refused (None: it is not).
    """

    read_only: str | None

    def check_writable(self) -> None:
        """Raise why save() is refused, if it is."""
        ...

    def commit(
        self, options: CommitOptions, step: int, captured: Capture, snapshot: Snapshot
    ) -> SaveCommit:
        """The commit of one save into this root, not yet run."""
        ...

    def list(self) -> list[CheckpointInfo]:
        """The committed checkpoints with intact manifests, oldest first."""
        ...

    def candidates(self) -> Candidates | None:
        """The committed steps for a restore; None where the root does not exist (yet)."""
        ...

    def close(self) -> None: ...
