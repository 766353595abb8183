"""Every GPUMEM_* environment switch, parsed in one place.

| variable              | meaning                                          | default            |
|-----------------------|--------------------------------------------------|--------------------|
| GPUMEM_THREADS        | worker threads of the native core (CRC, copies)  | all cores          |
| GPUMEM_SAVE_THREADS   | native threads of a save's background work       | cores left free    |
| GPUMEM_IO_THREADS     | reads in flight when restoring a checkpoint      | max(4, min(16, n)) |
| GPUMEM_DISABLE_CUDA   | 1: never load the CUDA runtime (a CPU machine)   | 0                  |
| GPUMEM_CUDA_LIBRARY   | path of libcudart to dlopen instead of searching | (search)           |
| GPUMEM_STAGING_BYTES  | default host staging budget of the Checkpointer  | (share of RAM)     |
| GPUMEM_DEBUG          | 1: the CLI prints a traceback with its one line  | 0                  |
| GPUMEM_FAKE_FULL_DISPATCH | 1: fake tensors take torch's full dispatch path | 0         |
| GPUMEM_PY_ALLOCATOR   | 1: step traces on the Python allocator simulator | 0 (compiled)       |
| GPUMEM_NODE           | this rank's node (node-local checkpoints, replicas) | GROUP_RANK, host |
| GPUMEM_GRACE_S        | PreemptionGuard's notice: seconds, signal to kill | 30 (or grace_s=)   |
| GPUMEM_CACHE_DIR      | folder of the estimator's step simulation cache  | off (also: off, 0) |
| GPUMEM_S3_REQUEST_DEADLINE_S | s3://: seconds one request may take, retries included | 120 |
| GPUMEM_S3_DEADLINE_S  | s3://: seconds one save's or restore's requests may take | 3600      |
| GPUMEM_S3_ATTEMPTS    | s3://: tries of a request with transient faults  | 8                  |

(n: the machine's cores.)

Modules read these through ``env_str``, ``env_int``, ``env_float`` and ``env_flag`` only, and
every name they read is in the table (tests/test_env_reads.py). A module that writes a switch
for another process (a job script setting the guard's notice) names it by its constant here.
"""

from __future__ import annotations

import os

GRACE_S_VAR = "GPUMEM_GRACE_S"  # set by the job scripts of gpumem.planner for the trainer's guard


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_int(name: str, default: int | None = None) -> int | None:
    value = env_str(name)
    if value is None:
        return default
    try:
        return int(value, 0)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; unset it or give a number") from None


def env_float(name: str, default: float | None = None) -> float | None:
    value = env_str(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number; unset it or give one") from None


def env_flag(name: str, default: bool = False) -> bool:
    value = env_str(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use 1 or 0")
