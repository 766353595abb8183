"""gpumem calibrate: measure this machine and its checkpoint storage, write calibration.json.

`gpumem plan` and `gpumem estimate` read the file with ``--calibration FILE``; what they take
from it is decided by the library (``gpumem.plan(..., calibration=)``,
``gpumem.estimate(..., calibration=)``), not here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar

DEFAULT_SIZES = "64MiB,256MiB"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure checkpoint cost and GPU reserve on this machine; write calibration.json",
        description="Save, persist and restore synthetic training states (fp32 model + AdamW) of "
        "each size with the real Checkpointer in a temporary directory under --dir (removed "
        "afterwards), fit seconds = a + b*bytes per quantity, measure the CUDA context and pinned "
        "copy bandwidth with --device cuda, and write the results for `gpumem plan --calibration` "
        "and `gpumem estimate --calibration`. Run it on the machine and the storage the job uses.",
    )
    p.add_argument(
        "--dir",
        type=_args.existing_dir,
        default=".",
        help="where the job's checkpoints will live (default: current directory)",
    )
    p.add_argument(
        "--sizes",
        type=_args.size_list,
        default=DEFAULT_SIZES,
        help=f"state sizes, comma-separated (default {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the saved tensors live (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--repeat",
        type=_args.bounded_int(1, 1000),
        default=5,
        help="measured rounds per size; medians are fitted (default 5)",
    )
    p.add_argument(
        "--report",
        metavar="PROFILE_JSON",
        type=_args.existing_path,
        default=None,
        help="a CUDA profile of your training step (gpumem profile --json FILE, or rep.to_json): "
        "adds its fragmentation and memory outside the allocator",
    )
    p.add_argument(
        "--out",
        type=_args.output_file,
        default="calibration.json",
        help="file to write (default: calibration.json here)",
    )
    p.add_argument("--json", action="store_true", help="print the file's JSON instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpumem.calibrate import measure

    out = Path(args.out)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    with progress_bar("calibrating checkpoint rounds", enabled=not args.json) as bar:
        cal = measure(
            args.dir,
            args.sizes,
            device=device,
            repeat=args.repeat,
            report=args.report,
            progress=bar,
        )
    path = cal.save(out)
    here = out.parent == Path(".") and not out.is_absolute()
    where = "in the current directory" if here else f"at {path.resolve()}"
    if args.json:
        print(cal.to_json(), end="")
        print(f"wrote {path} ({where})", file=sys.stderr)
    else:
        print(cal.table())
        print(f"\nwrote {path} ({where}); use it with `gpumem plan ... --calibration {path}`")
    return 0
