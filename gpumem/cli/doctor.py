"""gpumem doctor: versions, native core, GPUs and a quick bandwidth probe of this machine."""

from __future__ import annotations

import argparse
import json

from gpumem.cli import _args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="report versions, GPUs and this machine's memcpy, CRC32C and write+fsync bandwidth",
        description="Report versions, the native core, GPUs and drivers, and measure this "
        "machine's memcpy, CRC32C and write+fsync bandwidth in a few seconds.",
    )
    p.add_argument("--no-measure", action="store_true", help="skip the bandwidth probes")
    p.add_argument(
        "--size", type=_args.size, default="256MiB", help="probe buffer size (default 256MiB)"
    )
    p.add_argument(
        "--dir",
        type=_args.existing_dir,
        default=None,
        help="directory for the write probe (default: $TMPDIR)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpumem.doctor import run_doctor

    report = run_doctor(measure=not args.no_measure, nbytes=args.size, directory=args.dir)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0
