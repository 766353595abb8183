"""Where a training loop loses time to overlap-mode saves: step time by position after a save.

    python benchmarks/save_timeline.py [--threads N] [--steps 60] [--every 5]

Runs the loop of bench_checkpoint.py's training-loop row (GPTish, ~108 MiB of state, AdamW)
with an overlap save every ``--every`` steps and prints, for each position k after a save
(k = 0 is the step that saves), the median step time against the same loop without saves,
alternated in blocks, plus the saves' own figures (stall, copy staged, durable) and the
process's CPU time per block of each mode. ``--threads`` sets the native core's thread count for
this run (GPUMEM_THREADS). Run it once more under ``OMP_WAIT_POLICY=PASSIVE`` to see how much of
the loss is torch's OpenMP threads spinning at a barrier while a core is taken (torch's CPU
build: every parallel region ends at one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="GPUMEM_THREADS for this run")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument(
        "--all-cores",
        action="store_true",
        help="background work on every core at normal priority (what saves did before the "
        "thread budget), for comparison",
    )
    args = ap.parse_args(argv)
    if args.threads is not None:
        os.environ["GPUMEM_THREADS"] = str(args.threads)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_checkpoint import GPTish

    import gpumem

    if args.all_cores:
        import gpumem.checkpoint.stage.snapshot as snapshot_mod
        import gpumem.checkpoint.storage.writes as writes_mod

        snapshot_mod.background_threads = lambda: os.cpu_count() or 1  # type: ignore[assignment]
        writes_mod.lower_priority = lambda: None  # type: ignore[assignment]
    torch.manual_seed(0)
    d = 512
    model = GPTish(40_000_000 // 12 * 3, d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, d)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    root = Path(tempfile.mkdtemp(prefix="gpumem-timeline-"))
    ck = gpumem.Checkpointer(root / "ck", keep=1)
    ck.prepare(model, opt, background=False)
    every = args.every
    base: list[float] = []
    by_pos: dict[int, list[float]] = {k: [] for k in range(every)}
    stats = []
    # the process's CPU time (every thread, torch's spinning ones included) per block of each
    # mode: what the saves cost in CPU, which the machine's load barely moves, unlike wall time
    cpu: dict[bool, list[float]] = {False: [], True: []}
    try:
        for block in range(max(2, args.steps // (2 * every))):
            for saving in (False, True):
                c0 = time.process_time()
                for i in range(2 * every):
                    t0 = time.perf_counter()
                    step()
                    if saving and i % every == 0:
                        stats.append(
                            ck.save(block * 100 + i, model=model, optimizer=opt, rng=False)
                        )
                    dt = time.perf_counter() - t0
                    (by_pos[i % every] if saving else base).append(dt)
                ck.wait()
                cpu[saving].append(time.process_time() - c0)
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    b = statistics.median(base)
    from gpumem.checkpoint.workers import background_threads

    how = "all cores, normal priority" if args.all_cores else f"{background_threads()} thread(s)"
    print(f"background: {how}; torch threads {torch.get_num_threads()}")
    print(f"no save: {b * 1e3:.1f} ms/step (median of {len(base)})")
    lost = 0.0
    for k, ts in by_pos.items():
        m = statistics.median(ts)
        lost += m - b
        print(f"  step {k} after save: {m * 1e3:.1f} ms ({(m - b) * 1e3:+.1f})")

    def med(f) -> float:
        return statistics.median(f(s) for s in stats) * 1e3

    per_save = (statistics.median(cpu[True]) - statistics.median(cpu[False])) / 2
    print(
        f"CPU time (all threads) per block of {2 * every} steps: "
        f"{statistics.median(cpu[False]) * 1e3:.0f} ms without saves, "
        f"{statistics.median(cpu[True]) * 1e3:.0f} ms with 2: {per_save * 1e3:.0f} ms per save"
    )
    print(
        f"lost per save (sum of medians): {lost * 1e3:.0f} ms; "
        f"save(): {med(lambda s: s.save_s):.1f} ms, hook wait {med(lambda s: s.hook_wait_s):.1f}"
        f" ms, staged {med(lambda s: s.staged_s):.0f} ms, durable {med(lambda s: s.durable_s):.0f}"
        " ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
