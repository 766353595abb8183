"""gpumem.checkpoint: near-zero-stall snapshots, background persist, checksummed atomic commits,
preemption handling and exact resume.

    ckpt = gpumem.Checkpointer("ckpts", keep=3)
    ckpt.save(step, model=model, optimizer=opt, scheduler=sched, extra={"epoch": e})
    step = ckpt.restore(model=model, optimizer=opt, scheduler=sched)
    gpumem.checkpoint.verify("ckpts/step-000000100")

Modules: format (manifests, validation), codec (state tree <-> JSON + tensors), state (capture
and the all-or-nothing load), validate (a tree against the objects), snapshot (layout, copies),
safe_fs (no-follow, descriptor-relative file access), persist (files, commit protocol,
retention), lock (one job per directory), job (one save in flight), restore (read + verify),
replicated (DDP state written once: owners, cross-rank checks), checkpointer (the API),
preemption (PreemptionGuard).
"""

from .checkpointer import Checkpointer
from .errors import (
    CheckpointBranchWarning,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
)
from .format import CheckpointInfo
from .job import SaveStats
from .preemption import PreemptionGuard
from .restore import verify

__all__ = [
    "CheckpointBranchWarning",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointIOError",
    "CheckpointInfo",
    "CheckpointPointerWarning",
    "CheckpointStateError",
    "Checkpointer",
    "PreemptionGuard",
    "SaveStats",
    "verify",
]
