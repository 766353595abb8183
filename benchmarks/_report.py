"""Shared by every benchmark script: what machine this ran on, and a Markdown results table.

Benchmarks state ratios against a baseline measured in the same run (machines are noisy) and
leave a committed record under benchmarks/results/.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gpumem.doctor import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, str]:
    """Machine, versions and date, for the header of a results file."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": _mem_total(),
        "python": platform.python_version(),
    }
    for mod in ("torch", "triton", "numba", "numpy"):
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


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median and spread of wall time in seconds over `repeat` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "median": statistics.median(times),
        "min": times[0],
        "max": times[-1],
    }


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def write_results(
    name: str,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    notes: str = "",
    info: dict[str, str] | None = None,
) -> Path:
    """Write benchmarks/results/<name>.md and print the table last (what a reader sees first)."""
    info = info or machine_info()
    header = "\n".join(f"- **{k}**: {v}" for k, v in info.items())
    table = markdown_table(columns, rows)
    text = (
        f"# {title}\n"
        "\n"
        f"{header}\n"
        f"- **command**: `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`\n"
        "\n"
        f"{table}\n"
    )
    if notes:
        text += f"\n{notes.strip()}\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    print(table)
    return path
