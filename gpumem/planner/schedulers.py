"""Job scripts for a chosen layout: a Slurm batch script and a Kubernetes Job for Kueue, both
wired for preemption with a trainer that checkpoints on SIGTERM (``gpumem.PreemptionGuard``,
which exits with ``REQUEUE_EXIT_CODE`` once its final checkpoint is durable).

Slurm: ``--signal=B:TERM@N`` sends SIGTERM to the batch shell N seconds before the time limit.
The script starts the trainer with ``srun`` in the background, traps TERM, forwards it to
``srun`` (which passes it to every task), waits for the final checkpoint and requeues the job
(``scontrol requeue``; ``--requeue`` lets Slurm requeue it itself when it preempts the job). On
preemption Slurm signals the job and waits the partition's ``GraceTime`` before SIGKILL — the
final checkpoint must persist within it.

Kubernetes: ``terminationGracePeriodSeconds`` is the time between SIGTERM and SIGKILL on
eviction; ``podFailurePolicy`` ignores the trainer's requeue exit code and evictions
(``DisruptionTarget``), so preemptions recreate the pod instead of counting against
``backoffLimit``; Kueue admits the Job's pods all at once through its queue label and
``suspend: true``.

The grace period both use is :func:`grace_seconds` of the measured (or guessed) persist time.

Example:
    >>> print(sbatch_header(n_gpus=64, gpus_per_node=8, time_limit_min=240, signal_s=300))
"""

from __future__ import annotations

import math
import shlex

REQUEUE_EXIT_CODE = 143  # 128 + SIGTERM: PreemptionGuard's default after a durable final save
MIN_GRACE_S = 60


def grace_seconds(persist_s: float) -> int:
    """Seconds from SIGTERM to SIGKILL that a final checkpoint needs: twice the persist time
    (the final save may wait for one still in flight), at least a minute."""
    if not (persist_s >= 0 and math.isfinite(persist_s)):
        raise ValueError(f"persist_s must be a finite number of seconds >= 0, got {persist_s}")
    return max(MIN_GRACE_S, math.ceil(2 * persist_s))


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
    command: str = "python train.py",
    exit_code: int = REQUEUE_EXIT_CODE,
) -> str:
    """A Slurm batch script: nodes and GPUs, SIGTERM ``signal_s`` before the limit, forwarded to
    the trainer (``command``, run under srun), and a requeue when the trainer stops for it."""
    if signal_s <= 0 or time_limit_min <= 0:
        raise ValueError("signal_s and time_limit_min must be positive")
    if signal_s >= time_limit_min * 60:
        raise ValueError(
            f"signal {signal_s} s ahead of a {time_limit_min} min limit leaves no run time"
        )
    if not command.strip():
        raise ValueError("command must be the training command line")
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
        f"# layout: {layout or '(not given)'}",
        f"# SIGTERM reaches this shell {signal_s} s before the time limit; it is forwarded to the",
        "# trainer, which saves a final checkpoint (gpumem.PreemptionGuard) and exits "
        f"{exit_code};",
        "# the job is then requeued and resumes from that checkpoint. On preemption Slurm waits",
        "# the partition's GraceTime (scontrol show partition <name> | grep GraceTime) before",
        "# SIGKILL: the final checkpoint must persist within it.",
        "set -uo pipefail",
        f"TRAIN_CMD=({command})  # your training command; it must resume from its latest "
        "checkpoint",
        "",
        "requeue() {",
        '  echo "gpumem: requeueing job ${SLURM_JOB_ID}" >&2',
        '  scontrol requeue "${SLURM_JOB_ID}" || true  # Slurm may be requeueing it already',
        "}",
        "on_term() {",
        '  echo "gpumem: SIGTERM, forwarding it to the trainer (srun pid ${TRAINER_PID})" >&2',
        '  kill -TERM "${TRAINER_PID}" 2>/dev/null',
        '  wait "${TRAINER_PID}"',
        "  status=$?",
        "  requeue",
        '  exit "${status}"',
        "}",
        "trap on_term TERM",
        "",
        'srun "${TRAIN_CMD[@]}" &',
        "TRAINER_PID=$!",
        'wait "${TRAINER_PID}"',
        "status=$?",
        f"# {exit_code}: the trainer stopped for a preemption signal that reached it directly",
        f'if [ "${{status}}" -eq {exit_code} ]; then requeue; fi',
        'exit "${status}"',
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
    command: str = "python train.py",
    exit_code: int = REQUEUE_EXIT_CODE,
) -> str:
    """A Kubernetes (indexed) Job YAML, one pod per node, gang-admitted by Kueue, whose
    ``podFailurePolicy`` turns the trainer's ``exit_code`` and evictions into a new pod."""
    if grace_s <= 0:
        raise ValueError(f"grace_s must be positive, got {grace_s}")
    if not 0 < exit_code < 256:
        raise ValueError(f"exit_code must be in 1..255, got {exit_code}")
    nodes = _nodes(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    argv = ", ".join(f'"{a}"' for a in shlex.split(command))
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
  backoffLimit: 10         # real failures; preemptions below do not count
  podFailurePolicy:
    rules:
    - action: Ignore       # the trainer saved its final checkpoint and asks to be requeued
      onExitCodes:
        containerName: trainer
        operator: In
        values: [{exit_code}]
    - action: Ignore       # evictions (preemption, node drain) do not count either
      onPodConditions:
      - type: DisruptionTarget
  template:
    metadata:
      annotations:
        kueue.x-k8s.io/pod-group-total-count: "{nodes}"
    spec:
      restartPolicy: Never   # podFailurePolicy needs it
      terminationGracePeriodSeconds: {grace_s}   # SIGTERM -> SIGKILL: the final checkpoint \
must persist within it
      containers:
      - name: trainer
        image: {image}
        command: [{argv}]   # your training command; it must resume from its latest checkpoint
        resources:
          limits:
            nvidia.com/gpu: {per_node}
"""
