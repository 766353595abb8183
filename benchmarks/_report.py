"""Shared by every benchmark script: what machine this ran on, the figures it measured, and the
record it leaves under benchmarks/results/.

Benchmarks state ratios against a baseline measured in the same run (machines are noisy). Each
run writes two files of the same name: ``<name>.md``, the table a reader sees, and ``<name>.json``,
the same run's figures for machines (``benchmarks/compare.py OLD NEW`` reports what regressed).

A figure is one measured quantity with its unit, the direction that is better and the 20th, 50th
and 80th percentiles of its samples (linear interpolation between the sorted samples, numpy's
default): the median and a spread that a single outlier does not move. A figure derived from a
single value has all three equal. JSON layout (``SCHEMA``)::

    {"schema": "gpumem-bench/1", "benchmark": "native", "title": "...", "command": "...",
     "date": "2026-11-30T05:51:00Z", "git_commit": "85e775b...",
     "machine": {"host": ..., "cpu": ..., "cores": ..., "memory": ..., "gpu": ...},
     "versions": {"python": ..., "torch": ..., "gpumem": ...},
     "context": {anything else the script noted},
     "figures": [{"name": ..., "unit": "GB/s", "better": "higher", "p20": ..., "p50": ...,
                  "p80": ..., "n": 5, "tolerance": 0.0}, ...]}
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpumem.doctor import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = "gpumem-bench/1"
_DATE_FORMAT = "%Y-%m-%d %H:%M UTC"
MACHINE_KEYS = ("host", "cpu", "cores", "memory", "gpu", "cuda")
VERSION_KEYS = ("python", "torch", "triton", "numba", "numpy", "gpumem")


# ---------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figure:
    """One measured quantity of a benchmark run.

    Attributes:
        name: unique within its results file; compare.py matches figures by name.
        unit: "s", "ms", "GB/s", "x" (a ratio), "%", "B", ...
        p20, p50, p80: percentiles of the samples (all equal for a single value).
        n: samples behind the percentiles (0: not known, e.g. quantiles from triton's do_bench).
        better: "lower" or "higher".
        tolerance: a change smaller than this (in ``unit``) never counts as a regression, for
            figures that do not vary between runs (an estimator's error) where any change is real
            but a tiny one is not worth failing over. 0: only the noise rule applies.
    """

    name: str
    unit: str
    p20: float
    p50: float
    p80: float
    n: int
    better: str = "lower"
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(
                f"{self.name}: better must be 'lower' or 'higher', not {self.better!r}"
            )
        if not self.p20 <= self.p50 <= self.p80:
            raise ValueError(
                f"{self.name}: percentiles out of order {self.p20, self.p50, self.p80}"
            )


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def figure(
    name: str,
    unit: str,
    samples: Iterable[float],
    *,
    better: str = "lower",
    scale: float = 1.0,
    tolerance: float = 0.0,
) -> Figure:
    """A figure from its samples, each multiplied by ``scale`` (e.g. 1e3 for seconds -> ms)."""
    xs = [float(x) * scale for x in samples]
    p = [percentile(xs, q) for q in (20, 50, 80)]
    return Figure(name, unit, p[0], p[1], p[2], len(xs), better, tolerance)


def rate_figure(
    name: str, unit: str, amount: float, seconds: Iterable[float], *, better: str = "higher"
) -> Figure:
    """``amount / t`` for every timed sample ``t`` (e.g. bytes / 1e9 -> GB/s)."""
    return figure(name, unit, [amount / t for t in seconds], better=better)


def ratio_figure(name: str, num: Figure, den: Figure, *, better: str = "higher") -> Figure:
    """num / den when the two were sampled separately (unpaired): the median of the ratio is
    num.p50 / den.p50 and its band is the widest the two bands allow (num.p20 / den.p80 up to
    num.p80 / den.p20), so the ratio's noise is not understated. Paired samples (one of each per
    round) give a tighter figure: ``figure(name, "x", [a / b for a, b in pairs])``."""
    return Figure(
        name,
        "x",
        num.p20 / den.p80,
        num.p50 / den.p50,
        num.p80 / den.p20,
        min(num.n, den.n),
        better,
    )


def value_figure(
    name: str, unit: str, value: float, *, better: str = "lower", tolerance: float = 0.0
) -> Figure:
    """A single value (a count, an error of a deterministic estimate): p20 = p50 = p80."""
    v = float(value)
    return Figure(name, unit, v, v, v, 1, better, tolerance)


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Wall time in seconds of ``repeat`` calls after ``warmup`` calls: "median", "min", "max",
    "p20", "p80" and every sample ("samples", in call order)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {
        "median": percentile(times, 50),
        "p20": percentile(times, 20),
        "p80": percentile(times, 80),
        "min": min(times),
        "max": max(times),
        "samples": times,
    }


# --------------------------------------------------------------------------- machine, commit


def machine_info() -> dict[str, str]:
    """Machine, versions, date and git commit, for the header of a results file."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime(_DATE_FORMAT),
        "git commit": git_commit(),
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": _mem_total(),
        "python": platform.python_version(),
    }
    for mod in ("torch", "triton", "numba", "numpy", "gpumem"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = "not installed"
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = str(torch.version.cuda)
        else:
            info["gpu"] = "none"
    except Exception:
        info["gpu"] = "unknown"
    return info


def git_commit() -> str:
    """HEAD of the checkout the benchmark runs from, "+dirty" when tracked files other than the
    results themselves (benchmarks/results/, rewritten by every run) differ from it.

    A copy without .git (a lent GPU machine gets the working tree only) reports "unknown" unless
    BENCH_GIT_COMMIT names the commit.
    """
    given = os.environ.get("BENCH_GIT_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)benchmarks/results",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


# ------------------------------------------------------------------------------------ output


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def results_record(
    name: str, title: str, figures: Sequence[Figure], info: dict[str, str], command: str
) -> dict[str, Any]:
    """The JSON document of one run (see the module docstring)."""
    names = [f.name for f in figures]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"figure names must be unique in {name}: {dupes}")
    try:
        date = _dt.datetime.strptime(info["date"], _DATE_FORMAT).strftime("%Y-%m-%dT%H:%M:00Z")
    except (KeyError, ValueError):
        date = info.get("date", "unknown")
    known = {"date", "git commit", *MACHINE_KEYS, *VERSION_KEYS}
    return {
        "schema": SCHEMA,
        "benchmark": name,
        "title": title,
        "command": command,
        "date": date,
        "git_commit": info.get("git commit", "unknown"),
        "machine": {k: info[k] for k in MACHINE_KEYS if k in info},
        "versions": {k: info[k] for k in VERSION_KEYS if k in info},
        "context": {k: v for k, v in info.items() if k not in known},
        "figures": [asdict(f) for f in figures],
    }


def write_results(
    name: str,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    notes: str = "",
    info: dict[str, str] | None = None,
    *,
    figures: Sequence[Figure],
) -> Path:
    """Write benchmarks/results/<name>.md and <name>.json and print the table last (what a reader
    sees first). Returns the Markdown file's path."""
    info = info or machine_info()
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    record = results_record(name, title, figures, info, command)  # checks before writing either
    header = "\n".join(f"- **{k}**: {v}" for k, v in info.items())
    table = markdown_table(columns, rows)
    text = f"# {title}\n\n{header}\n- **command**: `{command}`\n\n{table}\n"
    if notes:
        text += f"\n{notes.strip()}\n"
    text += f"\nMachine-readable figures (p20/p50/p80): `{name}.json`.\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table)
    return path


def steal_ticks() -> int:
    """This machine's stolen CPU time so far (/proc/stat, clock ticks): the hypervisor running
    something else, on a VM the host's emulation of this guest's disk I/O among it."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0
