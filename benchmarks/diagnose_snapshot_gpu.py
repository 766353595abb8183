"""Where the CUDA snapshot's time goes: the D2H copies alone, the device CRCs alone, both together.

The H200 runs of session 3 measured the snapshot's D2H phase at 60 % of the pinned-copy ceiling
(28.2 ms against 16.8 ms for 864.77 MiB in 180 tensors) and could not say why. This script splits
it, on the same state as ``bench_checkpoint.py --device cuda``, each part timed for how long the
host takes to enqueue it and when the GPU has finished it (median of ``--repeat``):

- one pinned copy of all the bytes (the ceiling);
- the per-tensor copies into the arena alone (``HostArena.copy_from_device``, as the snapshot
  issues them);
- the device CRCs alone (``snapshot.device_crcs``), one launch per tensor and one for all;
- ``snapshot.copy_pieces``, which does both (copies first, CRCs on a second stream), with the
  CRCs launched per tensor (the default) and in one launch (``GPUMEM_CRC_ONE_LAUNCH=1``).

If the enqueue time of a part approaches its finish time, the host (Python per tensor, Triton's
launch overhead) is the limit, not the GPU or the link. It prints a Markdown table; nothing is
asserted (benchmarks/gpu_session.sh runs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import make_state

from gpumem.arena import HostArena
from gpumem.checkpoint import snapshot
from gpumem.checkpoint.snapshot import ArenaLayout, Piece

CHUNK = 4 << 20  # the Checkpointer's default chunk_bytes


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median (enqueue seconds, finished seconds) of ``fn`` on the current stream."""
    enq, done = [], []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:  # the first is a warm-up (kernel compile, pinned pools)
            enq.append(t1 - t0)
            done.append(t2 - t0)
    return statistics.median(enq), statistics.median(done)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bytes", type=int, default=1 << 30, help="state size (default 1 GiB, as the benchmark)"
    )
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diagnose_snapshot_gpu: needs a CUDA GPU; none here, nothing measured.")
        return 0
    _, _, tensors = make_state(args.bytes, device="cuda")
    srcs = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(s.numel() for s in srcs)
    offsets, pos = [], 0
    for s in srcs:
        offsets.append(pos)
        pos += -(-s.numel() // 4096) * 4096
    arena = HostArena(pos, pinned=True)
    arena.wait_pinned()
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pieces = [
        Piece(i, 0, s.numel(), 0, off) for i, (s, off) in enumerate(zip(srcs, offsets, strict=True))
    ]
    plan = ArenaLayout(capacity=pos, streaming=False, batch_sizes=[pos], bases=[0], pieces=pieces)

    def copies() -> None:
        for s, off in zip(srcs, offsets, strict=True):
            arena.copy_from_device(s, off)

    rows = [
        (
            "one pinned copy of all bytes (ceiling)",
            timed(lambda: pinned.copy_(flat, non_blocking=True), args.repeat),
        ),
        (f"{len(srcs)} copies into the arena", timed(copies, args.repeat)),
        (
            f"{len(srcs)} device CRCs, a launch each",
            timed(lambda: snapshot.device_crcs(srcs, CHUNK, one_launch=False), args.repeat),
        ),
        (
            f"{len(srcs)} device CRCs, one launch",
            timed(lambda: snapshot.device_crcs(srcs, CHUNK, one_launch=True), args.repeat),
        ),
        (
            "both: snapshot.copy_pieces",
            timed(lambda: snapshot.copy_pieces(arena, plan, pieces, tensors, CHUNK), args.repeat),
        ),
    ]
    os.environ["GPUMEM_CRC_ONE_LAUNCH"] = "1"
    rows.append(
        (
            "both, GPUMEM_CRC_ONE_LAUNCH=1",
            timed(lambda: snapshot.copy_pieces(arena, plan, pieces, tensors, CHUNK), args.repeat),
        )
    )
    ceiling = rows[0][1][1]
    print(
        f"state {total / 2**20:.2f} MiB in {len(srcs)} tensors on {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, chunk {CHUNK >> 20} MiB"
    )
    print("| part | host enqueue (ms) | finished (ms) | GB/s | vs ceiling |")
    print("|---|---|---|---|---|")
    for name, (enq, done) in rows:
        print(
            f"| {name} | {enq * 1e3:.2f} | {done * 1e3:.2f} | "
            f"{total / done / 1e9:.1f} | {ceiling / done:.0%} |"
        )
    arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
