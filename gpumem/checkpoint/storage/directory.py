"""The checkpoint directory: manifest files, the commit protocol, the ``latest`` pointer, retention.

Commit protocol (each step is durable before the next one makes it visible):

1. every file is written into ``.tmp-step-<N>/`` and fdatasync'ed;
2. the temporary directory is fsync'ed, renamed to ``step-<N>`` and the parent is fsync'ed:
   **this rename is the commit**;
3. ``latest`` is replaced atomically (write + fsync a temporary file, rename, fsync the parent).
   It carries the main manifest's CRC32C, so a stale or damaged pointer is detected on restore,
   and restore never depends on it: a failure here leaves the step committed and the pointer
   behind, which ``commit`` reports instead of raising.

A crash at any point leaves either no ``step-<N>`` (only a ``.tmp-*`` that the next start removes)
or a complete one. Retention runs only after the new checkpoint is committed, removes directories
by renaming them out of sight first (a crash mid-delete never leaves a half-deleted ``step-*``) and
never removes the checkpoint just committed. Everything here works through ``safe_fs.Dir``
descriptors: nothing is created through, renamed into or removed behind a symbolic link.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpumem import _strict_json
from gpumem._gc import paused as paused_gc

from ..errors import CheckpointCorruptError, CheckpointIOError, CheckpointStateError
from .format import (
    LATEST,
    MAIN_MANIFEST,
    MAX_MANIFEST_BYTES,
    STEP_DIR,
    CheckpointInfo,
    Manifest,
    ShardManifest,
    decode_manifest,
    encode_manifest,
    parse_main,
    parse_shard,
    step_dir_name,
)
from .safe_fs import Dir, io_error, read_error
from .step_reads import StepFiles

_LATEST_MAX = 4096
ABANDONED = "abandoned"  # holds the checkpoints of abandoned branches (set_aside_newer)
_REPLACED = ".replaced-"  # prefix of a committed step moved aside by a save of the same step
_STALE = (".tmp-step-", ".trash-step-", ".latest.tmp-")  # what crashed or failed saves leave


def tmp_name(step: int) -> str:
    return f".tmp-{step_dir_name(step)}"


def prepare_tmp(root: Dir, step: int) -> Dir:
    """A fresh, empty temporary directory for step ``step``: a leftover of a crash is removed
    (a link planted under that name is unlinked, never followed)."""
    root.remove_tree(tmp_name(step))
    return root.make_sub(tmp_name(step))


def write_manifest(d: Dir, name: str, manifest: Manifest) -> int:
    """Write a manifest (``format.shard_manifest`` / ``main_manifest``) durably as a new file;
    returns its CRC32C.

    Raises:
        CheckpointStateError: the manifest would be larger than any reader accepts (the state
            saved beside the tensors is too large: store big values as tensors).
    """
    data, crc = encode_manifest(manifest.body, manifest.version)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointStateError(
            f"{d.path / name}: the manifest would be {len(data)} bytes, over the "
            f"{MAX_MANIFEST_BYTES} byte limit readers enforce; store large values (lists of "
            "numbers, long strings) as tensors or NumPy arrays"
        )
    d.write_new(name, data)
    return crc


def read_manifest(
    d: StepFiles, name: str, *, native_tensors: bool = False
) -> tuple[dict[str, Any], int, int]:
    """Read (a regular file, size bounded before reading) and decode one manifest: (body, CRC32C,
    version); ``native_tensors``: see ``format.decode_manifest``."""
    data = d.read_small(name, MAX_MANIFEST_BYTES, "manifest")
    return decode_manifest(data, str(d.path / name), native_tensors=native_tensors)


@dataclass
class Committed:
    """What ``commit`` did: the step directory (committed), the abandoned branch it set aside,
    and why ``latest`` still points elsewhere (None: it was moved); ``committed_at``: when the
    rename was durable (``time.perf_counter``), before ``latest`` moved."""

    name: str
    set_aside: list[str] = field(default_factory=list)
    pointer_error: OSError | None = None
    committed_at: float = 0.0


def commit(root: Dir, tmp: Dir, step: int, manifest_crc: int) -> Committed:
    """Make the fully written ``tmp`` visible as ``step-<N>`` (the commit), then point ``latest``
    at it. The step is committed once the rename is durable (the directory synced after it); a
    failure before that raises and commits nothing (a rename whose sync failed is undone,
    ``_rolled_back``). A failure to move ``latest`` is returned in ``pointer_error``."""
    tmp.fsync()
    # before the rename: a crash in between then leaves the new branch's history, not the old one
    moved = set_aside_newer(root, step)
    final = step_dir_name(step)
    replaced = None
    if root.lstat(final) is not None:  # the same step saved again (e.g. after a resume)
        # moved aside under a name clean_stale() puts back if the rename below never happened
        replaced = f"{_REPLACED}{final}-{time.time_ns()}"
        root.rename(final, root, replaced)
    root.rename(tmp_name(step), root, final)
    try:
        root.fsync()
    except OSError as exc:
        raise _rolled_back(root, step, final, exc) from None
    done = Committed(final, moved, committed_at=time.perf_counter())
    try:
        write_latest(root, step, final, manifest_crc)
    except OSError as exc:
        done.pointer_error = exc
    if replaced is not None:
        root.discard_tree(replaced)
    return done


def _rolled_back(root: Dir, step: int, final: str, exc: OSError) -> CheckpointIOError:
    """The commit rename stands but syncing the directory failed, so whether it survives a crash
    is unknown: the save fails, and so that a failed save commits nothing (what a restore and the
    caller see agree) the rename is undone. The caller's clean-up (``clean_stale``) then removes
    the files and puts back a committed step it was replacing."""
    try:
        uncommit(root, step, final)
        undone = f"{final} was renamed back: nothing was committed, the previous steps stand"
    except OSError as undo:
        undone = (
            f"renaming {final} back failed too ({undo.strerror or undo}): it stays in place, "
            "and a restore verifies every byte of it before using it"
        )
    return CheckpointIOError(
        f"syncing {root.path} after the commit rename failed ({exc.strerror or exc}); {undone}",
        errno=exc.errno,
        filename=str(root.path),
    )


def uncommit(root: Dir, step: int, final: str) -> None:
    """Take back the committed ``final`` (``step-<N>``) of a save that failed after all: renamed
    back to its temporary name, which ``clean_stale`` then removes. Raises OSError."""
    root.rename(final, root, tmp_name(step))
    with contextlib.suppress(OSError):  # the step is gone from view; only durability is at stake
        root.fsync()


def set_aside_newer(root: Dir, step: int) -> list[str]:
    """Move committed checkpoints of an abandoned branch out of the way of a save of ``step``.

    Saving a step lower than a committed one means training went back: a rollback (restore of an
    older step, say after a loss spike) or a new run in an old run's directory. Left in place,
    the higher steps would win every restore and outrank the new branch in retention, which
    would delete the new saves as they come. They are moved, not deleted: every step >= ``step``
    goes into ``abandoned/<UTC time>-before-step-<step>/`` under its own name, where restore,
    retention and listing no longer see it (move it back to use it again). Returns the new
    paths. An ``abandoned`` that is not a plain directory (a symbolic link) is refused.
    """
    found = step_dirs(root)
    if not any(s > step for s, _ in found):
        return []  # at most the same step again: commit() replaces it, same lineage
    now = time.time_ns()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z"
    try:
        aside = root.ensure_sub(ABANDONED)
    except OSError as exc:
        raise read_error(exc, root.path / ABANDONED, "opening") from None
    moved = []
    with aside, aside.make_sub(f"{stamp}-before-step-{step}") as dest:
        for _, name in sorted(p for p in found if p[0] >= step):
            root.rename(name, dest, name)
            moved.append(str(dest.path / name))
        for d in (dest, aside, root):
            d.fsync()
    return moved


def write_latest(root: Dir, step: int, name: str, manifest_crc: int) -> None:
    data = (
        json.dumps({"step": step, "path": name, "manifest_crc32c": manifest_crc}).encode() + b"\n"
    )
    tmp = f".latest.tmp-{os.getpid()}"
    root.remove_tree(tmp)  # a stale one (this pid's crashed predecessor): never written through
    root.write_new(tmp, data)
    root.replace(tmp, LATEST)
    root.fsync()


def read_latest(root: Dir) -> dict[str, Any] | None:
    """The ``latest`` pointer, strictly parsed; None if there is none; CheckpointCorruptError if
    damaged (or not a small regular file)."""
    try:
        if root.lstat(LATEST) is None:
            return None
    except OSError as exc:
        raise read_error(exc, root.path / LATEST, "reading") from None
    raw = root.read_small(LATEST, _LATEST_MAX, "the latest pointer")
    try:
        data = _strict_json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    ok = (
        isinstance(data, dict)
        and set(data) == {"step", "path", "manifest_crc32c"}
        and isinstance(data["step"], int)
        and isinstance(data["manifest_crc32c"], int)
        and isinstance(data["path"], str)
        and STEP_DIR.match(data["path"]) is not None
    )
    if not ok:
        path = root.path / LATEST
        raise CheckpointCorruptError(f"{path}: damaged checkpoint pointer", path=str(path))
    return data


def step_dirs(root: Dir) -> list[tuple[int, str]]:
    """Committed checkpoint directories (real ones: a link named ``step-*`` is not one), newest
    step first, as (step, name)."""
    try:
        entries = root.entries()
    except OSError as exc:
        raise io_error(exc, root.path, "listing") from None
    found = []
    for e in entries:
        m = STEP_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            found.append((int(m.group(1)), e.name))
    return sorted(found, key=lambda x: x[0], reverse=True)


def open_step(root: Dir, name: str) -> Dir:
    """The checkpoint directory ``name`` in ``root``; a link or a file there is damage."""
    try:
        return root.sub(name)
    except OSError as exc:
        raise read_error(exc, root.path / name, "opening") from None


def load_info(step: StepFiles) -> CheckpointInfo:
    """Main-manifest view of a checkpoint directory (CRC and fields checked, data not read)."""
    body, crc, version = read_manifest(step, MAIN_MANIFEST)
    manifest = str(step.path / MAIN_MANIFEST)
    info = parse_main(body, manifest, crc, version)
    m = STEP_DIR.match(step.path.name)
    if m and int(m.group(1)) != info.step:
        raise CheckpointCorruptError(
            f"{manifest}: records step {info.step} but lives in {step.path.name}", path=manifest
        )
    return info


def load_shard_manifest(step: StepFiles, info: CheckpointInfo, rank: int) -> ShardManifest:
    """Rank ``rank``'s shard manifest of the checkpoint ``info`` describes, checked against it
    (its CRC32C as recorded, the same rank, world size, step, replicated flag and tensor bytes)."""
    ref = info.shards[rank]
    file = step.path / ref.file
    with paused_gc():  # millions of small acyclic objects for a large shard (gpumem._gc)
        body, crc, version = read_manifest(step, ref.file, native_tensors=True)
        if crc == ref.crc32c:
            shard = parse_shard(body, str(file), crc, version)
    if crc != ref.crc32c:
        raise CheckpointCorruptError(
            f"{file}: CRC32C {crc:08x} differs from {ref.crc32c:08x} recorded in the main manifest "
            "(a shard from another save)",
            path=str(file),
        )
    if shard.rank != rank or shard.world_size != info.world_size or shard.step != info.step:
        raise CheckpointCorruptError(
            f"{file}: rank/world size/step disagree with the main manifest", path=str(file)
        )
    if shard.replicated != info.replicated:
        raise CheckpointCorruptError(
            f"{file}: marked replicated={shard.replicated}, the main manifest "
            f"replicated={info.replicated}",
            path=str(file),
        )
    if sum(t.nbytes for t in shard.tensors) != ref.nbytes:
        raise CheckpointCorruptError(
            f"{file}: tensor bytes differ from the main manifest", path=str(file)
        )
    return shard


def list_checkpoints(root: Dir) -> list[CheckpointInfo]:
    """Checkpoints whose main manifest is intact, oldest first (data bytes are not verified)."""
    infos = []
    for _, name in step_dirs(root):
        try:
            with open_step(root, name) as step:
                infos.append(load_info(step))
        except CheckpointCorruptError:
            continue
    return sorted(infos, key=lambda i: i.step)


def apply_retention(root: Dir, keep: int | None, committed: str) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints, never ``committed``; returns the names
    removed."""
    if keep is None:
        return []
    removed = []
    for i, (_, name) in enumerate(step_dirs(root)):
        if i < keep or name == committed:
            continue
        trash = f".trash-{name}-{time.time_ns()}"
        root.rename(name, root, trash)
        root.discard_tree(trash)
        removed.append(name)
    if removed:
        root.fsync()
    return removed


def clean_stale(root: Dir) -> None:
    """Remove what crashed or failed saves left behind (temporary and trash directories, pointer
    temps), best effort: what cannot be removed now is tried again by the next save.

    A committed step moved aside to be replaced by a new save of the same step
    (``.replaced-step-<N>-*``) is complete: if the crash came before the new ``step-<N>`` took its
    place, it is renamed back instead of deleted."""
    try:
        entries = root.entries()
    except OSError:
        return  # best effort: the next save or start tries again
    replaced = sorted(
        (e for e in entries if e.name.startswith(_REPLACED)), key=lambda e: e.name, reverse=True
    )  # newest first (same step: the ns suffix decides)
    restored = False
    for e in replaced:
        final = e.name[len(_REPLACED) :].rsplit("-", 1)[0]
        try:
            if e.is_dir(follow_symlinks=False) and STEP_DIR.match(final) and not root.lstat(final):
                root.rename(e.name, root, final)
                restored = True
                continue
        except OSError:
            pass
        root.discard_tree(e.name)
    for e in entries:
        if e.name.startswith(_STALE):
            root.discard_tree(e.name)
    if restored:
        with contextlib.suppress(OSError):  # the rename stands; only its durability is at stake
            root.fsync()
