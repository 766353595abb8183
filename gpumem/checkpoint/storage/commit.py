"""One save's way to disk on the persist thread: the collectives, the writes, the manifests, the
commit and retention.

The protocol, on every rank (``Commit.run``):

1. rank 0 creates ``.tmp-step-<N>/`` (what a failed save left is removed first: the lock is
   ours and no other save is in flight);
2. one collective tells every rank whether rank 0 created it, whether all ranks save the same
   step and sections and declared the same replicated state, and all-gathers the DTensor blocks
   every rank is about to write, which every rank checks (``agreement``) before anything is
   written; a rank that never joins (save() called on some ranks only) makes the roll call
   raise on every rank that did, naming it;
3. each rank writes its data files from the snapshot as its batches are staged, checksums its
   host-staged pieces beside the writes (``writes``), and writes its shard manifest once the
   checksums are known, beside the data writes still running (with one rank, the main manifest
   too);
4. a second collective gathers each rank's outcome, shard-manifest CRC and size; rank 0 writes
   the main manifest and renames the directory into place (**the commit**,
   ``directory.commit``), then moves ``latest``;
5. a last collective tells every rank whether rank 0 committed (a failure there is raised on
   every rank with rank 0's reason); rank 0 then applies retention, after the other ranks know
   the step is committed (they do not wait for it).
"""

from __future__ import annotations

import errno
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from ..capture.codec import TensorTable
from ..capture.replicated import check_signatures, signature
from ..capture.training_state import Capture, sections
from ..errors import (
    CheckpointBranchWarning,
    CheckpointError,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
)
from ..group import Group
from ..stage.snapshot import Snapshot
from . import directory
from .agreement import check_agreement, check_complete, check_layout, layout_blob
from .format import MAIN_MANIFEST, Manifest, main_manifest, shard_manifest_name
from .nodes.replicas import spread
from .nodes.topology import Nodes
from .safe_fs import Dir
from .writes import HostChecksums, planned_files, rank_manifest, write_batches

_STATE = "CheckpointStateError: "  # how broadcast_text marks a state error (vs. an I/O one)


@dataclass(frozen=True)
class CommitOptions:
    """The Checkpointer's settings every commit shares.

    Attributes:
        root_path: the checkpoint directory (for messages; rank 0 passes its open ``Dir``).
        alignment: extent alignment in the data files.
        direct: write data files with O_DIRECT where the file system allows.
        group: the process group (rank, world size, collectives).
        keep: checkpoints to keep (None: all).
        nodes: node-local directories (``nodes.Nodes``): each node's leader plays rank 0's
            part in its own directory, and ``replicas.spread`` completes each node's copy
            before it commits. None: one directory every rank shares.
    """

    root_path: Path
    alignment: int
    direct: bool
    group: Group
    keep: int | None
    nodes: Nodes | None = None


class Commit:
    """The persist thread's part of one save (see the module docstring): ``run()`` raises what
    failed, after telling the other ranks; ``close()`` releases the temporary directory."""

    def __init__(
        self,
        options: CommitOptions,
        root: Dir | None,
        step: int,
        captured: Capture,
        snapshot: Snapshot,
    ):
        self.options, self.root, self.step = options, root, step
        self.captured, self.snapshot, self.stats = captured, snapshot, snapshot.stats
        self.group = options.group
        self._tmp_name = directory.tmp_name(step)
        self._tmp: Dir | None = None  # the open temporary directory of this save
        self._shared_blocks = False  # several ranks write one DTensor block (check_layout)
        self._committed_name: str | None = None
        self._data_files: list[str] = []  # this rank's data files (sent as replicas)
        nodes = options.nodes
        self._local = nodes if nodes is not None and nodes.local else None
        # rank 0 in a shared directory; each node's leader in its own node-local one
        self._leads = self.group.rank == 0 if self._local is None else self._local.leads
        self._shard_crc = 0  # this rank's shard manifest, once written (_write_manifests)
        self._main_crc: int | None = None  # the main manifest, if written beside the data

    def run(self) -> None:
        """Steps 1-5 of the module docstring, on the persist thread."""
        self._shared_blocks = self._agree(self._prepare_tmp())
        local_error, shard_crc = self._write_shard()
        self._commit_everywhere(local_error, shard_crc)

    def close(self) -> None:
        """Release the temporary directory's descriptor and the captured tensors; never raises
        (``Dir.close``). The tensors are the caller's: held by the Checkpointer's last save until
        the next one, a restore's replaced optimizer state would stay alive beside the new one
        (on a GPU too) and the next save would pay for freeing it."""
        self.captured = replace(self.captured, table=TensorTable())
        if self._tmp is not None:
            self._tmp.close()

    # ------------------------------------------------------------------ steps 1-2

    def _prepare_tmp(self) -> BaseException | None:
        """Rank 0: clean up and create the temporary directory; what failed, or None."""
        if not self._leads:
            return None
        try:
            assert self.root is not None  # the leader opened it in the constructor
            directory.clean_stale(self.root)
            self._tmp = directory.prepare_tmp(self.root, self.step)
        except OSError as exc:
            where = self.options.root_path / self._tmp_name
            return CheckpointIOError.wrap(exc, f"creating {where}")
        return None

    def _agree(self, local_error: BaseException | None) -> bool:
        """The first collective and the checks every rank makes on it; whether a DTensor box
        is written by several ranks (its copies are compared at commit)."""
        g, tree, chunk = self.group, self.captured.tree, self.snapshot.chunk
        ok = int(local_error is None)
        try:
            sig = signature(tree, self.captured.replication, chunk)
        except Exception as exc:
            local_error, ok, sig = exc, 0, signature(tree, None, chunk)
        blob = layout_blob(self.snapshot.table)
        try:
            g.join(f"save(step={self.step})")
            gathered = g.all_gather([ok, self.step, sections(tree), len(blob), *sig])
            sizes = [row[3] for row in gathered]
            blobs = g.all_gather_bytes(blob, sizes) if any(sizes) else []
        except CheckpointError:
            self._discard()
            raise
        bad = [r for r, row in enumerate(gathered) if not row[0]]
        if bad:
            self._discard()
            raise local_error or CheckpointIOError(
                f"rank(s) {bad} failed before writing (rank 0 creates "
                f"{self.options.root_path / self._tmp_name}); step {self.step} was not saved"
            )
        try:
            check_agreement([row[1:3] for row in gathered])
            check_signatures([row[4:] for row in gathered])
            return check_layout(blobs) if blobs else False
        except CheckpointError:
            self._discard()
            raise

    # ------------------------------------------------------------------ step 3

    def _write_shard(self) -> tuple[BaseException | None, int]:
        """This rank's data files and shard manifest: (what failed or None, the manifest's
        CRC32C). Batch b is written as soon as it is staged, its checksums taken beside the
        write (in blocking mode once all is staged); outside batched mode (CUDA state, or one
        batch) the writes start once the copy ends and are then written concurrently. The
        manifests are written by the checksum thread once the last checksum is taken, beside
        the data writes still running (``_write_manifests``)."""
        snap, rank, direct = self.snapshot, self.group.rank, self.options.direct
        n = len(snap.plan.batch_sizes)
        crcs: HostChecksums | None = None
        try:
            tmp = self._open_tmp()
            files = planned_files(snap.plan, rank)
            self._data_files = list(files)
            crcs = HostChecksums(snap, self.step, then=lambda: self._write_manifests(tmp, files))
            if not snap.batched:
                snap.staged.wait()
                _raise(snap.error)
                write_batches(tmp, snap, rank, range(n), direct)
            b = 0
            while snap.batched and b < n:
                ready = snap.wait_ready(b)
                # batch b alone while later ones are still being copied (the write hides the
                # copy); once the rest is staged too, the rest at once
                todo = range(b, n if ready == n else b + 1)
                write_batches(tmp, snap, rank, todo, direct)
                if snap.plan.streaming:  # a slot is reused only once its checksums are taken too
                    crcs.wait(todo)
                _raise(snap.error)
                b = todo[-1] + 1
                snap.release(b)
            crcs.join()  # and the manifests
            _raise(snap.error)
            return None, self._shard_crc
        except BaseException as exc:
            snap.fail(exc)
            return exc, 0
        finally:
            if crcs is not None:
                crcs.join()

    def _write_manifests(self, tmp: Dir, files: dict[str, int]) -> None:
        """On the checksum thread, once every CRC is known: the shard manifest, and with a single
        rank (there is no outcome to gather) the main manifest too, so that their fdatasyncs
        overlap the data writes instead of following them. Both lie in the temporary directory:
        nothing is committed before every data file is written."""
        manifest = rank_manifest(
            self.captured,
            self.snapshot,
            rank=self.group.rank,
            world_size=self.group.world_size,
            step=self.step,
            alignment=self.options.alignment,
            files=files,
        )
        name = shard_manifest_name(self.group.rank)
        self._shard_crc = directory.write_manifest(tmp, name, manifest)
        if self.group.world_size == 1:
            sharded = int(self.snapshot.table.sharded)
            main = self._main([[1, self._shard_crc, self.stats.nbytes, sharded]])
            assert main is not None
            self._main_crc = directory.write_manifest(tmp, MAIN_MANIFEST, main)

    # ------------------------------------------------------------------ steps 4-5

    def _commit_everywhere(self, local_error: BaseException | None, shard_crc: int) -> None:
        g, sharded = self.group, int(self.snapshot.table.sharded)
        code = getattr(local_error, "errno", None) or 0  # ENOSPC travels to the other ranks
        gathered = g.all_gather(
            [int(local_error is None), shard_crc, self.stats.nbytes, sharded, code]
        )
        bad = [r for r, row in enumerate(gathered) if not row[0]]
        if bad:
            self._discard()  # nobody writes any more: free the space a failed save took
            if local_error:
                raise as_error(local_error, self.step)
            theirs = next((row[4] for row in gathered if not row[0] and row[4]), None)
            why = ""
            if theirs:
                why = f" ({errno.errorcode.get(theirs, theirs)}: {os.strerror(theirs)})"
            raise CheckpointIOError(
                f"rank(s) {bad} failed to write their shards{why}; step {self.step} was not "
                "committed",
                errno=theirs,
            )
        main = None
        if self._local is not None:  # every node's copy whole before any node commits
            try:
                main = spread(
                    self._local, g, self._open_tmp(), self._data_files, self._main(gathered)
                )
            except CheckpointError:
                self._discard()
                raise
        ok = 1
        if self._leads:
            try:
                self._commit(gathered, main)
            except BaseException as exc:
                local_error, ok = exc, 0
                self._clean_failed()
        if g.all_reduce(ok, "min") == 0:
            self._undo_commit()
            self._raise_commit_failure(local_error)
        if not self.stats.durable_s:  # ranks other than 0: durable once rank 0 committed
            self.stats.durable_s = time.perf_counter() - self.snapshot.t0
        self.stats.committed = True
        if self._leads and self._committed_name is not None:
            self._retain(self._committed_name)

    def _undo_commit(self) -> None:
        """A leader whose commit went through while another node's failed (node-local
        directories): its step is taken back, so that no node holds a step of a save that
        failed (a restore would otherwise take it from that node)."""
        if not self._leads or self._committed_name is None:
            return
        assert self.root is not None
        self.stats.committed, self.stats.durable_s = False, 0.0
        try:
            directory.uncommit(self.root, self.step, self._committed_name)
        except OSError as exc:
            warnings.warn(
                f"step {self.step} failed on another node, but taking it back here failed "
                f"({exc.strerror or exc}): {self.options.root_path / self._committed_name} "
                "stays; a restore verifies it before using it",
                RuntimeWarning,
                stacklevel=1,
            )
        self._committed_name = None
        self._clean_failed()

    def _raise_commit_failure(self, local_error: BaseException | None) -> None:
        """Every rank raises rank 0's reason (a sharded save it found incomplete, say)."""
        text = ""
        if local_error is not None:
            state = isinstance(local_error, CheckpointStateError)
            text = (_STATE if state else "") + str(local_error)
        reason = self.group.broadcast_text(text, 0)
        if local_error is not None:
            raise as_error(local_error, self.step)
        if reason.startswith(_STATE):
            raise CheckpointStateError(reason[len(_STATE) :])
        raise CheckpointIOError(f"rank 0 failed to commit step {self.step}: {reason}")

    def _main(self, gathered: list[list[int]]) -> Manifest | None:
        """Rank 0's main manifest from every rank's (ok, shard CRC, bytes, sharded); None on
        the other ranks."""
        if self.group.rank != 0:
            return None
        return main_manifest(
            step=self.step,
            world_size=self.group.world_size,
            shards=[(row[1], row[2]) for row in gathered],
            replicated=self.captured.replication is not None,
            sharded=any(row[3] for row in gathered),
        )

    def _clean_failed(self) -> None:
        """Rank 0, after a failed commit: its space is freed now, not at the next start (a full
        disk would stay full); a step moved aside to be replaced goes back into place."""
        assert self.root is not None
        directory.clean_stale(self.root)

    def _write_main(self, tmp: Dir, gathered: list[list[int]]) -> int:
        """Rank 0: the main manifest written into ``tmp``, unless the checksum thread wrote it
        beside the data (one rank, ``_write_manifests``); its CRC32C."""
        self._check_blocks(tmp, gathered)
        if self._main_crc is not None:
            return self._main_crc
        manifest = self._main(gathered)
        assert manifest is not None
        return directory.write_manifest(tmp, MAIN_MANIFEST, manifest)

    def _check_blocks(self, tmp: Dir, gathered: list[list[int]]) -> None:
        """DTensor blocks several ranks wrote (``check_layout``) cover their tensors: the
        tiling was checked before writing, the files are checked now."""
        if any(row[3] for row in gathered) and self._shared_blocks:
            check_complete(tmp, [row[1] for row in gathered])

    def _durable(self, at: float | None = None) -> None:
        """Committed (at ``at``, a ``perf_counter`` time; None: now): from here on nothing fails
        the save (the pointer and retention are cleanup)."""
        self.stats.committed = True
        self.stats.durable_s = (time.perf_counter() if at is None else at) - self.snapshot.t0

    def _commit(self, gathered: list[list[int]], main: tuple[bytes, int] | None = None) -> None:
        """The leader: the main manifest (``main``: rank 0's bytes, node-local), the rename
        into place, ``latest``."""
        tmp = self._open_tmp()
        if main is not None:  # node-local: rank 0's bytes, spread to every node
            self._check_blocks(tmp, gathered)
            tmp.write_new(MAIN_MANIFEST, main[0])
            crc = main[1]
        else:
            crc = self._write_main(tmp, gathered)
        assert self.root is not None
        done = directory.commit(self.root, tmp, self.step, crc)
        tmp.path = self.root.path / done.name  # where its descriptor is now, for messages
        self._durable(done.committed_at)  # durable once the rename is: ``latest`` is a hint
        if done.set_aside:
            self.stats.set_aside = tuple(done.set_aside)
            warn_set_aside(self.step, done.set_aside)
        if done.pointer_error is not None:
            err = done.pointer_error
            self.stats.latest_error = f"{err.strerror or err} ({err.filename or 'latest'})"
            warnings.warn(
                f"step {self.step} is committed ({self.options.root_path / done.name}), but the "
                f"latest pointer was not updated: {self.stats.latest_error}. restore() does not "
                "need it (it takes the newest step that verifies); the next save moves it.",
                CheckpointPointerWarning,
                stacklevel=1,
            )
        self._committed_name = done.name  # retention runs once every rank knows

    def _retain(self, committed: str) -> None:
        """Rank 0, after the commit: remove checkpoints beyond ``keep`` (cleanup: a failure is a
        warning, and the next save tries again)."""
        assert self.root is not None
        keep = self.options.keep
        try:
            directory.apply_retention(self.root, keep, committed)
        except OSError as exc:
            warnings.warn(
                f"step {self.step} is committed, but removing checkpoints beyond keep={keep} "
                f"failed ({exc.strerror or exc}); they stay on disk, and the next save tries "
                "again",
                RuntimeWarning,
                stacklevel=1,
            )

    # ------------------------------------------------------------------ the directory

    def _open_tmp(self) -> Dir:
        """The temporary directory: rank 0 created it; the others open it (and, on first use,
        the root) once rank 0 said it exists."""
        if self._tmp is None:
            if self.root is None:
                self.root = Dir.open(self.options.root_path)
            self._tmp = self.root.sub(self._tmp_name)
        return self._tmp

    def _discard(self) -> None:
        """The leader: remove a failed save's temporary directory (best effort: the next save
        or start retries)."""
        if self._leads and self.root is not None:
            self.root.discard_tree(self._tmp_name)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def warn_set_aside(step: int, moved: list[str]) -> None:
    """The CheckpointBranchWarning of a save that set newer steps aside (any backend)."""
    names = ", ".join(os.path.basename(p) for p in moved)
    warnings.warn(
        f"step {step} is lower than committed checkpoints, so training went back (a rollback, "
        f"or a new run in an old run's directory): moved {names} to {os.path.dirname(moved[0])} "
        "so that restore() and retention follow the new branch. If your step counter restarts "
        "(per epoch), pass a global step to save() instead.",
        CheckpointBranchWarning,
        stacklevel=1,
    )


def as_error(exc: BaseException, step: int) -> CheckpointError:
    """A save's failure as the CheckpointError the caller gets."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return CheckpointIOError.wrap(exc, f"saving step {step}")
    err = CheckpointError(f"saving step {step} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
