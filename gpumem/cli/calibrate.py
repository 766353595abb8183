"""gpumem calibrate: measure this machine and its checkpoint storage, write calibration.json.

`gpumem plan` and `gpumem estimate` read the file with ``--calibration FILE``; what they take
from it is decided by the library (``gpumem.plan(..., calibration=)``,
``gpumem.estimate(..., calibration=)``), not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar


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
        default=None,
        help="state sizes, comma-separated (default: three up to 2 GiB, where bandwidth "
        "dominates the fixed costs, the largest a 16th of the memory free: 64MiB,256MiB,1GiB "
        "with 16-32 GiB free)",
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
    mem = p.add_argument_group("estimator memory fit (--memory)")
    mem.add_argument(
        "--memory",
        action="store_true",
        help="fit the estimator's per-architecture coefficients to profiles of small proxy "
        "models instead of measuring checkpoints; adds a memory section to --out (other "
        "sections of an existing file are kept)",
    )
    mem.add_argument(
        "--arch",
        default=None,
        help="with --memory: the family to fit (gpt2, llama, mixtral: gpumem.models; or a "
        "transformers model_type such as llama, qwen2, gemma3_text, mixtral, qwen2_moe)",
    )
    mem.add_argument(
        "--config",
        type=_args.existing_path,
        default=None,
        help="with --memory: fit the family of this config.json",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.memory:
        return _run_memory(args)
    if args.arch or args.config:
        raise ValueError("--arch and --config choose what --memory fits: add --memory")
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
    previous = _existing(out)
    if previous is not None and previous.memory is not None:  # keep the memory fit
        cal = dataclasses.replace(cal, memory=previous.memory)
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


def _existing(out: Path) -> Any:
    """The calibration already at ``out`` (None if there is none or it is unreadable)."""
    from gpumem.calibrate import CalibrationError, load

    if not out.is_file():
        return None
    try:
        return load(out)
    except CalibrationError:
        return None


def _run_memory(args: argparse.Namespace) -> int:
    """--memory: fit the estimator to proxies of --arch / --config; write the memory section."""
    from gpumem.calibrate._schema import utc_now
    from gpumem.calibrate.calibration import Calibration, Machine, versions
    from gpumem.estimator.memory_fit import fit_memory

    if (args.arch is None) == (args.config is None):
        raise ValueError(
            "--memory fits one architecture: give --arch FAMILY or --config config.json"
        )
    out = Path(args.out)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    mem = fit_memory(arch=args.arch, config=args.config, device=device)
    previous = _existing(out)
    if previous is not None:
        cal = dataclasses.replace(previous, memory=mem, created_utc=utc_now())
    else:
        cal = Calibration(
            created_utc=utc_now(), machine=Machine.this(), versions=versions(), memory=mem
        )
    path = cal.save(out)
    if args.json:
        print(cal.to_json(), end="")
    else:
        print(cal.table())
        print(f"\nwrote {path}; use it with `gpumem estimate ... --calibration {path}`")
    return 0
