"""gpumem profile: per-layer memory of training steps of a built-in or transformers model."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="profile the memory of training steps of a built-in model or a local config.json",
        description="Run training steps of a built-in model (gpt2, llama, mixtral, vit, resnet) "
        "or of a transformers model from a local config.json inside gpumem.profile and print "
        "the per-layer table.",
    )
    p.add_argument("model", help="gpt2 | llama | mixtral | vit | resnet | path/to/config.json")
    p.add_argument("--size", default="tiny", help="preset size (tiny, small, 7b, 70b, 8x7b, ...)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (LMs)")
    p.add_argument("--optimizer", default="adamw", help="adamw | adam | sgd | none")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 | amp-bf16 | amp-fp16")
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing per block"
    )
    p.add_argument("--fake", action="store_true", help="fake tensors: any size, no memory used")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (with --fake: fake CUDA tensors of any size; training them "
        "needs a usable GPU)",
    )
    p.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    p.add_argument(
        "--mode",
        default="exact",
        choices=("exact", "light"),
        help="exact: every op (default); light: hooks only, no temporaries on CPU",
    )
    p.add_argument("--depth", type=int, default=2, help="module depth shown in the table")
    p.add_argument("--json", metavar="FILE", help="write the JSON report ('-' for stdout)")
    p.add_argument("--markdown", action="store_true", help="print Markdown instead of the table")
    p.add_argument("--plot", metavar="FILE", help="write a PNG (per-layer bars, memory over time)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpumem.profiler.runner import profile_model

    rep = profile_model(
        args.model,
        size=args.size,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        optimizer=args.optimizer,
        precision=args.precision,
        checkpointing=args.checkpointing,
        fake=args.fake,
        device=args.device,
        steps=args.steps,
        mode=args.mode,
    )
    if args.json == "-":
        print(rep.to_json(timeline=False))
    else:
        if args.json:
            rep.to_json(args.json)
        print(rep.to_markdown(args.depth) if args.markdown else rep.table(args.depth))
    if args.plot:
        rep.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.trace:
        rep.to_chrome_trace(args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0
