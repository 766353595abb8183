"""gpumem profile: per-layer memory of training steps of a built-in or transformers model."""

from __future__ import annotations

import argparse
import shlex
import sys

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="profile the memory of training steps of a built-in model or a local config.json",
        description="Run training steps of a built-in model (gpt2, llama, mixtral, vit, resnet) "
        "or of a transformers model from a local config.json inside gpumem.profile and print "
        "the per-layer table. A real (not --fake) run is refused when its estimated peak "
        "exceeds the memory available (--force runs it anyway).",
    )
    p.add_argument("model", help="gpt2 | llama | mixtral | vit | resnet | path/to/config.json")
    p.add_argument(
        "--size",
        default=None,
        help="preset size of a built-in model (tiny, small, 7b, 70b, 8x7b, ...; default tiny); "
        "a config.json sets its own",
    )
    p.add_argument("--batch-size", type=_args.positive_int, default=2)
    p.add_argument(
        "--seq-len", type=_args.positive_int, default=None, help="tokens per sample (LMs)"
    )
    p.add_argument(
        "--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "none"), help="optimizer"
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"),
        help="parameter dtype, or fp32 weights under autocast (amp-*); default: a config.json's "
        "torch_dtype, else fp32",
    )
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing per block"
    )
    p.add_argument("--fake", action="store_true", help="fake tensors: any size, no memory used")
    p.add_argument(
        "--full",
        action="store_true",
        help="with --fake: profile every block. By default a built-in transformer's identical "
        "blocks are profiled 1, 2 and 3 at a time and the report extrapolated exactly (checked; "
        "no timeline and no simulated reserved peak: --plot, --trace, --memory-snapshot, "
        "--json FILE and --alloc-conf profile every block)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="run for real even when the estimated peak exceeds the memory available",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu or cuda (with --fake: fake CUDA tensors of any size; training them "
        "needs a usable GPU)",
    )
    p.add_argument("--steps", type=_args.step_count, default=2, help="training steps (default 2)")
    p.add_argument(
        "--mode",
        default="exact",
        choices=("exact", "light"),
        help="exact: every op (default); light: hooks only, no temporaries on CPU",
    )
    p.add_argument(
        "--alloc-conf",
        metavar="SETTINGS",
        type=_alloc_conf,
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF for the simulated reserved peak (default: the "
        "environment's), e.g. expandable_segments:True",
    )
    p.add_argument(
        "--depth",
        type=_args.non_negative_int,
        default=None,
        help="module depth of the table (default 2) and of --plot's bars (default: the "
        "repeated blocks and the embedding, norm and head around them)",
    )
    p.add_argument(
        "--json", metavar="FILE", type=_args.output_file, help="write the JSON report ('-': stdout)"
    )
    p.add_argument("--markdown", action="store_true", help="print Markdown instead of the table")
    p.add_argument(
        "--plot",
        metavar="FILE",
        type=_args.png_file,
        help="write a PNG (per-layer bars, memory over time)",
    )
    p.add_argument(
        "--trace", metavar="FILE", type=_args.output_file, help="write a Chrome/Perfetto trace JSON"
    )
    p.add_argument(
        "--memory-snapshot",
        metavar="FILE",
        type=_args.output_file,
        help="write PyTorch's memory-snapshot pickle for pytorch.org/memory_viz and `python -m "
        "torch.cuda._memory_viz stats|trace_plot` (the timeline as synthetic allocations by "
        "step and phase)",
    )
    p.set_defaults(func=run, skip_teardown=True)


def _alloc_conf(text: str) -> str:
    from gpumem.allocator.alloc_conf import AllocConf

    try:
        AllocConf.parse(text, source="--alloc-conf")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def run(args: argparse.Namespace) -> int:
    from gpumem._gc import paused as paused_gc

    # importing torch, and for --fake torch._dynamo (FakeTensorMode imports it when created),
    # makes hundreds of thousands of objects that live as long as the process: collections
    # while they are made walk them for nothing (0.5 s of a 5 s fake profile)
    with paused_gc():
        from gpumem.profiler.runner import profile_model

        if args.fake:
            import torch._dynamo  # noqa: F401

    job = {
        "size": args.size,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "optimizer": args.optimizer,
        "precision": args.precision,
        "checkpointing": args.checkpointing,
    }
    if not args.fake and not args.force:
        _refuse_what_cannot_fit(args, job)
    # what needs the whole run: the timeline, and the simulated caching allocator
    whole = args.full or args.alloc_conf or args.plot or args.trace or args.memory_snapshot
    whole = whole or (args.json not in (None, "-"))
    with progress_bar(f"profiling {args.model}", enabled=args.json != "-") as bar:
        rep = profile_model(
            args.model,
            **job,
            fake=args.fake,
            device=args.device,
            steps=args.steps,
            mode=args.mode,
            progress=bar,
            alloc_conf=args.alloc_conf,
            extrapolate=not whole,
            notice=lambda text: print(f"gpumem profile: {text}", file=sys.stderr),
        )
    if args.json == "-":
        print(rep.to_json(timeline=False))
    else:
        if args.json:
            rep.to_json(args.json)
        depth = 2 if args.depth is None else args.depth
        print(rep.to_markdown(depth) if args.markdown else rep.table(depth))
    for flag, write in (
        ("plot", lambda path: rep.plot(path, args.depth)),
        ("trace", rep.to_chrome_trace),
        ("memory_snapshot", rep.to_memory_snapshot),
    ):
        path = getattr(args, flag)
        if path:
            write(path)
            print(f"wrote {path}", file=sys.stderr)
    return 0


_DEFAULTS = {"optimizer": "adamw", "precision": None, "device": "cpu"}


def _refuse_what_cannot_fit(args: argparse.Namespace, job: dict) -> None:
    """A real run whose estimated peak exceeds the memory available is refused, with the
    estimate and the command that profiles it under fake tensors instead."""
    from gpumem.estimator.preflight import profile_preflight

    check = profile_preflight(args.model, device=args.device, **job)
    if check.fits:
        return
    from gpumem.profiler.runner import is_config_path

    argv = ["gpumem", "profile", args.model]
    if not is_config_path(args.model):  # a config.json sets its own size (--size is refused)
        argv += ["--size", "tiny" if args.size is None else args.size]
    argv += ["--batch-size", str(args.batch_size)]
    if args.seq_len is not None:
        argv += ["--seq-len", str(args.seq_len)]
    for flag in ("optimizer", "precision", "device"):
        if getattr(args, flag) != _DEFAULTS[flag]:
            argv += [f"--{flag}", getattr(args, flag)]
    if args.checkpointing:
        argv.append("--checkpointing")
    fake = shlex.join([*argv, "--fake"])
    raise ValueError(
        f"{check.message()}: a real run would be killed by the out-of-memory killer; profile it "
        f"under fake tensors (no memory used) with `{fake}`, or pass --force to run it anyway"
    )
