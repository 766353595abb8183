"""gpumem plan: which layouts fit, how many GPUs a job needs, and what preemption costs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar
from gpumem.cli.estimate import add_job_arguments
from gpumem.planner.capacity import Capacity
from gpumem.planner.capacity_spec import parse_capacity
from gpumem.planner.decision import DEFAULT_CONFIDENCE
from gpumem.planner.economics import (
    DEFAULT_PERSIST_S,
    DEFAULT_PRICE_PER_GPU_HOUR,
    DEFAULT_RESTART_S,
    DEFAULT_RUN_HOURS,
    DEFAULT_STALL_S,
    DEFAULT_STARTUP_S,
)
from gpumem.planner.margin import DEFAULT_HEADROOM, Margin


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search every layout that fits, rank them, and price preemptions",
        description="Search dp x tp x pp (x ep) x ZeRO x micro-batch x recompute for MODEL on "
        "--gpus GPUs, list the layouts that fit ranked by a throughput proxy, and optionally "
        "the checkpoint economics and a Slurm/Kubernetes job script.",
    )
    add_job_arguments(p)
    p.add_argument("--gpus", type=_args.gpu_count, default=8, help="number of GPUs (default 8)")
    p.add_argument("--min-gpus", action="store_true", help="find the smallest GPU count that fits")
    p.add_argument(
        "--global-batch", type=_args.positive_int, default=None, help="sequences per optimizer step"
    )
    p.add_argument(
        "--top", type=_args.positive_int, default=10, help="layouts to list (default 10)"
    )
    p.add_argument(
        "--headroom",
        type=_headroom,
        default=None,
        help="memory each GPU keeps free beyond the estimated peak: a share (5%%) or a size "
        f"(4GiB); default {DEFAULT_HEADROOM.replace('%', '%%')}",
    )
    p.add_argument(
        "--inference",
        action="store_true",
        help="serving: largest batch x context per layout (honours --gpus, --min-gpus, --tp, "
        "--pp, --precision, --kv-dtype, --engine)",
    )
    p.add_argument(
        "--tp", type=_args.gpu_count, default=None, help="inference: tensor-parallel degree"
    )
    p.add_argument(
        "--pp", type=_args.gpu_count, default=None, help="inference: pipeline-parallel degree"
    )
    e = p.add_argument_group("preemption economics")
    rate = e.add_mutually_exclusive_group()
    rate.add_argument(
        "--mtbf-hours",
        type=_args.positive_float,
        default=None,
        help="mean time between preemptions",
    )
    rate.add_argument(
        "--preemption-rate", type=_args.positive_float, default=None, help="preemptions per hour"
    )
    e.add_argument(
        "--price-per-gpu-hour",
        type=_args.positive_float,
        default=DEFAULT_PRICE_PER_GPU_HOUR,
        help=f"dollars (default {DEFAULT_PRICE_PER_GPU_HOUR:g})",
    )
    e.add_argument(
        "--stall-s",
        type=_args.non_negative_float,
        default=None,
        help="training stall per checkpoint, C (s; default: measured with --calibration, else "
        f"{DEFAULT_STALL_S:g})",
    )
    e.add_argument(
        "--persist-s",
        type=_args.non_negative_float,
        default=None,
        help="time until a checkpoint is durable, P >= C (s; default: measured with "
        f"--calibration, else {DEFAULT_PERSIST_S:g})",
    )
    e.add_argument(
        "--restart-s",
        type=_args.non_negative_float,
        default=None,
        help="restart + reload time, R (s; default: measured restore + --startup-s, else "
        f"{DEFAULT_RESTART_S:g})",
    )
    e.add_argument(
        "--startup-s",
        type=_args.non_negative_float,
        default=None,
        help="with --calibration: restart time besides the measured restore (default "
        f"{DEFAULT_STARTUP_S:g})",
    )
    e.add_argument(
        "--run-hours",
        type=_args.positive_float,
        default=DEFAULT_RUN_HOURS,
        help=f"failure-free length of the run (hours, default {DEFAULT_RUN_HOURS:g})",
    )
    e.add_argument(
        "--preempted-at-hours",
        type=_args.non_negative_float,
        default=None,
        help="realised loss of a preemption at this hour of the run",
    )
    e.add_argument(
        "--notice",
        type=_notice,
        default=None,
        help="the notice before a node is taken: aws (120 s), gcp or azure (30 s), gke (15 s) "
        "or seconds (Slurm: the partition's GraceTime); says whether the best layout's final "
        "save, every rank of a node writing at once, is durable within it",
    )
    c = p.add_argument_group(
        "capacity decision",
        "price the job on real capacity: spot (a trace or rates), on-demand, reserved, a "
        "cluster's tiers; rank layouts x capacities x policies by expected cost, subject to "
        "the deadline (docs/capacity.md)",
    )
    c.add_argument(
        "--capacity",
        action="append",
        type=_capacity,
        default=None,
        metavar="SPEC",
        help="KIND[,key=value...], repeatable: e.g. spot,trace=us-west-2a.json,price=0.97,"
        "notice=aws or on-demand,price=3.06 or tier,name=low,price=1,preemptions-per-day=4,"
        "outage-h=0.5,notice=30 (keys: name price trace nodes gap availability "
        "preemptions-per-day outage-h notice queue-wait-h)",
    )
    c.add_argument(
        "--deadline",
        type=_hours,
        default=None,
        help="wall-clock deadline from the start: 200h, 8d or hours (default: none)",
    )
    c.add_argument(
        "--confidence",
        type=_probability,
        default=DEFAULT_CONFIDENCE,
        help=f"probability of meeting the deadline required (default {DEFAULT_CONFIDENCE:g})",
    )
    sched = p.add_mutually_exclusive_group()
    for flag, what in (
        ("--slurm", "an sbatch script for the best layout (--notice: the partition's GraceTime)"),
        ("--k8s", "a Kubernetes manifest for it: PriorityClass, Service, Job (Kueue)"),
        ("--skypilot", "a SkyPilot task for it, on the capacity the decision chose"),
    ):
        sched.add_argument(
            flag,
            default=None,
            type=_script_file(flag),
            metavar="FILE",
            help=f"write {what} to FILE; with - it alone goes to stdout and the report to stderr",
        )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _script_file(flag: str) -> Callable[[str], str]:
    """The FILE of ``flag``: ``-`` or a file whose directory exists, refused before the search,
    not after it. A built-in model's name is refused too: ``plan --slurm gpt2`` meant the model,
    not a file."""

    def check(text: str) -> str:
        from gpumem.estimator.model_presets import PRESETS

        if text.lower() in PRESETS and not os.path.exists(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a model, not the job script's FILE: give the FILE (or - for "
                f"stdout) after the option, e.g. gpumem plan {text} {flag} job.{flag[2:]}"
            )
        if text != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(text))):
            raise argparse.ArgumentTypeError(f"no directory for the job script {text!r}")
        return text

    return check


def _capacity(text: str) -> Capacity:
    try:
        return parse_capacity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _hours(text: str) -> float:
    t = text.strip().lower()
    scale = 24.0 if t.endswith("d") else 1.0
    try:
        v = float(t.rstrip("hd")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: 200h, 8d or hours") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"a deadline must be > 0 hours, got {text!r}")
    return v


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"confidence must be in (0, 1), got {text}")
    return v


def _headroom(text: str) -> Margin:
    try:
        return Margin.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _notice(text: str) -> float:
    from gpumem.planner.notice import notice_seconds

    try:
        return notice_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _notice_fit(result: Any, notice_s: float) -> tuple[dict | None, list[str]]:
    """Whether the best layout's final save (after the step in flight, as the planner estimates
    it) is durable within the notice, with the ranks of a node writing at once, and what would
    make it fit: ``gpumem.planner.notice``."""
    from gpumem.planner.notice import final_save_fit

    nbytes = result.checkpoint_bytes()
    if nbytes is None:
        return None, ["final save on notice: no layout fits, so there is nothing to save"]
    fit = final_save_fit(
        rank_bytes=nbytes,
        ranks_per_node=min(result.gpu.gpus_per_node, result.n_gpus),
        notice_s=notice_s,
        calibration=result.calibration,
        step_s=result.best.step_seconds,
    )
    return fit.to_dict(), fit.lines()


def run(args: argparse.Namespace) -> int:
    if args.inference:
        return _inference(args)
    from gpumem.estimator.frameworks.deepspeed import knobs_from_cli
    from gpumem.planner import min_gpus, plan, realised

    if args.loss_chunks:
        raise ValueError(
            "--loss-chunks is torchtitan's chunked loss, and the planner does not sweep "
            "torchtitan: estimate its layouts one by one with gpumem estimate --framework "
            "torchtitan"
        )
    if args.compiled_loss:
        raise ValueError(
            "--compiled-loss is torchtitan's compiled loss, and the planner does not sweep "
            "torchtitan: estimate its layouts one by one with gpumem estimate --framework "
            "torchtitan"
        )
    if args.fsdp_float8_all_gather:
        raise ValueError(
            "--fsdp-float8-all-gather is torchtitan's float8 all-gather, and the planner does "
            "not sweep torchtitan: estimate its layouts one by one with gpumem estimate "
            "--framework torchtitan"
        )

    _check_capacity_args(args)
    kw = {
        "gpu": args.gpu,
        "gpu_memory": args.gpu_memory,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "grads": args.grads,
        "lora_rank": args.lora_rank,
        "base_quant": "nf4" if args.qlora else None,
        "calibration": args.calibration,
        "framework": args.framework,
        "deepspeed": knobs_from_cli(args.deepspeed, args.ds_config),
        "keep_logits": args.keep_logits,
        "headroom": args.headroom,
        "alloc_conf": args.alloc_conf,
    }
    with progress_bar("searching layouts", enabled=not args.json) as bar:
        if args.min_gpus:
            result = min_gpus(args.model, progress=bar, **kw)
        else:
            result = plan(args.model, n_gpus=args.gpus, progress=bar, **kw)
    out: dict = {
        "inputs": result.inputs_json(),
        "n_gpus": result.n_gpus,
        "n_configs": result.n_configs,
        "fitting": [
            {"layout": c.describe(), "peak_bytes": c.total_bytes, "step_s": c.step_seconds}
            for c in result.candidates[: args.top]
        ],
        "reserved": result.reserved_line(),
    }
    text = [result.table(args.top)]
    if result.best is not None:
        bill = result.bill()
        out["bill"] = bill.to_dict()
        text += ["", "best layout:", bill.table()]
        if bill.calibration:
            from gpumem.calibrate.memory import calibration_lines

            text += ["", *calibration_lines(bill)]
    times = result.checkpoint_times(
        stall_s=args.stall_s,
        persist_s=args.persist_s,
        restart_s=args.restart_s,
        startup_s=args.startup_s,
    )
    priced = args.mtbf_hours is not None or args.preemption_rate is not None
    if result.calibration is not None:
        out["calibration"] = times.calibration
        text += ["", result.calibration.reserve_line(result.gpu), *times.lines()]
    elif times.notes and (priced or args.preempted_at_hours is not None):
        text += ["", *times.notes]  # say that C, P and R were guessed, and how to measure them
    if priced:
        e = result.economics(
            mtbf_hours=args.mtbf_hours,
            preemption_rate=args.preemption_rate,
            price_per_gpu_hour=args.price_per_gpu_hour,
            run_hours=args.run_hours,
            times=times,
        )
        out["economics"] = e.to_dict()
        warn = times.extrapolation_warning
        text += ["", *([f"WARNING: {warn}"] if warn else []), e.table()]
    if args.preempted_at_hours is not None:
        loss = realised(
            hours=args.preempted_at_hours,
            n_gpus=result.n_gpus,
            price_per_gpu_hour=args.price_per_gpu_hour,
            mtbf_hours=args.mtbf_hours
            or (1 / args.preemption_rate if args.preemption_rate else None),
            **times.values(),
        )
        out["realised_loss"] = loss.to_dict()
        text += ["", loss.line()]
    if args.notice is not None:
        out["notice"], lines = _notice_fit(result, args.notice)
        text += ["", *lines]
    if args.capacity:
        text += ["", *_decision(args, result, times, out)]
    if _script_dest(args) is not None:
        script = _job_script(args, result, times.persist_s, out.get("decision"))
        out["script"] = script
        _emit(json.dumps(out, indent=2) if args.json else "\n".join(text), script, args)
        return 0
    print(json.dumps(out, indent=2) if args.json else "\n".join(text))
    return 0


def _emit(report: str, script: str, args: argparse.Namespace) -> None:
    """The report and the job script apart, so the script can be submitted as it is: FILE gets
    the script and stdout the report; with ``-`` stdout gets the script alone and stderr the
    report; ``--json`` keeps stdout JSON (the script is its ``script`` field)."""
    dest = _script_dest(args)
    if dest != "-":
        with open(dest, "w") as f:
            f.write(script)
        print(report)
        print(f"job script written to {dest}", file=sys.stderr)
    elif args.json:
        print(report)
    else:
        print(report, file=sys.stderr)
        sys.stdout.write(script)


def _script_dest(args: argparse.Namespace) -> str | None:
    return args.slurm or args.k8s or args.skypilot


def _job_script(args: argparse.Namespace, result, persist_s: float, decision: dict | None) -> str:
    """The job script asked for. Its grace is :func:`schedulers.grace_seconds` of the final save
    (the step in flight, then every rank of a node saving at once: ``notice``'s model, with the
    calibration when given) or of the persist time, whichever is longer; ``--notice`` is the
    partition's GraceTime for Slurm and the node's notice for Kubernetes and SkyPilot."""
    from gpumem.planner import kube_job, schedulers, sky_task
    from gpumem.planner.notice import final_save_seconds

    per_node = result.gpu.gpus_per_node
    final_s = None
    if result.best is not None:
        final_s = result.best.step_seconds + final_save_seconds(
            rank_bytes=result.checkpoint_bytes(),
            ranks_per_node=min(per_node, result.n_gpus),
            calibration=result.calibration,
        )
    grace = schedulers.grace_seconds(max(persist_s, final_s or 0.0))
    common = {
        "n_gpus": result.n_gpus,
        "gpus_per_node": per_node,
        "layout": result.best.describe() if result.best else "none fits",
        "final_save_s": final_s,
    }
    if args.slurm:
        return schedulers.sbatch_header(**common, signal_s=grace, grace_time_s=args.notice)
    if args.k8s:
        return kube_job.k8s_job(**common, grace_s=grace, notice_s=args.notice)
    spot_notices = [c.notice_s for c in args.capacity or () if c.preemptible and c.notice_s]
    best = (decision or {}).get("best")
    why = (
        f"the capacity decision: {best['policy']} on {best['capacity']}"
        if best
        else ("no --capacity given: spot first, on-demand when spot is unavailable")
    )
    return sky_task.skypilot_task(
        **common,
        accelerator=sky_task.SKYPILOT_ACCELERATORS.get(result.gpu.name, result.gpu.name),
        capacity=sky_task.capacity_of_policy(best["policy"] if best else None),
        notice_s=args.notice or min(spot_notices, default=None),
        why=why,
    )


def _check_capacity_args(args: argparse.Namespace) -> None:
    """Refuse, before any search, a deadline nothing can be priced on or meet."""
    if args.deadline is not None and not args.capacity:
        raise ValueError(
            "--deadline prices the job on capacity: give at least one --capacity (e.g. "
            f"on-demand,price={args.price_per_gpu_hour:g} and a spot trace or rates)"
        )
    if args.deadline is not None and args.deadline < args.run_hours:
        raise ValueError(
            f"--deadline {args.deadline:g} h is shorter than the work (--run-hours "
            f"{args.run_hours:g} h): no capacity meets it; give a later deadline"
        )


def _decision(args: argparse.Namespace, result, times, out: dict) -> list[str]:
    """The capacity decision's table and paragraph (and its JSON into ``out``)."""
    from gpumem.planner.decision import decide, layout_jobs

    if result.best is None:
        return ["capacity decision: no layout fits, so there is nothing to price"]
    jobs = layout_jobs(
        result,
        run_hours=args.run_hours,
        deadline_h=args.deadline,
        stall_s=args.stall_s,
        persist_s=args.persist_s,
        restart_s=args.restart_s,
        startup_s=args.startup_s,
    )
    warn = times.extrapolation_warning
    d = decide(jobs, args.capacity, confidence=args.confidence, warnings=(warn,) if warn else ())
    out["decision"] = d.to_dict()
    lines = [n for n in times.notes if "guesses" in n]
    for notice in sorted({c.notice_s for c in args.capacity if c.notice_s is not None}):
        if notice != args.notice:  # --notice printed its own
            lines += _notice_fit(result, notice)[1]
    return [*lines, d.table()]


def _inference(args: argparse.Namespace) -> int:
    """Serving: every tp x pp layout of --gpus (or --tp/--pp), the largest batch per context
    (capped at the model's maximum), KV bytes per token and the engine's reserve; --min-gpus:
    the fewest GPUs (powers of two) with a layout that holds one sequence of the model's
    context."""
    from gpumem.cli.estimate import inference_precision
    from gpumem.estimator.inference import plan_inference

    kw = {
        "gpu": args.gpu,
        "gpu_memory": args.gpu_memory,
        "tp": args.tp,
        "pp": args.pp,
        "precision": inference_precision(args.precision),
        "kv_dtype": args.kv_dtype,
        "engine": args.engine,
        "calibration": args.calibration,
    }
    n = args.gpus
    if args.min_gpus:
        n = 1
        while True:
            res = plan_inference(args.model, n_gpus=n, **kw)
            if any(x.max_batch.get(res.contexts[-1], 0) for x in res.layouts) or n >= 4096:
                break
            n *= 2
    else:
        res = plan_inference(args.model, n_gpus=n, **kw)
    print(json.dumps(res.to_dict(), indent=2) if args.json else res.table(args.top))
    return 0
