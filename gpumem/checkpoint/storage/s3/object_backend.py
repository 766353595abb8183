"""An ``s3://bucket/prefix`` root as an open Checkpointer holds it (the twin of ``root.Root``):
opened and probed on every rank, saves committed by ``object_commit``, candidates for restore.

Every rank opens its own client (each uploads its own shards and reads its own ranges): rank 0
probes the root fully (bucket, credentials, conditional writes: ``S3Store.check``) and removes
what killed saves left more than a day ago (``ObjectRoot.clean_stale``); the others check the
bucket and their credentials. One all-gather tells every rank who failed, so every rank raises
at construction, alike, before anything is written. There is no lock: two jobs on one root are
kept apart by the conditional put of each step's ``COMMIT`` (one wins).
"""

from __future__ import annotations

import contextlib
import warnings

from ...capture.training_state import Capture
from ...errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointStateError,
)
from ...group import Group
from ...stage.snapshot import Snapshot
from ..commit import CommitOptions
from ..format import CheckpointInfo, step_dir_name
from .object_commit import ObjectCommit
from .object_files import ObjectFiles, ObjectPath
from .object_ranges import REREADS
from .object_root import COMMIT, ObjectRoot


class ObjectBackend:
    """The object-store root of one Checkpointer (see the module docstring).

    Args:
        url: the ``s3://`` root, parsed by the config.
        endpoint_url: the S3 endpoint; None: the AWS environment's.
        group: the job's ranks.
        read_only: open for restore only (no conditional-write probe, nothing cleaned).

    Raises:
        CheckpointIOError: the root cannot be used (on the rank that found it; the others name
            that rank).
    """

    def __init__(self, url: str, endpoint_url: str | None, group: Group, *, read_only: bool):
        from .object_store import S3Store

        self.url, self.group = url, group
        self.path = ObjectPath(url)
        self.read_only: str | None = "opened with read_only=True" if read_only else None
        self.objects: ObjectRoot | None = None
        failure: Exception | None = None
        writer = group.rank == 0 and not read_only
        try:
            store = S3Store(url, endpoint_url=endpoint_url, writable=writer)
            self.objects = ObjectRoot(store)
            if writer:
                self.objects.clean_stale()
        except Exception as exc:  # raised below, once every rank has heard of it
            failure = exc
        if group.world_size > 1:
            bad = [r for r, (v,) in enumerate(group.all_gather([int(failure is not None)])) if v]
            if bad and failure is None:
                failure = CheckpointError(
                    f"rank(s) {bad} could not open {url} (their error is raised there)"
                )
        if failure is not None:
            raise failure

    def commit(
        self, options: CommitOptions, step: int, captured: Capture, snapshot: Snapshot
    ) -> ObjectCommit:
        """The ``object_commit.ObjectCommit`` of one save."""
        assert self.objects is not None
        return ObjectCommit(options, self.objects, step, captured, snapshot)

    def check_writable(self) -> None:
        if self.read_only is not None:
            raise CheckpointStateError(
                f"{self.url} was {self.read_only}: save() is refused; open a Checkpointer "
                "without read_only=True to save"
            )

    def list(self) -> list[CheckpointInfo]:
        assert self.objects is not None
        return self.objects.list_checkpoints()

    def candidates(self) -> ObjectCandidates:
        """The committed steps for a restore."""
        assert self.objects is not None
        return ObjectCandidates(self.objects)

    def close(self) -> None:
        return None


class ObjectCandidates:
    """The committed steps of an object root as ``restore.candidates`` walks a directory's:
    names newest first, each opened as its save's ``ObjectFiles`` (the manifest checked against
    the ``COMMIT`` record), and whether one vanished (another job's retention) mid-read."""

    def __init__(self, objects: ObjectRoot):
        self.objects = objects
        self.path = ObjectPath(objects.url)

    def names(self) -> list[str]:
        return [step_dir_name(s) for s in self.objects.steps()]

    def open(self, name: str) -> ObjectFiles:
        """The step's files, its manifest checked; a manifest that fails its checks is read
        again (``REREADS`` times) before the step is called damaged: a fault in transit."""
        for _ in range(REREADS):
            with contextlib.suppress(CheckpointCorruptError):
                return self.objects.open_step(int(name.removeprefix("step-")))[0]
        return self.objects.open_step(int(name.removeprefix("step-")))[0]

    def gone(self, name: str) -> bool:
        try:
            return self.objects.store.head(self.objects.store.url.key(f"{name}/{COMMIT}")) is None
        except CheckpointError:
            return False

    def check_pointer(self) -> None:
        """Cross-check ``latest`` (restore does not depend on it): naming a step that is not
        committed here gets a warning."""
        try:
            steps = self.objects.steps()
            got = self.objects.store.get(self.objects.store.url.key("latest"), max_bytes=4096)
        except CheckpointError:
            return
        if got is None or not steps:
            return
        from gpumem import _strict_json

        try:
            step = _strict_json.loads(got[0]).get("step")
        except (ValueError, RecursionError, AttributeError):
            step = None
        if step not in steps:
            warnings.warn(
                f"ignoring the latest pointer of {self.objects.url}: it names {step!r}, which is "
                "not committed there; taking the newest committed step",
                CheckpointFallbackWarning,
                stacklevel=5,  # Checkpointer.restore, through NewestRestore, restore, _names
            )
