"""A Slurm batch script for a chosen layout, wired for preemption with a trainer that
checkpoints on SIGTERM (``gpumem.PreemptionGuard``, which exits with ``REQUEUE_EXIT_CODE`` once its
final checkpoint is durable); and what the Kubernetes manifest (``kube_job``) and the SkyPilot task
(``sky_task``) share with it: the grace a final save needs, the nodes, the warnings, torchrun.

Slurm: ``--signal=B:USR1@N`` sends SIGUSR1 to the batch shell at least N seconds before the time
limit; its trap sends SIGTERM to the trainer's tasks with ``scancel --signal=TERM`` (Slurm
delivers it to every task, and under ``srun torchrun`` to torchrun and its workers), never to
``srun``: srun answers SIGTERM by SIGKILLing its tasks (issue #38, on Slurm 22.05). On preemption
Slurm signals the tasks itself and SIGKILLs them after the partition's ``GraceTime``. The script
requeues the job (``scontrol requeue``) when the trainer exits with the requeue code or the shell
was told to stop: a job that exits 143 is FAILED otherwise, ``--requeue`` notwithstanding.

The grace period is :func:`grace_seconds` of the measured (or guessed) final save.

Example:
    >>> print(sbatch_header(n_gpus=64, gpus_per_node=8, time_limit_min=240, signal_s=300))
"""

from __future__ import annotations

import math
import re

from gpumem._env import GRACE_S_VAR

REQUEUE_EXIT_CODE = 143  # 128 + SIGTERM: PreemptionGuard's default after a durable final save
MIN_GRACE_S = 60
TORCHRUN_SHUTDOWN_S = 30  # torchrun SIGKILLs its workers this long after passing SIGTERM on
LAUNCHERS = ("srun", "torchrun")
RDZV_PORT = 29500  # torchrun's rendezvous port unless told otherwise


def grace_seconds(persist_s: float) -> int:
    """Seconds from SIGTERM to SIGKILL that a final checkpoint needs: twice the persist time
    (the final save may wait for one still in flight), at least a minute."""
    if not (persist_s >= 0 and math.isfinite(persist_s)):
        raise ValueError(f"persist_s must be a finite number of seconds >= 0, got {persist_s}")
    return max(MIN_GRACE_S, math.ceil(2 * persist_s))


def nodes_for(n_gpus: int, gpus_per_node: int) -> int:
    """Whole nodes for ``n_gpus`` (one node when the job fits in one)."""
    if n_gpus <= 0 or gpus_per_node <= 0:
        raise ValueError(f"need positive n_gpus and gpus_per_node, got {n_gpus}, {gpus_per_node}")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}; use a multiple")
    return max(1, n_gpus // gpus_per_node)


def _slurm_name(setting: str, value: str) -> str:
    """A Slurm name as one ``#SBATCH`` word: sbatch stops reading an option at a space."""
    if not re.fullmatch(r"[A-Za-z0-9_.,+-]+", value):
        raise ValueError(
            f"{setting} {value!r} is not a Slurm name: use letters, digits and _ . , + - only"
        )
    return value


def torchrun_argv(
    *, nodes: int | str, per_node: int, endpoint: str, command: list[str]
) -> list[str]:
    """torchrun over ``per_node`` GPUs on each of ``nodes`` nodes (a number or a shell
    variable), meeting at ``endpoint`` (``host:port``, c10d), running ``command``."""
    return [
        "torchrun",
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        *command,
    ]


def dump_yaml(*docs: dict) -> str:
    """YAML documents in the order given, keys as built, multi-line strings as ``|`` blocks
    (scripts stay readable). PyYAML is imported here, for the Kubernetes and SkyPilot files
    only: gpumem does not require it.

    Raises:
        ValueError: PyYAML is not installed (one line, saying what to install).
    """
    try:
        import yaml
    except ImportError:
        raise ValueError(
            "writing a Kubernetes manifest or a SkyPilot task needs PyYAML: pip install pyyaml"
        ) from None

    class BlockDumper(yaml.SafeDumper):
        pass

    def block(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
        style = "|" if "\n" in text else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    BlockDumper.add_representer(str, block)
    return yaml.dump_all(docs, Dumper=BlockDumper, sort_keys=False, default_flow_style=False)


def save_warnings(final_save_s: float | None, windows: dict[str, float]) -> list[str]:
    """One line per stop window (setting -> seconds) shorter than the final save (measured with
    a calibration, else estimated: the caller's figure, SIGTERM to durable)."""
    if final_save_s is None:
        return []
    if not (final_save_s >= 0 and math.isfinite(final_save_s)):
        raise ValueError(
            f"final_save_s must be a finite number of seconds >= 0, got {final_save_s}"
        )
    return [
        f"WARNING: {setting} ({s:g} s) is shorter than the final save, SIGTERM to durable "
        f"({final_save_s:.3g} s): a stop there loses the steps since the last periodic save"
        for setting, s in windows.items()
        if s < final_save_s
    ]


def sbatch_header(
    *,
    n_gpus: int,
    gpus_per_node: int = 8,
    time_limit_min: int = 240,
    signal_s: int = 300,
    job_name: str = "gpumem-train",
    partition: str | None = None,
    layout: str = "",
    command: str | None = None,
    exit_code: int = REQUEUE_EXIT_CODE,
    launcher: str = "srun",
    final_save_s: float | None = None,
    grace_time_s: float | None = None,
    rdzv_port: int = RDZV_PORT,
) -> str:
    """A Slurm batch script: nodes and GPUs, SIGUSR1 to the shell at least ``signal_s`` before
    the limit, turned into SIGTERM to the trainer's tasks, and a requeue when the trainer stops.

    ``launcher``: ``"srun"`` runs ``command`` (default ``python train.py``) once per GPU;
    ``"torchrun"`` runs ``srun torchrun ... command`` (default ``train.py``) once per node.
    ``final_save_s``, the measured time from SIGTERM to a durable final save, is checked against
    ``signal_s`` (an error), the partition's ``grace_time_s`` and torchrun's 30 s shutdown
    (warnings in the header: the site sets those). ``rdzv_port``: torchrun's rendezvous port
    on the first node."""
    if signal_s <= 0 or time_limit_min <= 0:
        raise ValueError(
            f"signal_s (the --signal lead, {signal_s}) and time_limit_min ({time_limit_min}) "
            "must be positive"
        )
    if signal_s >= time_limit_min * 60:
        raise ValueError(
            f"signal {signal_s} s ahead of a {time_limit_min} min limit leaves no run time"
        )
    if not 0 < rdzv_port < 65536:
        raise ValueError(f"rdzv_port must be a TCP port in 1..65535, got {rdzv_port}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if grace_time_s is not None and not grace_time_s >= 0:
        raise ValueError(
            f"grace_time_s (the partition's GraceTime) must be >= 0, got {grace_time_s}"
        )
    torchrun = launcher == "torchrun"
    command = command if command is not None else ("train.py" if torchrun else "python train.py")
    if not command.strip():
        raise ValueError("command must be the training command line")
    windows: dict[str, float] = {"--signal lead": signal_s}
    if grace_time_s is not None:
        windows["the partition's GraceTime"] = grace_time_s
    if torchrun:
        windows["torchrun's shutdown timeout"] = TORCHRUN_SHUTDOWN_S
    warnings = save_warnings(final_save_s, windows)
    if warnings and "--signal lead" in warnings[0]:
        raise ValueError(f"{warnings[0]}; give a longer signal_s")
    nodes = nodes_for(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    h, m = divmod(time_limit_min, 60)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_slurm_name('job name', job_name)}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={1 if torchrun else per_node}",
        f"#SBATCH --gpus-per-node={per_node}",
        f"#SBATCH --time={h:02d}:{m:02d}:00",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{signal_s}",
        "#SBATCH --open-mode=append",
    ]
    if partition is not None:
        lines.append(f"#SBATCH --partition={_slurm_name('partition', partition)}")
    lines += [f"# {w}" for w in warnings]
    lines += _slurm_body(layout=layout, signal_s=signal_s, exit_code=exit_code)
    guard_s = signal_s if grace_time_s is None else min(signal_s, grace_time_s)
    lines.insert(
        lines.index("set -uo pipefail") + 1,
        f"export {GRACE_S_VAR}={guard_s:g}  # the guard's deadline: the shorter stop window",
    )
    if torchrun:
        argv = torchrun_argv(
            nodes="${SLURM_NNODES}",
            per_node=per_node,
            endpoint=f"${{HEAD_NODE}}:{rdzv_port}",
            command=[],
        )
        launch = " ".join(argv) + " "
        lines.insert(
            lines.index("set -uo pipefail") + 1,
            'HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)',
        )
    else:
        launch = ""
    i = lines.index("TRAIN_CMD_PLACEHOLDER")
    lines[i] = (
        f"TRAIN_CMD=({launch}{command})  # your training command; it must resume from its "
        "latest checkpoint"
    )
    return "\n".join(lines) + "\n"


def _slurm_body(*, layout: str, signal_s: int, exit_code: int) -> list[str]:
    """The script after the ``#SBATCH`` lines: what happens on each stop, then the traps."""
    return [
        f"# layout: {layout or '(not given)'}",
        "# The trainer (gpumem.PreemptionGuard) saves a final checkpoint on SIGTERM and exits",
        f"# {exit_code} once it is durable; this script then requeues the job (a job that exits",
        f"# {exit_code} is FAILED unless something requeues it). The ways it stops:",
        f"# - time limit: --signal sends USR1 to this shell at least {signal_s} s before the",
        "#   limit (N is a minimum lead, not exact: it may come earlier); the trap sends SIGTERM",
        "#   to the trainer's tasks with `scancel --signal=TERM`, never to srun (it would SIGKILL",
        "#   them).",
        "# - preemption: Slurm sends SIGTERM to the tasks and SIGKILL after the partition's",
        "#   GraceTime (scontrol show partition NAME | grep GraceTime): the final save must be",
        "#   durable within it. With send_user_signal (Slurm 22.05: SlurmctldParameters=",
        "#   preempt_send_user_signal; later: PreemptParameters=send_user_signal) Slurm sends this",
        "#   shell the USR1 instead, as at the time limit: needed under torchrun, whose exit",
        "#   status is not the trainer's.",
        "# - by hand: `scancel --batch --signal=USR1 JOBID` stops and requeues it the same way.",
        "#   `scontrol requeue JOBID` and `scancel JOBID` send SIGTERM to srun as well: no final",
        "#   save is promised there, and the script does not requeue (Slurm decides).",
        "# A requeued job is held PENDING about 120 s (its BeginTime: the credential lifetime,",
        "# AuthInfo=cred_expire) before it can start again: count that in the restart time.",
        "set -uo pipefail",
        "TRAIN_CMD_PLACEHOLDER",
        "STOPPING=0   # 1: told to stop (USR1): requeue whatever the trainer's exit status",
        "CANCELLED=0  # 1: SIGTERM to this shell (scancel, scontrol requeue): Slurm decides",
        "TRAPPED=0",
        "",
        "requeue() {",
        '  echo "gpumem: requeueing job ${SLURM_JOB_ID}" >&2',
        '  scontrol requeue "${SLURM_JOB_ID}" || true  # Slurm may be requeueing it already',
        "}",
        "on_usr1() {",
        "  STOPPING=1 TRAPPED=1",
        '  echo "gpumem: SIGUSR1: SIGTERM to the trainer tasks (scancel --signal=TERM)" >&2',
        "  # not `kill -TERM` to srun: srun answers SIGTERM by SIGKILLing its tasks",
        "  # (kill -USR1: srun passes it on; the guard stops on it, torchrun does not)",
        '  scancel --signal=TERM "${SLURM_JOB_ID}" || kill -USR1 "${TRAINER_PID}"',
        "}",
        "on_term() {",
        "  CANCELLED=1 TRAPPED=1",
        '  echo "gpumem: SIGTERM: the job is being cancelled or requeued by Slurm" >&2',
        "}",
        "trap on_usr1 USR1",
        "trap on_term TERM",
        "",
        'srun "${TRAIN_CMD[@]}" &',
        "TRAINER_PID=$!",
        "while :; do",
        "  TRAPPED=0",
        '  wait "${TRAINER_PID}"',
        "  status=$?",
        '  [ "${TRAPPED}" -eq 1 ] || break  # a trap ended `wait` early: wait for the trainer',
        "done",
        f'if [ "${{CANCELLED}}" -eq 0 ] && {{ [ "${{STOPPING}}" -eq 1 ] || '
        f'[ "${{status}}" -eq {exit_code} ]; }}; then',
        "  requeue",
        "fi",
        'exit "${status}"',
    ]
