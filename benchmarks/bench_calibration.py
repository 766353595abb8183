"""Does a calibration predict a checkpoint it has not seen? Calibrate at two sizes, predict a
larger third, measure the third in the same run, and report predicted vs measured.

    python benchmarks/bench_calibration.py                        # 64 MiB, 256 MiB -> 1 GiB
    python benchmarks/bench_calibration.py --sizes 16MiB,64MiB --test-size 256MiB --no-write

Every size is measured by ``gpumem.calibrate.measure_checkpoint`` (the real Checkpointer: blocking
save, overlap save in its worst case, time to durable, restore with the page cache dropped), in
one call whose rounds go round-robin over the three sizes. The calibration line of each quantity
is ``fit_line`` over the medians of the two calibration sizes only; the third size's medians are
what it must predict. Baseline
in the same run: proportional scaling of the largest calibration size (``t(s2) * s3 / s2``),
the estimate a user makes without a fixed-cost term.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import figure, machine_info, markdown_table, write_results

from gpumem.calibrate import fit_line, measure_checkpoint
from gpumem.calibrate.checkpoint_cost import QUANTITIES
from gpumem.units import format_bytes, parse_bytes

LABELS = {
    "blocking_stall_s": "save() stall, blocking",
    "overlap_stall_s": "save() + hook wait, overlap (worst case)",
    "durable_s": "time to durable",
    "restore_s": "restore (page cache dropped)",
}


def _err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas:+.1%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", default="64MiB,256MiB", help="the two calibration sizes (default 64MiB,256MiB)"
    )
    ap.add_argument(
        "--test-size", default=None, help="the size to predict (default 4x the largest)"
    )
    ap.add_argument(
        "--repeat", type=int, default=5, help="measured rounds per size (median; default 5)"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--dir", default=None, help="directory to measure in (default: the temporary directory)"
    )
    ap.add_argument(
        "--no-write", action="store_true", help="print only; leave benchmarks/results alone"
    )
    args = ap.parse_args(argv)
    sizes = sorted(parse_bytes(s) for s in args.sizes.split(","))
    if len(sizes) != 2:
        ap.error("--sizes takes exactly two sizes")
    test = parse_bytes(args.test_size) if args.test_size else 4 * sizes[-1]
    directory = args.dir or tempfile.gettempdir()
    cost = measure_checkpoint(directory, [*sizes, test], device=args.device, repeat=args.repeat)
    cal_pts, test_pt = cost.points[:2], cost.points[2]
    xs = [p.nbytes for p in cal_pts]
    rows, figures = [], []
    for q in QUANTITIES:
        fit = fit_line(xs, [p.median(q) for p in cal_pts])
        pred, meas = fit.predict(test_pt.nbytes), test_pt.median(q)
        prop = cal_pts[1].median(q) * test_pt.nbytes / cal_pts[1].nbytes
        spread = f"{min(test_pt.samples[q]):.3f}-{max(test_pt.samples[q]):.3f}"
        what = f"{LABELS[q]}, {format_bytes(test_pt.nbytes)}"
        figures.append(figure(f"{what}: measured", "s", test_pt.samples[q]))
        # the prediction against each measured round: its spread is the measurement's noise
        errors = [abs(pred - m) / m * 100 for m in test_pt.samples[q]]
        figures.append(figure(f"{what}: |prediction error|", "%", errors))
        rows.append(
            [
                LABELS[q],
                f"{fit.intercept_s:.4f} + {fit.seconds_per_byte * 2**30:.4f}/GiB",
                f"{pred:.3f}",
                f"{meas:.3f} ({spread})",
                _err(pred, meas),
                f"{prop:.3f}",
                _err(prop, meas),
            ]
        )
    columns = [
        "quantity",
        "fit a (s) + b (s/GiB)",
        "predicted (s)",
        "measured (s), median (min-max)",
        "error",
        "proportional (s)",
        "its error",
    ]
    points = "; ".join(
        f"{format_bytes(p.nbytes)}: " + ", ".join(f"{q} {p.median(q):.3f} s" for q in QUANTITIES)
        for p in cal_pts
    )
    where = f"tensors on {cost.device}, in {cost.directory} ({cost.filesystem})"
    modes = ", ".join(
        f"{format_bytes(p.nbytes)} {p.blocking_mode}/{p.overlap_mode}" for p in cost.points
    )
    sizes_line = (
        f"Calibrated at {format_bytes(xs[0])} and {format_bytes(xs[1])} of staged "
        f"tensor bytes; predicted {format_bytes(test_pt.nbytes)} "
        f"({test_pt.nbytes / xs[1]:.1f}x the largest); {where}; median of {cost.repeat} "
        "rounds after one untimed round, round-robin over the three sizes."
    )
    notes = "\n".join(
        [
            sizes_line,
            f"Calibration medians: {points}.",
            (
                "Error = (predicted - measured) / measured. 'Proportional' "
                "scales the largest calibration size's time by"
            ),
            (
                "bytes (no fixed cost): the baseline a fit with "
                f"an intercept has to beat. Modes: {modes}."
            ),
            (
                "A shared 2-vCPU VM with a virtual disk: the min-max "
                "spread of the measured size shows its noise."
            ),
        ]
    )
    title = "Calibration: predicted vs measured checkpoint times of an unseen size"
    if args.no_write:
        print(markdown_table(columns, rows))
        print(notes)
    else:
        name = "calibration" if args.device == "cpu" else "calibration_gpu"
        write_results(name, title, columns, rows, notes=notes, info=machine_info(), figures=figures)
        print(notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
