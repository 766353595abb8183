"""The estimator's reserved memory: what simulating each step's allocations through the caching
allocator costs an estimate and a planner sweep, against the flat fragmentation share
(``alloc_conf=False``). "cold": the simulation caches cleared before every call (a fresh
process, as the CLI runs); "warm": its shapes already simulated.

    python benchmarks/bench_reserved.py       # writes benchmarks/results/estimator_reserved.md
"""

from __future__ import annotations

from _report import figure, machine_info, median_time, ratio_figure, write_results

import gpumem
from gpumem.estimator import step_trace

JOBS = [
    ("estimate llama-3-8b, 1 GPU", "llama-3-8b", {"seq_len": 4096}),
    (
        "estimate llama-3-70b, dp8/tp8/pp2/zero1",
        "llama-3-70b",
        {"seq_len": 4096, "layout": gpumem.Layout(dp=8, tp=8, pp=2, zero=1), "grad_accum": 8},
    ),
]


def _cold(fn):
    def run():
        for cache in (step_trace.fragmentation, step_trace._step_stage, step_trace._walk_stage):
            cache.cache_clear()
        return fn()

    return run


def main() -> None:
    import os

    os.environ["GPUMEM_CACHE_DIR"] = "off"  # cold means simulated: no on-disk results either
    info = machine_info()
    rows, figures = [], []
    cases = [(name, lambda m=m, kw=kw, **a: gpumem.estimate(m, **kw, **a)) for name, m, kw in JOBS]
    cases.append(
        (
            "plan llama-3-70b on 64 x H100-80GB",
            lambda **a: gpumem.plan("llama-3-70b", n_gpus=64, seq_len=4096, **a),
        )
    )
    for name, call in cases:
        flat = median_time(lambda c=call: c(alloc_conf=False), repeat=3)
        cold = median_time(_cold(lambda c=call: c(alloc_conf="")), repeat=3)
        warm = median_time(lambda c=call: c(alloc_conf=""), repeat=3)
        f_flat = figure(f"{name}: flat share", "ms", flat["samples"], scale=1e3)
        f_cold = figure(f"{name}: simulated, cold", "ms", cold["samples"], scale=1e3)
        f_warm = figure(f"{name}: simulated, warm", "ms", warm["samples"], scale=1e3)
        ratio = ratio_figure(f"{name}: cold / flat", f_cold, f_flat, better="lower")
        figures += [f_flat, f_cold, f_warm, ratio]
        res = call(alloc_conf="")
        bill = res if isinstance(res, gpumem.Bill) else res.bill()
        rows.append(
            (
                name,
                f"{flat['median'] * 1e3:.0f}",
                f"{cold['median'] * 1e3:.0f}",
                f"{warm['median'] * 1e3:.0f}",
                f"{cold['median'] / flat['median']:.1f}x",
                f"{bill.allocated_bytes / 2**30:.2f} / {bill.peak_reserved_bytes / 2**30:.2f}"
                if bill.peak_reserved_bytes is not None
                else "-",
            )
        )
    notes = """
"flat": `alloc_conf=False`, the flat 5 % fragmentation share (the estimator before the
simulator). "cold" clears the simulation caches (`step_trace`'s three) before each call;
"warm" reuses it. The planner simulates only the configurations whose allocated peak fits, each
rank's shapes simulated for K and 2K layers (K = 4) and extrapolated. Last column: the bill's
(the plan's best layout's) allocated and simulated reserved peaks, GiB.
"""
    write_results(
        "estimator_reserved",
        "Estimator: the cost of simulating reserved memory",
        [
            "job",
            "flat ms",
            "simulated cold ms",
            "simulated warm ms",
            "cold / flat",
            "allocated / reserved GiB",
        ],
        rows,
        notes,
        info,
        figures=figures,
    )


if __name__ == "__main__":
    main()
