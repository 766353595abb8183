"""Where a training loop loses time to overlap-mode saves: step time by position after a save.

    python benchmarks/save_timeline.py [--threads N] [--steps 60] [--every 5]

Runs the loop of bench_checkpoint.py's training-loop row (GPTish, ~108 MiB of state, AdamW)
with an overlap save every ``--every`` steps and prints, for each position k after a save
(k = 0 is the step that saves), the median step time against the same loop without saves,
alternated in blocks, plus the saves' own figures (stall, copy staged, durable) and the
process's CPU time per block of each mode, split by thread: the training thread, torch's
OpenMP workers, gpumem's Python threads (persist, overlap copier), gpumem's native pool, and the
threads that ended within the block (a save's checksum and write threads), with the kernel's
share. ``--threads`` sets the native core's thread count for this run (GPUMEM_THREADS).

``--write`` runs the loop in child processes three ways (as is; ``OMP_WAIT_POLICY=PASSIVE``, so
torch's OpenMP threads sleep at a barrier instead of spinning while a core is taken; torch on
one thread) and writes ``results/save_timeline.md``: where each save's time goes on this
machine, the timeline behind bench_checkpoint.py's training-loop rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _report import steal_ticks

HERE = Path(__file__).resolve().parent

# thread groups of the CPU split, in the order printed
GROUPS = (
    "training thread",
    "torch's OpenMP workers",
    "gpumem Python threads",
    "gpumem native pool",
)
ENDED = "threads ended within the block"
STOLEN = "stolen by the hypervisor"

VARIANTS = (  # (label, extra environment, extra arguments) of --write
    ("as is", {}, []),
    ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}, []),
    ("torch on 1 thread", {}, ["--torch-threads", "1"]),
)


def thread_times() -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of each live thread of this process, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)  # utime, stime
    return out


def process_times() -> tuple[float, float]:
    """(user, system) CPU seconds of the whole process, ended threads included."""
    t = os.times()
    return t.user, t.system


class CpuSplit:
    """CPU time by thread group between two points. Threads that exist before the Checkpointer
    is made, other than the main thread and Python's, are torch's; Python threads named
    gpumem-* are gpumem's; any other thread born later is gpumem's native pool."""

    def __init__(self) -> None:
        self.main = threading.main_thread().native_id
        self.torch = set(thread_times()) - {self.main} - self._python()

    @staticmethod
    def _python() -> set[int]:
        return {t.native_id for t in threading.enumerate() if t.native_id is not None}

    def group(self, tid: int) -> str:
        if tid == self.main:
            return GROUPS[0]
        if tid in self.torch:
            return GROUPS[1]
        names = {t.native_id: t.name for t in threading.enumerate()}
        if tid in names:
            return GROUPS[2] if names[tid].startswith("gpumem") else "other Python threads"
        return GROUPS[3]

    def sample(self) -> tuple[dict[int, tuple[float, float]], tuple[float, float], int]:
        return thread_times(), process_times(), steal_ticks()

    def between(self, a: Any, b: Any) -> dict[str, float]:
        """CPU seconds per group from sample ``a`` to ``b``, 'kernel' (system time, all) and
        STOLEN (the machine's, every CPU: the hypervisor's, among it the host's emulation of
        this guest's disk writes on the cores the guest computes on)."""
        (ta, pa, sa), (tb, pb, sb) = a, b
        out = dict.fromkeys(GROUPS, 0.0)
        for tid, (u, s) in tb.items():
            u0, s0 = ta.get(tid, (0.0, 0.0))
            g = self.group(tid)
            out[g] = out.get(g, 0.0) + (u - u0) + (s - s0)
        total = (pb[0] - pa[0]) + (pb[1] - pa[1])
        out[ENDED] = max(0.0, total - sum(out.values()))
        out["total"] = total
        out["kernel"] = pb[1] - pa[1]
        out[STOLEN] = (sb - sa) / os.sysconf("SC_CLK_TCK")
        return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the loop with and without saves, alternated in blocks; the summary as a dict."""
    import torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    sys.path.insert(0, str(HERE))
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
    split = CpuSplit()  # torch's threads exist now, gpumem's not yet
    root = Path(tempfile.mkdtemp(prefix="gpumem-timeline-"))
    ck = gpumem.Checkpointer(root / "ck", keep=1)
    ck.prepare(model, opt, background=False)
    every = args.every
    base: list[float] = []
    by_pos: dict[int, list[float]] = {k: [] for k in range(every)}
    stats = []
    # CPU time per block of each mode, by thread group: what the saves cost in CPU, which the
    # machine's load barely moves, unlike wall time
    cpu: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for block in range(max(2, args.steps // (2 * every))):
            for saving in (False, True):
                c0 = split.sample()
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
                cpu[saving].append(split.between(c0, split.sample()))
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    from gpumem.checkpoint.workers import background_threads

    b = statistics.median(base)
    after = {k: statistics.median(ts) - b for k, ts in by_pos.items()}
    keys = sorted({k for c in cpu[False] + cpu[True] for k in c})

    def per_block(saving: bool, k: str) -> float:
        return statistics.median(c.get(k, 0.0) for c in cpu[saving])

    def med(f) -> float:
        return statistics.median(f(s) for s in stats)

    return {
        "background": "all cores, normal priority"
        if args.all_cores
        else f"{background_threads()} native thread(s)",
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "step_s": b,
        "steps": len(base),
        "after_save_s": after,
        "lost_per_save_s": sum(after.values()),
        # two saves per saving block
        "cpu_per_save_s": {k: (per_block(True, k) - per_block(False, k)) / 2 for k in keys},
        "cpu_per_block_s": {k: per_block(False, k) for k in keys},
        "save_s": med(lambda s: s.save_s),
        "hook_wait_s": med(lambda s: s.hook_wait_s),
        "staged_s": med(lambda s: s.staged_s),
        "durable_s": med(lambda s: s.durable_s),
        "nbytes": stats[0].nbytes,
    }


def show(r: dict[str, Any]) -> None:
    print(f"background: {r['background']}; torch threads {r['torch_threads']}")
    print(f"no save: {r['step_s'] * 1e3:.1f} ms/step (median of {r['steps']})")
    for k, dt in r["after_save_s"].items():
        print(f"  step {k} after save: {(r['step_s'] + dt) * 1e3:.1f} ms ({dt * 1e3:+.1f})")
    print("CPU time per save (with saves minus without, per block / 2), by thread:")
    for k, v in r["cpu_per_save_s"].items():
        without = r["cpu_per_block_s"][k] * 1e3
        print(f"  {k}: {v * 1e3:+.0f} ms (without saves {without:.0f} ms/block)")
    print(
        f"lost per save (sum of medians): {r['lost_per_save_s'] * 1e3:.0f} ms; "
        f"save(): {r['save_s'] * 1e3:.1f} ms, hook wait {r['hook_wait_s'] * 1e3:.1f} ms, "
        f"staged {r['staged_s'] * 1e3:.0f} ms, durable {r['durable_s'] * 1e3:.0f} ms"
    )


def write(args: argparse.Namespace) -> int:
    """Each variant in a child process; one table of where a save's time goes."""
    from _report import figure, machine_info, write_results

    runs = []
    for label, env, extra in VARIANTS:
        cmd = [sys.executable, __file__, "--json", "--steps", str(args.steps)]
        cmd += ["--every", str(args.every), *extra]
        out = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True
        ).stdout
        runs.append((label, json.loads(out.strip().splitlines()[-1])))
    cols = ["run", "step (no save)", "lost per save", "copy (staged)", "save()"]
    cols += [f"CPU per save: {g}" for g in (*GROUPS, ENDED)] + ["of it, kernel", STOLEN]
    rows, figures = [], []
    for label, r in runs:
        c = r["cpu_per_save_s"]
        rows.append(
            [
                f"{label} (torch {r['torch_threads']} thread(s), {r['background']})",
                f"{r['step_s'] * 1e3:.1f} ms",
                f"{r['lost_per_save_s'] * 1e3:.0f} ms",
                f"{r['staged_s'] * 1e3:.1f} ms",
                f"{r['save_s'] * 1e3:.1f} ms",
                *(f"{c.get(g, 0.0) * 1e3:+.0f} ms" for g in (*GROUPS, ENDED)),
                f"{c.get('kernel', 0.0) * 1e3:+.0f} ms",
                f"{c.get(STOLEN, 0.0) * 1e3:+.0f} ms",
            ]
        )
        figures.append(figure(f"{label}: lost per save", "ms", [r["lost_per_save_s"] * 1e3]))
        figures.append(figure(f"{label}: CPU per save", "ms", [c.get("total", 0.0) * 1e3]))
    nbytes = runs[0][1]["nbytes"]
    notes = (
        f"bench_checkpoint.py's training-loop state ({nbytes / 2**20:.2f} MiB: GPTish + AdamW), "
        f"an overlap save every {args.every} steps, {args.steps} steps per mode alternated in "
        "blocks, each variant in a fresh process. 'lost per save': the sum over the steps after "
        "a save of each position's median step time less the loop's without saves. 'CPU per "
        "save': CPU time of each thread group per block with two saves less per block without, "
        "halved (/proc/self/task: torch's threads are those that existed before the "
        "Checkpointer; 'ended' are threads that exited within the block, from the process's "
        "total). On 2 cores with torch on both no core is idle: every CPU millisecond a save "
        "spends is taken from training, and torch's OpenMP workers that wait at a barrier for "
        "a descheduled peer spin (their added CPU) unless OMP_WAIT_POLICY=PASSIVE. "
        f"'{STOLEN}': the CPU time /proc/stat counts as stolen from this VM (every CPU) per "
        "save: where the host emulates the guest's disk on the cores it computes on, each "
        "write takes that from training whatever the guest does (bench_checkpoint.py's "
        "training-loop rows measure the same loop with a raw copy + write of the same bytes)."
    )
    write_results(
        "save_timeline",
        "Training loop: where an overlap save's time goes",
        cols,
        rows,
        notes=notes,
        info=machine_info(),
        figures=figures,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="GPUMEM_THREADS for this run")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument(
        "--all-cores",
        action="store_true",
        help="background work on every core at normal priority (what saves did before the "
        "thread budget), for comparison",
    )
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    ap.add_argument(
        "--write", action="store_true", help="run the variants, write results/save_timeline.md"
    )
    args = ap.parse_args(argv)
    if args.write:
        return write(args)
    if args.threads is not None:
        os.environ["GPUMEM_THREADS"] = str(args.threads)
    r = measure(args)
    if args.json:
        print(json.dumps(r))
    else:
        show(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
