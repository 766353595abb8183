"""The script ``gpumem plan --slurm`` writes, submitted to a real (private, one-node) Slurm with
a tiny trainer (Checkpointer + PreemptionGuard): preempted by a higher-tier job, it saves, is
requeued by the script, resumes and ends COMPLETED with every loss bit-identical to an
uninterrupted run and at most one step recomputed. Runs only where slurmctld is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path

import pytest

from gpumem.planner import sbatch_header

pytestmark = pytest.mark.skipif(
    shutil.which("slurmctld") is None,
    reason="slurmctld is not installed (Debian: apt-get install slurm-wlm munge)",
)

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _trainer(ckpt: Path, total: int, step_s: float) -> list[str]:
    return [sys.executable, str(HERE / "slurm_train.py"), str(ckpt), str(total), str(step_s)]


def _losses(text: str, tag: str = "") -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for step, value in re.findall(rf"^{tag}loss (\d+) (\S+)$", text, re.M):
        out.setdefault(int(step), []).append(value)
    return out


def _until(ready, what: str, timeout_s: float, cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s: " + str(
            {k: v for k, v in cluster.items() if k in ("JobState", "Reason", "Restarts")}
        )
        time.sleep(0.5)


def _run_job(
    slurm,
    tmp_path,
    *,
    total,
    step_s,
    disturb,
    time_limit_min=10,
    signal_s=60,
    tasks=1,
    launcher="srun",
):
    """Submit the generated script with the tiny trainer, call ``disturb(job_id)`` once it
    trains, wait out each requeue's hold (the cluster's 10 s credential lifetime) and return
    the final ``scontrol show job``, the output and the reference losses."""
    ref = subprocess.run(
        _trainer(tmp_path / "ref", total, 0),
        env={**slurm.env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    script = tmp_path / "job.sbatch"
    command = ["env", f"PYTHONPATH={ROOT}", *_trainer(tmp_path / "ckpt", total, step_s)]
    if launcher == "torchrun":  # torchrun runs the script with its own Python
        command = command[3:]
    script.write_text(
        sbatch_header(
            n_gpus=tasks,
            gpus_per_node=tasks,
            time_limit_min=time_limit_min,
            signal_s=signal_s,
            partition="spot",
            command=" ".join(command),
            grace_time_s=30,
            launcher=launcher,
            rdzv_port=slurm.free_port(),
        )
    )
    out = tmp_path / "job.out"
    venv_bin = str(Path(sys.executable).parent)  # torchrun
    env = {**slurm.env, "PYTHONPATH": str(ROOT), "PATH": f"{venv_bin}:{slurm.env['PATH']}"}
    job = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", str(script)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _until(lambda: out.exists() and "loss 5 " in out.read_text(), "training", 90, slurm.job(job))
    disturb(job)
    deadline, released, holds = time.monotonic() + 400, 0, []
    while (info := slurm.job(job)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, info
        restarts = int(info.get("Restarts", 0))
        if info.get("JobState") == "PENDING" and restarts > released:
            hold = (datetime.fromisoformat(info["StartTime"]) - datetime.now()).total_seconds()
            print(f"requeued: held {hold:.0f} s (BeginTime: cred_expire)")
            holds.append(hold)
            released = restarts
        time.sleep(0.5)
    info["holds"] = holds  # type: ignore[assignment]
    return info, out.read_text(), {s: v[0] for s, v in _losses(ref).items()}


def _preempt(slurm, job):
    """A job in the higher tier that needs both GPUs: Slurm preempts the spot job for it."""
    slurm.run("sbatch", "-p", "prio", "--gres=gpu:2", "--output=/dev/null", "--wrap", "sleep 2")


def _check(info, text, ref, total, what, tasks=1):
    assert info["JobState"] == "COMPLETED", (info, text[-2000:])
    assert "forcing job termination" not in text, text[-2000:]
    recomputed = 0
    for tag in ["", *(f"rank{r} " for r in range(1, tasks))]:
        losses = _losses(text, tag)
        assert sorted(losses) == list(range(total)), (tag, text[-2000:])
        for step, values in losses.items():
            assert set(values) == {ref[step]}, (tag, step, values)
        recomputed = max(recomputed, sum(len(v) - 1 for v in losses.values()))
    starts = re.findall(r"^start (\d+)$", text, re.M)
    durable = re.findall(r"durable ([\d.]+) s after the signal", text)
    requeues = int(info["Restarts"])
    # from the job leaving the node (rank 0's exit after its final save) to the next run's first
    # step: the requeue, its hold (BeginTime), the start and the restore
    stops = [float(t) for t in re.findall(r"^at stop ([\d.]+)$", text, re.M)]
    firsts = [float(t) for t in re.findall(r"^at first-step ([\d.]+)$", text, re.M)]
    to_step = [round(b - a, 2) for a, b in zip(stops, firsts[1:], strict=False)]
    print(
        f"{what}: {requeues} requeue(s), resumed from {starts}, {recomputed} step(s) "
        f"recomputed, signal to durable {durable} s, requeue to first resumed step {to_step} s "
        f"(of which the hold {[round(h) for h in info['holds']]} s)"
    )
    figures = {
        "scenario": what,
        "requeues": requeues,
        "recomputed": recomputed,
        "signal_to_durable_s": [float(d) for d in durable],
        "requeue_to_first_step_s": to_step,
        "hold_s": info["holds"],
    }
    print(f"figures: {json.dumps(figures)}")  # benchmarks/bench_schedulers.py reads these
    assert len(stops) == requeues and len(to_step) == requeues, text[-2000:]
    assert requeues >= 1 and len(starts) == requeues + 1 and int(starts[1]) > 0, text[-2000:]
    said = "\n".join(re.findall(r"^.*gpumem: .*$", text, re.M))  # every rank's stop lines
    assert len(durable) == requeues * tasks, said or text[-2000:]
    assert recomputed <= requeues  # at most the step in flight, per stop


def test_preemption_by_a_higher_tier_loses_at_most_one_step(slurm, tmp_path):
    """No send_user_signal: Slurm sends SIGTERM to the tasks, the trainer exits 143 and the
    script requeues on it."""

    preempt = partial(_preempt, slurm)

    info, text, ref = _run_job(slurm, tmp_path, total=60, step_s=0.25, disturb=preempt)
    _check(info, text, ref, 60, "preemption")


def test_time_limit_saves_and_requeues(slurm, tmp_path):
    """--signal=B:USR1@60 on a 2 min limit: the shell's trap sends SIGTERM to the tasks with
    scancel (issue #38: forwarding TERM to srun SIGKILLed them), the script requeues."""
    info, text, ref = _run_job(
        slurm,
        tmp_path,
        total=700,
        step_s=0.1,
        disturb=lambda job: None,
        time_limit_min=2,
        signal_s=60,
    )
    assert "gpumem: SIGUSR1: SIGTERM to the trainer tasks" in text
    _check(info, text, ref, 700, "time limit")


def test_stop_by_hand_with_two_tasks_per_node(slurm, tmp_path):
    """`scancel --batch --signal=USR1 JOB` (the header's way to stop and requeue by hand) with
    `srun` running two tasks: both save, the script requeues, both resume."""

    def by_hand(job):
        slurm.run("scancel", "--batch", "--signal=USR1", job)

    info, text, ref = _run_job(slurm, tmp_path, total=60, step_s=0.25, disturb=by_hand, tasks=2)
    _check(info, text, ref, 60, "scancel --batch --signal=USR1, 2 tasks", tasks=2)


def test_stop_under_srun_torchrun(slurm, tmp_path):
    """`srun torchrun`, two workers: scancel --signal=TERM reaches torchrun and its workers, the
    workers save and exit 143, torchrun exits with its own status, and the script requeues
    because it was told to stop."""

    def by_hand(job):
        slurm.run("scancel", "--batch", "--signal=USR1", job)

    info, text, ref = _run_job(
        slurm, tmp_path, total=60, step_s=0.25, disturb=by_hand, tasks=2, launcher="torchrun"
    )
    _check(info, text, ref, 60, "srun torchrun, 2 workers", tasks=2)


@pytest.mark.parametrize("slurm", ["SlurmctldParameters=preempt_send_user_signal"], indirect=True)
def test_preemption_under_torchrun_with_send_user_signal(slurm, tmp_path):
    """Under `srun torchrun` the exit status is torchrun's: a preempted job is requeued only
    because Slurm sends the batch shell the --signal USR1 at preemption (22.05's spelling of
    send_user_signal)."""

    preempt = partial(_preempt, slurm)

    info, text, ref = _run_job(
        slurm, tmp_path, total=60, step_s=0.25, disturb=preempt, tasks=2, launcher="torchrun"
    )
    assert "gpumem: SIGUSR1: SIGTERM to the trainer tasks" in text
    _check(info, text, ref, 60, "preemption, srun torchrun, send_user_signal", tasks=2)
