"""gpumem: measure, estimate and protect the memory of PyTorch training jobs.

The public face. Everything is imported lazily so that ``import gpumem`` stays cheap: it imports
neither torch, triton nor numba and creates no CUDA context until a feature is used
(``tests/test_lean_import.py`` holds us to it).

    with gpumem.profile(model, optimizer=opt) as prof: ...   # measure (gpumem.profiler)
    gpumem.estimate("llama-2-70b", ...)                        # estimate (gpumem.estimator)
    ckpt = gpumem.Checkpointer("ckpts")                        # protect (gpumem.checkpoint)

Subpackages (the data flows measure -> report -> calibrate -> estimate -> plan; then the rest):

    profiler/       measure: where a training step's memory goes, per layer and phase
    allocator/      the CUDA caching allocator simulated: what a run reserves, not only holds
    calibrate/      this machine and its checkpoint storage, measured: calibration.json
    estimator/      estimate: the per-GPU memory bill of a job, before booking GPUs
    planner/        plan: which layouts fit, and what preemptions cost
    checkpoint/     protect: the Checkpointer and the PreemptionGuard
    integrations/   checkpointing inside the transformers and Lightning trainers
    models/         built-in models at named sizes
    kernels/        Triton kernels (per-chunk CRC32C on the device)
    demo/           ``gpumem demo``: the four parts end to end
    cli/            the ``gpumem`` command, one module per subcommand

Modules:

    dcp             StorageWriter / StorageReader for torch.distributed.checkpoint
    checksum        CRC32C of buffers and tensors: native on the CPU, Triton on the GPU
    writer          parallel file writes through the native core
    reader          parallel file reads with each chunk's CRC32C, strict opening
    arena           the host staging arena (page-aligned, pinned on CUDA machines)
    device          what GPUs this machine has (NVML, torch.cuda)
    doctor          ``gpumem doctor``: versions, native core, GPUs, bandwidth probes
    units           bytes <-> text, for display and CLI input only
    _version        the version (pyproject.toml reads it; modules import it, not this one)
    _env            every GPUMEM_* switch, parsed in one place
    _native         loads the native core ``gpumem._C`` (csrc/) and says what is missing
    _strict_json    the one strict JSON reader (manifests, calibration files)
    _gc             the cyclic garbage collector paused over a bulk decode (manifests)
    _plots          matplotlib on first use, one clear line where it is not installed
    _assumptions    assumptions a model follows under fake tensors, for whoever listens
    __main__        ``python -m gpumem``: the command line
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpumem._version import __version__

if TYPE_CHECKING:  # what a type checker sees; at run time the names resolve lazily below
    from gpumem import (
        arena,
        calibrate,
        checkpoint,
        checksum,
        dcp,
        device,
        integrations,
        reader,
        units,
        writer,
    )
    from gpumem.calibrate import Calibration, CalibrationError
    from gpumem.checkpoint import (
        CheckpointBranchWarning,
        CheckpointCorruptError,
        Checkpointer,
        CheckpointError,
        CheckpointFallbackWarning,
        CheckpointInfo,
        CheckpointIOError,
        CheckpointPointerWarning,
        CheckpointStateError,
        PreemptionGuard,
        SaveStats,
    )
    from gpumem.estimator import GPU, Bill, Layout, ModelSpec, estimate
    from gpumem.planner import PlanResult, plan
    from gpumem.profiler import Profile, Report, fake, profile

# public name -> (module, attribute); resolved on first access
_LAZY_ATTRS: dict[str, tuple[str, str]] = {
    "profile": ("gpumem.profiler", "profile"),
    "fake": ("gpumem.profiler", "fake"),
    "Profile": ("gpumem.profiler", "Profile"),
    "Report": ("gpumem.profiler", "Report"),
    "Checkpointer": ("gpumem.checkpoint", "Checkpointer"),
    "PreemptionGuard": ("gpumem.checkpoint", "PreemptionGuard"),
    "SaveStats": ("gpumem.checkpoint", "SaveStats"),
    "CheckpointInfo": ("gpumem.checkpoint", "CheckpointInfo"),
    "CheckpointError": ("gpumem.checkpoint", "CheckpointError"),
    "CheckpointCorruptError": ("gpumem.checkpoint", "CheckpointCorruptError"),
    "CheckpointIOError": ("gpumem.checkpoint", "CheckpointIOError"),
    "CheckpointStateError": ("gpumem.checkpoint", "CheckpointStateError"),
    "CheckpointFallbackWarning": ("gpumem.checkpoint", "CheckpointFallbackWarning"),
    "CheckpointBranchWarning": ("gpumem.checkpoint", "CheckpointBranchWarning"),
    "CheckpointPointerWarning": ("gpumem.checkpoint", "CheckpointPointerWarning"),
    "estimate": ("gpumem.estimator", "estimate"),
    "Bill": ("gpumem.estimator", "Bill"),
    "Layout": ("gpumem.estimator", "Layout"),
    "ModelSpec": ("gpumem.estimator", "ModelSpec"),
    "GPU": ("gpumem.estimator", "GPU"),
    "plan": ("gpumem.planner", "plan"),
    "PlanResult": ("gpumem.planner", "PlanResult"),
    "Calibration": ("gpumem.calibrate", "Calibration"),
    "CalibrationError": ("gpumem.calibrate", "CalibrationError"),
}

# submodules reachable as attributes (gpumem.checksum.crc32c(...)) without an explicit import
_LAZY_MODULES = (
    "arena",
    "calibrate",
    "checkpoint",
    "checksum",
    "dcp",
    "device",
    "integrations",
    "reader",
    "units",
    "writer",
)

# the literal list is what type checkers and `from gpumem import *` read; a test keeps it in step
__all__ = [
    "GPU",
    "Bill",
    "Calibration",
    "CalibrationError",
    "CheckpointBranchWarning",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointIOError",
    "CheckpointInfo",
    "CheckpointPointerWarning",
    "CheckpointStateError",
    "Checkpointer",
    "Layout",
    "ModelSpec",
    "PlanResult",
    "PreemptionGuard",
    "Profile",
    "Report",
    "SaveStats",
    "__version__",
    "arena",
    "calibrate",
    "checkpoint",
    "checksum",
    "dcp",
    "device",
    "estimate",
    "fake",
    "integrations",
    "plan",
    "profile",
    "reader",
    "units",
    "writer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        module, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'gpumem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_ATTRS) | set(_LAZY_MODULES))
