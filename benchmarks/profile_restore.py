"""Where a restore's time goes: the phases of one restore in a fresh process, and the physical
costs of the same bytes measured alone in the same run (issue #20 item 1).

    python benchmarks/profile_restore.py --size 1GB --repeat 3

One state (bench_checkpoint's GPT-like model + AdamW, 12 bytes per parameter) is saved once; then
each round runs, each in a fresh process with the page cache of the checkpoint dropped first:

- ``restore``: ``Checkpointer.restore(model=, optimizer=)`` with every phase timed (the manifest
  reads, the data-file reads with their CRCs, decoding, validation, the optimizer's and the
  model's load) by wrapping the functions that do them;
- ``parts``: the same bytes' physical costs alone: an O_DIRECT read into a warm buffer (the
  baseline of bench_checkpoint's restore row), the same read into fresh memory, faulting in fresh
  memory alone (4 KiB and 2 MiB pages), CRC32C of warm bytes, and a copy of the model's bytes
  into its parameters.

Writes benchmarks/results/checkpoint_restore_profile.md (and its JSON twin) unless --no-write.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import figure, machine_info, write_results
from bench_checkpoint import GPTish, child_lines, files_under, make_state

import gpumem
from gpumem.reader import drop_page_cache, read_file
from gpumem.units import format_bytes, parse_bytes

_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_HUGE = 2 << 20


def _madvise(t: torch.Tensor, advice: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(t.data_ptr()), t.numel(), advice) == 0


def _aligned(n: int, align: int) -> torch.Tensor:
    raw = torch.empty(n + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + n]


def _cpu() -> float:
    """CPU seconds (user + system) this process has used so far, every thread's."""
    t = os.times()
    return t.user + t.system


def _data_files(ck_dir: Path) -> list[Path]:
    return sorted(p for p in files_under(ck_dir) if p.name.startswith("data-"))


def child_parts(ck_dir: Path, nbytes: int) -> dict[str, float]:
    """The physical costs of the checkpoint's bytes, each alone."""
    files = _data_files(ck_dir)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    threads = max(4, os.cpu_count() or 1)
    out: dict[str, float] = {}

    def read_all(buf: torch.Tensor, label: str) -> None:
        drop_page_cache(files)
        c0, t0 = _cpu(), time.perf_counter()
        at = 0
        for f, n in zip(files, sizes, strict=True):
            read_file(str(f), [(0, buf[at : at + n])], direct=True, threads=threads)
            at += n
        out[label] = time.perf_counter() - t0
        out[f"cpu: {label}"] = _cpu() - c0

    warm = _aligned(total, 4096)
    warm.fill_(1)
    read_all(warm, "read_warm")
    del warm
    read_all(_aligned(total, 4096), "read_fresh")  # the reader's prefault maps it in
    for label, huge in (("fault_4k", False), ("fault_2m", True)):
        buf = _aligned(total, _HUGE)
        t0 = time.perf_counter()
        if huge:
            _madvise(buf, _MADV_HUGEPAGE)
        if not _madvise(buf, _MADV_POPULATE_WRITE):
            buf.fill_(0)
        out[label] = time.perf_counter() - t0
        if label == "fault_4k":
            crc_src = buf
        del buf
    from gpumem.checksum import chunk_crc32c

    t0 = time.perf_counter()
    chunk_crc32c(crc_src, 8 << 20)
    out["crc"] = time.perf_counter() - t0
    del crc_src
    model = GPTish(nbytes // 12, 1024)
    params = [p.detach() for p in model.parameters()]
    src = [p.clone() for p in params]
    t0 = time.perf_counter()
    for d, s in zip(params, src, strict=True):
        d.copy_(s)
    out["copy_model"] = time.perf_counter() - t0
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["total_bytes"] = total
    return out


def child_restore(ck_dir: Path, nbytes: int) -> dict[str, float]:
    """One restore with its phases timed (seconds, summed over calls)."""
    from gpumem.checkpoint.restore import candidates, files, plain

    spent: dict[str, float] = defaultdict(float)

    def timed(module, name: str, label: str) -> None:
        fn = getattr(module, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(module, name, wrapper)

    timed(plain, "load_shard_manifest", "manifests")
    timed(plain, "read_tensors", "read_tensors (alloc + read + CRC)")
    timed(files, "_read_file", "  native reads + CRCs (prefault included)")
    timed(files, "_stream_file", "  padding stream")
    timed(files, "_check_crcs", "  CRC comparison")
    timed(plain, "decode", "decode")
    timed(plain, "check_targets", "validate")
    timed(plain, "apply", "apply (load_state_dict)")
    if hasattr(plain, "copy_many"):
        timed(plain, "copy_many", "  native copy into the model (commit)")
    timed(candidates, "load_info", "main manifest")
    model = GPTish(nbytes // 12, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for obj, label in ((opt, "  optimizer.load_state_dict"), (model, "  model.load_state_dict")):
        fn = obj.load_state_dict

        def wrapped(*a, fn=fn, label=label, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        obj.load_state_dict = wrapped
    checkpointer = gpumem.Checkpointer
    c0, t0 = _cpu(), time.perf_counter()
    ck = checkpointer(ck_dir, keep=1)
    assert ck.restore(model=model, optimizer=opt, rng=False) is not None
    spent["total"] = time.perf_counter() - t0  # until restore() returns (as bench_checkpoint)
    spent["cpu: total"] = _cpu() - c0
    ck.close()
    return dict(spent)


def run_child(
    kind: str, ck_dir: Path, nbytes: int, pythonpath: str | None = None
) -> dict[str, float]:
    """One child's timed phases (``pythonpath``: a baseline gpumem package, e.g. a copy of
    main's, the same phases timed)."""
    args = ["--child", kind, str(ck_dir), str(nbytes)]
    return json.loads(child_lines(__file__, args, f"child {kind}", pythonpath)[-1])


PARTS = {
    "read_warm": "O_DIRECT read into a warm buffer (the raw-read baseline)",
    "read_fresh": "O_DIRECT read into fresh memory (faults in the reader)",
    "fault_4k": "fault in fresh memory alone, 4 KiB pages (MADV_POPULATE_WRITE)",
    "fault_2m": "fault in fresh memory alone, 2 MiB pages (MADV_HUGEPAGE first)",
    "crc": "CRC32C of warm bytes, all threads",
    "copy_model": "copy of the model's bytes into its parameters",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--baseline", default=None, help="a directory holding another gpumem package to profile too"
    )
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, path, n = args.child
        fn = child_restore if kind == "restore" else child_parts
        print(json.dumps(fn(Path(path), int(n))))
        return 0
    nbytes = parse_bytes(args.size)
    root = Path(tempfile.mkdtemp(prefix="gpumem-prof-", dir=args.dir))
    try:
        model, opt, tensors = make_state(nbytes)
        label = format_bytes(sum(t.numel() * t.element_size() for t in tensors))
        ck_dir = root / "ck"
        with gpumem.Checkpointer(ck_dir, keep=1) as ck:
            ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)
        del model, opt, tensors
        samples: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeat + 1):  # the first round warms up (imports, disk)
            got = {**run_child("parts", ck_dir, nbytes), **run_child("restore", ck_dir, nbytes)}
            if args.baseline:
                base = run_child("restore", ck_dir, nbytes, args.baseline)
                got.update({f"baseline: {k}": v for k, v in base.items()})
            for k, v in got.items():
                samples[k].append(v)
        samples = {k: v[1:] for k, v in samples.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    base = med["read_warm"]
    rows, figures = [], []

    def row(what: str, key: str, group: str) -> None:
        xs = samples[key]
        rows.append(
            [
                label,
                group,
                what,
                f"{med[key] * 1e3:.0f} ms",
                f"{med[key] / base:.2f}x",
                f"runs {min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f} ms",
            ]
        )
        figures.append(figure(f"{label}: {group}: {what.strip()}", "ms", xs, scale=1e3))

    for key, what in PARTS.items():
        row(what, key, "alone")
    for key in ("read_warm", "read_fresh"):
        row(f"{PARTS[key]}: CPU time, every thread", f"cpu: {key}", "alone")
    for key in samples:
        if key in PARTS or key.endswith("_bytes") or key.startswith(("baseline: ", "cpu: r")):
            continue
        row(key.replace("cpu: total", "total: CPU time, every thread"), key, "restore phase")
    for key in samples:
        if key.startswith("baseline: "):
            what = key.removeprefix("baseline: ").replace(
                "cpu: total", "total: CPU time, every thread"
            )
            row(what, key, "baseline restore phase")
    notes = (
        f"Ratios against the O_DIRECT read into a warm buffer ({base * 1e3:.0f} ms, "
        f"{med['total_bytes'] / base / 1e9:.2f} GB/s). The model's parameters are "
        f"{format_bytes(int(med['model_bytes']))} of the {format_bytes(int(med['total_bytes']))}; "
        "the rest is AdamW state, which a fresh optimizer does not have yet, so it lands in "
        "fresh memory whatever the reader does. Phases are wall time summed over calls, "
        "indented ones inside the phase above them; 'baseline' rows time the same phases of "
        "the --baseline package (main's) in the same rounds; medians of "
        f"{args.repeat} fresh-process rounds after one warm-up round."
    )
    if args.no_write:
        from _report import markdown_table

        print(markdown_table(["state", "kind", "what", "time", "ratio", "spread"], rows))
        print(notes)
    else:
        write_results(
            "checkpoint_restore_profile",
            "Restore: where the time goes",
            ["state", "kind", "what", "time (median)", "ratio", "spread"],
            rows,
            notes=notes,
            info=machine_info(),
            figures=figures,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
