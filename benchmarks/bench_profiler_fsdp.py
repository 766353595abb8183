"""Overhead of gpumem.profile on an FSDP2 training step: 2 ranks, gloo, CPU.

GPT-style model (6 layers, d 512, 8 heads, seq 256, batch 4 per rank, AdamW), every block and
the root its own ``fully_shard`` unit, one thread per rank. In each round the configurations
(plain step, light mode, exact mode) run one step each, in a rotated order, on both ranks in
lockstep (FSDP's collectives synchronise them); each is compared with the plain step of the same
round; a mode that only re-dispatches shows what any dispatch-mode tool pays. Rank 0's wall
time is reported (a step ends for both ranks at the same collective), and
both ranks' CPU times. Entering and leaving the region is part of the timed step.

    python benchmarks/bench_profiler_fsdp.py [--rounds 9] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _report import figure, machine_info, value_figure, write_results
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import gpumem
from gpumem.models import build_model, example_batch
from gpumem.profiler import Profile

WORLD = 2
CONFIGS = (
    "plain step",
    "gpumem.profile(mode='light')",
    "gpumem.profile (exact)",
    "empty TorchDispatchMode, DTensor first (the floor of any dispatch-mode tracker)",
)


class _Floor(TorchDispatchMode):
    """A mode that only re-dispatches every op, letting DTensor run first as exact mode,
    MemTracker and FSDPMemTracker do (DTensor's ops then reach the mode as local ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return func(*args, **(kwargs or {}))


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = build_model(
            "gpt2", "tiny", vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, seq_len=256
        )
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(rank)
        x, y = example_batch(model.config, args.batch_size, args.seq_len)

        def step() -> None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        makers = {
            CONFIGS[0]: contextlib.nullcontext,
            CONFIGS[1]: lambda: gpumem.profile(model, opt, mode="light"),
            CONFIGS[2]: lambda: gpumem.profile(model, opt),
            CONFIGS[3]: _Floor,
        }
        step()  # optimizer state and FSDP's buffers exist before any timing
        wall: dict[str, list[float]] = {c: [] for c in CONFIGS}
        cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
        peaks: dict[str, int] = {}
        t_start = time.perf_counter()
        rounds = 0
        while True:
            # rank 0 decides whether another round starts; every rank follows
            go = torch.tensor(
                [
                    rounds < args.rounds
                    and (rounds < 3 or time.perf_counter() - t_start < args.budget_s)
                ]
            )
            dist.broadcast(go, 0)
            if not go.item():
                break
            k = rounds % len(CONFIGS)
            for name in CONFIGS[k:] + CONFIGS[:k]:
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                with makers[name]() as prof:
                    step()
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
                if isinstance(prof, Profile):
                    peaks[name] = prof.report().peak_bytes
            rounds += 1
        Path(f"{out}.{rank}").write_text(json.dumps({"wall": wall, "cpu": cpu, "peaks": peaks}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ratios(times: dict[str, list[float]], name: str) -> tuple[float, float]:
    """Median over rounds of (config / plain step of the same round), and min / min."""
    base = times[CONFIGS[0]]
    per_round = [t / b for t, b in zip(times[name], base, strict=True)]
    return statistics.median(per_round), min(times[name]) / min(base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9, help="at most this many rounds")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting new rounds after this many seconds (at least 3 rounds)",
    )
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    load_start = " ".join(f"{v:.1f}" for v in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times")
        mp.spawn(_worker, args=(args, str(Path(tmp) / "rendezvous"), out), nprocs=WORLD)
        res = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    load_end = " ".join(f"{v:.1f}" for v in os.getloadavg())
    rounds = len(res[0]["wall"][CONFIGS[0]])
    rows = []
    figures = []
    for name in CONFIGS:
        figures.append(figure(f"{name}: wall (rank 0)", "ms", res[0]["wall"][name], scale=1e3))
        if name != CONFIGS[0]:  # the ratio to the plain step of the same round, per round
            base = res[0]["wall"][CONFIGS[0]]
            per_round = [t / b for t, b in zip(res[0]["wall"][name], base, strict=True)]
            figures.append(figure(f"{name}: wall / plain step", "x", per_round))
            for r, times in enumerate(x["cpu"] for x in res):
                base = times[CONFIGS[0]]
                per_round = [t / b for t, b in zip(times[name], base, strict=True)]
                figures.append(figure(f"{name}: CPU / plain step (rank {r})", "x", per_round))
        if name in res[0]["peaks"]:
            figures.append(value_figure(f"{name}: peak (rank 0)", "B", res[0]["peaks"][name]))
        wr, wm = _ratios(res[0]["wall"], name)
        cpu_ratios = [_ratios(r["cpu"], name) for r in res]
        peak = res[0]["peaks"].get(name)
        rows.append(
            [
                name,
                f"{statistics.median(res[0]['wall'][name]) * 1e3:.0f}",
                f"{min(res[0]['wall'][name]) * 1e3:.0f}",
                f"{wr:.3f}x",
                f"{wm:.3f}x",
                " / ".join(f"{c[0]:.3f}x" for c in cpu_ratios),
                "-" if peak is None else f"{peak / 2**20:.2f} MiB",
            ]
        )
    notes = f"""
2 ranks (gloo, file rendezvous, one thread each) on this machine; GPT-style model: 6 layers,
d 512, 8 heads, seq {args.seq_len}, batch {args.batch_size} per rank, vocab 8192, AdamW; each
block and the root a `fully_shard` unit (reshard_after_forward=True). {rounds} rounds, the
configurations interleaved in each round in a rotated order after a barrier. "ratio" columns: the
median over rounds of the configuration's time over the plain step's time in the same round;
"min ratio": best time over best plain time; CPU ratios per rank (rank 0 / rank 1). Entering
and leaving each region (and, for the profiled steps, nothing else: the report is built after
the timer stops) is part of the timed step. Load average (1, 5, 15 min) at start {load_start},
at end {load_end}, on {os.cpu_count()} cores (the benchmark itself keeps 2 busy).

Target (issue #12): light mode at most 1.05x the plain step. Light mode pays a few Python calls
per module call and per FSDP gather, reshard and reduce; exact mode pays one per aten op, and
with a dispatch mode active DTensor's ops (here the optimizer step on the sharded parameters)
take their Python path: the empty mode's row is that floor, exact mode's own work is its ratio
over it.
"""
    info = machine_info()
    info["load average at start / end"] = f"{load_start} / {load_end}"
    write_results(
        "profiler_fsdp",
        "gpumem.profile overhead on FSDP2 (2 ranks, gloo)",
        [
            "configuration",
            "median wall ms (rank 0)",
            "min wall ms",
            "wall ratio",
            "min wall ratio",
            "CPU ratio (rank 0 / 1)",
            "peak (rank 0)",
        ],
        rows,
        notes,
        info,
        figures=figures,
    )


if __name__ == "__main__":
    main()
