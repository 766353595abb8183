"""Uploading a committed local step to an object root (the tiers' side of ``ObjectRoot``): its
data files sent from the page cache (``mmap``), then its manifests, then the conditional commit.

``upload_step`` sends a whole step (a directory every rank shares: rank 0 uploads it);
``upload_rank`` and ``commit_uploaded`` split it for node-local directories, where each rank
sends its own data files and rank 0 commits once all did (``checkpoint.node_uploads``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointStateError
from ..directory import load_info, load_shard_manifest
from ..format import MAIN_MANIFEST, MAX_MANIFEST_BYTES, step_dir_name
from ..safe_fs import Dir, release_fd


@dataclass
class UploadedStep:
    """What ``upload_step`` did: the step and save committed, the bytes sent, the steps that
    retention removed, and why ``latest`` was not moved (None: it was)."""

    step: int
    save: str
    nbytes: int
    removed: list[int] = field(default_factory=list)
    pointer_error: CheckpointError | None = None
    set_aside: list[str] = field(default_factory=list)


class StepUploads:
    """``ObjectRoot``'s upload methods (a base class of it: ``store``, ``commit_save``,
    ``move_latest``, ``set_aside_newer``, ``apply_retention`` and ``_delete_prefix`` are its)."""

    store: Any
    part_bytes: int
    budget_bytes: int
    url: Any
    _key: Any
    commit_save: Any
    move_latest: Any
    set_aside_newer: Any
    apply_retention: Any
    _delete_prefix: Any

    def upload_step(
        self, local: str | os.PathLike, keep: int | None = None, back: bool = False
    ) -> UploadedStep:
        """Upload the committed local checkpoint directory ``local`` (a ``step-<N>``) and commit
        it here as step N; then (``back``: the local save went back) set the newer steps aside,
        move ``latest`` and apply retention (``keep`` newest).

        The local step is checked first (its manifests, as restore checks them); its data
        files are sent from the page cache (``mmap``), not read into a copy.

        Raises:
            CheckpointStateError: step N is already committed here (by this or another job).
            CheckpointCorruptError: the local step is damaged.
            CheckpointIOError: the store failed (what was uploaded is deleted again).
        """
        save = uuid.uuid4().hex
        with Dir.open(local) as src:
            info = load_info(src)
            shards = [load_shard_manifest(src, info, r) for r in range(info.world_size)]
            try:
                sent = sum(self._upload_shard(src, s, info.step, save) for s in shards)
            except BaseException:
                self._delete_prefix(f"{step_dir_name(info.step)}/{save}/")
                raise
        done = self.commit_uploaded(local, save, keep, back)
        done.nbytes = sent
        return done

    def upload_rank(self, local: str | os.PathLike, rank: int, save: str) -> int:
        """Upload the data files of saved rank ``rank`` of the committed local step ``local``
        under save ``save`` (tiers on node-local directories: each rank sends its own, then rank
        0 calls ``commit_uploaded``). Returns the bytes sent; what it sent stays on a failure
        (``commit_uploaded`` is never called then; rank 0 deletes the save's objects)."""
        with Dir.open(local) as src:
            info = load_info(src)
            sent = self._upload_shard(src, load_shard_manifest(src, info, rank), info.step, save)
        return sent

    def _upload_shard(self, src: Dir, shard: Any, step: int, save: str) -> int:
        base = f"{step_dir_name(step)}/{save}"
        return sum(
            self._upload_file(src, name, size, f"{base}/{name}")
            for name, size in shard.files.items()
        )

    def commit_uploaded(
        self, local: str | os.PathLike, save: str, keep: int | None = None, back: bool = False
    ) -> UploadedStep:
        """Once every saved rank's data files of the local step ``local`` are up under ``save``:
        its shard manifests, then its main manifest, then the commit; then (``back``) the newer
        steps set aside, ``latest`` moved and retention applied (``keep`` newest). A failure
        before the commit deletes the save's objects.

        Raises:
            CheckpointStateError: step N is already committed here (by this or another job).
            CheckpointCorruptError: the local step is damaged.
            CheckpointIOError: the store failed.
        """
        with Dir.open(local) as src:
            info = load_info(src)
            base = f"{step_dir_name(info.step)}/{save}"
            try:
                # the shard manifests, then the main one, last: a listing of the save's files
                # never shows a manifest before what it describes
                for name in [*(ref.file for ref in info.shards), MAIN_MANIFEST]:
                    data = src.read_small(name, MAX_MANIFEST_BYTES, "manifest")
                    self.store.put(self._key(f"{base}/{name}"), data)
                won = self.commit_save(info.step, save, info.manifest_crc32c)
            except BaseException:
                self._delete_prefix(f"{base}/")
                raise
        if not won:
            self._delete_prefix(f"{base}/")
            raise CheckpointStateError(
                f"step {info.step} is already committed at {self.url} (by another save or job); "
                "its checkpoint was kept and this one discarded"
            )
        done = UploadedStep(info.step, save, 0)
        if back:
            done.set_aside = self.set_aside_newer(info.step)
        try:
            self.move_latest(info.step, info.manifest_crc32c, back=bool(done.set_aside))
        except CheckpointError as exc:
            done.pointer_error = exc
        done.removed = self.apply_retention(keep, info.step)
        return done

    def discard_save(self, step: int, save: str) -> None:
        """Delete the objects of an uncommitted save ``save`` of ``step`` (best effort)."""
        with contextlib.suppress(CheckpointError):
            self._delete_prefix(f"{step_dir_name(step)}/{save}/")

    def _upload_file(self, src: Dir, name: str, size: int, key: str) -> int:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=src.fd)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                path = str(src.path / name)
                raise CheckpointCorruptError(
                    f"{path}: {actual} bytes on disk, manifest says {size}", path=path
                )
            if size == 0:
                self.store.upload(self._key(key), [b""])
                return 0
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            try:
                view = memoryview(mm)
                try:
                    self.store.upload(
                        self._key(key),
                        [view],
                        part_bytes=self.part_bytes,
                        budget_bytes=self.budget_bytes,
                    )
                finally:
                    view.release()
            finally:
                # a failed upload's traceback still holds slices of the map: closing it then
                # raises BufferError, which would replace the upload's own error; the map goes
                # with the last slice instead
                with contextlib.suppress(BufferError):
                    mm.close()
        finally:
            release_fd(fd, src.path / name)  # read only: its close failing loses nothing
        return size
