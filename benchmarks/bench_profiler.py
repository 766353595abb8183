"""Overhead of gpumem.profile on a training step, against MemTracker and torch.profiler.

GPT-style model (6 layers, d 512, 8 heads, seq 256, batch 8, AdamW), CPU by default. Each
configuration runs the same step; the table gives the median step time and its ratio to the plain
step measured in the same run. Also times the fake-tensor profile of a full Llama-2-70B decoder
layer (bf16, batch 1, seq 4096).

    python benchmarks/bench_profiler.py [--repeat 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from _report import machine_info, median_time, write_results

import gpumem
from gpumem.models import build_model, default_dtype, example_batch, get_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = build_model("gpt2", "tiny", vocab_size=8192, hidden_size=512, num_layers=6,
                        num_heads=8, seq_len=256).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = example_batch(model.config, 8, 256, device=dev)

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def inside(make_ctx):
        def run():
            with make_ctx():
                step()
        return run

    def memtracker():
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt, x)
        return mt

    def torch_profiler():
        return torch.profiler.profile(profile_memory=True, record_shapes=True)

    configs = [
        ("plain step", contextlib.nullcontext),
        ("gpumem.profile", lambda: gpumem.profile(model, opt)),
        ("gpumem.profile(timeline=False)", lambda: gpumem.profile(model, opt, timeline=False)),
        ("MemTracker", memtracker),
        ("torch.profiler(profile_memory=True)", torch_profiler),
    ]
    step()  # optimizer state exists before any timing: every configuration times a later step
    # interleave configurations round by round so machine noise hits all of them alike
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    for _ in range(args.repeat):
        for name, ctx in configs:
            times[name].append(median_time(inside(ctx), repeat=1, warmup=0)["median"])
    base = sorted(times["plain step"])[len(times["plain step"]) // 2]
    base_min = min(times["plain step"])
    rows = []
    for name, _ in configs:
        med, best = sorted(times[name])[len(times[name]) // 2], min(times[name])
        rows.append([name, f"{med * 1e3:.1f}", f"{best * 1e3:.1f}", f"{med / base:.2f}x",
                     f"{best / base_min:.2f}x"])

    cfg = get_config("llama", "70b")

    def fake_layer():
        with gpumem.fake():
            with default_dtype(torch.bfloat16):
                from gpumem.models.transformer import Block

                block = Block(cfg)
            o = torch.optim.AdamW(block.parameters())
            xx = torch.randn(1, 4096, cfg.hidden_size, dtype=torch.bfloat16)
            with gpumem.profile(block, o) as prof:
                block(xx).float().square().mean().backward()
                o.step()
        return prof.report()

    t0 = time.perf_counter()
    rep = fake_layer()
    fake_s = time.perf_counter() - t0
    rows.append(["fake Llama-2-70B layer: build + profile 1 AdamW step", f"{fake_s * 1e3:.0f}",
                 "-", f"peak {rep.peak_bytes / 2**30:.2f} GiB", "-"])
    notes = f"""
GPT-style model: 6 layers, d 512, 8 heads, seq 256, batch 8, vocab 8192, AdamW, {args.device};
{args.repeat} rounds, configurations interleaved within each round; ratios against the plain step's
median (and min). Entering and leaving each region is part of the timed step. On a shared machine
(see the load average) the min ratio is the more trustworthy of the two.

What each mode measures:
- `gpumem.profile`: every storage the dispatcher sees, exact bytes, categories, per-layer
  activations/temporaries, phase peaks, the memory-over-time timeline.
- `gpumem.profile(timeline=False)`: the same numbers without the time series (no plot/trace).
- MemTracker: the same storage tracking, its own categories, per-module snapshots.
- torch.profiler: op events with allocation records (analysis happens afterwards).
The cost of all three dispatch-mode tools is per op (Python dispatch), so the ratio falls as the
ops get bigger (larger batch, sequence or hidden size, or a GPU where kernels run asynchronously
and the hooks overlap with them).
"""
    info = machine_info()
    info["load average at start"] = load
    write_results("profiler", "gpumem.profile overhead", ["configuration", "median ms", "min ms",
                  "median ratio", "min ratio"], rows, notes=notes, info=info)


if __name__ == "__main__":
    main()
