"""Plan: which layouts fit, how many GPUs a job needs, and what preemptions will cost.

    >>> import gpumem
    >>> result = gpumem.plan("llama-2-70b", gpu="H100-80GB", n_gpus=64, seq_len=4096)
    >>> print(result.table())

Modules: ``search`` (the numba sweep), ``economics`` (Young/Daly, preemption cost),
``schedulers`` (Slurm and Kubernetes job headers).
"""

from gpumem.planner.economics import Economics, economics, realised_loss, young_daly
from gpumem.planner.schedulers import k8s_job, sbatch_header
from gpumem.planner.search import Candidate, PlanResult, min_gpus, plan

__all__ = [
    "Candidate",
    "Economics",
    "PlanResult",
    "economics",
    "k8s_job",
    "min_gpus",
    "plan",
    "realised_loss",
    "sbatch_header",
    "young_daly",
]
