"""The I/O fault sweep of issue 39, in full: EIO, ENOSPC and EINTR injected into every open,
write, read, fsync, fdatasync, rename, close, unlink and mkdir call (N = 1 ... the count) that a
plain save and a plain restore make, in the native core and in Python alike
(tests/checkpoint/fault_sweep.py, an LD_PRELOAD shim built with gcc here).

One row per (phase, call kind, errno): the cases and what they ended in. The invariants (the
columns after "CheckpointError" must be 0): never a hang (a 60 s watchdog), never a bare OSError
or another exception, never a lost or altered committed step, no temporary directory surviving
the next open, every CheckpointError naming the errno and a path under the root, EINTR retried
(the operation succeeds), and a save reported failed never found committed (issue #39 item 8:
an fsync EIO after the commit's rename now rolls the rename back).

    python benchmarks/bench_faults.py                 # the full sweep (a few minutes)
    python benchmarks/bench_faults.py --sample        # the CI sample only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "checkpoint"))
from _report import machine_info, value_figure, write_results
from fault_sweep import PHASES, Case, Result, build_shim, counted, run_cases, sweep_cases

COLUMNS = [
    "phase",
    "call",
    "fault",
    "calls (N range)",
    "cases",
    "success",
    "CheckpointError",
    "hang",
    "bare OSError",
    "other error",
    "lost step",
    "temp left",
    "not named",
    "EINTR failed",
]
# each violation's column, by how fault_sweep._judge's text starts
_COLUMN_OF = (
    ("hang", "hang"),
    ("bare OSError", "bare OSError"),
    ("other", "other error"),
    ("EINTR", "EINTR failed"),
    ("fault not named", "not named"),
    ("left ", "temp left"),
    ("", "lost step"),  # lost, altered or unreadable steps, a save reported done but absent
)


_OUTCOME_COLUMN = {"ok": "success", "other": "other error"}


def column(violation: str) -> str:
    return next(col for key, col in _COLUMN_OF if violation.startswith(key))


def tally(counts: dict, results: list[Result]) -> list[list[object]]:
    rows: dict[tuple[str, str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        row = rows[(r.case.phase, r.case.kind, r.case.err)]
        row["cases"] += 1
        row[_OUTCOME_COLUMN.get(r.outcome, r.outcome)] += 1
        for col in {column(v) for v in r.violations} - {"hang", "bare OSError", "other error"}:
            row[col] += 1
    out = []
    for (phase, kind, err), row in rows.items():
        n = counts[phase][kind]
        out.append([phase, kind, err, f"{n} (1-{n})", *(row[c] for c in COLUMNS[4:])])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", action="store_true", help="the CI sample: first, middle, last N")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gpumem-faults-") as tmp:
        base = Path(tmp)
        shim = build_shim(base)
        if shim is None:
            print("bench_faults: no C compiler (gcc): the fault injector cannot be built")
            return 1
        t0 = time.perf_counter()
        counting = run_cases([Case(p, "", "", 0) for p in PHASES], shim, base, 300)
        counts = counted(counting)
        results = run_cases(sweep_cases(counting, not args.sample), shim, base, 3600)
        wall = time.perf_counter() - t0
    rows = tally(counts, results)
    total = {c: sum(int(r[i]) for r in rows) for i, c in enumerate(COLUMNS) if i >= 4}
    totals = ["all", "", "", "", *(total[c] for c in COLUMNS[4:])]
    figures = [
        value_figure("cases", "cases", total["cases"], better="higher"),
        *(
            value_figure(c, "cases", total[c])
            for c in ("hang", "bare OSError", "other error", "lost step", "temp left")
        ),
        value_figure("not named", "cases", total["not named"]),
        value_figure("EINTR failed", "cases", total["EINTR failed"]),
    ]
    notes = (
        f"{total['cases']} cases ({'CI sample' if args.sample else 'every N'}) in {wall:.0f} s, "
        f"load average {load:.1f} on {os.cpu_count()} cores at start (shared machine). "
        "The scenario: a root with steps 1 and 2 committed (keep=2, 256 KiB staging, 64 KiB "
        "chunks: the state of a 256-256-64 MLP goes out as 3 data files, the native writer on 2 "
        "threads); the faulted save is step 3 (its commit removes step 1), the faulted restore a "
        "resumed job's Checkpointer(root).restore(). Only calls that touch a file under the root "
        "count (N); the shim counts them over all threads of the process (strace's when=N counts "
        "per thread). Each case runs in a forked child under a 60 s watchdog; the checks run in a"
        " fresh process without faults."
    )
    write_results(
        "faults",
        "I/O fault sweep: EIO, ENOSPC and EINTR in every call of a save and a restore",
        COLUMNS,
        [*rows, totals],
        notes,
        machine_info(),
        figures=figures,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
