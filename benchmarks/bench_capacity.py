"""Capacity: the replay against a published result, the planner's prediction against the replay
on every shared spot trace, the four policies side by side, and the CLI's speed (issue #37).

    python benchmarks/bench_capacity.py [--traces DIR] [--calibration FILE]
        # writes benchmarks/results/capacity.md and capacity.json

1. Uniform Progress (Can't Be Late, NSDI 2024) on the window its data set's README names: 48 h
   of work, 52 h deadline, 0.2 h restart, $3.06 on-demand, $0.9731 spot per hour: $47.6819.
2. Every trace in ``shared/data/spot-traces`` (the AWS traces, their windows, Bamboo's event
   traces for a job of 8 and of all nodes): the prediction ``gpumem plan`` prints (the sampled
   capacity model) against the replay's mean over every window, for spot-only, Uniform Progress
   and gpumem's policy, on jobs with and without checkpoint costs; and, for reference,
   ``economics()`` (preemptions at random on capacity that is always there) against the same
   replay of spot-only.
3. The policies on every window of every AWS trace, for a job whose C, P, R and final save come
   from a calibration of this machine's disk (or ``--calibration``): mean cost and the share of
   windows that meet the deadline.
4. ``gpumem plan llama-2-70b --gpus 1024`` with a spot trace and on-demand: CPU and wall time
   beyond process start, against the same plan without capacities.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import ROOT, figure, machine_info, value_figure, write_results

from gpumem.planner.capacity import Capacity
from gpumem.planner.capacity_replay import CapacityJob
from gpumem.planner.economics import economics
from gpumem.planner.predict import predict_options, replay_windows
from gpumem.planner.traces import load_trace

SPOT, ON_DEMAND = 0.9731, 3.06
POLICIES = ("spot", "uniform-progress", "gpumem")


def _traces(root: Path) -> list[tuple[str, Capacity, int]]:
    """(label, capacity, ranks per node) for every shared trace."""
    out = []
    for f in sorted(root.glob("aws-*/*.json")):
        tr = load_trace(f)
        label = f"{f.parent.name.replace('aws-2022-10-us-west-2', 'aws')}/{f.stem}"
        out.append(
            (
                label,
                Capacity.from_trace(tr, SPOT, name=label, notice_s=120),
                8 if f.stem.endswith("_8") else 1,
            )
        )
    for f in sorted(root.glob("bamboo-*/*.csv")):
        full = 32 if f.stem.startswith("p3") else 24
        for nodes in (8, full):
            tr = load_trace(f, nodes=nodes)
            label = f"bamboo/{f.stem} {nodes} nodes"
            out.append((label, Capacity.from_trace(tr, SPOT, name=label, notice_s=120), 1))
    return out


def _jobs(label: str) -> list[tuple[str, CapacityJob]]:
    """Jobs the agreement is measured on: hours that fit the trace's length."""
    if label.startswith("bamboo"):  # 11 h traces
        return [
            (
                "4 h, deadline 6 h, C/P/R 10/60/600 s",
                CapacityJob(
                    4, deadline_h=6, stall_s=10, persist_s=60, restart_s=600, final_save_s=60
                ),
            ),
            ("4 h, deadline 5 h, sky_spot costs", CapacityJob(4, deadline_h=5, restart_s=600)),
        ]
    return [
        (
            "24 h, deadline 36 h, C/P/R 10/60/600 s",
            CapacityJob(
                24, deadline_h=36, stall_s=10, persist_s=60, restart_s=600, final_save_s=60
            ),
        ),
        (
            "24 h, deadline 30 h, no notice fit",
            CapacityJob(24, deadline_h=30, stall_s=30, persist_s=300, restart_s=900),
        ),
        ("48 h, deadline 52 h, sky_spot costs", CapacityJob(48, deadline_h=52, restart_s=720)),
    ]


def published() -> tuple[list[tuple], list]:
    root = ROOT.parent / "shared" / "data" / "spot-traces"
    f = root / "aws-2022-10-us-west-2-windows" / "us-west-2a_k80_1.json"
    if not f.is_file():
        f = ROOT / "tests" / "planner" / "data" / "can-t-be-late-us-west-2a_k80_1-window.json"
    spot = Capacity.from_trace(load_trace(f), SPOT)
    job = CapacityJob(48, deadline_h=52, restart_s=720)
    (up,) = replay_windows([(job, "uniform-progress")], spot, Capacity.on_demand(ON_DEMAND), [0])
    row = (
        "Uniform Progress, published window",
        "$47.6819",
        f"${up.expected_cost:.4f}",
        f"{abs(up.expected_cost - 47.6819) * 100:.2f} cents off",
    )
    return [row], [
        value_figure(
            "uniform progress published window cost", "$", up.expected_cost, better="lower"
        )
    ]


def _rel(model: float, replay: float) -> list[float]:
    """[|model / replay - 1|], [0.0] when both agree exactly (a run that never finishes in
    both), [] when the replay has no finite, non-zero mean to compare with."""
    if model == replay:
        return [0.0]
    if not (0 < replay < float("inf")):
        return []
    return [abs(model / replay - 1)]


def _economics_error(job: CapacityJob, cap: Capacity, mtbf_h: float) -> list[float]:
    free = CapacityJob(
        job.work_h, stall_s=job.stall_s, persist_s=job.persist_s, restart_s=job.restart_s
    )
    (spot_only,) = replay_windows([(free, "spot")], cap, None)
    e = economics(
        n_gpus=1,
        price_per_gpu_hour=SPOT,
        mtbf_hours=mtbf_h,
        run_hours=job.work_h,
        stall_s=job.stall_s,
        persist_s=max(job.persist_s, job.stall_s),
        restart_s=job.restart_s,
    )
    return _rel(e.expected_hours_with, spot_only.expected_hours)


def agreement(traces: list) -> tuple[list[tuple], list, dict]:
    od = Capacity.on_demand(ON_DEMAND)
    errs_h, errs_c, econ, never = [], [], [], []
    rows = []
    t_replay = t_model = 0.0
    for label, cap, _ in traces:
        per_trace_h, per_trace_c = [], []
        for _, job in _jobs(label):
            opts = [(job, p) for p in POLICIES]
            t0 = time.perf_counter()
            ref = replay_windows(opts, cap, od)
            t1 = time.perf_counter()
            mod = predict_options(opts, cap, od)
            t_model += time.perf_counter() - t1
            t_replay += t1 - t0
            for r, m in zip(ref, mod, strict=True):
                if math.isinf(r.expected_hours) or math.isinf(m.expected_hours):
                    # some window or path never finishes: the mean is "never" (its dollars are
                    # the horizon's); agreement is both saying so
                    never += [math.isinf(r.expected_hours) == math.isinf(m.expected_hours)]
                    continue
                per_trace_h += _rel(m.expected_hours, r.expected_hours)
                per_trace_c += _rel(m.expected_cost, r.expected_cost)
            # economics(): Poisson preemptions on capacity that never goes away, MTBF read off
            # the trace; the same job (no deadline) replayed spot-only
            mtbf_h = cap.availability.mtbf_s / 3600
            if 0 < mtbf_h < float("inf"):
                econ += _economics_error(job, cap, mtbf_h)
        errs_h += per_trace_h
        errs_c += per_trace_c
        a = cap.availability
        rows.append(
            (
                label,
                f"{a.fraction:.2f}",
                f"{a.mtbf_s / 3600:.1f} h",
                f"{a.mean_outage_s / 3600:.1f} h",
                f"{np.median(per_trace_h):.1%}",
                f"{max(per_trace_h):.1%}",
                f"{np.median(per_trace_c):.1%}",
                f"{max(per_trace_c):.1%}",
            )
        )
    rows.append(
        (
            "all traces",
            "",
            "",
            "",
            f"**{np.median(errs_h):.1%}**",
            f"{max(errs_h):.1%}",
            f"**{np.median(errs_c):.1%}**",
            f"{max(errs_c):.1%}",
        )
    )
    figs = [
        figure("prediction vs replay |error| hours", "%", errs_h, scale=100),
        figure("prediction vs replay |error| dollars", "%", errs_c, scale=100),
        value_figure("prediction vs replay median |error| hours", "%", np.median(errs_h) * 100),
        value_figure("prediction vs replay median |error| dollars", "%", np.median(errs_c) * 100),
        value_figure("economics() vs replay median |error| hours", "%", np.median(econ) * 100),
    ]
    ctx = {
        "runs that never finish (some window or path)": f"{len(never)}, model and replay agree "
        f"on {sum(never)}",
        "replay seconds (all traces)": f"{t_replay:.1f}",
        "prediction seconds (all traces)": f"{t_model:.1f}",
        "economics() vs spot-only replay |error| hours": f"median {np.median(econ):.1%}, "
        f"worst {max(econ):.1%}",
    }
    return rows, figs, ctx


def sweep_seconds(traces: list) -> tuple[list[tuple], list]:
    """Every window of every shared trace, the four policies: how long the reference takes
    (the issue: "in seconds"). The AWS traces tick every 600 s (a 24 h job); Bamboo's events are
    resampled to 60 s ticks (a 4 h job: the traces are 11 h long)."""
    od = Capacity.on_demand(ON_DEMAND)
    pols = ("on-demand", *POLICIES)
    rows, figs = [], []
    for group, work, deadline in (("aws", 24, 36), ("bamboo", 4, 6)):
        job = CapacityJob(
            work, deadline_h=deadline, stall_s=10, persist_s=60, restart_s=600, final_save_s=60
        )
        windows = 0
        t0 = time.perf_counter()
        for label, cap, _ in traces:
            if label.startswith(group) and cap.trace is not None:
                replay_windows([(job, p) for p in pols], cap, od)
                windows += cap.trace.ticks
        t = time.perf_counter() - t0
        rows.append(
            (
                f"every window of the {group} traces ({windows:,} windows x 4 policies, "
                f"{work} h job)",
                f"{t:.1f} s",
                f"load {os.getloadavg()[0]:.1f}",
                "",
                "",
                "",
                "",
                "",
            )
        )
        figs.append(value_figure(f"replay sweep of every {group} window", "s", t))
    return rows, figs


def _calibrated_job(
    cal_path: str | None, work_h: float, deadline_h: float, node_ranks: int, rank_bytes: int
) -> tuple[CapacityJob, str]:
    from gpumem.calibrate.calibration import as_calibration
    from gpumem.planner.checkpoint_times import checkpoint_times
    from gpumem.planner.notice import final_save_seconds

    cal = as_calibration(cal_path)
    t = checkpoint_times(cal, checkpoint_bytes=rank_bytes)
    save = final_save_seconds(rank_bytes=rank_bytes, ranks_per_node=node_ranks, calibration=cal)
    job = CapacityJob(
        work_h,
        deadline_h=deadline_h,
        stall_s=t.stall_s,
        persist_s=t.persist_s,
        restart_s=t.restart_s,
        final_save_s=save,
    )
    return job, (
        f"C {t.stall_s:.2f} s, P {t.persist_s:.2f} s, R {t.restart_s:.0f} s, final "
        f"save of {node_ranks} ranks {save:.1f} s"
    )


def policies(traces: list, cal_path: str) -> tuple[list[tuple], list, dict]:
    od = Capacity.on_demand(ON_DEMAND)
    rank_bytes = 2 << 30
    rows, figs, ctx = [], [], {}
    for work, deadline in ((24, 30), (24, 36)):
        cost: dict[str, list[float]] = {p: [] for p in ("on-demand", *POLICIES)}
        met: dict[str, list[float]] = {p: [] for p in cost}
        for label, cap, ranks in traces:
            if label.startswith("bamboo"):
                continue
            job, note = _calibrated_job(cal_path, work, deadline, ranks, rank_bytes)
            ctx[f"job on {ranks}-GPU nodes"] = note
            preds = replay_windows([(job, p) for p in cost], cap, od)
            for p in preds:
                cost[p.policy].append(p.expected_cost)
                met[p.policy].append(1 - p.miss_probability)
        for p in cost:
            c, m = float(np.mean(cost[p])), float(np.mean(met[p]))
            rows.append(
                (
                    f"{work} h, deadline {deadline} h",
                    p,
                    f"${c:,.2f}",
                    f"{m:.1%}",
                    f"{c / np.mean(cost['uniform-progress']):.3f}",
                )
            )
            figs.append(value_figure(f"{p} mean cost {work}h/{deadline}h", "$", c))
            figs.append(
                value_figure(f"{p} deadline met {work}h/{deadline}h", "%", m * 100, better="higher")
            )
    return rows, figs, ctx


def _calibrate(folder: str) -> str:
    out = Path(folder) / "calibration.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem",
            "calibrate",
            "--device",
            "cpu",
            "--dir",
            folder,
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return str(out)


def cli(trace: Path) -> tuple[list[tuple], list]:
    base = [sys.executable, "-m", "gpumem"]
    plan = ["plan", "llama-2-70b", "--gpus", "1024"]
    caps = [
        "--deadline",
        "30h",
        "--capacity",
        f"spot,trace={trace},price=1.2,notice=aws",
        "--capacity",
        "on-demand,price=3.0",
    ]
    kinds = {"start": ["--version"], "plan": plan, "plan + capacities": plan + caps}

    def run(argv: list[str]) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(base + argv, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    run(plan + caps)
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(5):
        for k, argv in kinds.items():
            got[k].append(run(argv))
    wall = {k: statistics.median(r[0] for r in v) for k, v in got.items()}
    cpu = {k: statistics.median(r[1] for r in v) for k, v in got.items()}
    load = os.getloadavg()[0]
    rows, figs = [], []
    for k in ("plan", "plan + capacities"):
        c, w = cpu[k] - cpu["start"], wall[k] - wall["start"]
        rows.append(
            (
                f"gpumem {' '.join(plan)}"
                + (" --deadline 30h --capacity x2" if k != "plan" else ""),
                f"{c * 1e3:.0f} ms CPU",
                f"{w * 1e3:.0f} ms wall (load {load:.1f})",
                "yes" if c < 1 else "NO",
            )
        )
        figs.append(value_figure(f"{k} CLI CPU beyond start", "ms", c * 1e3))
    return rows, figs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "spot-traces"))
    ap.add_argument("--calibration", default=None, help="default: calibrate this machine now")
    args = ap.parse_args()
    root = Path(args.traces)
    traces = _traces(root)
    if not traces:
        sys.exit(f"no traces under {root}: give --traces DIR")
    info = machine_info()
    r1, f1 = published()
    r2, f2, c2 = agreement(traces)
    r5, f5 = sweep_seconds(traces)
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-cal-", dir=ROOT) as d:
        cal = args.calibration or _calibrate(d)
        r3, f3, c3 = policies(traces, cal)
    r4, f4 = cli(next(root.glob("aws-2022-10-us-west-2/*v100_8.json")))
    info.update(c2)
    info.update(c3)
    info["calibration"] = args.calibration or "measured by this run (gpumem calibrate, defaults)"
    rows = [("**1. published result**", "", "", "", "", "", "", "")]
    rows += [(*r, "", "", "", "") for r in r1]
    rows += [
        (
            "**2. prediction vs replay**",
            "availability",
            "MTBF",
            "mean outage",
            "median err h",
            "worst err h",
            "median err $",
            "worst err $",
        ),
        *r2,
        *r5,
    ]
    rows += [
        (
            "**3. policies, every window**",
            "policy",
            "mean cost",
            "deadline met",
            "cost / UP",
            "",
            "",
            "",
        ),
        *[(*r, "", "", "") for r in r3],
    ]
    rows += [
        ("**4. CLI**", "CPU beyond start", "wall", "< 1 s CPU", "", "", "", ""),
        *[(*r, "", "", "", "") for r in r4],
    ]
    write_results(
        "capacity",
        "Capacity: replay, prediction and policies on real spot traces",
        ["what", "", "", "", "", "", "", ""],
        rows,
        notes=NOTES,
        info=info,
        figures=[*f1, *f2, *f5, *f3, *f4],
    )


NOTES = """
Replay: ``gpumem.planner.capacity_replay`` with sky_spot's tick semantics, every start tick of
each trace (read as a cycle). Prediction: ``gpumem.planner.predict.predict_options`` — 512
paths sampled from the trace's run-length distributions (not the trace itself), the same job
and policies.
Errors are |prediction / replay mean - 1| per (trace, job, policy), the jobs listed in
``_jobs``; spot-only runs are replayed to completion (no deadline guard). economics():
Young/Daly with MTBF = the trace's mean run before a preemption, no outages. Section 3: the
job's C, P, R and its final save (all ranks of a node at once) come from the calibration at a
2 GiB state per GPU; AWS's notice is 120 s; prices $0.9731 spot, $3.06 on-demand per GPU-hour.
"""

if __name__ == "__main__":
    main()
