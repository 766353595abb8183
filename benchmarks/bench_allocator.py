"""Cost of the caching allocator simulator (gpumem.allocator) on the traces it will replay inside
every estimate and planner candidate: one Llama-2-70B decoder layer's training step and a full
Llama-3-8B training step, both recorded by ``gpumem.profile`` under ``gpumem.fake()`` (every
storage the dispatcher sees, in order; bf16, batch 1, seq 4096, AdamW).

The budget is 1 s per replay on this machine; the figures are the replay time (median of
``--repeat`` runs, the recording not counted) and the rate in events per second, with and without
``expandable_segments:True`` and with the segment map at the peak (a second pass up to it).

    python benchmarks/bench_allocator.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _report import figure, value_figure, write_results

import gpumem
from gpumem.allocator import simulate
from gpumem.models import build_model, default_dtype, get_config
from gpumem.profiler.reserved import log_events

GiB = 2**30


def _events(build, batch) -> tuple[list, int]:
    """Profile one AdamW step of ``build()`` on ``batch()`` under fake tensors; returns the
    simulator's events and the profile's peak."""
    with gpumem.fake():
        with default_dtype(torch.bfloat16):
            model = build()
        opt = torch.optim.AdamW(model.parameters())
        x = batch()
        with gpumem.profile(model, opt, alloc_conf="") as prof:
            out = model(x)
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    log = prof.tracker.alloc_log
    assert log is not None
    return log_events(log), prof.report().peak_bytes


def _layer70b():
    cfg = get_config("llama", "70b")

    def build():
        from gpumem.models.transformer import Block

        return Block(cfg)

    return build, lambda: torch.randn(1, 4096, cfg.hidden_size, dtype=torch.bfloat16)


def _step8b():
    cfg = get_config("llama", "7b", vocab_size=128256, ffn_hidden_size=14336, num_kv_heads=8)
    return (
        lambda: build_model(cfg, dtype=torch.bfloat16),
        lambda: torch.randint(0, cfg.vocab_size, (1, 4096)),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    rows, figures = [], []
    for name, (build, batch) in (
        ("Llama-2-70B layer", _layer70b()),
        ("Llama-3-8B full step", _step8b()),
    ):
        t0 = time.perf_counter()
        events, peak = _events(build, batch)
        record_s = time.perf_counter() - t0
        figures.append(value_figure(f"{name}: events", "events", len(events)))
        for conf, segment_map in (("", False), ("expandable_segments:True", False), ("", True)):
            times = []
            r = None
            for _ in range(args.repeat):
                t = time.perf_counter()
                r = simulate(events, conf, segment_map=segment_map)
                times.append(time.perf_counter() - t)
            assert r is not None
            what = f"{name}, {conf or 'default'}" + (", segment map" if segment_map else "")
            f = figure(f"{what}: replay", "ms", times, scale=1e3)
            figures.append(f)
            figures.append(
                figure(
                    f"{what}: rate",
                    "Mevents/s",
                    [len(events) / t / 1e6 for t in times],
                    better="higher",
                )
            )
            figures.append(value_figure(f"{what}: peak reserved", "B", r.peak_reserved))
            rows.append(
                [
                    what,
                    f"{len(events)}",
                    f"{f.p50:.2f}",
                    f"{len(events) / (f.p50 / 1e3) / 1e6:.2f}",
                    f"{f.p50 / 1e3:.3f}x",
                    f"{r.peak_reserved / GiB:.2f}",
                    f"{r.peak_allocated / GiB:.2f}",
                    f"{peak / GiB:.2f}",
                ]
            )
        print(f"{name}: recorded {len(events)} events in {record_s:.1f} s", file=sys.stderr)
    notes = f"""
Each trace is the allocation/free sequence of every storage of one training step (fake tensors,
bf16, batch 1, seq 4096, AdamW, `gpumem.profile` exact mode: the sequence the profiler feeds the
simulator), replayed {args.repeat} times; "replay ms" is the median. "of budget": the median over
the 1 s budget. The recording (the fake-tensor profile) is not timed. "peak live" is the profile's
peak of live bytes; "peak allocated" is the simulator's (the same storages in 512-byte blocks,
with the unsplit remainders of blocks handed out whole); "peak reserved" is what the caching
allocator would hold. "segment map": a second pass up to the peak keeps the segment map there.
"""
    write_results(
        "allocator",
        "Caching allocator simulator: replay cost",
        [
            "trace, alloc_conf",
            "events",
            "replay ms",
            "Mevents/s",
            "of budget",
            "peak reserved GiB",
            "peak allocated GiB",
            "peak live GiB",
        ],
        rows,
        notes,
        figures=figures,
    )


if __name__ == "__main__":
    main()
