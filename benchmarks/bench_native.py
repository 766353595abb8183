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
from _report import machine_info, median_time, write_results

COLUMNS = ["measurement", "GB/s", "baseline", "baseline GB/s", "ratio", "target", "met"]
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1G', '256M', '4096' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def time_writes(writers: list[Callable[[Path], object]], path: Path, repeat: int) -> list[float]:
    """Median seconds of each writer(path), run round-robin so that disk noise (other jobs, the
    device's cache) hits every writer alike; the file is removed (untimed) before each run."""
    times: list[list[float]] = [[] for _ in writers]
    for _ in range(repeat):
        for i, write in enumerate(writers):
            path.unlink(missing_ok=True)
            os.sync()  # start every run with no dirty pages of earlier runs in flight
            t0 = time.perf_counter()
            write(path)
            times[i].append(time.perf_counter() - t0)
    path.unlink(missing_ok=True)
    return [float(np.median(t)) for t in times]


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


def bench_crc(raw: bytes, repeat: int) -> list[list]:
    import google_crc32c

    from gpumem._native import load

    C = load()
    n = len(raw)
    src = np.frombuffer(raw, np.uint8)
    dst = np.ones(n, np.uint8)  # faulted in, so memcpy measures copying, not page faults
    memcpy = gbps(n, median_time(lambda: np.copyto(dst, src), repeat)["median"])
    expected = google_crc32c.value(raw)
    for impl in ("auto", "table"):
        assert C.crc32c(src, 0, impl, 1) == expected, (
            f"CRC32C ({impl}) disagrees with google-crc32c"
        )
    one = gbps(n, median_time(lambda: C.crc32c(src, 0, "auto", 1), repeat)["median"])
    threads = C.num_threads()
    every = gbps(n, median_time(lambda: C.crc32c(src, 0, "auto", 0), repeat)["median"])
    table = gbps(n, median_time(lambda: C.crc32c(src, 0, "table", 1), repeat)["median"])
    google = gbps(n, median_time(lambda: google_crc32c.value(raw), repeat)["median"])
    hw = C.crc32c_hardware()
    base = "memcpy 1 thread"
    return [
        row("memcpy 1 thread (numpy.copyto)", memcpy),
        row(f"gpumem CRC32C {hw}, 1 thread", one, base, memcpy, 1.0),
        row(f"gpumem CRC32C {hw}, {threads} threads", every, base, memcpy),
        row("gpumem CRC32C table fallback, 1 thread", table, base, memcpy),
        row(f"google-crc32c ({google_crc32c.implementation})", google, base, memcpy),
        row("gpumem CRC32C 1 thread vs google-crc32c", one, "google-crc32c", google),
    ]


def bench_write(raw: bytes, directory: Path, repeat: int) -> list[list]:
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
    plain, ours, direct = (gbps(n, t) for t in secs)
    base = "plain write+fsync"
    return [
        row("plain Python open/write/fsync", plain),
        row("gpumem write_file (pwrite pool, fdatasync)", ours, base, plain, 0.9),
        row("gpumem write_file direct=True (O_DIRECT)", direct, base, plain),
    ]


def bench_triton() -> tuple[list[list], str]:
    """Rows of bench_triton_crc32c.measure() on a CUDA machine, else none and why."""
    try:
        import torch

        if not torch.cuda.is_available():
            return [], "Triton CRC32C: no CUDA device on this machine, not measured."
        from bench_triton_crc32c import measure
    except ImportError as exc:
        return [], f"Triton CRC32C: not measured ({exc})."
    rows = []
    for r in measure():
        if isinstance(r, dict):
            rows.append([r.get(c, "") for c in COLUMNS])
        else:
            cells = [str(c) for c in r]
            rows.append((cells + [""] * len(COLUMNS))[: len(COLUMNS)])
    return rows, ""


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
    rows = bench_crc(raw, args.repeat)
    notes = [
        (
            f"Buffer: {size} bytes of random data. CRC/memcpy: median of {args.repeat} runs. "
            f"Load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared "
            "machine: absolute GB/s move between runs, the same-run ratios are the claim)."
        )
    ]
    if not args.no_write:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpumem-bench-") as tmp:
            rows += bench_write(raw, Path(tmp), args.write_repeat)
            notes.append(
                f"Writes: median of {args.write_repeat} rounds (writers interleaved) into "
                f"{Path(tmp).parent}, file removed before each run; the disk, not the CPU, bounds "
                "both buffered writers. O_DIRECT skips the page-cache copy."
            )
    triton_rows, why = (
        ([], "Triton CRC32C: skipped (--no-triton).") if args.no_triton else bench_triton()
    )
    rows += triton_rows
    if why:
        notes.append(why)
    path = write_results(
        args.name,
        "Native core: CRC32C and writer throughput",
        COLUMNS,
        rows,
        notes="\n\n".join(notes),
        info=info,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
