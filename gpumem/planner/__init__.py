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
    traces             capacity traces from files (JSON 0/1, CSV samples, counts, events)
    capacity           a source of GPUs: availability runs, price, notice, queue wait
    capacity_spec      capacities on one line (``--capacity spot,trace=...,price=...``)
    capacity_replay    the job tick by tick over capacity under a policy: the reference
    policies           on-demand, spot, Uniform Progress (Can't Be Late) and gpumem's
    predict            expected hours, cost and deadline risk from the capacity model
    decision           layouts x capacities x policies ranked by cost under a deadline
    margin             the headroom a plan keeps free on every GPU (``--headroom``)
    search             the numba sweep: ``plan`` and ``PlanResult``
    schedulers         the Slurm script wired for preemption; what the others share with it
    kube_job           the Kubernetes manifest: PriorityClass, headless Service, indexed Job
    sky_task           the SkyPilot task: the decision's capacity, recovery, checkpoint bucket
    layout_chart       bills of layouts side by side (``gpumem estimate --plot``)
"""

from gpumem.planner.capacity import Availability, Capacity
from gpumem.planner.capacity_replay import CapacityJob
from gpumem.planner.capacity_spec import parse_capacity
from gpumem.planner.checkpoint_times import CheckpointTimes, checkpoint_times
from gpumem.planner.decision import Decision, Option, decide, layout_jobs
from gpumem.planner.economics import (
    Economics,
    RealisedLoss,
    economics,
    realised,
    realised_loss,
    young_daly,
)
from gpumem.planner.kube_job import k8s_job
from gpumem.planner.notice import NOTICE_S, NoticeFit, final_save_fit, notice_seconds
from gpumem.planner.predict import Prediction, predict, predict_options, replay_windows
from gpumem.planner.schedulers import grace_seconds, sbatch_header
from gpumem.planner.search import Candidate, PlanResult, min_gpus, plan
from gpumem.planner.sky_task import skypilot_task
from gpumem.planner.traces import CapacityTrace, TraceError, load_trace

__all__ = [
    "NOTICE_S",
    "Availability",
    "Candidate",
    "Capacity",
    "CapacityJob",
    "CapacityTrace",
    "CheckpointTimes",
    "Decision",
    "Economics",
    "NoticeFit",
    "Option",
    "PlanResult",
    "Prediction",
    "RealisedLoss",
    "TraceError",
    "checkpoint_times",
    "decide",
    "economics",
    "final_save_fit",
    "grace_seconds",
    "k8s_job",
    "layout_jobs",
    "load_trace",
    "min_gpus",
    "notice_seconds",
    "parse_capacity",
    "plan",
    "predict",
    "predict_options",
    "realised",
    "realised_loss",
    "replay_windows",
    "sbatch_header",
    "skypilot_task",
    "young_daly",
]
