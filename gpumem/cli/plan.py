"""gpumem plan: which layouts fit, how many GPUs a job needs, and what preemption costs."""

from __future__ import annotations

import argparse
import json

from gpumem.cli.estimate import add_job_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search every layout that fits, rank them, and price preemptions",
        description="Search dp x tp x pp (x ep) x ZeRO x micro-batch x recompute for MODEL on "
        "--gpus GPUs, list the layouts that fit ranked by a throughput proxy, and optionally "
        "the checkpoint economics and a Slurm/Kubernetes job header.",
    )
    add_job_arguments(p)
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    p.add_argument("--min-gpus", action="store_true", help="find the smallest GPU count that fits")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    p.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    p.add_argument(
        "--inference",
        action="store_true",
        help="serving: largest batch x context per layout (honours --gpus, --min-gpus, --tp, "
        "--pp, --precision, --kv-dtype, --engine)",
    )
    p.add_argument("--tp", type=int, default=None, help="inference: tensor-parallel degree")
    p.add_argument("--pp", type=int, default=None, help="inference: pipeline-parallel degree")
    econ = p.add_argument_group("preemption economics")
    rate = econ.add_mutually_exclusive_group()
    rate.add_argument(
        "--mtbf-hours", type=float, default=None, help="mean time between preemptions"
    )
    rate.add_argument("--preemption-rate", type=float, default=None, help="preemptions per hour")
    econ.add_argument("--price-per-gpu-hour", type=float, default=3.0, help="dollars (default 3)")
    econ.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="training stall per checkpoint (s; default: measured with --calibration, else 1)",
    )
    econ.add_argument(
        "--persist-s",
        type=float,
        default=None,
        help="time to persist a checkpoint (s; default: measured with --calibration, else 60)",
    )
    econ.add_argument(
        "--restart-s",
        type=float,
        default=None,
        help="restart + reload time (s; default: measured restore + --startup-s, else 300)",
    )
    econ.add_argument(
        "--startup-s",
        type=float,
        default=None,
        help="with --calibration: restart time besides the measured restore (default 300)",
    )
    econ.add_argument("--run-hours", type=float, default=24.0, help="length of the run (hours)")
    econ.add_argument(
        "--preempted-at-hours",
        type=float,
        default=None,
        help="realised loss of a preemption at this hour of the run",
    )
    sched = p.add_mutually_exclusive_group()
    sched.add_argument(
        "--slurm", action="store_true", help="print an sbatch header for the best layout"
    )
    sched.add_argument("--k8s", action="store_true", help="print a Kubernetes Job (Kueue) for it")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpumem.cli.calibrate import (
        calibrated_gpu,
        load_calibration,
        reserve_lines,
        resolve_checkpoint_times,
    )

    cal = load_calibration(args)
    gpu = calibrated_gpu(args, cal)
    if args.inference:
        return _inference(args, gpu)
    from gpumem.planner import economics, k8s_job, min_gpus, plan, realised_loss, sbatch_header

    kw = {
        "gpu": gpu,
        "gpu_memory": args.gpu_memory,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "grads": args.grads,
        "lora_rank": args.lora_rank,
        "base_quant": "nf4" if args.qlora else None,
        "framework": args.framework,
        "calibration": cal if cal is not None and cal.memory is not None else None,
    }
    if args.min_gpus:
        result = min_gpus(args.model, **kw)
    else:
        result = plan(args.model, n_gpus=args.gpus, **kw)
    out: dict = {
        "n_gpus": result.n_gpus,
        "n_configs": result.n_configs,
        "fitting": [
            {"layout": c.describe(), "peak_bytes": c.total_bytes, "step_s": c.step_seconds}
            for c in result.candidates[: args.top]
        ],
    }
    text = [result.table(args.top)]
    bill = None
    if result.best is not None:
        bill = result.bill()
        out["bill"] = bill.to_dict()
        text += ["", "best layout:", bill.table()]
    record, lines = resolve_checkpoint_times(
        args, cal, bill
    )  # sets args.stall_s / persist_s / restart_s
    priced = (
        args.mtbf_hours is not None
        or args.preemption_rate is not None
        or args.preempted_at_hours is not None
    )
    if record is not None:
        out["calibration"] = record
        text += ["", *reserve_lines(args, cal, gpu), *lines]
    elif lines and priced:  # say that C, P and R were guessed, and how to measure them
        text += ["", *lines]
    if args.mtbf_hours is not None or args.preemption_rate is not None:
        e = economics(
            n_gpus=result.n_gpus,
            price_per_gpu_hour=args.price_per_gpu_hour,
            mtbf_hours=args.mtbf_hours,
            preemption_rate=args.preemption_rate,
            stall_s=args.stall_s,
            persist_s=args.persist_s,
            restart_s=args.restart_s,
            run_hours=args.run_hours,
        )
        out["economics"] = e.to_dict()
        text += ["", e.table()]
    if args.preempted_at_hours is not None:
        out["realised_loss"] = _realised(args, result.n_gpus, text, realised_loss)
    if args.slurm or args.k8s:
        layout = result.best.describe() if result.best else "none fits"
        per_node = result.gpu.gpus_per_node
        script = (
            sbatch_header(
                n_gpus=result.n_gpus,
                gpus_per_node=per_node,
                layout=layout,
                signal_s=max(60, int(args.persist_s * 2)),
            )
            if args.slurm
            else k8s_job(
                n_gpus=result.n_gpus,
                gpus_per_node=per_node,
                layout=layout,
                grace_s=max(60, int(args.persist_s * 2)),
            )
        )
        out["script"] = script
        text += ["", script]
    print(json.dumps(out, indent=2) if args.json else "\n".join(text))
    return 0


def _realised(args: argparse.Namespace, n_gpus: int, text: list[str], realised_loss) -> dict:
    """What one preemption at hour H costs: all H hours without a checkpoint; with checkpoints
    at most one interval of work plus the persist and restart times (the interval is Young/Daly's
    when an MTBF or rate is given, else the persist time, the shortest possible)."""
    from gpumem.planner import young_daly

    hours = args.preempted_at_hours
    if args.mtbf_hours is not None or args.preemption_rate is not None:
        mtbf_s = 3600.0 * (args.mtbf_hours or 1.0 / args.preemption_rate)
        interval_s = max(young_daly(args.stall_s, mtbf_s), args.persist_s)
    else:
        interval_s = args.persist_s
    at_most_h = min(hours, (interval_s + args.persist_s + args.restart_s) / 3600.0)
    price = args.price_per_gpu_hour
    without = realised_loss(n_gpus=n_gpus, hours_lost=hours, price_per_gpu_hour=price)
    with_ckpt = realised_loss(n_gpus=n_gpus, hours_lost=at_most_h, price_per_gpu_hour=price)
    text += [
        "",
        f"one preemption at hour {hours:g} on {n_gpus} GPUs at ${price:g}/GPU-h: "
        f"${without:,.0f} lost without a checkpoint ({hours:g} h of work), at most "
        f"${with_ckpt:,.0f} with one every {interval_s / 60:.1f} min",
    ]
    return {
        "hours": hours,
        "without_checkpoint": without,
        "with_checkpoint_at_most": with_ckpt,
        "interval_s": interval_s,
    }


def _inference(args: argparse.Namespace, gpu) -> int:
    """Serving: every tp x pp layout of --gpus (or --tp/--pp), the largest batch per context
    (capped at the model's maximum), KV bytes per token and the engine's reserve; --min-gpus:
    the fewest GPUs (powers of two) with a layout that holds one sequence of the model's
    context."""
    from gpumem.cli.estimate import inference_precision
    from gpumem.estimator.inference import plan_inference

    kw = {
        "gpu": gpu,
        "gpu_memory": args.gpu_memory,
        "tp": args.tp,
        "pp": args.pp,
        "precision": inference_precision(args.precision),
        "kv_dtype": args.kv_dtype,
        "engine": args.engine,
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
