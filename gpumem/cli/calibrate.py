"""gpumem calibrate: measure this machine and its checkpoint storage; and how `plan` and
`estimate` read the file (``--calibration FILE``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

DEFAULT_SIZES = "64MiB,256MiB"
# what `gpumem plan` assumes where nothing better is known (the planner's documented guesses)
DEFAULT_STALL_S, DEFAULT_PERSIST_S, DEFAULT_RESTART_S = 1.0, 60.0, 300.0
# the part of a restart a calibration cannot measure: requeue, container start, imports, model
# build, process-group set-up; the same guess as the whole restart had before, stated as such
DEFAULT_STARTUP_S = 300.0


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
        default=".",
        help="where the job's checkpoints will live (default: current directory)",
    )
    p.add_argument(
        "--sizes",
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
        type=int,
        default=5,
        help="measured rounds per size; medians are fitted (default 5)",
    )
    p.add_argument(
        "--report",
        metavar="PROFILE_JSON",
        default=None,
        help="a CUDA profile of your training step (gpumem profile --json FILE, or rep.to_json): "
        "adds its fragmentation and memory outside the allocator",
    )
    p.add_argument(
        "--out", default="calibration.json", help="file to write (default: calibration.json here)"
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
        "--config", default=None, help="with --memory: fit the family of this config.json"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.memory:
        return _run_memory(args)
    if args.arch or args.config:
        raise ValueError("--arch and --config choose what --memory fits: add --memory")
    from gpumem.calibrate import measure
    from gpumem.units import parse_bytes

    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(
            f"--out {args.out}: directory {out.parent} does not exist; create it or write elsewhere"
        )
    if not Path(args.dir).is_dir():
        raise ValueError(
            f"--dir {args.dir} is not a directory: pass "
            "the existing directory the checkpoints go to"
        )
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cal = measure(args.dir, sizes, device=device, repeat=args.repeat, report=args.report)
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
    from gpumem.calibrate.memory_fit import fit_memory

    if (args.arch is None) == (args.config is None):
        raise ValueError(
            "--memory fits one architecture: give --arch FAMILY or --config config.json"
        )
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(
            f"--out {args.out}: directory {out.parent} does not exist; create it or write elsewhere"
        )
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
    print(cal.to_json(), end="") if args.json else print(cal.table())
    print(f"\nwrote {path}; use it with `gpumem estimate ... --calibration {path}`")
    return 0


# -- `plan` and `estimate` ---------------------------------------------------------------------


def load_calibration(args: argparse.Namespace) -> Any:
    """The Calibration named by ``--calibration``, or None."""
    path = getattr(args, "calibration", None)
    if path is None:
        return None
    from gpumem.calibrate import load

    return load(path)


def calibrated_gpu(args: argparse.Namespace, cal: Any) -> Any:
    """``--gpu`` as given, or the catalog GPU with the calibration's measured reserve."""
    if cal is None:
        return args.gpu
    from gpumem.estimator.gpus import find_gpu

    return cal.apply_to(find_gpu(args.gpu, args.gpu_memory))


def _origin(cal: Any, path: str) -> str:
    return f"{path} (measured {cal.created_utc} on {cal.machine.host})"


def reserve_lines(args: argparse.Namespace, cal: Any, gpu: Any) -> list[str]:
    """One line saying which reserve numbers of ``gpu`` were measured and which are defaults."""
    from gpumem.units import format_bytes

    ctx, source = cal.context_bytes()
    ctx_src = f"measured: {source}" if ctx is not None else "default"
    frag_src = "measured: profile report" if cal.report else "default"
    parts = (
        f"context {format_bytes(gpu.context_bytes)} ({ctx_src})",
        f"fragmentation {gpu.fragmentation:.2%} ({frag_src})",
        f"NCCL {format_bytes(gpu.nccl_bytes)} (default)",
    )
    return [f"GPU reserve of {gpu.name} from {_origin(cal, args.calibration)}: " + ", ".join(parts)]


def resolve_checkpoint_times(
    args: argparse.Namespace, cal: Any, bill: Any
) -> tuple[dict | None, list[str]]:
    """Settle the stall C, persist P and restart R the economics use, in place on ``args``.

    Explicit ``--stall-s`` / ``--persist-s`` / ``--restart-s`` win; else, with a calibration and a
    best layout, the times predicted for the checkpoint that layout's ranks write: the weights
    and optimizer state of one GPU (``bill.model_states``; gradients are not saved; fp32 master
    weights are part of the optimizer state), with R = restore + ``--startup-s``; else the
    planner's defaults. Returns the JSON record (None without --calibration) and text lines.
    """
    given = {k: getattr(args, k) for k in ("stall_s", "persist_s", "restart_s")}
    startup = getattr(args, "startup_s", None)
    if cal is None and startup is not None:
        raise ValueError(
            "--startup-s adds to the restore time a calibration measured: give --calibration FILE, "
            "or --restart-s for the whole restart time"
        )
    values = {
        "stall_s": (DEFAULT_STALL_S, "default guess"),
        "persist_s": (DEFAULT_PERSIST_S, "default guess"),
        "restart_s": (DEFAULT_RESTART_S, "default guess"),
    }
    record: dict[str, Any] | None = None
    lines: list[str] = []
    if cal is not None:
        record = {
            "file": str(args.calibration),
            "created_utc": cal.created_utc,
            "host": cal.machine.host,
        }
        if cal.checkpoint is None:
            lines.append(
                f"checkpoint times: {args.calibration} holds "
                "no checkpoint measurement; defaults used"
            )
        elif bill is None:
            lines.append(
                "checkpoint times: nothing fits, so no checkpoint size to predict; defaults used"
            )
        else:
            nbytes = int(bill.model_states["weights"] + bill.model_states["optimizer"])
            stall, persist, restore = cal.checkpoint_times(nbytes)
            start = DEFAULT_STARTUP_S if startup is None else startup
            start_src = "--startup-s" if startup is not None else "default guess; set --startup-s"
            restart_src = f"measured restore {restore:.3g} s + startup {start:g} s ({start_src})"
            values = {
                "stall_s": (stall, "measured: overlap save, worst case"),
                "persist_s": (persist, "measured: time to durable"),
                "restart_s": (restore + start, restart_src),
            }
            fit = cal.checkpoint.fits["durable_s"]
            record.update(
                checkpoint_bytes=nbytes,
                restore_s=restore,
                startup_s=start,
                extrapolated=fit.extrapolates(nbytes),
                directory=cal.checkpoint.directory,
                checkpoint_device=cal.checkpoint.device,
            )
            lines.append(_size_line(nbytes, cal, args.calibration, fit))
    guessed = [k for k, v in given.items() if v is None]
    if cal is None and guessed:
        names = ", ".join(f"--{k.replace('_', '-')} {values[k][0]:g}" for k in guessed)
        lines.append(
            f"checkpoint times are guesses ({names}): measure them on the job's storage with "
            "`gpumem calibrate --dir CKPT_DIR` and pass --calibration FILE"
        )
    for key, value in given.items():
        if value is not None:
            values[key] = (value, f"--{key.replace('_', '-')}")
        setattr(args, key, values[key][0])
    if record is not None:
        for key, (value, source) in values.items():
            record[key] = {"value": value, "source": source}
        names = {"stall_s": "stall C", "persist_s": "persist P", "restart_s": "restart R"}
        lines += [
            f"  {names[key]:<11}{value:>10.3f} s  {source}"
            for key, (value, source) in values.items()
        ]
    return record, lines


def _size_line(nbytes: int, cal: Any, path: str, fit: Any) -> str:
    from gpumem.units import format_bytes

    c = cal.checkpoint
    where = f"{c.directory} ({c.filesystem or 'file system unknown'}), tensors on {c.device}"
    line = (
        f"checkpoint times for {format_bytes(nbytes)} per GPU (weights + "
        f"optimizer state of the best layout), from {_origin(cal, path)}, {where}"
    )
    if fit.extrapolates(nbytes):
        line += (
            f"; extrapolated beyond the sizes measured ({format_bytes(fit.min_bytes)} to "
            f"{format_bytes(fit.max_bytes)}): calibrate nearer this size for a firmer number"
        )
    bounded = [k for k, f in cal.checkpoint.fits.items() if f.bounded_above(nbytes)]
    if bounded:
        line += (
            f"; {', '.join(bounded)}: no growth with size was measured, so "
            "the largest size's time is scaled in proportion (an upper bound)"
        )
    return line
