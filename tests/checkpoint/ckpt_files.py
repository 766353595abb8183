"""Path-level views of a checkpoint directory for tests (the library works on directory
descriptors: gpumem.checkpoint.storage.safe_fs.Dir), and the framing of hand-made manifests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpumem.checkpoint.storage import directory as persist
from gpumem.checkpoint.storage import format
from gpumem.checkpoint.storage.format import CheckpointInfo
from gpumem.checkpoint.storage.safe_fs import Dir


def read_manifest(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(body, CRC) of the manifest file at ``path``."""
    path = Path(path)
    with Dir.open(path.parent) as d:
        body, crc, _ = persist.read_manifest(d, path.name)
    return body, crc


def encode_manifest(body: dict[str, Any]) -> tuple[bytes, int]:
    """A hand-made (or hand-edited) manifest framed as the version its fields call for, as a
    writer that forged it would: (file bytes, CRC32C)."""
    fields = body if isinstance(body, dict) else {}
    version = format.format_version(
        replicated=fields.get("replicated") is True,
        sharded=fields.get("sharded") is True or "meshes" in fields,
    )
    return format.encode_manifest(body, version)


def load_info(step_dir: str | os.PathLike) -> CheckpointInfo:
    with Dir.open(step_dir) as d:
        return persist.load_info(d)


def step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed checkpoints, newest first, as (step, path)."""
    if not Path(root).is_dir():
        return []
    with Dir.open(root) as d:
        return [(s, Path(root) / name) for s, name in persist.step_dirs(d)]


def read_latest(root: str | os.PathLike) -> dict[str, Any] | None:
    with Dir.open(root) as d:
        return persist.read_latest(d)
