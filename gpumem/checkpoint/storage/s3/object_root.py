"""A checkpoint root in an object store (``s3://bucket/prefix``): the directory's format and commit
rules, on objects.

Layout under the prefix::

    step-<N>/<save>/MANIFEST, manifest-r*, data-r*-*.bin   one save's files, named as in a step
                                                          directory, under the save's own id
    step-<N>/COMMIT        {"save": id, "manifest_crc32c": crc}: the commit of step N
    latest                 the directory's pointer, same fields, moved by conditional put

Commit rules (the directory's, with a conditional put where it has a rename):

- a save uploads its data files (multipart from memory, each part and object with its CRC32C),
  then its shard manifests, then its main manifest, and only then writes ``COMMIT`` with
  ``If-None-Match: *``: **that put is the commit**. Of two jobs committing one step exactly one
  wins; the other's objects are deleted and it gets ``CheckpointStateError``;
- each save's files live under a fresh id, so a failed, killed or losing save never touches a
  byte of a committed one, and what it leaves (objects, incomplete uploads) is never read:
  only a ``COMMIT`` makes a step visible, and ``clean_stale`` removes the rest;
- ``latest`` moves by ``If-Match`` on the version it replaces (``If-None-Match`` where there is
  none) and never back to an older step; restore does not depend on it;
- retention runs after a commit and deletes a step's ``COMMIT`` first (it stops being visible),
  then its files; never the step just committed.

Reading applies the directory's trust rules: every manifest is read through ``ObjectFiles`` (the
read side of ``safe_fs.Dir``) by the directory's own ``load_info`` and ``load_shard_manifest``, so
size caps, framing, CRC32C and every field are checked as for files; a data object's size is
checked against its shard manifest before a byte is read; ``fetch`` downloads a step into a
local directory, where ``restore.fetch`` runs the full ``verify`` on it and falls back to the
next older step (with a ``CheckpointFallbackWarning``) when one is damaged.

This is what a node-local tier needs (upload a committed local step, fetch one back), what
``gpumem ckpt`` reads, and what ``Checkpointer("s3://...")`` saves to directly
(``object_commit``: each rank uploads its own files from the staging arena) and
restores from (``restore.candidates`` over ``object_backend.ObjectCandidates``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpumem import _strict_json

from ...errors import (
    CheckpointCorruptError,
    CheckpointStateError,
)
from ..directory import load_info, load_shard_manifest
from ..format import (
    LATEST,
    MAIN_MANIFEST,
    MAX_MANIFEST_BYTES,
    CheckpointInfo,
    step_dir_name,
)
from ..safe_fs import Dir
from .object_files import ObjectFiles
from .object_store import S3Store
from .object_upload import StepUploads

COMMIT = "COMMIT"
ABANDONED = "abandoned"  # going back: the newer steps' commit records, set aside
_COMMIT_KEY = re.compile(r"^step-(\d{1,19})/COMMIT$")
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_SMALL = 4096  # COMMIT and latest are a line of JSON


class ObjectRoot(StepUploads):
    """The checkpoints under one ``s3://`` root (see the module docstring).

    Args:
        store: the opened store (``S3Store``: endpoint, credentials and probe done there).
        part_bytes, budget_bytes: of the multipart uploads (see ``S3Store.upload``).
    """

    def __init__(
        self, store: S3Store, *, part_bytes: int = 64 << 20, budget_bytes: int = 512 << 20
    ):
        self.store = store
        self.part_bytes, self.budget_bytes = part_bytes, budget_bytes

    @property
    def url(self) -> str:
        return str(self.store.url)

    def _key(self, name: str) -> str:
        return self.store.url.key(name)

    # ------------------------------------------------------------------ writing

    def save_files(self, step: int, save: str) -> ObjectFiles:
        """The files of save ``save`` (a fresh ``uuid4().hex``) of step ``step``, to write."""
        key = self._key(f"{step_dir_name(step)}/{save}")
        return ObjectFiles(self.store, key, self.part_bytes, self.budget_bytes)

    def commit_save(self, step: int, save: str, manifest_crc: int) -> bool:
        """**The commit**: ``step-<N>/COMMIT`` naming ``save`` by conditional put; False when
        another save committed step N first (nothing was changed then)."""
        return self.store.put_new(
            self._key(f"{step_dir_name(step)}/{COMMIT}"),
            _json({"save": save, "manifest_crc32c": manifest_crc}),
        )

    def move_latest(self, step: int, crc: int, back: bool = False) -> None:
        """Point ``latest`` at ``step`` unless it points at a newer one (``back``: even then,
        after going back), by conditional put."""
        key = self._key(LATEST)
        data = _json({"step": step, "path": step_dir_name(step), "manifest_crc32c": crc})
        for _ in range(self.store.max_attempts):
            got = self.store.get(key, max_bytes=_SMALL)
            if got is None:
                if self.store.put_new(key, data):
                    return
                continue
            current, etag = got
            try:
                old = _strict_json.loads(current)
                if (
                    isinstance(old, dict)
                    and isinstance(old.get("step"), int)
                    and old["step"] > step
                    and not back
                ):
                    return  # a newer commit moved it already
            except (ValueError, RecursionError):
                pass  # a damaged pointer is replaced
            if self.store.put_over(key, data, etag) is not None:
                return
        raise CheckpointStateError(f"{self.url}/latest kept moving under concurrent commits")

    def set_aside_newer(self, step: int) -> list[str]:
        """Going back (a save of ``step`` below committed steps): each newer step stops being
        visible, its ``COMMIT`` record moved to ``abandoned/step-<N>-<save>/COMMIT`` and its
        files kept (``clean_stale`` leaves them). Returns where each record went."""
        moved = []
        for newer in self.steps():
            if newer <= step:
                break
            key = self._key(f"{step_dir_name(newer)}/{COMMIT}")
            try:
                record = self._commit_record(newer)
                name = f"{ABANDONED}/{step_dir_name(newer)}-{record['save']}"
                self.store.put(self._key(f"{name}/{COMMIT}"), _json(record))
            except CheckpointCorruptError:
                name = f"{ABANDONED}/{step_dir_name(newer)}-damaged"
            self.store.delete([key])
            moved.append(f"{self.url}/{name}")
        return moved

    def _abandoned_saves(self) -> set[str]:
        found = set()
        for obj in self.store.list(f"{ABANDONED}/"):
            m = re.search(r"/step-\d{1,19}-([0-9a-f]{32})/COMMIT$", obj.key)
            if m:
                found.add(m.group(1))
        return found

    def apply_retention(self, keep: int | None, committed: int) -> list[int]:
        """Delete all but the ``keep`` newest committed steps (never ``committed``): each one's
        ``COMMIT`` first, then its files. Returns the steps removed."""
        if keep is None:
            return []
        removed = []
        for i, step in enumerate(self.steps()):
            if i < keep or step == committed:
                continue
            self.store.delete([self._key(f"{step_dir_name(step)}/{COMMIT}")])
            self._delete_prefix(f"{step_dir_name(step)}/")
            removed.append(step)
        return removed

    def clean_stale(self, older_than_s: float = 24 * 3600.0) -> list[str]:
        """Remove what killed or losing saves left, older than ``older_than_s`` (a live job's
        upload in progress is younger): incomplete multipart uploads, and files of saves that
        no ``COMMIT`` names. Returns what was removed (keys, and ``upload:<key>``)."""
        cutoff = time.time() - older_than_s
        removed = []
        for up in self.store.uploads():
            if up.initiated < cutoff:
                self.store.abort(up)
                removed.append(f"upload:{up.key}")
        committed = {}
        for step in self.steps():
            with contextlib.suppress(CheckpointCorruptError):
                committed[step] = self._commit_record(step)["save"]
        orphans, kept = [], self._abandoned_saves()
        for obj, modified in self._objects_with_times():
            rel = obj[len(self._key("")) :] if self.store.url.prefix else obj
            m = re.match(r"^step-(\d{1,19})/([0-9a-f]{32})/", rel)
            if (
                m
                and committed.get(int(m.group(1))) != m.group(2)
                and m.group(2) not in kept  # an abandoned branch's files stay, as on disk
                and modified < cutoff
            ):
                orphans.append(obj)
        self.store.delete(orphans)
        return removed + orphans

    def _objects_with_times(self) -> Iterator[tuple[str, float]]:
        for obj in self.store.list():
            yield obj.key, obj.modified if obj.modified is not None else time.time()

    def _delete_prefix(self, prefix: str) -> None:
        self.store.delete([o.key for o in self.store.list(prefix)])

    # ------------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """The committed steps (a ``COMMIT`` exists), newest first."""
        found = []
        for obj in self.store.list("step-"):
            rel = obj.key[len(self._key("")) :] if self.store.url.prefix else obj.key
            m = _COMMIT_KEY.match(rel)
            if m:
                found.append(int(m.group(1)))
        return sorted(found, reverse=True)

    def _commit_record(self, step: int) -> dict[str, Any]:
        key = self._key(f"{step_dir_name(step)}/{COMMIT}")
        name = f"s3://{self.store.url.bucket}/{key}"
        got = self.store.get(key, max_bytes=_SMALL)
        if got is None:
            raise CheckpointCorruptError(f"{name}: the commit record is missing", path=name)
        try:
            data = _strict_json.loads(got[0])
        except (ValueError, RecursionError):
            data = None
        if not (
            isinstance(data, dict)
            and set(data) == {"save", "manifest_crc32c"}
            and isinstance(data["save"], str)
            and _SAVE_ID.match(data["save"])
            and isinstance(data["manifest_crc32c"], int)
        ):
            raise CheckpointCorruptError(f"{name}: damaged commit record", path=name)
        return data

    def open_step(self, step: int) -> tuple[ObjectFiles, CheckpointInfo]:
        """The committed step ``step``: its files and its main manifest, checked (the manifest's
        CRC32C against the commit record, its step against N).

        Raises:
            CheckpointCorruptError: naming the object at fault.
        """
        record = self._commit_record(step)
        files = ObjectFiles(
            self.store,
            self._key(f"{step_dir_name(step)}/{record['save']}"),
            self.part_bytes,
            self.budget_bytes,
            doing="restore",
        )
        info = load_info(files)
        manifest = str(files.path / MAIN_MANIFEST)
        if info.manifest_crc32c != record["manifest_crc32c"]:
            raise CheckpointCorruptError(
                f"{manifest}: CRC32C {info.manifest_crc32c:08x} is not the committed "
                f"{record['manifest_crc32c']:08x}",
                path=manifest,
            )
        if info.step != step:
            raise CheckpointCorruptError(
                f"{manifest}: records step {info.step} but is committed as step {step}",
                path=manifest,
            )
        return files, info

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifests are intact, oldest first (data not read)."""
        infos = []
        for step in self.steps():
            with contextlib.suppress(CheckpointCorruptError):
                infos.append(self.open_step(step)[1])
        return sorted(infos, key=lambda i: i.step)

    def download_step(self, step: int, dest: str | os.PathLike) -> Path:
        """Copy committed step ``step`` into ``dest/step-<N>`` (which must not exist), manifests
        checked as read, each data object's size checked against its shard manifest before it
        is read; one file is in memory at a time. ``restore.fetch`` then checks every byte
        (``verify``); a failure removes what was written locally.

        Raises:
            CheckpointCorruptError: the step is damaged.
        """
        files, info = self.open_step(step)
        name = step_dir_name(step)
        with Dir.open(dest, create=True) as root:
            out = root.make_sub(name)
            try:
                with out:
                    for r in range(info.world_size):
                        shard = load_shard_manifest(files, info, r)
                        for fname, size in shard.files.items():
                            key = f"{files.key}/{fname}"
                            files.check_size(fname, size)  # before memory is taken for it
                            buf = np.empty(size, dtype=np.uint8)
                            self.store.read_into(
                                key,
                                0,
                                buf,
                                object_size=size,
                                range_bytes=self.part_bytes,
                                deadline=files.deadline,
                            )
                            out.write_pieces(fname, [(0, buf)] if size else [], size, False)
                    for manifest in [*(ref.file for ref in info.shards), MAIN_MANIFEST]:
                        data = files.read_small(manifest, MAX_MANIFEST_BYTES, "manifest")
                        out.write_new(manifest, data)
                    out.fsync()
            except BaseException:
                root.discard_tree(name)
                raise
        return Path(os.fsdecode(dest)) / name


def _json(obj: dict[str, Any]) -> bytes:
    import json

    return json.dumps(obj).encode() + b"\n"
