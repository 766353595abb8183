"""Which checkpoint a restore takes: the newest one that verifies, the same one on every rank.

The protocol of ``restore`` (every rank runs it; ``Checkpointer.restore`` is a collective):

1. the candidates are the committed ``step-<N>`` directories, newest first, as rank 0 lists them
   (or the one checkpoint the caller named); ``latest`` is only cross-checked, never relied on.
   A step a writer's retention removed while it was read is not damage: the steps are listed
   again and the newest one not tried yet comes next (``_StepQueue``, ``MAX_RELISTS``);
2. each rank *prepares* the candidate (``StagedRestore.prepare``: read, verify, decode and
   validate against the objects, touching none of them): plain state through ``PlainRestore``,
   DTensor state on either side through ``ShardedRestore``;
3. the ranks agree on the outcome with one all-reduce (the worst wins): all prepared, or some
   rank failed, and then they exchange what each found (``verdict``) and take one outcome and
   one error: damaged (every rank falls back to the next older one, with the same
   CheckpointFallbackWarning) or an error every rank raises alike;
4. all prepared: each rank *applies* it (``StagedRestore.apply``), all or nothing, agreeing
   again before anything that cannot be rolled back; optionally each rank verifies what it
   loaded (``verify_loaded``).

One rule for what a failure means (``outcome``): content that fails to decode or validate,
whatever raised, is CheckpointCorruptError for that step, and restore falls back to the next
older one; an operating-system error is CheckpointIOError and is raised; a checkpoint that does
not fit the objects is CheckpointStateError and is raised.
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ..capture.training_state import TrainingState
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointIOError,
)
from ..group import Group
from ..storage.backend import Candidates, StorageRoot
from ..storage.directory import load_info
from ..storage.format import CheckpointInfo
from ..storage.safe_fs import io_error
from ..storage.step_reads import StepFiles
from .files import open_checkpoint
from .plain import PlainRestore
from .sharded import ShardedRestore, has_dtensors
from .verdict import DAMAGED, OK, RAISE, Verdict, exchange, unify

# a candidate's outcome, agreed over the ranks with a MIN: the worst one wins
_RAISE, _DAMAGED, _OK = RAISE, DAMAGED, OK


class StagedRestore(Protocol):
    """A candidate checkpoint staged for this rank: plain (``PlainRestore``) or sharded
    (``ShardedRestore``), behind one interface."""

    info: CheckpointInfo

    def prepare(self) -> StagedRestore:
        """Read, verify, decode and validate; touch no object. Raises what is wrong."""
        ...

    def apply(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Load into the objects, all or nothing (``agree``: every rank loaded its part)."""
        ...

    def verify_loaded(self) -> int:
        """Check the loaded tensors where they live; how many were checked."""
        ...

    def release(self) -> None:
        """Drop the staged tensors once loaded (the objects hold what they took): kept as
        ``Checkpointer.last_restore``, it must not hold a copy of the state until the next
        restore, nor the objects' replaced tensors."""
        ...


class Restorer(Protocol):
    """How a Checkpointer restores from its root: the newest checkpoint that verifies
    (``NewestRestore``), or from node-local directories the newest one the nodes hold whole
    (``peers.Restore``); either one restores a ``path`` it is given as ``restore`` does."""

    def __call__(
        self,
        state: TrainingState,
        group: Group,
        stage: Callable[[int], torch.Tensor],
        *,
        path: str | os.PathLike | None = None,
        verify_loaded: bool = False,
    ) -> tuple[int | None, StagedRestore | None]:
        """(the restored step, the staged restore), or (None, None): nothing to restore."""
        ...


class NewestRestore:
    """``restore`` over the committed steps of ``root`` (a directory every rank shares, or an
    object store), ``directory`` its path for messages: a ``Restorer``."""

    def __init__(self, root: StorageRoot, directory: Path):
        self.root, self.directory = root, directory

    def __call__(
        self,
        state: TrainingState,
        group: Group,
        stage: Callable[[int], torch.Tensor],
        *,
        path: str | os.PathLike | None = None,
        verify_loaded: bool = False,
    ) -> tuple[int | None, StagedRestore | None]:
        return restore(
            state,
            group,
            stage,
            root=self.root.candidates() if path is None else None,
            directory=self.directory,
            path=path,
            verify_loaded=verify_loaded,
        )


def restore(
    state: TrainingState,
    group: Group,
    stage: Callable[[int], torch.Tensor],
    *,
    root: Candidates | None,
    directory: Path,
    path: str | os.PathLike | None = None,
    verify_loaded: bool = False,
) -> tuple[int | None, StagedRestore | None]:
    """Restore the newest checkpoint that verifies into ``state``'s objects (see the module
    docstring): (its step, the staged restore), or (None, None) when there is none at all.

    Args:
        state: the objects to load.
        group: the ranks that restore together.
        stage: host staging memory of ``n`` bytes for a sharded restore.
        root: the root's committed steps (``StorageRoot.candidates()``; None: the root does not
            exist, yet, on this rank).
        directory: its path, for messages.
        path: one checkpoint directory to restore instead of the newest one.
        verify_loaded: check the loaded tensors where they live (on a GPU: the Triton CRC32C).

    Raises:
        CheckpointCorruptError: every checkpoint (or the one named by ``path``) is damaged, or
            removed by a writer's retention while read (the message counts them apart).
        CheckpointIOError: (EAGAIN) none was damaged, but a writer's retention removed every
            step this restore tried, ``MAX_RELISTS`` listings over; or the operating system
            failed a read.
        CheckpointStateError: the checkpoint does not fit the objects.
    """
    dtensors = has_dtensors(state.model, state.optimizer)
    queue = _StepQueue(root, group) if path is None else None
    failures: list[CheckpointError] = []  # damaged
    removed: list[CheckpointError] = []  # removed by a writer's retention while being read
    for name in queue if queue is not None else [None]:  # None: the caller's path
        label = os.fsdecode(path) if path is not None else str(directory / str(name))
        status, err, staged = _OK, None, None
        try:
            with _open(root, name, path) as step:
                staged = _prepare(step, state, group, stage, dtensors)
        except Exception as exc:
            status, err = outcome(exc, label)
            if name is not None and _gone(root, name):  # not damage: a writer's retention
                status, err = (
                    _DAMAGED,
                    CheckpointCorruptError(
                        f"{label}: {REMOVED} (a writer's retention, keep=...), not damaged",
                        path=label,
                    ),
                )
        if group.all_reduce(status, "min") != _OK:
            status, err = unify(exchange(group, Verdict.of(status, err)), label, err, group.rank)
        else:
            assert staged is not None
            status, err = _apply(staged, group, label)
            if status == _OK:
                if verify_loaded:
                    staged.verify_loaded()
                staged.release()
                return staged.info.step, staged
        assert err is not None
        if status == _RAISE:
            raise err
        gone = REMOVED in str(err)  # the same on every rank: the verdict is unified
        (removed if gone else failures).append(err)
        if queue is not None:
            if gone:
                queue.relist()
            warnings.warn(
                f"skipping {'removed' if gone else 'damaged'} checkpoint "
                f"{os.path.basename(label)}: {err}",
                CheckpointFallbackWarning,
                stacklevel=4,  # Checkpointer.restore's caller (through NewestRestore)
            )
    if failures or removed:
        raise _none_restored(failures, removed, directory, queue.relists if queue else 0)
    return None, None


REMOVED = "was removed while it was being read"

MAX_RELISTS = 8
"""How many times one restore lists the committed steps again after a writer's retention removed
the step it was reading (each time it takes the newest step not tried yet)."""


_LISTING_CHARS = 60_000  # of rank 0's listing sent (broadcast_text sends 64 KiB): ~4,000 steps


class _StepQueue:
    """The committed steps of ``root`` a restore tries, newest first, the same on every rank
    (rank 0's listing). After a step was removed by a writer's retention (``relist``), the
    steps are listed again, at most ``MAX_RELISTS`` times: the newer steps that writer committed
    meanwhile are tried before the older ones it is about to remove."""

    def __init__(self, root: Candidates | None, group: Group):
        self.root, self.group = root, group
        self.relists = 0
        self.tried: set[str] = set()
        if root is not None:
            root.check_pointer()
        self.queue = self._listing()

    def __iter__(self) -> _StepQueue:
        return self

    def __next__(self) -> str:
        if not self.queue:
            raise StopIteration
        name = self.queue.pop(0)
        self.tried.add(name)
        return name

    def relist(self) -> None:
        if self.relists < MAX_RELISTS:
            self.relists += 1
            self.queue = [n for n in self._listing() if n not in self.tried]

    def _listing(self) -> list[str]:
        names = list(self.root.names()) if self.root is not None else []
        if self.group.world_size > 1:  # one list on every rank, though a writer commits meanwhile
            text = "\n".join(names)
            if len(text) > _LISTING_CHARS:  # the newest steps whole, never a name cut short
                text = text[:_LISTING_CHARS].rsplit("\n", 1)[0]
            text = self.group.broadcast_text(text, 0)
            names = [n for n in text.split("\n") if n]
        return names


def _none_restored(
    failures: list[CheckpointError], removed: list[CheckpointError], directory: Path, relists: int
) -> CheckpointError:
    """Why no candidate restored: the damage found, and apart from it the steps a writer's
    retention removed while they were read (those are not damage)."""
    if not removed:
        if len(failures) == 1:
            return failures[0]
        return CheckpointCorruptError(
            f"all {len(failures)} checkpoints in {directory} are damaged; newest: {failures[0]}",
            path=str(directory),
        )
    gone = (
        f"{len(removed)} removed by a writer's retention while being read (listed again "
        f"{relists} time(s))"
    )
    if not failures:
        return CheckpointIOError(
            f"{directory}: no checkpoint was restored, none damaged: {gone}; a writer removes "
            "steps faster than this restore reads them: restore again, or give that writer a "
            "larger keep=",
            errno=errno.EAGAIN,
            filename=str(directory),
        )
    return CheckpointCorruptError(
        f"{directory}: {len(failures)} checkpoint(s) damaged and {gone}; newest damaged: "
        f"{failures[0]}",
        path=str(directory),
    )


def _gone(root: Candidates | None, name: str) -> bool:
    """The step ``name`` no longer stands in ``root`` (retention renamed or deleted it)."""
    try:
        return root is not None and root.gone(name)
    except OSError:
        return False


def _apply(staged: StagedRestore, group: Group, label: str) -> tuple[int, CheckpointError | None]:
    """Load a candidate every rank prepared; a load that fails fails on every rank together
    (``_Agree``), with one message for all."""
    agree = _Agree(group)
    try:
        staged.apply(agree=agree)
    except CheckpointCorruptError as exc:
        mine = Verdict.of(_DAMAGED, exc, own=agree.failed_here)
        return unify(exchange(group, mine), label, exc, group.rank)
    return _OK, None


class _Agree:
    """``apply``'s agreement (an all-reduce), remembering whether this rank was the one that
    failed (its message then speaks for every rank)."""

    def __init__(self, group: Group):
        self.group, self.failed_here = group, False

    def __call__(self, ok: bool) -> bool:
        self.failed_here = not ok
        return self.group.all_reduce(int(ok), "min") == 1


def _prepare(
    step: StepFiles, state: TrainingState, group: Group, stage: Callable, dtensors: bool
) -> StagedRestore:
    """The candidate ``step`` prepared for this rank: block by block into the objects' layout
    when either side holds DTensor state, else whole from one saved rank."""
    info = load_info(step)
    staged: StagedRestore
    if info.sharded or dtensors:
        staged = ShardedRestore(step, info, group.rank, group.world_size, state, stage)
    else:
        staged = PlainRestore(step, info, group.rank, group.world_size, state, stage)
    return staged.prepare()


def _open(root: Candidates | None, name: str | None, path: str | os.PathLike | None) -> StepFiles:
    if name is None:
        assert path is not None
        return open_checkpoint(path)
    assert root is not None
    # an object store's step reads through the same calls (``storage.backend.StepFiles``)
    return root.open(name)


def outcome(exc: Exception, where: str) -> tuple[int, CheckpointError]:
    """What a failure to read or check a candidate checkpoint means: damage (fall back to an
    older one) or an error to raise. The one rule: whatever the content made fail is damage;
    the operating system's errors and a checkpoint that does not fit the objects are raised."""
    if isinstance(exc, CheckpointCorruptError):
        return _DAMAGED, exc
    if isinstance(exc, CheckpointError):
        return _RAISE, exc
    if isinstance(exc, MemoryError):
        err: CheckpointError = CheckpointIOError(
            f"{where}: out of memory while reading it; free memory and restore again",
            errno=errno.ENOMEM,
            filename=where,
        )
        return _RAISE, err
    if isinstance(exc, OSError):
        return _RAISE, io_error(exc, exc.filename or where, "reading")
    err = CheckpointCorruptError(
        f"{where}: its state fails to decode or validate ({type(exc).__name__}: {str(exc)[:300]})",
        path=where,
    )
    err.__cause__ = exc
    return _DAMAGED, err
