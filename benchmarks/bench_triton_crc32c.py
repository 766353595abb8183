"""Triton CRC32C on the GPU against a device-to-device copy of the same bytes, in one run.

For each chunk size: GB/s of ``chunk_crc32c_triton`` on a ``size``-byte CUDA tensor (median of
``triton.testing.do_bench``) and of ``dst.copy_(src)`` on the same bytes; GB/s counts the bytes of
the input once for both (a copy also writes them, so HBM moves twice as much for the copy). The
kernel reads with 4-byte word loads when the buffer start, chunk size and length are multiples of
4, else with byte loads; a row of each kind is measured. Every result is first checked against
the ``crc32c`` package on a CPU copy, so a wrong kernel cannot post a number.

    python benchmarks/bench_triton_crc32c.py                  # 1 GiB, results/triton_crc32c.md
    python benchmarks/bench_triton_crc32c.py --size 256M

Without CUDA it says so and exits 0. ``--interpret-smoke`` runs the same code path on a small
CPU tensor under Triton's interpreter (wall-clock timer, no results file) to check the script.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import Figure, machine_info, markdown_table, median_time, ratio_figure, write_results

COLUMNS = ["measurement", "chunk", "kernel", "ms", "GB/s", "baseline", "baseline GB/s", "ratio"]
DEFAULT_CHUNKS = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

NOTES = """
GB/s = payload bytes / time for both; the copy also writes them, so it moves twice as much HBM
traffic. Expected on an H100/H200 (estimated from the sm_90 SASS before a measurement): the tiled
kernel's inner loop, not HBM, is the limit. Byte tables: 4 lookups per 4-byte word, each
warp-wide lookup spread over up to 8 L1 cache lines, near 1 TB/s. Nibble tables (default): 8
lookups per word, each inside one 64-byte table, ~13 instructions per byte, about 1.2-2 TB/s.
Chunks <= 256 bytes use one lane per chunk (uncoalesced) and chunks of a few KiB pay a per-tile
lane combine; both are slower and meant for small tensors. If the large-chunk rows land far below
the copy, the proposed next step is a GF(2) matrix-multiply CRC on the tensor cores: the raw CRC
of every 64-byte block is a fixed 512x32 bit-matrix product, i.e. an int8 `tl.dot` of unpacked
bits followed by `& 1`, then the same lane/tile combine as now (or, outside Triton, a CUDA kernel
with the tables in shared memory).
"""


def parse_size(text: str) -> int:
    """'1G', '256M', '4096' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _sig(x: float) -> float:
    """Three significant digits."""
    return float(f"{x:.3g}")


def _reference(data, chunk: int) -> list[int]:
    import crc32c

    view = memoryview(data.cpu().numpy())
    return [crc32c.crc32c(view[i : i + chunk]) for i in range(0, len(view), chunk)]


def _timer(device: str) -> Callable[[Callable[[], object]], list[float]]:
    """Seconds of fn at its 20th, 50th and 80th percentiles: do_bench on CUDA, one wall-clock run
    in interpreter smoke runs."""
    if device == "cuda":
        from triton.testing import do_bench

        def bench(fn: Callable[[], object]) -> list[float]:
            ms = do_bench(fn, warmup=25, rep=200, quantiles=[0.2, 0.5, 0.8])
            ms = list(ms) if isinstance(ms, (list, tuple)) else [ms] * 3
            return [m / 1e3 for m in ms]

        return bench
    return lambda fn: [median_time(fn, repeat=1, warmup=0)["median"]] * 3


def _rate(name: str, gb: float, seconds: list[float]) -> Figure:
    """GB/s from the time's 20th/50th/80th percentiles (a rate's p20 is the time's p80).
    do_bench does not say how many runs it took: n = 0."""
    return Figure(name, "GB/s", gb / seconds[2], gb / seconds[1], gb / seconds[0], 0, "higher")


def measure(
    size_bytes: int = 1 << 30,
    chunk_bytes: Sequence[int] = DEFAULT_CHUNKS,
    device: str = "cuda",
) -> tuple[list[dict], list[Figure]]:
    """One row per (chunk size, load kind): Triton CRC32C GB/s vs a D2D copy of the same bytes.

    Args:
        size_bytes: bytes in the buffer (random data).
        chunk_bytes: chunk sizes to measure with word loads (tiled kernel, byte tables); the
            largest that fits is also measured with byte loads (the buffer viewed from its second
            byte).
        device: ``"cuda"``; ``"cpu"`` only in interpreter smoke runs.

    Returns:
        dicts keyed by COLUMNS (also the keys bench_native.py reads), numbers rounded; and the
        figures (GB/s of the copy and of each row, each row's ratio to the copy).
    """
    import torch

    from gpumem.kernels.crc32c import SMALL_CHUNK_MAX, chunk_crc32c_triton

    timer = _timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (size_bytes + 1,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    aligned, shifted = src[:size_bytes], src[1:]
    copy_q = timer(lambda: dst[:size_bytes].copy_(aligned))
    copy_s = copy_q[1]
    gb = size_bytes / 1e9
    copy_fig = _rate(f"device-to-device copy, {_human(size_bytes)}", gb, copy_q)
    figures = [copy_fig]
    fits = [c for c in chunk_bytes if c <= size_bytes]
    cases = []  # (data, chunk, what the kernel does)
    for c in fits:
        if c <= SMALL_CHUNK_MAX:
            cases.append((aligned, c, "one lane per chunk, byte loads"))
            continue
        cases.append((aligned, c, "tiled, word loads, byte tables"))
    if fits and max(fits) > SMALL_CHUNK_MAX:
        cases.append((shifted, max(fits), "tiled, unaligned: byte loads"))
    rows = []
    for data, chunk, kernel in cases:
        run = functools.partial(chunk_crc32c_triton, data, chunk)
        if run().cpu().tolist() != _reference(data, chunk):
            raise AssertionError(f"Triton CRC32C disagrees with crc32c: chunk {chunk}, {kernel}")
        crc_q = timer(run)
        crc_s = crc_q[1]
        name = f"Triton CRC32C, {_human(size_bytes)}, chunk {_human(chunk)}, {kernel}"
        fig = _rate(name, gb, crc_q)
        figures += [fig, ratio_figure(f"{name} / copy", fig, copy_fig)]
        rows.append(
            {
                "measurement": f"Triton CRC32C, {_human(size_bytes)}, chunk {_human(chunk)}",
                "chunk": _human(chunk),
                "kernel": kernel,
                "ms": _sig(crc_s * 1e3),
                "GB/s": _sig(size_bytes / crc_s / 1e9),
                "baseline": "device-to-device copy (dst.copy_(src))",
                "baseline GB/s": _sig(size_bytes / copy_s / 1e9),
                "ratio": _sig(copy_s / crc_s),
                "target": "report",
                "met": "",
            }
        )
    return rows, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="buffer size, e.g. 1G, 256M (default 1G)")
    parser.add_argument(
        "--chunks", default=",".join(str(c) for c in DEFAULT_CHUNKS), help="comma-separated sizes"
    )
    parser.add_argument("--name", default="triton_crc32c", help="results/<name>.md")
    parser.add_argument("--interpret-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chunks = [parse_size(c) for c in args.chunks.split(",")]

    if args.interpret_smoke:
        # Must precede the first import of a kernel module: Triton decides it at definition.
        os.environ["TRITON_INTERPRET"] = "1"
        rows, _ = measure(64 << 10, [256, 4096, 64 << 10], device="cpu")
        print(markdown_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_triton_crc32c: needs a CUDA GPU; none here, nothing measured.")
        return 0
    size = parse_size(args.size)
    rows, figures = measure(size, chunks)
    write_results(
        args.name,
        "Triton CRC32C vs device-to-device copy",
        COLUMNS,
        [[r[c] for c in COLUMNS] for r in rows],
        notes=f"Median of triton.testing.do_bench; {size} bytes of random data.\n" + NOTES,
        info=machine_info(),
        figures=figures,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
