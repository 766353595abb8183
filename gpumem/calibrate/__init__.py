"""Calibrate: measure this machine and its checkpoint storage, for the estimator and the planner.

The step between measuring and estimating (measure → report → **calibrate** → estimate → plan):

    cal = gpumem.calibrate.measure("/ckpts", device="cuda")   # default sizes: up to 2 GiB
    cal.save("calibration.json")                     # or: gpumem calibrate --dir /ckpts
    cal = gpumem.calibrate.load("calibration.json")
    stall_s, persist_s, restore_s = cal.checkpoint_times(nbytes)   # feeds planner economics
    gpu = cal.apply_to(gpumem.estimator.find_gpu("H100-80GB"))      # feeds the estimator's reserve

Modules, bottom up:

    _schema           strict reading of calibration JSON: every field typed and in range
    fit               cost lines ``seconds = a + b · bytes``; bandwidth and fixed cost apart
    checkpoint_cost   save, durable and restore times, measured with the real Checkpointer
    reserve           CUDA context and copy bandwidth; fragmentation from a profile report
    memory            the estimator's fitted coefficients (a section), and how they apply
    calibration       the file format and its consumers; ``measure`` and ``load``

Importing this package imports neither torch nor numba; the measurements do. The fit of the
memory section runs the estimator, so it lives there (``gpumem.estimator.memory_fit``).
"""

from gpumem.calibrate._schema import CalibrationError
from gpumem.calibrate.calibration import Calibration, Machine, as_calibration, load, measure
from gpumem.calibrate.checkpoint_cost import (
    CheckpointCost,
    CheckpointPoint,
    default_sizes,
    measure_checkpoint,
    synthetic_state,
)
from gpumem.calibrate.fit import LinearFit, fit_cost, fit_line
from gpumem.calibrate.reserve import GpuReserve, ReportReserve, from_report, measure_gpu_reserve

__all__ = [
    "Calibration",
    "CalibrationError",
    "CheckpointCost",
    "CheckpointPoint",
    "GpuReserve",
    "LinearFit",
    "Machine",
    "ReportReserve",
    "as_calibration",
    "default_sizes",
    "fit_cost",
    "fit_line",
    "from_report",
    "load",
    "measure",
    "measure_checkpoint",
    "measure_gpu_reserve",
    "synthetic_state",
]
