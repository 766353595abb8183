"""One save straight to an object store (``Checkpointer("s3://bucket/prefix")``): the directory
backend's protocol (``commit.Commit``), with the save's own objects where it has a temporary
directory and a conditional put where it has a rename.

Every rank, on the persist thread (``ObjectCommit.run``):

1. the first collective of ``Commit`` (the roll call, agreement on the step, sections, layout);
   then rank 0 draws a fresh save id and every rank hears it: the save's objects go under
   ``step-<N>/<save>/``, which no other save (of this job or another) ever names;
2. each rank uploads its own data files straight from the staging arena as its batches are
   staged (``object_files.ObjectFiles.write_pieces``: multipart, CRC32C per part and object),
   then its shard manifest;
3. the second collective: every rank's shard manifest exists (its upload returned) before rank 0
   writes the main manifest and puts ``step-<N>/COMMIT`` with ``If-None-Match: *``, **the
   commit** (``ObjectRoot.commit_save``); of two jobs committing one step one wins, the other
   deletes its objects and raises ``CheckpointStateError`` on every rank;
4. a step below committed ones (going back) sets the newer ones aside
   (``ObjectRoot.set_aside_newer``: their ``COMMIT`` records moved to ``abandoned/``, their
   files kept) with a ``CheckpointBranchWarning``, as the directory does; ``latest`` moves by
   ``If-Match`` (back only then); retention (``keep``) deletes only steps older than the one
   just committed, each one's ``COMMIT`` first.

A save that fails or is killed leaves objects no ``COMMIT`` names, and incomplete multipart
uploads (a failed upload aborts its own; a killed process's are left): a restore never reads
them, and ``ObjectRoot.clean_stale`` (run when a Checkpointer opens the root) removes them once
they are older than a day (a live job's upload is younger).
"""

from __future__ import annotations

import contextlib
import uuid
import warnings

from ...capture.training_state import Capture
from ...errors import CheckpointError, CheckpointPointerWarning, CheckpointStateError
from ...stage.snapshot import Snapshot
from ..commit import Commit, CommitOptions, warn_set_aside
from .object_files import ObjectFiles
from .object_root import ObjectRoot


class ObjectCommit(Commit):
    """The persist thread's part of one save to an object store (see the module docstring)."""

    def __init__(
        self,
        options: CommitOptions,
        objects: ObjectRoot,
        step: int,
        captured: Capture,
        snapshot: Snapshot,
    ):
        super().__init__(options, None, step, captured, snapshot)
        self.objects = objects
        self._files: ObjectFiles | None = None
        self._save = ""

    def run(self) -> None:
        self._shared_blocks = self._agree(self._prepare_tmp())
        save = self.group.broadcast_text(uuid.uuid4().hex if self.group.rank == 0 else "", 0)
        self._files = self.objects.save_files(self.step, save)
        self._save = save
        local_error, shard_crc = self._write_shard()
        self._commit_everywhere(local_error, shard_crc)

    def close(self) -> None:
        return None

    def _prepare_tmp(self) -> BaseException | None:
        return None  # nothing to create: a save's objects are under its own fresh id

    def _open_tmp(self) -> ObjectFiles:  # type: ignore[override]
        assert self._files is not None  # drawn in run() before any write
        return self._files

    def _discard(self) -> None:
        """Rank 0: delete a failed save's objects (best effort: ``clean_stale`` retries)."""
        if self.group.rank == 0 and self._files is not None:
            with contextlib.suppress(CheckpointError):
                self._files.discard()

    def _clean_failed(self) -> None:
        self._discard()

    def _commit(self, gathered: list[list[int]], main: tuple[bytes, int] | None = None) -> None:
        """Rank 0: the main manifest, the conditional put of ``COMMIT``, ``latest``."""
        files = self._open_tmp()
        crc = self._write_main(files, gathered)  # type: ignore[arg-type]
        if not self.objects.commit_save(self.step, self._save, crc):
            self._discard()
            raise CheckpointStateError(
                f"step {self.step} is already committed at {self.objects.url} (by another save "
                "or job writing the same root); its checkpoint was kept and this one discarded"
            )
        self._durable()
        moved = self.objects.set_aside_newer(self.step)  # going back: as a directory does
        if moved:
            self.stats.set_aside = tuple(moved)
            warn_set_aside(self.step, moved)
        try:
            self.objects.move_latest(self.step, crc, back=bool(moved))
        except CheckpointError as exc:
            self.stats.latest_error = str(exc)
            warnings.warn(
                f"step {self.step} is committed at {self.objects.url}, but latest was not moved: "
                f"{exc}. restore() does not need it; the next save moves it.",
                CheckpointPointerWarning,
                stacklevel=1,
            )
        self._committed_name = str(self.step)

    def _retain(self, committed: str) -> None:
        """Rank 0, after the commit: steps beyond ``keep`` deleted (a failure is a warning)."""
        keep = self.options.keep
        try:
            self.objects.apply_retention(keep, self.step)
        except CheckpointError as exc:
            warnings.warn(
                f"step {self.step} is committed, but removing checkpoints beyond keep={keep} at "
                f"{self.objects.url} failed ({exc}); the next save tries again",
                RuntimeWarning,
                stacklevel=1,
            )
