"""Overhead of gpumem.profile on a training step, against MemTracker and torch.profiler.

GPT-style model (6 layers, d 512, 8 heads, seq 256, batch 8, AdamW), CPU by default. Every
configuration runs the same step; configurations are interleaved within each round (in a rotated
order, so none always runs first) and each is compared with the plain step of the same round.
Wall time and process CPU time are both reported: on a shared machine the wall time of a 2-core
step swings by 2x with other people's jobs, while CPU time mostly does not. Also times the
fake-tensor profile of a full Llama-2-70B decoder layer (bf16, batch 1, seq 4096) in both modes.

    python benchmarks/bench_profiler.py [--rounds 9] [--budget-s 540] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from _report import figure, machine_info, value_figure, write_results
from torch.utils._python_dispatch import TorchDispatchMode

import gpumem
from gpumem.models import build_model, default_dtype, example_batch, get_config


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9, help="at most this many rounds")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="stop starting new rounds after this many seconds (at least 3 rounds)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument(
        "--fake-rounds",
        type=int,
        default=3,
        help="rounds of the full fake Llama-2-70B profile (fast path and full dispatch)",
    )
    args = ap.parse_args()
    load_start = _load()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = build_model(
        "gpt2", "tiny", vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, seq_len=256
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = example_batch(model.config, args.batch_size, args.seq_len, device=dev)

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def memtracker():
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt, x)
        return mt

    configs = [
        ("plain step", contextlib.nullcontext),
        ("empty TorchDispatchMode (the floor of any dispatch-mode tracker)", _OpCounter),
        ("gpumem.profile (exact)", lambda: gpumem.profile(model, opt)),
        (
            "gpumem.profile (exact, timeline=False)",
            lambda: gpumem.profile(model, opt, timeline=False),
        ),
        ("gpumem.profile(mode='light')", lambda: gpumem.profile(model, opt, mode="light")),
        ("MemTracker", memtracker),
        (
            "torch.profiler(profile_memory=True)",
            lambda: torch.profiler.profile(profile_memory=True, record_shapes=True),
        ),
    ]
    step()  # optimizer state exists before any timing: every configuration times a later step
    counter = _OpCounter()
    with counter:
        step()
    wall: dict[str, list[float]] = {name: [] for name, _ in configs}
    cpu: dict[str, list[float]] = {name: [] for name, _ in configs}
    t_start = time.perf_counter()
    rounds = 0
    while rounds < args.rounds and (rounds < 3 or time.perf_counter() - t_start < args.budget_s):
        k = rounds % len(configs)
        for name, make in configs[k:] + configs[:k]:
            w0, c0 = time.perf_counter(), time.process_time()
            with make():
                step()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
        rounds += 1
    load_end = _load()

    def ratios(times: dict[str, list[float]], name: str) -> tuple[float, float]:
        """Median over rounds of (config / plain step of the same round), and min / min."""
        base = times["plain step"]
        per_round = [t / b for t, b in zip(times[name], base, strict=True)]
        return statistics.median(per_round), min(times[name]) / min(base)

    rows, figures = [], []
    for name, _ in configs:
        figures.append(figure(f"{name}: wall", "ms", wall[name], scale=1e3))
        figures.append(figure(f"{name}: CPU", "ms", cpu[name], scale=1e3))
        if name != "plain step":  # the ratio to the plain step of the same round, per round
            for kind, times in (("wall", wall), ("CPU", cpu)):
                per_round = [t / b for t, b in zip(times[name], times["plain step"], strict=True)]
                figures.append(figure(f"{name}: {kind} / plain step", "x", per_round))
        wr, wm = ratios(wall, name)
        cr, cm = ratios(cpu, name)
        rows.append(
            [
                name,
                f"{statistics.median(wall[name]) * 1e3:.0f}",
                f"{min(wall[name]) * 1e3:.0f}",
                f"{wr:.3f}x",
                f"{wm:.3f}x",
                f"{statistics.median(cpu[name]) * 1e3:.0f}",
                f"{cr:.3f}x",
                f"{cm:.3f}x",
            ]
        )
    base_cpu = min(cpu["plain step"])
    per_op_us = (min(cpu["gpumem.profile (exact)"]) - base_cpu) / counter.n * 1e6

    cfg = get_config("llama", "70b")

    def fake_layer(mode: str):
        with gpumem.fake():
            with default_dtype(torch.bfloat16):
                from gpumem.models.transformer import Block

                block = Block(cfg)
            o = torch.optim.AdamW(block.parameters())
            xx = torch.randn(1, 4096, cfg.hidden_size, dtype=torch.bfloat16)
            with gpumem.profile(block, o, mode=mode) as prof:
                block(xx).float().square().mean().backward()
                o.step()
        return prof.report()

    for mode in ("exact", "light"):
        t0 = time.perf_counter()
        rep = fake_layer(mode)
        fake_s = time.perf_counter() - t0
        what = f"fake Llama-2-70B layer, {mode}"
        figures.append(value_figure(f"{what}: build + profile", "ms", fake_s * 1e3))
        figures.append(value_figure(f"{what}: peak", "B", rep.peak_bytes))
        rows.append(
            [
                f"fake Llama-2-70B layer, {mode}: build + profile 1 AdamW step",
                f"{fake_s * 1e3:.0f}",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"peak {rep.peak_bytes / 2**30:.2f} GiB",
            ]
        )
    fake_rows, fake_figures, fake_notes = _fake_70b(args.fake_rounds)
    rows += fake_rows
    figures += fake_figures
    op_share = 100 * per_op_us * counter.n / 1e6 / base_cpu
    notes = f"""
GPT-style model: 6 layers, d 512, 8 heads, seq {args.seq_len}, batch {args.batch_size}, vocab
8192, AdamW, {args.device}, {torch.get_num_threads()} threads; {rounds} rounds, the
configurations interleaved in each round in a rotated order. "ratio" columns: the median over
rounds of the configuration's time over the plain step's time in the same round; "min ratio":
best time over best plain time. Entering and leaving each region is part of the timed step.
{counter.n} aten ops per step; the exact tracker's cost over the plain step is
{per_op_us:.1f} µs of CPU time per op (best times), {per_op_us * counter.n / 1e3:.0f} ms per step,
{op_share:.1f}% of the plain step's best CPU time (negative: below
the noise): differences below a few percent in the table are noise (ratios below 1 show its size).
Load average (1, 5, 15 min) at start {load_start}, at end {load_end}, on {os.cpu_count()} cores (the
benchmark itself keeps about 1-2 busy; more means other jobs shared the machine), so trust CPU-time
ratios and min ratios over median wall-time ratios.

What each configuration measures:
- `gpumem.profile` (exact): every storage the dispatcher sees, exact bytes, all seven
  categories, per-layer activations and temporaries, phase peaks, the memory-over-time timeline.
- `timeline=False`: the same numbers without the time series (no plot or trace).
- `mode='light'`: no dispatch mode, hooks only. Weights, gradients, optimizer state,
  activations (per layer) and inputs, equal to exact mode; on CUDA the allocator's true peak and
  per-layer temporaries from it; on CPU no temporaries (reported as not measured) and the peak
  of the measured categories only.
- empty TorchDispatchMode: a mode that only re-dispatches every op, the cost any tracker built
  on a dispatch mode (exact mode, MemTracker) pays before doing anything: exact mode's own work is
  its ratio over this one.
- MemTracker: the same storage tracking as exact mode, its own categories, per-module snapshots.
- torch.profiler: op events with allocation records (analysis happens afterwards).
The dispatch-mode tools pay per op (a Python call), so their ratio falls as ops get bigger
(larger batch, sequence or hidden size); light mode pays per module call.
{fake_notes}"""
    info = machine_info()
    info["load average at start / end"] = f"{load_start} / {load_end}"
    write_results(
        "profiler",
        "gpumem.profile overhead",
        [
            "configuration",
            "median wall ms",
            "min wall ms",
            "wall ratio",
            "min wall ratio",
            "median CPU ms",
            "CPU ratio",
            "min CPU ratio",
        ],
        rows,
        notes=notes,
        info=info,
        figures=figures,
    )


_FULL = "GPUMEM_FAKE_FULL_DISPATCH"
_CLI = [sys.executable, "-m", "gpumem", "profile", "llama", "--size", "70b", "--fake", "--full"]
_IMPORTS = [sys.executable, "-c", "import torch, torch._dynamo, gpumem.cli, gpumem.profiler.runner"]


def _comparable(rep) -> dict:
    d = rep.to_dict()
    d["timeline"] = {k: v for k, v in d["timeline"].items() if k != "t_ns"}
    d["spans"] = [{k: v for k, v in s.items() if not k.endswith("_ns")} for s in d["spans"]]
    return d


def _child(argv: list[str], full: bool) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system) and stdout of a fresh process."""
    import resource
    import subprocess

    env = {**os.environ, _FULL: "1" if full else "0"}
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - w0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), out


def _fake_70b(rounds: int) -> tuple[list[list[str]], list, str]:
    """The full fake Llama-2-70B profile (80 blocks, batch 2 x 4096 tokens, 2 AdamW steps, what
    ``gpumem profile llama --size 70b --fake`` runs): the fast path against the full dispatch
    (``GPUMEM_FAKE_FULL_DISPATCH=1``), interleaved in rotated order, in this process (CPU and
    wall time of ``profile_model``) and end to end in fresh processes (the command line); the
    two reports are checked equal field by field."""
    from gpumem.profiler.runner import profile_model

    kinds = [("fast path", False), ("full dispatch", True)]
    cpu: dict[str, list[float]] = {k: [] for k, _ in kinds}
    wall: dict[str, list[float]] = {k: [] for k, _ in kinds}
    reports = {}
    for r in range(rounds):
        for name, full in kinds[r % 2 :] + kinds[: r % 2]:
            os.environ[_FULL] = "1" if full else "0"
            w0, c0 = time.perf_counter(), time.process_time()
            rep = profile_model("llama", size="70b", fake=True)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
            reports[name] = _comparable(rep)
            del rep
    os.environ.pop(_FULL, None)
    if reports["fast path"] != reports["full dispatch"]:
        raise SystemExit("the fast path's report differs from the full dispatch's")
    cli = {name: _child(_CLI, full) for name, full in kinds}
    if cli["fast path"][2] != cli["full dispatch"][2]:
        raise SystemExit("gpumem profile prints different tables on the two paths")
    imports = _child(_IMPORTS, False)
    floor_rows, floor_figures, floor_note = _import_floor()
    phase_rows, phase_figures, phase_note = _fake_phases(profile_model)
    per_round = [f / s for f, s in zip(cpu["full dispatch"], cpu["fast path"], strict=True)]
    rows, figures = [], []
    for name, _ in kinds:
        what = f"fake Llama-2-70B, 2 AdamW steps, {name}"
        figures.append(figure(f"{what}: profile_model CPU", "s", cpu[name]))
        figures.append(figure(f"{what}: profile_model wall", "s", wall[name]))
        figures.append(value_figure(f"{what}: gpumem profile CPU", "s", cli[name][1]))
        figures.append(value_figure(f"{what}: gpumem profile wall", "s", cli[name][0]))
        ratio = "1.000x" if name == "full dispatch" else f"{statistics.median(per_round):.3f}x"
        rows.append(
            [
                f"{what}: profile_model (CLI: {cli[name][1]:.1f} s CPU, {cli[name][0]:.1f} s wall)",
                f"{statistics.median(wall[name]) * 1e3:.0f}",
                f"{min(wall[name]) * 1e3:.0f}",
                "-",
                "-",
                f"{statistics.median(cpu[name]) * 1e3:.0f}",
                f"full/fast {ratio}",
                f"full/fast {min(cpu['full dispatch']) / min(cpu[name]):.3f}x",
            ]
        )
    figures.append(figure("fake Llama-2-70B: full dispatch / fast path CPU", "x", per_round))
    figures.append(
        value_figure("python startup and imports (torch, dynamo, gpumem) CPU", "s", imports[1])
    )
    rows += floor_rows + phase_rows
    figures += floor_figures + phase_figures
    notes = f"""
The fake Llama-2-70B rows: the whole model (80 blocks, batch 2 x 4096 tokens, fp32, AdamW, 2
steps: what `gpumem profile llama --size 70b --fake` runs), {rounds} rounds of `profile_model` in
this process, the fast path and the full dispatch (`GPUMEM_FAKE_FULL_DISPATCH=1`) interleaved;
"full/fast": the full dispatch's CPU time over the fast path's in the same round (median), and
best over best. In brackets: the command line once per path in a fresh process, CPU (user +
system) and wall seconds; starting Python and importing torch, dynamo and gpumem alone costs
{imports[1]:.1f} s CPU ({imports[0]:.1f} s wall) of that. The two reports are equal field by
field (wall-clock times aside) and the two tables byte for byte, checked in the run.
{floor_note}{phase_note}"""
    return rows, figures, notes


# what `gpumem profile --fake` cannot go below: each line a fresh process, each adding imports
_FLOOR = [
    ("python startup", "pass"),
    ("+ import torch", "import torch"),
    ("+ import torch._dynamo", "import torch, torch._dynamo"),
    (
        "+ import gpumem (CLI, runner, models)",
        "import torch, torch._dynamo, gpumem.cli, gpumem.cli.profile, gpumem.profiler.runner, "
        "gpumem.models",
    ),
]


def _import_floor(rounds: int = 3) -> tuple[list[list[str]], list, str]:
    """CPU seconds of fresh processes that only import, interleaved over ``rounds``: torch, then
    torch._dynamo (``FakeTensorMode.__init__`` imports ``torch._dynamo.config``, and torch
    wraps every ``TorchDispatchMode.__torch_dispatch__`` in ``torch._disable_dynamo``, which
    imports dynamo on its first call), then gpumem's own modules."""
    cpu: dict[str, list[float]] = {name: [] for name, _ in _FLOOR}
    for _ in range(rounds):
        for name, code in _FLOOR:
            cpu[name].append(_child([sys.executable, "-c", code], False)[1])
    rows, figures = [], []
    for name, _ in _FLOOR:
        med = statistics.median(cpu[name])
        figures.append(figure(f"import floor: {name} CPU", "s", cpu[name]))
        rows.append(
            [
                f"import floor: {name} (fresh process)",
                "-",
                "-",
                "-",
                "-",
                f"{med * 1e3:.0f}",
                "-",
                "-",
            ]
        )
    note = f"""
Import floor ("import floor" rows, CPU of fresh processes, median of {rounds} interleaved
rounds): torch._dynamo comes with any TorchDispatchMode on torch 2.13 (FakeTensorMode imports
`torch._dynamo.config`; every mode's `__torch_dispatch__` is wrapped in `torch._disable_dynamo`),
so a fake profile pays it before its first op; gpumem's own modules add little.
"""
    return rows, figures, note


def _fake_phases(profile_model) -> tuple[list[list[str]], list, str]:
    """Where the CPU time of one in-process fake Llama-2-70B profile goes, from the progress
    callback's marks: each interval is charged to the work that starts at its first mark
    (build; a block's forward; the last block's forward with the head and loss until the first
    block backward; a block's backward; the optimizer step; the report)."""
    marks: list[tuple[float, str]] = []

    def tick(_done, _total=None, description=None):
        marks.append((time.process_time(), description or ""))

    c0 = time.process_time()
    rep = profile_model("llama", size="70b", fake=True, progress=tick)
    end = time.process_time()
    del rep
    spent: dict[str, float] = {}
    starts = [(c0, "building the model"), *marks]
    for (t, what), (t_next, _) in zip(starts, [*marks, (end, "")], strict=True):
        if "backward" in what:
            kind = "backward (blocks, embedding)"
        elif "forward" in what:
            kind = "forward (blocks, head, loss, head backward)"
        elif "optimizer" in what:
            kind = "optimizer steps (AdamW)"
        elif "buil" in what:
            kind = "build the fake model"
        else:
            kind = "report and the rest"
        spent[kind] = spent.get(kind, 0.0) + (t_next - t)
    total = end - c0
    rows, figures = [], []
    for kind, s in spent.items():
        figures.append(value_figure(f"fake Llama-2-70B phase: {kind} CPU", "s", s))
        rows.append(
            [
                f"fake Llama-2-70B, 2 steps, phase: {kind}",
                "-",
                "-",
                "-",
                "-",
                f"{s * 1e3:.0f}",
                f"{100 * s / total:.0f}% of {total:.1f} s",
                "-",
            ]
        )
    note = """
Phase rows: one more in-process fast-path profile, its CPU time split at the progress bar's
marks (a block's forward, a block's backward, the optimizer step); the share is of that run's
`profile_model` CPU time.
"""
    return rows, figures, note


if __name__ == "__main__":
    main()
