"""Plan: which layouts fit, how many GPUs a job needs, and what preemptions will cost.

    >>> import gpumem
    >>> result = gpumem.plan("llama-2-70b", gpu="H100-80GB", n_gpus=64, seq_len=4096)
    >>> print(result.table())

Modules, bottom up:

    economics          Young/Daly, expected completion time and cost with and without
                       checkpoints; the planner's default guesses
    checkpoint_times   C, P, R: given, calibrated for the best layout, or the defaults
    notice             provider notices (AWS 120 s, GCP/Azure 30 s, GKE 15 s) and whether a
                       node's final save is durable within one (``--notice``)
    margin             the headroom a plan keeps free on every GPU (``--headroom``)
    search             the numba sweep: ``plan`` and ``PlanResult``
    schedulers         Slurm and Kubernetes job scripts wired for preemption
    layout_chart       bills of layouts side by side (``gpumem estimate --plot``)
"""

from gpumem.planner.checkpoint_times import CheckpointTimes, checkpoint_times
from gpumem.planner.economics import (
    Economics,
    RealisedLoss,
    economics,
    realised,
    realised_loss,
    young_daly,
)
from gpumem.planner.notice import NOTICE_S, NoticeFit, final_save_fit, notice_seconds
from gpumem.planner.schedulers import grace_seconds, k8s_job, sbatch_header
from gpumem.planner.search import Candidate, PlanResult, min_gpus, plan

__all__ = [
    "NOTICE_S",
    "Candidate",
    "CheckpointTimes",
    "Economics",
    "NoticeFit",
    "PlanResult",
    "RealisedLoss",
    "checkpoint_times",
    "economics",
    "final_save_fit",
    "grace_seconds",
    "k8s_job",
    "min_gpus",
    "notice_seconds",
    "plan",
    "realised",
    "realised_loss",
    "sbatch_header",
    "young_daly",
]
