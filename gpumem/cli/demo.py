"""gpumem demo: the four things gpumem is for, in about two minutes, offline."""

from __future__ import annotations

import argparse

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="start here: profile a step, fit a 70B job, price preemptions, resume after SIGTERM",
        description="Profile a small GPT's training step (table + chart), estimate Llama-2-70B "
        "and plan it on 64 H100s, measure this machine's checkpoint cost and price spot "
        "preemptions, and train a small model that is preempted by SIGTERM and resumes "
        "bit-identically. Offline, on built-in models; files go under --out.",
    )
    p.add_argument(
        "--out",
        type=_args.new_or_existing_dir,
        default="gpumem-demo",
        help="directory for the charts, calibration.json and checkpoints (default gpumem-demo)",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller measurements (CI)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpumem.demo import run_demo

    result = run_demo(args.out, quick=args.quick, bar=lambda what: progress_bar(what))
    return 0 if result.bit_identical else 1
