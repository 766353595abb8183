"""Durability: data files, manifests, the commit protocol, the ``latest`` pointer and retention.

Commit protocol (each step is durable before the next one makes it visible):

1. every file is written into ``.tmp-step-<N>/`` and fdatasync'ed;
2. the temporary directory is fsync'ed, renamed to ``step-<N>`` and the parent is fsync'ed;
3. ``latest`` is replaced atomically (write + fsync a temporary file, rename, fsync the parent).
   It carries the main manifest's CRC32C, so a stale or damaged pointer is detected on restore.

A crash at any point leaves either no ``step-<N>`` (only a ``.tmp-*`` that the next start removes)
or a complete one. Retention runs only after the new checkpoint is committed, removes directories
by renaming them out of sight first (a crash mid-delete never leaves a half-deleted ``step-*``) and
never removes the checkpoint just committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ._core import fsync_dir, write_file
from .errors import CheckpointCorruptError
from .format import (
    LATEST,
    MAIN_MANIFEST,
    STEP_DIR,
    CheckpointInfo,
    encode_manifest,
    parse_main,
    read_manifest,
    step_dir_name,
)

_LATEST_MAX = 4096
ABANDONED = "abandoned"  # holds the checkpoints of abandoned branches (set_aside_newer)
_REPLACED = ".replaced-"  # prefix of a committed step moved aside by a save of the same step


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{step_dir_name(step)}"


def prepare_tmp(root: Path, step: int) -> Path:
    """A fresh, empty temporary directory for step ``step`` (a leftover from a crash is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_bytes(path: Path, data: bytes) -> None:
    """Write a small file durably (fdatasync) through the native writer."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    write_file(str(path), [(0, buf)] if buf is not None else [], size=len(data), fsync=True)


def write_manifest(path: Path, body: dict[str, Any]) -> int:
    """Write a manifest durably; returns its CRC32C."""
    data, crc = encode_manifest(body)
    write_bytes(path, data)
    return crc


def commit(root: Path, tmp: Path, step: int, manifest_crc: int) -> tuple[Path, list[Path]]:
    """Make the fully written ``tmp`` visible as ``step-<N>`` and point ``latest`` at it.

    Returns the committed directory and where :func:`set_aside_newer` moved the checkpoints of
    an abandoned branch (empty unless a step lower than existing ones was saved)."""
    fsync_dir(str(tmp))
    # before the rename: a crash in between then leaves the new branch's history, not the old one
    moved = set_aside_newer(root, step)
    final = root / step_dir_name(step)
    trash = None
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        # moved aside under a name clean_stale() puts back if the rename below never happened
        trash = root / f"{_REPLACED}{final.name}-{time.time_ns()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(str(root))
    write_latest(root, step, final.name, manifest_crc)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final, moved


def set_aside_newer(root: Path, step: int) -> list[Path]:
    """Move committed checkpoints of an abandoned branch out of the way of a save of ``step``.

    Saving a step lower than a committed one means training went back: a rollback (restore of an
    older step, say after a loss spike) or a new run in an old run's directory. Left in place,
    the higher steps would win every restore and outrank the new branch in retention, which
    would delete the new saves as they come. They are moved, not deleted: every step >= ``step``
    goes into ``abandoned/<UTC time>-before-step-<step>/`` under its own name, where restore,
    retention and listing no longer see it (move it back to use it again).
    """
    found = step_dirs(root)
    if not any(s > step for s, _ in found):
        return []  # at most the same step again: commit() replaces it, same lineage
    now = time.time_ns()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z"
    dest = root / ABANDONED / f"{stamp}-before-step-{step}"
    dest.mkdir(parents=True)
    moved = []
    for _, path in sorted(p for p in found if p[0] >= step):
        os.rename(path, dest / path.name)
        moved.append(dest / path.name)
    for d in (dest, dest.parent, root):
        fsync_dir(str(d))
    return moved


def write_latest(root: Path, step: int, name: str, manifest_crc: int) -> None:
    data = (
        json.dumps({"step": step, "path": name, "manifest_crc32c": manifest_crc}).encode() + b"\n"
    )
    tmp = root / f".latest.tmp-{os.getpid()}"
    write_bytes(tmp, data)
    os.replace(tmp, root / LATEST)
    fsync_dir(str(root))


def read_latest(root: Path) -> dict[str, Any] | None:
    """The ``latest`` pointer, strictly parsed; None if there is none; CheckpointCorruptError if
    damaged."""
    path = root / LATEST
    try:
        raw = path.read_bytes()[: _LATEST_MAX + 1]
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: unreadable: {exc}", path=str(path)) from None
    try:
        data = json.loads(raw) if len(raw) <= _LATEST_MAX else None
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
        raise CheckpointCorruptError(f"{path}: damaged checkpoint pointer", path=str(path))
    return data


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories, newest step first."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for e in entries:
        m = STEP_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            found.append((int(m.group(1)), Path(e.path)))
    return sorted(found, key=lambda x: x[0], reverse=True)


def load_info(path: Path) -> CheckpointInfo:
    """Main-manifest view of a checkpoint directory (CRC and fields checked, data not read)."""
    manifest = path / MAIN_MANIFEST
    body, crc = read_manifest(manifest)
    info = parse_main(body, str(manifest), crc)
    m = STEP_DIR.match(path.name)
    if m and int(m.group(1)) != info.step:
        raise CheckpointCorruptError(
            f"{manifest}: records step {info.step} but lives in {path.name}", path=str(manifest)
        )
    return info


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Checkpoints whose main manifest is intact, oldest first (data bytes are not verified)."""
    infos = []
    for _, path in step_dirs(root):
        try:
            infos.append(load_info(path))
        except CheckpointCorruptError:
            continue
    return sorted(infos, key=lambda i: i.step)


def apply_retention(root: Path, keep: int | None, committed: Path) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints, never ``committed``; returns what was
    removed."""
    if keep is None:
        return []
    removed = []
    for i, (_, path) in enumerate(step_dirs(root)):
        if i < keep or path == committed:
            continue
        trash = root / f".trash-{path.name}-{time.time_ns()}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    if removed:
        fsync_dir(str(root))
    return removed


def clean_stale(root: Path) -> None:
    """Remove what crashed saves left behind (temporary and trash directories, pointer temps).

    A committed step moved aside to be replaced by a new save of the same step
    (``.replaced-step-<N>-*``) is complete: if the crash came before the new ``step-<N>`` took its
    place, it is renamed back instead of deleted."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    replaced = sorted(
        (e for e in entries if e.name.startswith(_REPLACED) and e.is_dir(follow_symlinks=False)),
        key=lambda e: e.name,
        reverse=True,
    )  # newest first (same step: the ns suffix decides)
    restored = False
    for e in replaced:
        final = root / e.name[len(_REPLACED) :].rsplit("-", 1)[0]
        if STEP_DIR.match(final.name) and not final.exists():
            os.rename(e.path, final)
            restored = True
        else:
            shutil.rmtree(e.path, ignore_errors=True)
    if restored:
        fsync_dir(str(root))
    for e in entries:
        if e.name.startswith((".tmp-step-", ".trash-step-")) and e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        elif e.name.startswith(".latest.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(e.path)
