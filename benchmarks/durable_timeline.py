"""Where a blocking save's time to durable goes, against a raw write + fdatasync of its bytes.

    python benchmarks/durable_timeline.py [--size 1GB] [--rounds 3]

Each round copies the state into a locked buffer and writes it raw (O_DIRECT + fdatasync): the
floor and the limit; then one blocking save of a prepared Checkpointer (arena resident) whose
phases are timed by wrapping the functions that do them: the copy, each data file's write, the
checksums the writes wait for, the shard and main manifests, the directory fsync, the rename,
``latest``. Prints each phase's start and end relative to save() entry, per round.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    from bench_checkpoint import make_state

    import gpumem
    from gpumem.arena import HostArena
    from gpumem.checkpoint.storage import commit as commit_mod
    from gpumem.checkpoint.storage import directory, safe_fs, writes
    from gpumem.units import format_bytes, parse_bytes
    from gpumem.writer import write_file

    events: list[tuple[str, float, float, str]] = []
    t_zero = [0.0]

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append(
                    (
                        label,
                        t - t_zero[0],
                        time.perf_counter() - t_zero[0],
                        threading.current_thread().name,
                    )
                )

        setattr(owner, name, wrapper)

    timed(writes, "_write_batch", "data file write")
    timed(writes, "checksum_host_pieces", "checksums")
    timed(writes.HostChecksums, "wait", "wait for checksums")
    timed(commit_mod, "rank_manifest", "shard manifest: build")
    timed(directory, "write_manifest", "manifest write")
    timed(safe_fs.Dir, "fsync", "directory fsync")
    timed(safe_fs.Dir, "rename", "rename")
    timed(directory, "write_latest", "latest")
    timed(directory, "clean_stale", "clean stale")
    timed(directory, "prepare_tmp", "prepare tmp")

    print(f"gpumem from {Path(gpumem.__file__).parent}")
    model, opt, tensors = make_state(parse_bytes(args.size))
    total = sum(t.numel() * t.element_size() for t in tensors)
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 4095) // 4096 * 4096
    floor_arena = HostArena(off, pinned=False)
    floor_arena.lock()
    root = Path(tempfile.mkdtemp(prefix="gpumem-durable-", dir=args.dir))
    ratios = []
    with gpumem.Checkpointer(root / "ck", keep=1, staging_bytes=off + (64 << 20)) as ck:
        ck.prepare(model, opt, background=False)
        ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)
        ck.wait()
        for i in range(args.rounds):
            t0 = time.perf_counter()
            floor_arena.copy_in(tensors, offsets)
            floor = time.perf_counter() - t0
            raw = root / "raw.bin"
            t0 = time.perf_counter()
            write_file(str(raw), [(0, floor_arena.view(0, off))], size=off, fsync=True, direct=True)
            raw_s = time.perf_counter() - t0
            raw.unlink()
            events.clear()
            t_zero[0] = time.perf_counter()
            st = ck.save(i + 1, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
            print(
                f"round {i}: {format_bytes(total)}; floor copy {floor * 1e3:.0f} ms, raw write "
                f"{raw_s * 1e3:.0f} ms; save() {st.save_s * 1e3:.0f} ms, staged "
                f"{st.staged_s * 1e3:.0f} ms, durable {st.durable_s * 1e3:.0f} ms = "
                f"{st.durable_s / raw_s:.3f}x the raw write"
            )
            for label, a, b, who in sorted(events, key=lambda e: e[1]):
                print(
                    f"  {a * 1e3:8.1f} -> {b * 1e3:8.1f} ms ({(b - a) * 1e3:6.1f}) {label} [{who}]"
                )
            ratios.append(st.durable_s / raw_s)
    floor_arena.close()
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"durable / raw write: median {statistics.median(ratios):.3f}x "
        f"(runs {min(ratios):.3f}-{max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
