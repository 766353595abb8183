"""``fetch``: the newest good checkpoint of an object-store root, copied into a local directory
and checked there completely (``verify``), falling back to older steps as ``restore`` does.

The copy is ``storage.s3.object_root.ObjectRoot.download_step`` (manifests checked as read, sizes
before reading); every byte is then checked by the same ``verify`` as a local directory, so the
trust rules are the directory's. A damaged step's local copy is removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ..errors import CheckpointCorruptError, CheckpointFallbackWarning
from ..storage.format import CheckpointInfo, step_dir_name
from ..storage.s3.object_root import ObjectRoot
from .verify import verify


def fetch(root: ObjectRoot, dest: str | os.PathLike, newer_than: int | None = None) -> Path | None:
    """The newest committed step of ``root`` that downloads and verifies, as
    ``dest/step-<N>``; a damaged one is skipped with a ``CheckpointFallbackWarning``. None when
    no step is committed (or none is intact); with ``newer_than``, only steps above it are
    tried (the tiers: older ones are in the local directory already).

    Raises:
        CheckpointIOError: the store or the local disk failed (not a damaged checkpoint).
    """
    for step in root.steps():
        if newer_than is not None and step <= newer_than:
            break
        path = Path(os.fsdecode(dest)) / step_dir_name(step)
        try:
            root.download_step(step, dest)
            verify(path)
            return path
        except CheckpointCorruptError as exc:
            if path.is_dir() and not path.is_symlink():  # what download_step wrote, unverified
                shutil.rmtree(path, ignore_errors=True)
            warnings.warn(
                f"skipped step {step} at {root.url}: {exc}", CheckpointFallbackWarning, stacklevel=2
            )
    return None


def verify_step(root: ObjectRoot, step: int) -> CheckpointInfo:
    """Check committed step ``step`` of ``root`` completely (as ``verify`` checks a directory):
    copied into a temporary directory, verified there, removed.

    Raises:
        CheckpointCorruptError: naming the object at fault.
    """
    with tempfile.TemporaryDirectory(prefix="gpumem-verify-") as tmp:
        return verify(root.download_step(step, tmp))
