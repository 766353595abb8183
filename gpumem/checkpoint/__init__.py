"""gpumem.checkpoint: near-zero-stall snapshots, background persist, checksummed atomic commits,
preemption handling and exact resume.

    ckpt = gpumem.Checkpointer("ckpts", keep=3)
    ckpt.save(step, model=model, optimizer=opt, scheduler=sched, extra={"epoch": e})
    step = ckpt.restore(model=model, optimizer=opt, scheduler=sched)
    gpumem.checkpoint.verify("ckpts/step-000000100")

A save goes through the stages in order: capture (the objects become a JSON tree and tensors),
stage (the tensors are copied into host memory), storage (written, checksummed, committed); a
restore goes through restore (the newest checkpoint that verifies, checked and loaded all or
nothing). docs/architecture.md follows one save and one restore through the modules.

Modules:
    checkpointer  Checkpointer, the façade: save / restore / prepare / wait / close
    settings      CheckpointerConfig: every argument documented and validated once
    factory       the storage a Checkpointer uses, picked from its root and the environment
    save          Save: one save in flight (its snapshot, its commit, the persist thread)
    save_setup    SaveSetup: the parts every save is staged and committed with, declared
    preemption    PreemptionGuard: SIGTERM / SIGUSR1 -> a durable checkpoint and a requeue code
    tiers         the upload tiers: a local directory first, an s3:// remote in the background
    stats         SaveStats: what one save cost
    group         the private gloo group of checkpoint collectives and its roll call
    workers       the long-lived background threads (persist, overlap copy)
    lifecycle     what outlives a call: worker shutdown, close after `with`, close at exit
    optimizer_hooks  the hooks on optimizers: overlap's fence, restore()'s prepare-ahead
    errors        CheckpointError and its kinds; the warnings
    capture       what a training state is: TrainingState, codec, replicated, DTensor blocks, boxes
    stage         host memory and the device: staging, plan, snapshot, host/device copies, spill
    storage       the format, the seam (backend), the directory, the commit; s3/, nodes/
    restore       candidates and fallback; plain and sharded restore; reshard; validate; verify
    interop       DCP storage (gpumem.dcp), plain DCP directories, safetensors export
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
from .preemption import PreemptionGuard
from .restore.verify import verify
from .settings import CheckpointerConfig
from .stats import SaveStats
from .storage.format import CheckpointInfo

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
    "CheckpointerConfig",
    "PreemptionGuard",
    "SaveStats",
    "verify",
]
