"""Schedulers: the real-Slurm scenarios of tests/slurm, with what each stop cost (issue #38).

    python benchmarks/bench_schedulers.py   # root, slurm-wlm and munge installed
        # writes benchmarks/results/schedulers.md and schedulers.json

Runs ``pytest tests/slurm -s`` (a private one-node Slurm: preemption by a higher tier, the time
limit, a stop by hand with two tasks, srun torchrun, preemption under torchrun with
send_user_signal), reads the ``figures:`` line each scenario prints and records, per scenario:
steps recomputed after the stops, seconds from the signal to the durable final save (the
trainer's PreemptionGuard measures it), and seconds from the job leaving the node (the trainer's
exit after its final save) to the resumed run's first step, of which the requeue hold
(BeginTime, the credential lifetime: 10 s in the test cluster, 120 s by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _report import ROOT, figure, machine_info, value_figure, write_results


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except OSError:
        return "not installed"
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else "?"


def run_scenarios() -> tuple[list[dict], str]:
    """Every scenario's figures, and pytest's summary line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/slurm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = proc.stdout.splitlines()
    found = [json.loads(line.split(":", 1)[1]) for line in lines if line.startswith("figures:")]
    summary = lines[-1] if lines else proc.stderr[-300:]
    if proc.returncode != 0 or not found:
        sys.exit(f"tests/slurm did not pass here: {summary}\n{proc.stdout[-3000:]}")
    return found, summary


def main() -> None:
    info = machine_info()
    info["slurm"] = _version(["slurmctld", "-V"])
    info["munge"] = _version(["munged", "--version"])
    info["load average before"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    scenarios, summary = run_scenarios()
    info["load average after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    info["pytest"] = summary
    rows, figures = [], []
    for s in scenarios:
        name = s["scenario"]
        rows.append(
            (
                name,
                s["requeues"],
                s["recomputed"],
                " / ".join(f"{x:.2f}" for x in s["signal_to_durable_s"]),
                " / ".join(f"{x:.1f}" for x in s["requeue_to_first_step_s"]),
                " / ".join(f"{x:.0f}" for x in s["hold_s"]),
            )
        )
        figures += [
            value_figure(f"{name}: steps recomputed", "steps", s["recomputed"], tolerance=1),
            figure(f"{name}: signal to durable", "s", s["signal_to_durable_s"]),
            figure(f"{name}: requeue to first resumed step", "s", s["requeue_to_first_step_s"]),
        ]
    write_results(
        "schedulers",
        "Schedulers: real Slurm, each stop from signal to durable and from requeue to resumed",
        [
            "scenario",
            "requeues",
            "steps recomputed",
            "signal -> durable (s, per task and stop)",
            "requeue -> first resumed step (s)",
            "of which the hold (s)",
        ],
        rows,
        notes=NOTES,
        info=info,
        figures=figures,
    )


NOTES = """
One node, a private Slurm (tests/slurm/conftest.py): partitions ``spot`` (PriorityTier 1,
GraceTime 30 s) and ``prio`` (PriorityTier 10), PreemptType=preempt/partition_prio,
PreemptMode=REQUEUE, two fake GPUs, ``AuthInfo=cred_expire=10`` (the requeue hold; Slurm's
default is 120 s, which a real cluster adds to the restart). The trainer is tests/slurm/
slurm_train.py: a Linear(8, 1) with SGD, a Checkpointer save every 10 steps, PreemptionGuard,
0.1-0.25 s steps; every loss of the resumed run is bit-identical to an uninterrupted one.
Steps recomputed: steps trained twice (at most the step in flight per stop). Signal to
durable: the guard's own measure, per task. Requeue to first resumed step: from the trainer's
exit after its final save (rank 0) to the resumed run's first step: the requeue, the hold, the
scheduler's next pass (sched_interval=2), the start of Python and torch, the restore.
Kubernetes and SkyPilot are checked against their schemas only (tests/planner): no cluster or
cloud ran them here.
"""

if __name__ == "__main__":
    main()
