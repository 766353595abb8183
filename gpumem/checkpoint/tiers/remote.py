"""Tiers: a checkpoint durable on the node-local disk first, then copied to an object store in
the background (``Checkpointer(directory, remote="s3://bucket/prefix")``).

- **Save**: the local save is today's, at today's speed; once a step is committed locally, the
  uploader thread sends it with ``ObjectRoot.upload_step`` (data, shard manifests, main manifest,
  then the conditional put of ``step-<N>/COMMIT``; ``latest`` and the remote's retention after
  that commit). One upload runs at a time; a step committed while one runs waits, and a newer
  one replaces it (only the newest waits: intermediate steps are not uploaded, and say so in
  their ``SaveStats.remote``). A failed upload leaves the local step as it was; the remote
  catches up with the next save's upload.
- **Restore**: the newest step complete in a tier the job reaches. Rank 0 compares the local
  directory's committed steps with the remote's; when the remote holds a newer one it is fetched
  into the local directory (``restore.fetch``: downloaded, verified, older ones tried when it is
  damaged) and the normal restore reads it from there. An unreachable remote is a warning when
  the local directory holds a checkpoint, an error when it holds none (starting from scratch
  because the store did not answer would lose the run).
- **A store outage at construction** (it does not answer: refused, reset, timed out, 5xx past
  the retries; not a missing bucket, denied credentials or a store without conditional writes,
  which stay errors) is one RuntimeWarning when the local tier holds a committed step (any
  rank's directory, node-local or shared): the job starts, restores from the local tier without
  asking the store again, and each upload opens the store first, so uploads resume once it
  answers. With no committed local step it is the error it always was, nothing created.
- **Ranks**: with a directory every rank shares, rank 0 uploads the whole step. With node-local
  directories (``storage.nodes``) each rank uploads its own shards from its node's committed
  step and rank 0 commits once all succeeded (``node_uploads``); a restore then also fetches
  the remote's step into the nodes that lack it when it is newer than any step they hold whole.

The uploader is a daemon thread: a process that exits (``PreemptionGuard`` after its grace
period, see ``stop_waiting``) abandons the upload in flight; what it sent is never committed
(no ``COMMIT``) and ``ObjectRoot.clean_stale`` removes it.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointIOError
from ..group import Group
from ..storage.directory import list_checkpoints
from ..storage.format import step_dir_name
from ..storage.nodes.topology import Nodes
from ..storage.root import Root
from .upload_thread import UploadThread

LOCAL, REMOTE = "local", "remote"

OUTAGE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EAGAIN,
        errno.EIO,
    }
)
"""The errnos of a store that does not answer (``CheckpointIOError`` from ``S3Store``): an outage
the job may outlive on its local tier, not a configuration to fix first."""

_OK, _FAILED, _DOWN = 0, 1, 2  # rank 0's word on opening the store


@dataclass(frozen=True)
class TierRow:
    """One step and the tiers that hold it committed (``ls``, ``Tiers.holding``)."""

    step: int
    tiers: tuple[str, ...]


def tier_rows(local_steps: list[int], remote_steps: list[int]) -> list[TierRow]:
    """Every step of either tier, oldest first, with the tiers holding it."""
    local, remote = set(local_steps), set(remote_steps)
    return [
        TierRow(s, tuple(t for t, held in ((LOCAL, s in local), (REMOTE, s in remote)) if held))
        for s in sorted(local | remote)
    ]


def _holds_a_step(directory: Path) -> bool:
    """This rank's view of ``directory`` holds a committed step (nothing is created)."""
    from ..storage.safe_fs import Dir

    try:
        with Dir.open(directory) as d:
            return bool(list_checkpoints(d))
    except (CheckpointError, OSError):
        return False


def open_remote(url: str, endpoint_url: str | None, writable: bool = True) -> Any:
    """The ``ObjectRoot`` at ``url``, probed (bucket, credentials, conditional writes)."""
    from ..storage.s3.object_root import ObjectRoot
    from ..storage.s3.object_store import S3Store

    return ObjectRoot(S3Store(url, endpoint_url=endpoint_url, writable=writable))


class Tiers:
    """The remote tier of one Checkpointer and its uploader (see the module docstring).

    Without a remote (``url`` None) there is one tier, the local directory, and every method
    is a no-op: ``Checkpointer.tiers`` always exists, ``url`` says whether there is a remote.

    Args:
        url: the ``s3://`` root (already parsed by the config), or None.
        endpoint_url: the S3 endpoint, or None for the AWS environment's.
        directory: the local directory (the local tier).
        keep: the remote's retention (the Checkpointer's ``keep``).
        group: the job's ranks; rank 0 opens the store and uploads.
        timeout_s: how long the other ranks wait for rank 0's word on opening the store (and,
            on node-local directories, ``close()`` for the other ranks' uploads).

    Raises:
        CheckpointIOError: the store cannot be used (missing bucket, denied credentials, no
            conditional writes, unreachable): on rank 0 its error, on the others that rank 0
            failed. Raised before the local directory is created.
    """

    def __init__(
        self,
        url: str | None,
        endpoint_url: str | None,
        directory: Path,
        keep: int | None,
        group: Group,
        timeout_s: float,
    ):
        self.url, self.directory, self.keep, self.group = url, directory, keep, group
        self.endpoint_url, self.collective_timeout_s = endpoint_url, timeout_s
        self.root: Any = None  # the ObjectRoot, on rank 0
        self.down: str | None = None  # why the store did not answer at construction
        if url is not None:
            self._open(url, endpoint_url, timeout_s)
        self._pending: Any = None  # the newest committed-or-committing save not yet uploaded
        self._uploads = UploadThread(self._take, self._upload)
        self._cond = self._uploads.cond
        self._abandon = False
        self.uploaded: int | None = None  # the newest step this tier committed remotely
        self.last_error: CheckpointError | None = None
        self.restored_from: str | None = None  # the tier the last restore() read ("local"...)
        self.per_rank: Any = None  # node_uploads.NodeUploads, on node-local directories
        self.local: Root | None = None  # the local directory's root, once attached

    def _open(self, url: str, endpoint_url: str | None, timeout_s: float) -> None:
        """Rank 0 opens the store; every rank hears how it went. An outage is survived when the
        local tier holds a committed step (the module docstring); anything else is raised."""
        group, failure, code = self.group, None, _OK
        if group.rank == 0:
            try:
                self.root = open_remote(url, endpoint_url)
            except Exception as exc:  # raised below, once every rank has heard of it
                failure = exc
                down = isinstance(exc, CheckpointIOError) and exc.errno in OUTAGE_ERRNOS
                code = _DOWN if down else _FAILED
        if group.world_size > 1:
            code = group.from_rank0("remote-open", code, timeout_s, f"whether it opened {url}")
            if code and failure is None:
                failure = CheckpointError(
                    f"rank 0 could not open remote={url} (its error is there)"
                )
        if code == _DOWN and group.all_reduce(int(_holds_a_step(self.directory)), "max"):
            self.down = str(failure) if group.rank == 0 else f"rank 0 could not reach {url}"
            if group.rank == 0:
                warnings.warn(
                    f"remote={url} does not answer ({failure}); starting from the local tier "
                    f"{self.directory}, which holds committed steps: uploads resume once the "
                    "store answers",
                    RuntimeWarning,
                    stacklevel=5,  # Checkpointer(...)'s caller (through open_storage)
                )
            return
        if failure is not None:
            raise failure

    def store(self) -> Any:
        """Rank 0's ``ObjectRoot``, opened again if the store did not answer before (raises
        what opening it raises)."""
        if self.root is None:
            assert self.url is not None
            self.root = open_remote(self.url, self.endpoint_url)
            self.down = None
        return self.root

    @classmethod
    def from_config(cls, cfg: Any, group: Group) -> Tiers:
        """The tiers of a Checkpointer with ``cfg`` (a remote one where ``cfg.remote`` is set)."""
        return cls(
            cfg.remote, cfg.endpoint_url, cfg.directory, cfg.keep, group, cfg.collective_timeout_s
        )

    def attach(self, nodes: Nodes, endpoint_url: str | None, root: Root) -> None:
        """The local tier is ``root``. Node-local directories with several ranks
        (``nodes.local``): the uploads are per rank (``node_uploads``); every rank opens the
        store, all raise if one cannot (``root`` is closed then)."""
        self.local = root
        if self.url is not None and nodes.local and self.group.world_size > 1:
            from .node_uploads import NodeUploads

            try:
                self.per_rank = NodeUploads(
                    self, nodes, lambda: open_remote(self.url, endpoint_url, writable=False)
                )
            except BaseException:
                with contextlib.suppress(CheckpointError):  # what failed is what to raise
                    root.close()
                raise

    # ------------------------------------------------------------------ save

    def submit(self, job: Any) -> None:
        """Upload ``job`` (a ``save.Save``) once it is committed locally; only the newest
        waiting save is kept."""
        if self.url is None:
            return
        if self.per_rank is not None:
            self.per_rank.submit(job)
            return
        if self.group.rank != 0:
            job.stats.remote = "uploaded by rank 0 (see its SaveStats)"
            return
        with self._cond:
            if self._pending is not None:
                self._pending.stats.remote = (
                    f"not uploaded: superseded by step {job.step} while an upload ran"
                )
            job.stats.remote = "queued"
            self._pending = job
            self._uploads.wake()

    def _take(self) -> Any:
        job, self._pending = self._pending, None
        return job

    def _upload(self, job: Any) -> None:
        job.done.wait()
        stats = job.stats
        if not stats.committed:
            why = stats.status if stats.superseded_by is not None else "not committed locally"
            stats.remote = f"not uploaded: {why}"
            return
        path = self.directory / step_dir_name(job.step)
        stats.remote = "uploading"
        t0 = time.perf_counter()
        try:
            # a local save that went back sets the remote's newer steps aside too
            store = self.store()  # the store may answer again after an outage
            done = store.upload_step(path, keep=self.keep, back=bool(stats.set_aside))
        except Exception as exc:  # the thread never dies; the local step stays as it was
            if not path.is_dir():  # local retention removed it while it went up
                stats.remote = "not uploaded: removed locally (keep) during its upload"
                return
            err = exc if isinstance(exc, CheckpointError) else CheckpointIOError(str(exc))
            self.last_error = err
            stats.remote = f"upload failed: {err}"
            with contextlib.suppress(Exception):  # a warnings filter of "error" must not kill it
                warnings.warn(
                    f"step {job.step} is committed in {self.directory} but its upload to "
                    f"{self.url} failed ({err}); the next save uploads again",
                    RuntimeWarning,
                    stacklevel=1,
                )
            return
        self.committed(job, done, time.perf_counter() - t0)

    def committed(self, job: Any, done: Any, seconds: float) -> None:
        """``job``'s step is committed remotely (``done``: its ``UploadedStep``)."""
        stats = job.stats
        stats.remote_s, stats.remote_committed = seconds, True
        stats.remote = "uploaded" + (
            f"; latest not moved ({done.pointer_error})" if done.pointer_error else ""
        )
        self.uploaded = max(self.uploaded or -1, job.step)
        self.last_error = None

    def wait(self, timeout: float | None = None) -> bool:
        """Until no upload runs or waits (False: ``timeout`` passed first)."""
        if self.per_rank is not None:
            with self.per_rank._cond:
                return self.per_rank._cond.wait_for(lambda: not self.per_rank.pending(), timeout)
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending is None and self._uploads.running is None, timeout
            )

    @property
    def uploading(self) -> int | None:
        """The step being uploaded now, or None."""
        if self.per_rank is not None:
            return self.per_rank.uploading
        job = self._uploads.running
        return job.step if job is not None else None

    def stop_waiting(self) -> None:
        """``close()`` no longer waits for uploads (the process is leaving: PreemptionGuard's
        grace period is over); the one in flight is abandoned, never committed."""
        self._abandon = True

    def where(self, step: int) -> str:
        """Which tier holds ``step``, as the guard reports it (no request to the store)."""
        local = f"step {step} durable in {self.directory} (local)"
        if self.uploaded == step:
            return f"{local} and in {self.url} (remote)"
        if self.group.rank != 0:
            return f"{local}; rank 0 reports the remote"
        newest = f"step {self.uploaded}" if self.uploaded is not None else "no step of this job"
        running = self.uploading
        doing = f", step {running} was still uploading" if running is not None else ""
        return f"{local} only: NOT in {self.url} in time{doing} (it holds {newest})"

    def holding(self) -> list[TierRow]:
        """Every committed step of either tier and which tiers hold it (rank 0; lists the
        store)."""
        from ..storage.safe_fs import Dir

        local: list[int] = []
        if self.directory.is_dir():
            with Dir.open(self.directory) as d:
                local = [i.step for i in list_checkpoints(d)]
        remote = self.root.steps() if self.root is not None else []
        return tier_rows(local, remote)

    # ------------------------------------------------------------------ restore

    def before_restore(self, path: Any = None) -> None:
        """Rank 0: fetch the remote's newest step into the local directory when it is newer than
        the local ones (every rank waits for the outcome: the restore that follows reads it).
        Nothing to do for a restore of a given ``path``."""
        if self.url is None or path is not None:
            return
        root = self.local
        assert root is not None  # attached when the Checkpointer opened its directory
        if self.per_rank is not None:
            self.restored_from = self.per_rank.before_restore(root)
            return
        failure: Exception | None = None
        if self.group.rank == 0:
            try:
                self.restored_from = self._fetch_if_newer(root)
            except Exception as exc:
                failure = exc
        # a collective, not a timed wait: a fetch takes long
        failed = self.group.all_reduce(int(failure is not None), "max")
        if failed and failure is None:
            failure = CheckpointError(
                f"rank 0 could not fetch from remote={self.url} (its error is there)"
            )
        if failure is not None:
            raise failure

    def _fetch_if_newer(self, root: Root) -> str | None:
        from ..restore.fetch import fetch

        d = root.maybe()
        local = max((i.step for i in list_checkpoints(d)), default=None) if d else None
        if self.down is not None and local is not None:
            return LOCAL  # the store did not answer at construction: warned there, once
        try:
            remote = self.store().steps()
            newer = remote and (local is None or remote[0] > local)
            got = fetch(self.root, self.directory, newer_than=local) if newer else None
        except CheckpointError as exc:
            if local is None:
                raise CheckpointIOError(
                    f"the local directory {self.directory} holds no checkpoint and remote="
                    f"{self.url} could not be read ({exc}); not starting from scratch while the "
                    "store may hold the run: fix the store's access and restart"
                ) from exc
            warnings.warn(
                f"remote={self.url} could not be read ({exc}); restoring from {self.directory}",
                RuntimeWarning,
                stacklevel=4,
            )
            return LOCAL
        if got is not None:
            return REMOTE
        return LOCAL if local is not None else None

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Wait for the uploads (unless ``stop_waiting``), end the thread; say on stderr when
        the newest upload failed."""
        if self.url is None:
            return
        if not self._abandon:  # per rank: bounded once only the other ranks are awaited
            self.per_rank.drain() if self.per_rank is not None else self.wait()
        self._uploads.close()
        if self.per_rank is not None:
            self.per_rank.close()
        if self.last_error is not None and not self._abandon:
            print(
                f"gpumem: the last upload to {self.url} failed ({self.last_error}); the local "
                f"directory {self.directory} holds the newer step",
                file=sys.stderr,
                flush=True,
            )
