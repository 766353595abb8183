"""Tiers on node-local directories: every rank uploads its own shards, rank 0 commits remotely.

``Checkpointer("/nvme/ckpt", remote="s3://...")`` on a job whose directory is node-local
(``storage.nodes``): a committed local step holds the data files of the node's own ranks only,
so no single rank can upload it. Instead, on every rank, an uploader thread takes the steps in
the order they were saved (the same order on every rank) and, per step:

1. one all-gather over the uploaders' **own gloo group** (``Group.private``, created at
   construction; used by these threads only, so it never interleaves with the checkpoint's
   collectives nor the training's): the step, whether it committed locally on this rank, and,
   from rank 0, whether a newer step already waits (then this one is skipped by every rank:
   only the newest waiting step goes up, as with a shared directory). A rank reaches it only
   once its own save of that step is done, so no thread waits in a collective while idle;
2. each rank uploads its own data files from its node's committed step under the step's save
   id (derived from a token rank 0 drew at construction and the save's sequence number: the
   same on every rank without another collective), multipart with CRC32C as any upload;
3. a second all-gather: every rank's outcome. Only when all succeeded does rank 0 upload the
   shard manifests and the main manifest (every node's directory holds all of them) and put
   ``COMMIT`` conditionally (``ObjectRoot.commit_uploaded``); otherwise rank 0 deletes the
   save's objects, the remote keeps its previous step, the local step stays as it is, and a
   RuntimeWarning names the ranks that failed (on them, their own error).

A rank that dies mid-upload fails the collective on the others (gloo sees its connection
close): that step is never committed remotely, and the uploads stop for the rest of the job
(its group is gone; a warning says so). A collective waits at most ``UPLOAD_TIMEOUT_S`` for the
slowest rank's upload. ``close()`` (the job's end) waits for the uploads while this rank's own
part runs, but once this rank waits in a collective for the others, at most
``collective_timeout_s`` more (``drain``): a peer that died without gloo noticing (its node
gone, or hung) must not hold the survivors for two hours. Then the thread is abandoned (a
daemon: the process exits), the step is not committed remotely, and a RuntimeWarning says so.

Restore (``before_restore``): the newest step complete in a tier the job reaches. The leaders'
inventories (``restore.peers``) give the newest step the nodes hold whole; rank 0 lists the
remote. When the remote's is newer (a replaced node and ``replicas=1``, say), the leader of
every node that does not hold it fetches it into its directory (``restore.fetch``: downloaded,
verified); the peer restore that follows then finds it whole and sends what is still missing.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, CheckpointIOError
from ..group import Group
from ..storage.format import step_dir_name
from ..storage.nodes.topology import Nodes
from .upload_thread import UploadThread

UPLOAD_TIMEOUT_S = 2 * 3600.0  # the slowest rank's upload of one step, at most


def save_id(token: str, seq: int) -> str:
    """The save id of the ``seq``-th save of the job whose token is ``token`` (32 hex)."""
    return hashlib.sha256(f"{token}:{seq}".encode()).hexdigest()[:32]


class NodeUploads:
    """The per-rank uploads of one Checkpointer's tiers (see the module docstring).

    Args:
        tiers: the ``Tiers`` (its url, directory, keep, and rank 0's ``root``).
        nodes: the job's nodes (node-local directories).
        opener: opens this rank's ``ObjectRoot`` (rank 0's is ``tiers.root``).

    Raises:
        CheckpointIOError: a rank could not open the store (every rank raises).
    """

    def __init__(self, tiers: Any, nodes: Nodes, opener: Callable[[], Any]):
        self.tiers, self.nodes, g = tiers, nodes, tiers.group
        self.root: Any = tiers.root  # None: the store did not answer (``tiers.down``)
        self.opener = opener
        failure: Exception | None = None
        if g.rank != 0 and tiers.down is None:
            try:
                self.root = opener()
            except Exception as exc:  # raised below, once every rank has heard of it
                failure = exc
        bad = [r for r, (v,) in enumerate(g.all_gather([int(failure is not None)])) if v]
        if bad and failure is None:
            failure = CheckpointError(
                f"rank(s) {bad} could not open remote={tiers.url} (their error is raised there)"
            )
        if failure is not None:
            raise failure
        self.token = g.broadcast_text(uuid.uuid4().hex if g.rank == 0 else "", 0)
        self.group = Group.private(UPLOAD_TIMEOUT_S)
        self._queue: collections.deque[tuple[int, Any]] = collections.deque()
        self._seq = 0
        self._uploads = UploadThread(self._take, self._run)
        self._cond = self._uploads.cond
        self.broken: str | None = None  # why the uploads stopped (a rank died mid-upload)
        self.peer_wait_s = float(tiers.collective_timeout_s)  # close()'s wait for the others
        self._waiting_since: float | None = None  # this rank's uploader waits for the others

    # ------------------------------------------------------------------ save

    def submit(self, job: Any) -> None:
        with self._cond:
            self._queue.append((self._seq, job))
            self._seq += 1
            job.stats.remote = "queued"
            self._uploads.wake()

    def _take(self) -> tuple[int, Any, bool] | None:
        if not self._queue:
            return None
        seq, job = self._queue.popleft()
        return seq, job, bool(self._queue)  # whether a newer save waits

    def _run(self, item: tuple[int, Any, bool]) -> None:
        seq, job, newer = item
        try:
            self._one(seq, job, newer)
        except Exception as exc:  # the thread never dies; the local step stays as it was
            self._failed(job, exc if isinstance(exc, CheckpointError) else None, str(exc))

    def _one(self, seq: int, job: Any, newer: bool) -> None:
        job.done.wait()
        stats, g = job.stats, self.group
        if self.broken is not None:
            stats.remote = f"not uploaded: the uploads stopped ({self.broken})"
            return
        try:
            rows = self._gather([seq, job.step, int(stats.committed), int(newer)])
        except CheckpointError as exc:
            self._stop(job, exc)
            return
        if any(r[0] != seq or r[1] != job.step for r in rows):
            saw = sorted({(r[0], r[1]) for r in rows})
            self._stop(job, CheckpointError(f"the ranks upload different saves {saw}"))
            return
        if not all(r[2] for r in rows):
            stats.remote = "not uploaded: not committed locally on every rank"
            return
        if rows[0][3]:
            stats.remote = "not uploaded: superseded by a newer step waiting to upload"
            return
        save, path = save_id(self.token, seq), self.tiers.directory / step_dir_name(job.step)
        stats.remote = "uploading"
        t0, error = time.perf_counter(), None
        try:
            if self.root is None:  # the store did not answer at construction: it may now
                self.root = self.tiers.store() if g.rank == 0 else self.opener()
            self.root.upload_rank(path, g.rank, save)
        except Exception as exc:
            error = exc
        try:
            oks = self._gather([int(error is None)])
        except CheckpointError as exc:
            if g.rank == 0 and self.root is not None:
                self.root.discard_save(job.step, save)
            self._stop(job, exc)
            return
        bad = [r for r, (v,) in enumerate(oks) if not v]
        if error is not None:
            self._failed(job, None, f"rank {g.rank}'s upload failed: {error}")
        if g.rank != 0:
            if error is None:
                stats.remote = "its shards uploaded; rank 0 commits the step remotely"
            return
        if bad:
            if self.root is not None:
                self.root.discard_save(job.step, save)
            if error is None:
                self._failed(job, None, f"rank(s) {bad} could not upload their shards")
            return
        done = self.root.commit_uploaded(
            path, save, keep=self.tiers.keep, back=bool(stats.set_aside)
        )
        self.tiers.committed(job, done, time.perf_counter() - t0)

    def _gather(self, row: list[int]) -> list[list[int]]:
        """An all-gather on the private group, noting since when this rank waits in it."""
        with self._cond:
            self._waiting_since = time.monotonic()
            self._cond.notify_all()  # a drain() waiting unbounded now waits bounded
        try:
            return self.group.all_gather(row)
        finally:
            with self._cond:
                self._waiting_since = None
                self._cond.notify_all()

    def _failed(self, job: Any, err: CheckpointError | None, why: str) -> None:
        err = err or CheckpointIOError(why)
        self.tiers.last_error = err
        job.stats.remote = f"upload failed: {err}"
        with contextlib.suppress(Exception):  # a warnings filter of "error" must not kill it
            warnings.warn(
                f"step {job.step} is committed in {self.tiers.directory} but its upload to "
                f"{self.tiers.url} failed ({err}); the remote keeps its previous step and the "
                "next save uploads again",
                RuntimeWarning,
                stacklevel=1,
            )

    def _stop(self, job: Any, exc: CheckpointError) -> None:
        """A collective failed (a rank died or the ranks disagree): no more uploads."""
        self.broken = str(exc)[:300]
        self._failed(job, exc, self.broken)

    def pending(self) -> bool:
        return bool(self._queue) or self._uploads.running is not None

    @property
    def uploading(self) -> int | None:
        item = self._uploads.running
        return item[1].step if item is not None else None

    def drain(self) -> bool:
        """Wait until no upload runs or waits, but at most ``peer_wait_s`` in a row while this
        rank's uploader waits in a collective for the others (False: gave up, warned)."""
        with self._cond:
            while self.pending():
                since = self._waiting_since
                if since is None:
                    self._cond.wait()
                    continue
                left = since + self.peer_wait_s - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            else:
                return True
            step = self.uploading
        with contextlib.suppress(Exception):  # a warnings filter of "error" must not raise here
            warnings.warn(
                f"rank {self.group.rank} stopped waiting for the other ranks' upload of step "
                f"{step} after {self.peer_wait_s:g} s (collective_timeout_s): a rank died or "
                f"hangs; step {step} is committed in {self.tiers.directory} but not in "
                f"{self.tiers.url}",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def close(self) -> None:
        self._uploads.close()

    # ------------------------------------------------------------------ restore

    def before_restore(self, root: Any) -> str | None:
        """Fetch the remote's newest step into the directories that lack it when it is newer
        than the newest step the nodes hold whole (see the module docstring). Collective on the
        checkpoint's group. Returns the tier restore reads: "remote" when one was fetched."""
        from ..restore import peers
        from ..restore.fetch import fetch

        g, nodes = self.tiers.group, self.nodes
        held = peers.inventory(root.maybe()) if g.rank == nodes.leader() else {}
        per_node = peers.gather(g, nodes, held)
        whole, _ = peers.complete_steps(per_node)
        best = whole[0][0] if whole else None
        remote, listing_error = -1, None
        warned = self.root is None  # the store did not answer at construction: warned there
        if g.rank == 0:
            try:
                if warned:
                    raise CheckpointIOError(str(self.tiers.down))
                remote = max(self.root.steps(), default=-1)
            except CheckpointError as exc:
                remote, listing_error = -2, exc
        remote = g.all_gather([remote])[0][0]
        if remote == -2:
            if best is None:
                raise CheckpointIOError(
                    f"the local directories ({self.tiers.directory}) hold no step whole and "
                    f"remote={self.tiers.url} could not be read ({listing_error or 'see rank 0'}"
                    "); not starting from scratch while the store may hold the run: fix the "
                    "store's access and restart"
                )
            if g.rank == 0 and not warned:
                warnings.warn(
                    f"remote={self.tiers.url} could not be read ({listing_error}); restoring "
                    "from the node-local directories",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return "local"
        if remote < 0 or (best is not None and remote <= best):
            return "local" if best is not None else None
        failure: Exception | None = None
        if g.rank == nodes.leader() and remote not in per_node[nodes.node]:
            try:
                fetch(self.root, self.tiers.directory, newer_than=best)
            except Exception as exc:
                failure = exc
        bad = [r for r, (v,) in enumerate(g.all_gather([int(failure is not None)])) if v]
        if failure is not None:
            raise failure
        if bad:
            raise CheckpointError(
                f"rank(s) {bad} could not fetch step {remote} from remote={self.tiers.url} "
                "(their error is raised there)"
            )
        return "remote"
