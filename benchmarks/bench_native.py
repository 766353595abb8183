"""Native core throughput: CRC32C and the parallel writer against same-run baselines.

Claims (issue #2), each a ratio measured in one run on the same buffer:
  * CRC32C (1 thread) >= 1.0x a single-thread memcpy of the buffer (numpy.copyto into a
    preallocated, already faulted destination);
  * writer (write_file, all threads, fdatasync) >= 0.9x a plain Python open/write/fsync of the
    same bytes into the same directory (the file is removed before every run, untimed).
google-crc32c, the all-threads CRC and the table fallback are reported for context. On a CUDA
machine the Triton CRC32C rows of benchmarks/bench_triton_crc32c.py are appended.

    python benchmarks/bench_native.py                 # 1 GiB, results/native.md
    python benchmarks/bench_native.py --size 256M --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import (
    Figure,
    figure,
    machine_info,
    median_time,
    rate_figure,
    ratio_figure,
    write_results,
)

COLUMNS = ["measurement", "GB/s", "baseline", "baseline GB/s", "ratio", "target", "met"]
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1G', '256M', '4096' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def time_writes(
    writers: list[Callable[[Path], object]], path: Path, repeat: int
) -> list[list[float]]:
    """Seconds of each run of each writer(path), run round-robin so that disk noise (other jobs,
    the device's cache) hits every writer alike; the file is removed (untimed) before each run."""
    times: list[list[float]] = [[] for _ in writers]
    for _ in range(repeat):
        for i, write in enumerate(writers):
            path.unlink(missing_ok=True)
            os.sync()  # start every run with no dirty pages of earlier runs in flight
            t0 = time.perf_counter()
            write(path)
            times[i].append(time.perf_counter() - t0)
    path.unlink(missing_ok=True)
    return times


def plain_write(buf: bytes) -> Callable[[Path], None]:
    def run(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())

    return run


def row(
    name: str, value: float, base_name: str = "", base: float = 0.0, target: float | None = None
) -> list:
    ratio = value / base if base else None
    met = "" if target is None or ratio is None else ("yes" if ratio >= target else "NO")
    return [
        name,
        f"{value:.2f}",
        base_name,
        f"{base:.2f}" if base else "",
        f"{ratio:.2f}x" if ratio is not None else "",
        f">= {target:.1f}x" if target is not None else "",
        met,
    ]


def bench_crc(raw: bytes, repeat: int) -> tuple[list[list], list[Figure]]:
    import google_crc32c

    from gpumem._native import load

    C = load()
    n = len(raw)
    src = np.frombuffer(raw, np.uint8)
    dst = np.ones(n, np.uint8)  # faulted in, so memcpy measures copying, not page faults
    expected = google_crc32c.value(raw)
    for impl in ("auto", "table"):
        assert C.crc32c(src, 0, impl, 1) == expected, (
            f"CRC32C ({impl}) disagrees with google-crc32c"
        )
    threads = C.num_threads()
    hw = C.crc32c_hardware()
    timed = {  # figure name: what it times
        "memcpy 1 thread (numpy.copyto)": lambda: np.copyto(dst, src),
        f"gpumem CRC32C {hw}, 1 thread": lambda: C.crc32c(src, 0, "auto", 1),
        f"gpumem CRC32C {hw}, {threads} threads": lambda: C.crc32c(src, 0, "auto", 0),
        "gpumem CRC32C table fallback, 1 thread": lambda: C.crc32c(src, 0, "table", 1),
        f"google-crc32c ({google_crc32c.implementation})": lambda: google_crc32c.value(raw),
    }
    figs = {
        name: rate_figure(name, "GB/s", n / 1e9, median_time(fn, repeat)["samples"])
        for name, fn in timed.items()
    }
    memcpy, one, every, table, google = (f.p50 for f in figs.values())
    names = list(figs)
    base = "memcpy 1 thread"
    rows = [
        row(names[0], memcpy),
        row(names[1], one, base, memcpy, 1.0),
        row(names[2], every, base, memcpy),
        row(names[3], table, base, memcpy),
        row(names[4], google, base, memcpy),
        row("gpumem CRC32C 1 thread vs google-crc32c", one, "google-crc32c", google),
    ]
    ratios = [
        ratio_figure("CRC32C 1 thread / memcpy 1 thread", figs[names[1]], figs[names[0]]),
        ratio_figure("CRC32C 1 thread / google-crc32c", figs[names[1]], figs[names[4]]),
    ]
    return rows, [*figs.values(), *ratios]


def bench_write(raw: bytes, directory: Path, repeat: int) -> tuple[list[list], list[Figure]]:
    from gpumem.arena import HostArena
    from gpumem.writer import write_file

    n = len(raw)
    src = np.frombuffer(raw, np.uint8)
    path = directory / "bench_native.bin"
    with HostArena(n, pinned=False) as arena:  # page-aligned, as checkpoint staging buffers are
        arena.copy_in([src], [0])
        view = arena.view(0, n)
        secs = time_writes(
            [
                plain_write(raw),
                lambda p: write_file(p, [(0, src)]),
                lambda p: write_file(p, [(0, view)], direct=True),
            ],
            path,
            repeat,
        )
    names = [
        "plain Python open/write/fsync",
        "gpumem write_file (pwrite pool, fdatasync)",
        "gpumem write_file direct=True (O_DIRECT)",
    ]
    figs = [rate_figure(name, "GB/s", n / 1e9, t) for name, t in zip(names, secs, strict=True)]
    plain, ours, direct = (f.p50 for f in figs)
    base = "plain write+fsync"
    rows = [
        row(names[0], plain),
        row(names[1], ours, base, plain, 0.9),
        row(names[2], direct, base, plain),
    ]
    # the writers ran round-robin: each round's ratio shares that round's disk state
    paired = [p / o for p, o in zip(secs[0], secs[1], strict=True)]
    return rows, [
        *figs,
        figure("write_file / plain write, per round", "x", paired, better="higher"),
    ]


def bench_triton() -> tuple[list[list], list[Figure], str]:
    """Rows and figures of bench_triton_crc32c.measure() on a CUDA machine, else none and why."""
    try:
        import torch

        if not torch.cuda.is_available():
            return [], [], "Triton CRC32C: no CUDA device on this machine, not measured."
        from bench_triton_crc32c import measure
    except ImportError as exc:
        return [], [], f"Triton CRC32C: not measured ({exc})."
    rows, figs = measure()
    return [[r.get(c, "") for c in COLUMNS] for r in rows], figs, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="buffer size, e.g. 1G, 256M (default 1G)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per CRC/memcpy row")
    parser.add_argument("--write-repeat", type=int, default=3, help="timed runs per write row")
    parser.add_argument(
        "--dir", default=None, help="directory for the write test (default: a temp dir)"
    )
    parser.add_argument("--no-write", action="store_true", help="skip the writer rows")
    parser.add_argument("--name", default="native", help="results file name (results/<name>.md)")
    parser.add_argument(
        "--no-triton",
        action="store_true",
        help="skip the Triton rows on a CUDA machine (bench_triton_crc32c.py measures them alone)",
    )
    args = parser.parse_args(argv)

    size = parse_size(args.size)
    info = machine_info()
    raw = np.random.default_rng(0).bytes(size)
    rows, figures = bench_crc(raw, args.repeat)
    notes = [
        (
            f"Buffer: {size} bytes of random data. CRC/memcpy: median of {args.repeat} runs. "
            f"Load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared "
            "machine: absolute GB/s move between runs, the same-run ratios are the claim)."
        )
    ]
    if not args.no_write:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpumem-bench-") as tmp:
            write_rows, write_figures = bench_write(raw, Path(tmp), args.write_repeat)
            rows += write_rows
            figures += write_figures
            notes.append(
                f"Writes: median of {args.write_repeat} rounds (writers interleaved) into "
                f"{Path(tmp).parent}, file removed before each run; the disk, not the CPU, bounds "
                "both buffered writers. O_DIRECT skips the page-cache copy."
            )
    triton_rows, triton_figures, why = (
        ([], [], "Triton CRC32C: skipped (--no-triton).") if args.no_triton else bench_triton()
    )
    rows += triton_rows
    figures += triton_figures
    if why:
        notes.append(why)
    path = write_results(
        args.name,
        "Native core: CRC32C and writer throughput",
        COLUMNS,
        rows,
        notes="\n\n".join(notes),
        info=info,
        figures=figures,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
