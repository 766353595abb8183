"""``gpumem demo``: what gpumem is for, in four parts, offline, on built-in models.

1. Where a training step's memory goes: a small GPT profiled with ``gpumem.profile``, its
   per-layer table and a chart (per-layer bars by category, memory over time by phase).
2. Does Llama-2-70B fit? The model-state wall, why one 80 GB GPU cannot hold it, and the
   cheapest layouts on 64 H100-80GB from the planner.
3. What does a preemption cost? This machine's checkpoint stall and persist time, measured with
   the real Checkpointer, priced for that 70B job on spot capacity; then the capacity decision
   on a real AWS spot trace: spot, on-demand or a policy that mixes them, under a deadline.
4. Does resume work? A small model trained for real, stopped by SIGTERM mid-run, checkpointed
   inside its grace period, restarted and resumed: its loss curve against an uninterrupted run,
   bit for bit.

Everything is written under one directory (``out``): the charts, ``calibration.json`` and the
checkpoints of part 4 (the demo clears only its own files there). ``quick=True`` does the same
with fewer steps and smaller measurements (for CI).

Modules (the four parts are in this one):

    train   the trainer part 4 runs, preempts and resumes (``python -m gpumem.demo.train``)

Example:
    >>> from gpumem.demo import run_demo
    >>> result = run_demo("gpumem-demo", quick=True)              # doctest: +SKIP
    >>> result.bit_identical, result.profile_chart                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumem._plots import pyplot
from gpumem.units import format_bytes

GPU, N_GPUS, MODEL, SEQ = "H100-80GB", 64, "llama-2-70b", 4096
MTBF_HOURS, RUN_HOURS, PRICE, PREEMPTED_AT = 24.0, 168.0, 3.0, 47.0
# part 3's real market: AWS spot availability (Can't Be Late's traces, gpumem/data/README.md),
# spot at 0.42x on-demand (p5en.48xlarge $26.57 vs $63.30 an hour, us-east-2, 2026-08)
SPOT_TRACE = Path(__file__).resolve().parent.parent / "data" / "spot-aws-us-west-2a-v100x8.json"
SPOT_RATIO, DEADLINE_HOURS = 0.42, 200.0
REQUEUE_EXIT_CODE = 143  # PreemptionGuard's default after a durable final checkpoint


@dataclass
class DemoResult:
    """What the demo found (for tests and callers); the story itself is printed."""

    out: Path
    profile_chart: Path | None = None
    loss_chart: Path | None = None
    calibration: Path | None = None
    peak_bytes: int = 0
    cluster_state_bytes: int = 0
    best_layout: str = ""
    interval_s: float = 0.0
    stall_s: float = 0.0
    persist_s: float = 0.0
    decision: str = ""
    decision_cost: float = 0.0
    preempted_exit_code: int | None = None
    resumed_from: int | None = None
    losses: list[str] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def bit_identical(self) -> bool:
        return bool(self.losses) and self.losses == self.reference


@dataclass(frozen=True)
class _Sizes:
    calibrate_sizes: tuple[int, ...] | None  # None: gpumem calibrate's defaults
    calibrate_repeat: int
    steps: int
    sigterm_at: int


# the defaults reach where bandwidth dominates: 16-64 MiB put a 28 GiB restore at 175 s, not 14 s
FULL = _Sizes(None, 2, 30, 12)
QUICK = _Sizes((4 << 20, 16 << 20), 1, 12, 7)

Echo = Callable[[str], None]
Bar = Callable[[str], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _no_bar(_: str) -> Iterator[Callable[..., None]]:
    yield lambda *a, **k: None


def run_demo(
    out: str | Path = "gpumem-demo",
    *,
    quick: bool = False,
    echo: Echo = print,
    bar: Bar = _no_bar,
) -> DemoResult:
    """Run the four parts, printing the story through ``echo``; files go under ``out``.

    Args:
        out: the directory for the demo's files (created if missing).
        quick: fewer steps and smaller measurements.
        bar: ``bar(description)`` is a context manager yielding ``update(done, total)`` (the CLI
            passes a progress bar on a terminal).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if quick else FULL
    result = DemoResult(out=out.resolve())
    parts = (
        ("profile", lambda: _profile(result, echo)),
        ("estimate", lambda: _estimate(result, echo)),
        ("preemption", lambda: _preemption(result, sizes, echo, bar)),
        ("resume", lambda: _resume(result, sizes, echo, bar)),
    )
    for name, part in parts:
        t0 = time.perf_counter()
        part()
        result.seconds[name] = time.perf_counter() - t0
        echo(f"    ({result.seconds[name]:.1f} s)\n")
    _summary(result, echo)
    return result


def _title(echo: Echo, n: int, text: str) -> None:
    echo(f"[{n}/4] {text}")
    echo("-" * (len(text) + 6))


# -- 1. profile ----------------------------------------------------------------------------


def _profile(result: DemoResult, echo: Echo) -> None:
    import torch
    import torch.nn.functional as F

    import gpumem
    from gpumem.models import build_model, example_batch

    _title(echo, 1, "Where does a training step's memory go?  gpumem.profile")
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny", hidden_size=128, num_layers=4, num_heads=4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = example_batch(model.config, batch_size=8, seq_len=128)
    n_params = sum(p.numel() for p in model.parameters())
    echo(
        f"A small GPT ({n_params / 1e6:.2f} M parameters, 4 layers, fp32, AdamW), two training "
        "steps of 8 x 128 tokens on the CPU, inside:"
    )
    echo("    with gpumem.profile(model, optimizer=opt) as prof:")
    echo("        loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); ...")
    with gpumem.profile(model, optimizer=opt) as prof:
        for _ in range(2):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, loss
    rep = prof.report()
    echo("")
    echo(rep.table(depth=2))
    at = rep.at_peak
    echo("")
    echo(
        f"Every byte is counted as it is allocated and freed. The peak, "
        f"{format_bytes(rep.peak_bytes)} in the {rep.peak_phase} of step {rep.peak_step}, holds "
        f"{format_bytes(at['weights'] or 0)} of weights, {format_bytes(at['optimizer'] or 0)} of "
        f"AdamW state (two fp32 moments per parameter) and {format_bytes(at['activations'] or 0)}"
        " of activations saved for backward."
    )
    result.profile_chart = rep.plot(result.out / "profile.png")
    result.peak_bytes = rep.peak_bytes
    echo(f"chart: {result.profile_chart}  (per-layer bars by category; memory over time by phase)")


# -- 2. estimate and plan ------------------------------------------------------------------


def _estimate(result: DemoResult, echo: Echo) -> None:
    import gpumem
    from gpumem.estimator import find_gpu

    _title(echo, 2, "Does Llama-2-70B fit?  gpumem.estimate and gpumem.plan")
    gpu = find_gpu(GPU)
    one = gpumem.estimate(MODEL, seq_len=SEQ, gpu=GPU)
    states = one.cluster_model_state_bytes
    per_param = states / one.n_params
    echo(
        f"Llama-2-70B has {one.n_params:,} parameters. Mixed-precision training with AdamW keeps "
        f"{per_param:.0f} bytes per parameter (bf16 weights 2 + bf16 gradients 2 + fp32 master "
        f"weights and two Adam moments 12): {states / 1e12:.2f} TB of model state, before a "
        "single activation."
    )
    echo(
        f"One {GPU} holds {format_bytes(gpu.total_bytes)}: the bf16 weights alone are "
        f"{format_bytes(one.per_gpu['weights'])}. On one GPU the step would need "
        f"{format_bytes(one.per_gpu['total'])}:"
    )
    echo("")
    echo(one.table())
    echo("")
    echo(
        f"So the state must be sharded. The planner sweeps every data/tensor/pipeline-parallel "
        f"layout x ZeRO stage x micro-batch x recompute on {N_GPUS} x {GPU} at {SEQ} tokens, "
        "keeps those that fit and ranks them by estimated step time (on a fixed number of GPUs "
        "the fastest step is the cheapest):"
    )
    res = gpumem.plan(MODEL, gpu=GPU, n_gpus=N_GPUS, seq_len=SEQ)
    echo("")
    echo(res.table(5))
    best = res.best
    assert best is not None
    result.cluster_state_bytes = states
    result.best_layout = best.describe()
    echo(
        f"\nThe best, {best.describe()}, peaks at {format_bytes(best.total_bytes)} per GPU of "
        f"{format_bytes(gpu.total_bytes)}."
    )


# -- 3. preemption economics -----------------------------------------------------------------


def _preemption(result: DemoResult, sizes: _Sizes, echo: Echo, bar: Bar) -> None:
    import gpumem
    from gpumem.calibrate import measure
    from gpumem.calibrate.checkpoint_cost import default_sizes
    from gpumem.planner import realised

    _title(echo, 3, "What does a preemption cost?  gpumem.calibrate and the planner")
    chosen = sizes.calibrate_sizes or default_sizes(result.out)
    shown = ", ".join(format_bytes(s) for s in chosen)
    echo(
        f"Checkpointing this machine for real: training states of {shown} saved with "
        f"gpumem.Checkpointer into {result.out}, {sizes.calibrate_repeat} round(s) each, timing "
        "the training stall C, the time until the checkpoint is durable P and the restore."
    )
    with bar("measuring checkpoints") as update:
        cal = measure(
            result.out,
            list(chosen),
            repeat=sizes.calibrate_repeat,
            warmup=1,
            progress=update,
        )
    result.calibration = cal.save(result.out / "calibration.json")
    c = cal.checkpoint
    assert c is not None
    for p in c.points:
        echo(
            f"    {format_bytes(p.nbytes):>10}: stall {p.median('overlap_stall_s'):.3f} s, "
            f"durable after {p.median('durable_s'):.3f} s, restore {p.median('restore_s'):.3f} s"
        )
    res = gpumem.plan(MODEL, gpu=GPU, n_gpus=N_GPUS, seq_len=SEQ, calibration=cal)
    times = res.checkpoint_times()
    result.stall_s, result.persist_s = times.stall_s, times.persist_s
    echo("")
    best = res.best.describe() if res.best else "-"
    echo(
        f"The fitted lines predict the checkpoint of one GPU of {best} "
        f"({format_bytes(res.checkpoint_bytes() or 0)}: its weights and optimizer state):"
    )
    for line in times.lines():
        echo(f"    {line.strip()}")
    e = res.economics(
        mtbf_hours=MTBF_HOURS, run_hours=RUN_HOURS, price_per_gpu_hour=PRICE, times=times
    )
    result.interval_s = e.interval_s
    echo("")
    echo(
        f"Priced for a {RUN_HOURS:g} h run on {N_GPUS} spot H100s at ${PRICE:g}/GPU-h that are "
        f"preempted about once a day (MTBF {MTBF_HOURS:g} h, at random):"
    )
    echo(e.table())
    loss = realised(
        hours=PREEMPTED_AT,
        n_gpus=N_GPUS,
        price_per_gpu_hour=PRICE,
        mtbf_hours=MTBF_HOURS,
        **times.values(),
    )
    echo("")
    echo(f"And the night it happens: {loss.line()}.")
    _capacity_decision(result, res, echo)
    echo(f"calibration: {result.calibration}  (use it: gpumem plan ... --calibration FILE)")


def _capacity_decision(result: DemoResult, res: Any, echo: Echo) -> None:
    """The same job priced on a real spot market: the decision the planner makes."""
    from gpumem.planner.capacity import Capacity
    from gpumem.planner.decision import decide, layout_jobs
    from gpumem.planner.traces import load_trace

    spot = Capacity.from_trace(
        load_trace(SPOT_TRACE), PRICE * SPOT_RATIO, name="spot us-west-2a p3.16xlarge", notice_s=120
    )
    od = Capacity.on_demand(PRICE)
    jobs = layout_jobs(res, run_hours=RUN_HOURS, deadline_h=DEADLINE_HOURS, top=1)
    warn = res.checkpoint_times().extrapolation_warning
    d = decide(jobs, [spot, od], warnings=(warn,) if warn else ())
    result.decision = d.best.policy
    result.decision_cost = d.best.prediction.expected_cost
    echo("")
    echo(
        f"But spot capacity also goes away for hours. Priced on a real AWS spot market (8 x V100 "
        f"in us-west-2a, Oct-Nov 2022: available {spot.availability.fraction:.0%} of the time), "
        f"spot at ${PRICE * SPOT_RATIO:.2f}/GPU-h (0.42x on-demand, AWS's p5en ratio), "
        f"on-demand ${PRICE:g}, a {DEADLINE_HOURS:g} h deadline:"
    )
    echo(d.table(top=4))


# -- 4. preempted and resumed -----------------------------------------------------------------


def _trainer(ckpt: Path, steps: int, losses: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpumem.demo.train", str(ckpt), str(steps), str(losses), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, what: str) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    if proc.returncode not in (0, REQUEUE_EXIT_CODE):
        tail = " ".join(err.strip().splitlines()[-3:])
        raise RuntimeError(f"the {what} trainer failed (exit {proc.returncode}): {tail}")
    return proc.returncode, out, err


def _resume(result: DemoResult, sizes: _Sizes, echo: Echo, bar: Bar) -> None:
    _title(echo, 4, "Does resume work?  gpumem.Checkpointer and gpumem.PreemptionGuard")
    out = result.out
    runs = {name: (out / f"ckpts-{name}", out / f"losses-{name}.txt") for name in ("ref", "job")}
    for ckpt, losses in runs.values():  # only the demo's own files from an earlier run
        shutil.rmtree(ckpt, ignore_errors=True)
        losses.unlink(missing_ok=True)
    n, k = sizes.steps, sizes.sigterm_at
    echo(
        f"A small GPT trained for real, {n} steps with dropout, AdamW and a cosine schedule, "
        f"checkpointing every 5 steps. At step {k} the trainer sends itself SIGTERM, as a "
        "scheduler does before it takes the machine; PreemptionGuard saves a final checkpoint "
        "inside the grace period and exits 143, the requeue code. The job then restarts and "
        "resumes. The same job also trains without interruption, for reference."
    )
    (ref_ckpt, ref_losses), (job_ckpt, job_losses) = runs["ref"], runs["job"]
    with bar("training") as update:
        update(0, 3)
        job = _trainer(job_ckpt, n, job_losses, "--sigterm-at", str(k))
        # the reference trains here meanwhile: one process start fewer
        from gpumem.demo import train

        with contextlib.redirect_stdout(None):
            train.main([str(ref_ckpt), str(n), str(ref_losses)])
        update(1, 3)
        code, _, stderr = _finish(job, "preempted")
        update(2, 3)
        result.preempted_exit_code = code
        stop = next((line for line in stderr.splitlines() if "gpumem: SIG" in line), "")
        _, restart_out, _ = _finish(_trainer(job_ckpt, n, job_losses), "restarted")
        update(3, 3)
    result.resumed_from = int(restart_out.split()[1]) if restart_out.startswith("start") else None
    echo(f"    first run : {stop.strip() or f'exit {code}'}")
    echo(f"    exit code : {code}")
    echo(f"    restarted : resumed from the checkpoint of step {result.resumed_from}")
    result.losses = [line.split()[1] for line in job_losses.read_text().splitlines()]
    result.reference = [line.split()[1] for line in ref_losses.read_text().splitlines()]
    echo("")
    echo(f"    {'step':>4}  {'uninterrupted':>13}  {'preempted+resumed':>17}  same bits")
    for i, (a, b) in enumerate(zip(result.reference, result.losses, strict=False), 1):
        mark = "yes" if a == b else "NO"
        note = "  <- SIGTERM, final checkpoint, restart" if i == k else ""
        echo(f"    {i:>4}  {float.fromhex(a):>13.6f}  {float.fromhex(b):>17.6f}  {mark}{note}")
    same = sum(a == b for a, b in zip(result.reference, result.losses, strict=False))
    verdict = "bit-identical" if result.bit_identical else "NOT identical"
    echo(
        f"\n{same} of {len(result.reference)} losses have the same bits: the resumed curve is "
        f"{verdict} to the uninterrupted one (model, optimizer, schedule, data position and RNG "
        "all came back)."
    )
    result.loss_chart = _loss_chart(result, k)
    echo(f"chart: {result.loss_chart}")
    echo(f"checkpoints: {job_ckpt}  (try: gpumem ckpt ls {job_ckpt})")


def _loss_chart(result: DemoResult, k: int) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = range(1, len(result.reference) + 1)
    ax.plot(steps, [float.fromhex(v) for v in result.reference], lw=3, label="uninterrupted")
    ax.plot(
        range(1, len(result.losses) + 1),
        [float.fromhex(v) for v in result.losses],
        "k--",
        lw=1,
        label=f"preempted at step {k}, resumed",
    )
    ax.axvline(k, color="red", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    # above the axes: where the resume is exact the curves coincide, nothing may hide them
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, borderaxespad=0, frameon=False)
    fig.tight_layout()
    path = result.out / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _summary(result: DemoResult, echo: Echo) -> None:
    total = sum(result.seconds.values())
    echo(f"Done in {total:.0f} s. Files in {result.out}:")
    for path in (result.profile_chart, result.calibration, result.loss_chart):
        if path is not None:
            echo(f"    {path}")
    echo(
        "Next: `gpumem profile gpt2 --plot p.png`, `gpumem estimate llama-2-70b --gpus 64 --tp 8 "
        "--zero 1 --plot bill.png`, `gpumem plan llama-2-70b --gpus 64 --mtbf-hours 24 "
        "--slurm job.sbatch`, `gpumem doctor`."
    )


__all__ = ["DemoResult", "run_demo"]
