"""The script ``gpumem plan --slurm`` writes, submitted to a real (private, one-node) Slurm with
a tiny trainer (Checkpointer + PreemptionGuard): preempted by a higher-tier job, it saves, is
requeued by the script, resumes and ends COMPLETED with every loss bit-identical to an
uninterrupted run and at most one step recomputed. Runs only where slurmctld is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumem.planner import sbatch_header

pytestmark = pytest.mark.skipif(
    shutil.which("slurmctld") is None,
    reason="slurmctld is not installed (Debian: apt-get install slurm-wlm munge)",
)

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TOTAL, STEP_S = 60, 0.25


def _trainer(ckpt: Path, step_s: float = STEP_S) -> list[str]:
    return [sys.executable, str(HERE / "slurm_train.py"), str(ckpt), str(TOTAL), str(step_s)]


def _losses(text: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for step, value in re.findall(r"^loss (\d+) (\S+)$", text, re.M):
        out.setdefault(int(step), []).append(value)
    return out


def _until(ready, what: str, timeout_s: float, cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s: " + str(
            {k: v for k, v in cluster.items() if k in ("JobState", "Reason", "Restarts")}
        )
        time.sleep(0.5)


def test_preemption_by_a_higher_tier_loses_at_most_one_step(slurm, tmp_path):
    ref = subprocess.run(
        _trainer(tmp_path / "ref", step_s=0),
        env={**slurm.env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    ref_losses = {s: v[0] for s, v in _losses(ref).items()}
    assert sorted(ref_losses) == list(range(TOTAL))

    script = tmp_path / "job.sbatch"
    script.write_text(
        sbatch_header(
            n_gpus=1,
            gpus_per_node=1,
            time_limit_min=10,
            signal_s=60,
            partition="spot",
            command=" ".join(["env", f"PYTHONPATH={ROOT}", *_trainer(tmp_path / "ckpt")]),
            grace_time_s=30,
        )
    )
    out = tmp_path / "job.out"
    job = slurm.run("sbatch", "--parsable", f"--output={out}", str(script)).strip()
    _until(lambda: out.exists() and "loss 5 " in out.read_text(), "training", 90, slurm.job(job))
    t0 = time.monotonic()
    slurm.run("sbatch", "--parsable", "-p", "prio", "--gres=gpu:2", "--wrap", "sleep 2")
    # the script requeues it; Slurm then holds it ~120 s (BeginTime): the test lets it go now
    _until(lambda: int(slurm.job(job).get("Restarts", 0)) >= 1, "requeued", 60, slurm.job(job))
    print(f"preemption: requeued {time.monotonic() - t0:.1f} s after the higher-tier job")
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    _until(
        lambda: slurm.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
        "COMPLETED",
        120,
        slurm.job(job),
    )
    info = slurm.job(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", (info, text[-2000:])
    losses = _losses(text)
    assert sorted(losses) == list(range(TOTAL)), text[-2000:]
    for step, values in losses.items():
        assert set(values) == {ref_losses[step]}, (step, values)
    recomputed = sum(len(v) - 1 for v in losses.values())
    starts = re.findall(r"^start (\d+)$", text, re.M)
    durable = re.findall(r"durable ([\d.]+) s after the signal", text)
    print(
        f"preemption: resumed from {starts}, {recomputed} step(s) recomputed, "
        f"signal to durable {durable} s"
    )
    assert len(starts) == 2 and int(starts[1]) > 0, text[-2000:]
    assert recomputed <= 1
