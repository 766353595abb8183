"""Job scripts for a chosen layout: a Slurm sbatch header and a Kubernetes Job for Kueue.

Slurm: ``--requeue`` brings a preempted job back; ``--signal=B:TERM@N`` sends SIGTERM to the
batch shell N seconds before the time limit so the trainer can checkpoint. On preemption Slurm
signals the job and waits the partition's ``GraceTime`` (``scontrol show partition``) before
SIGKILL — the final checkpoint must persist within it.

Kubernetes: ``terminationGracePeriodSeconds`` is the time between SIGTERM and SIGKILL on
eviction; Kueue admits the Job's pods all at once (gang admission) through its queue label and
``suspend: true``.

Example:
    >>> print(sbatch_header(n_gpus=64, gpus_per_node=8, time_limit_min=240, signal_s=300))
"""

from __future__ import annotations


def _nodes(n_gpus: int, gpus_per_node: int) -> int:
    if n_gpus <= 0 or gpus_per_node <= 0:
        raise ValueError(f"need positive n_gpus and gpus_per_node, got {n_gpus}, {gpus_per_node}")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}; use a multiple")
    return max(1, n_gpus // gpus_per_node)


def sbatch_header(
    *,
    n_gpus: int,
    gpus_per_node: int = 8,
    time_limit_min: int = 240,
    signal_s: int = 300,
    job_name: str = "gpumem-train",
    partition: str | None = None,
    layout: str = "",
) -> str:
    """An sbatch header: nodes, GPUs per node, requeue, SIGTERM ``signal_s`` before the limit."""
    if signal_s <= 0 or time_limit_min <= 0:
        raise ValueError("signal_s and time_limit_min must be positive")
    if signal_s >= time_limit_min * 60:
        raise ValueError(
            f"signal {signal_s} s ahead of a {time_limit_min} min limit leaves no run time"
        )
    nodes = _nodes(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    h, m = divmod(time_limit_min, 60)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --gpus-per-node={per_node}",
        f"#SBATCH --time={h:02d}:{m:02d}:00",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:TERM@{signal_s}",
        "#SBATCH --open-mode=append",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        f"# layout: {layout}" if layout else "# layout: (not given)",
        (
            f"# SIGTERM reaches the batch shell {signal_s} s "
            "before the time limit: trap it and forward"
        ),
        (
            "# it to the trainer (srun ... & wait). On "
            "preemption Slurm waits the partition's GraceTime"
        ),
        "# (scontrol show partition <name> | grep GraceTime) before SIGKILL: the final checkpoint",
        "# must persist within it.",
        "trap 'kill -TERM $TRAINER_PID 2>/dev/null; wait $TRAINER_PID' TERM",
    ]
    return "\n".join(lines) + "\n"


def k8s_job(
    *,
    n_gpus: int,
    gpus_per_node: int = 8,
    grace_s: int = 300,
    name: str = "gpumem-train",
    image: str = "REPLACE_WITH_IMAGE",
    queue: str = "default",
    layout: str = "",
) -> str:
    """A Kubernetes (indexed) Job YAML, one pod per node, gang-admitted by Kueue."""
    if grace_s <= 0:
        raise ValueError(f"grace_s must be positive, got {grace_s}")
    nodes = _nodes(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    return f"""apiVersion: batch/v1
kind: Job
metadata:
  name: {name}
  labels:
    kueue.x-k8s.io/queue-name: {queue}
  annotations:
    gpumem/layout: "{layout}"
spec:
  suspend: true            # Kueue unsuspends when all {nodes} pods can be admitted together
  completionMode: Indexed
  parallelism: {nodes}
  completions: {nodes}
  backoffLimit: 100        # preemptions restart pods; the trainer resumes from its checkpoint
  podFailurePolicy:
    rules:
    - action: Ignore       # evictions (preemption) do not count against backoffLimit
      onPodConditions:
      - type: DisruptionTarget
  template:
    metadata:
      annotations:
        kueue.x-k8s.io/pod-group-total-count: "{nodes}"
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: {grace_s}   # SIGTERM -> SIGKILL: \
checkpoint must persist within it
      containers:
      - name: trainer
        image: {image}
        resources:
          limits:
            nvidia.com/gpu: {per_node}
"""
