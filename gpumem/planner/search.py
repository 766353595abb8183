"""``gpumem.plan``: sweep every layout of a job, keep those that fit, rank them.

The sweep enumerates dp × tp × pp (× ep for MoE) × ZeRO stage × sequence parallel ×
micro-batch × recompute. Python builds one vector of peak terms per configuration (the
activation pieces are cached per (tp, sp, micro-batch, recompute), so this is cheap); numba
evaluates :func:`gpumem.estimator.peak.assemble` — the estimator's own formula, compiled — over
all of them. Numba is imported on first use, never by ``import gpumem``.

Ranking: a stated throughput proxy, the estimated time of one optimizer step (lower is better):

    step = compute · (1 + recompute) / (1 - bubble) + exposed communication

* compute = 6 · params · tokens_per_step / (GPUs · bf16 peak · 40 % MFU) — the same for every
  layout of a job; only the factors below tell layouts apart;
* recompute: selective +5 % (attention core), full +33 % (one more forward), every-K the same;
* pipeline bubble (1F1B): (pp − 1) / (micro-batches · vpp);
* communication per step: data-parallel gradient reduce-scatter + all-gather (2·P·bytes, ZeRO-3
  1.5× that: the ZeRO paper), tensor-parallel all-reduces of the activations (4 per layer per
  micro-batch), over NVLink inside a node and the network across nodes; half is assumed hidden
  behind compute.

Example:
    >>> result = plan("llama-2-70b", gpu="H100-80GB", n_gpus=64, seq_len=4096)
    >>> print(result.table())
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.calibrate.calibration import Calibration, split_calibration
from gpumem.calibrate.memory import category_scales
from gpumem.estimator import inputs as job_inputs
from gpumem.estimator import peak
from gpumem.estimator.api import estimate, resolve_alloc_conf
from gpumem.estimator.bill import Bill
from gpumem.estimator.frameworks.conventions import default_grads, engine, resolve_framework
from gpumem.estimator.frameworks.deepspeed import ZeroConfig
from gpumem.estimator.gpus import GPU, find_gpu
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.preset import PresetTerms
from gpumem.estimator.resolver import resolve_model
from gpumem.estimator.states import Training
from gpumem.planner.checkpoint_times import CheckpointTimes, checkpoint_times
from gpumem.planner.economics import (
    DEFAULT_PRICE_PER_GPU_HOUR,
    DEFAULT_RUN_HOURS,
    Economics,
    economics,
)
from gpumem.planner.margin import DEFAULT_HEADROOM, Margin
from gpumem.units import format_bytes

SWEPT_SOURCES = {
    "batch_size": "searched",
    "recompute": "searched",
    "grad_accum": "derived: global batch / (dp x micro-batch)",
}
"""The sources of a candidate's bill inputs that the sweep chose, not the caller."""

RECOMPUTE_COST = {"none": 0.0, "selective": 0.05, "full": 1 / 3}
MFU = 0.4
EXPOSED_COMM = 0.5


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its peak and its throughput proxy.

    ``total_bytes`` is the per-GPU peak; ``weight_bytes``, ``grad_bytes`` and ``optimizer_bytes``
    are the model states held at that peak (the sweep's own numbers, not recomputed).
    """

    layout: Layout
    micro_batch: int
    recompute: str
    grad_accum: int
    total_bytes: int
    step_seconds: float
    bubble: float
    comm_bytes: float
    weight_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0

    def describe(self) -> str:
        return (
            f"{self.layout.describe()} mb{self.micro_batch} ga{self.grad_accum} rc-{self.recompute}"
        )


@dataclass
class PlanResult:
    """What :func:`plan` found: fitting candidates, best first, and how much it searched."""

    model: ModelSpec
    gpu: GPU
    n_gpus: int
    candidates: list[Candidate]
    n_configs: int
    seconds: float
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    inputs: dict[str, Any] = field(default_factory=dict)
    """The job's inputs: seq_len, global batch, precision, optimizer and the searched
    micro-batches and recompute modes."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each of :attr:`inputs` came from (given, default, searched)."""
    calibration: Calibration | None = field(default=None, repr=False)
    """The calibration given to :func:`plan` (its reserve is already in :attr:`gpu`)."""
    alloc_note: str = ""
    """Why the caching allocator was not simulated (empty when it was)."""

    def reserved_line(self) -> str:
        """The best layout's allocated, reserved and unreleasable bytes under the plan's alloc
        conf, and what ``expandable_segments:True`` would save there."""
        if self.best is None:
            return ""
        b = self.bill()
        if b.peak_reserved_bytes is None:
            return f"reserved not simulated ({self.alloc_note or b.reserved_note})"
        line = (
            f"best layout: allocated {format_bytes(b.allocated_bytes)}, reserved "
            f"{format_bytes(b.peak_reserved_bytes)} (alloc_conf {b.alloc_conf}), "
            f"{format_bytes(b.unreleasable_bytes)} of it unreleasable"
        )
        conf = self.kwargs.get("alloc_conf")
        if isinstance(conf, AllocConf) and not conf.expandable_segments:
            e = self.bill(alloc_conf=dataclasses.replace(conf, expandable_segments=True))
            assert e.peak_reserved_bytes is not None
            line += (
                f"; with expandable_segments:True reserved {format_bytes(e.peak_reserved_bytes)}"
                f" (saves {format_bytes(b.peak_reserved_bytes - e.peak_reserved_bytes)}), "
                f"{format_bytes(e.unreleasable_bytes)} unreleasable"
            )
        return line

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def inputs_line(self) -> str:
        """``inputs: seq_len 4096 (given), global batch 256 (default: max(GPUs, 256)), ...``"""
        parts = [
            f"{k.replace('_', ' ')} {_show(self.inputs[k])} ({self.sources[k]})"
            for k in self.inputs
        ]
        return "inputs: " + ", ".join(parts)

    def inputs_json(self) -> dict[str, dict[str, Any]]:
        return {k: {"value": v, "source": self.sources[k]} for k, v in self.inputs.items()}

    def checkpoint_bytes(self) -> int | None:
        """What one rank of the best layout saves: its weights and optimizer state (fp32 master
        weights are optimizer state; gradients are not saved). None when nothing fits."""
        if self.best is None:
            return None
        states = self.bill().model_states
        return int(states["weights"] + states["optimizer"])

    def checkpoint_times(
        self,
        *,
        stall_s: float | None = None,
        persist_s: float | None = None,
        restart_s: float | None = None,
        startup_s: float | None = None,
    ) -> CheckpointTimes:
        """C, P and R for the best layout's checkpoint: given, predicted by the calibration, or
        the defaults (``gpumem.planner.checkpoint_times``)."""
        return checkpoint_times(
            self.calibration,
            checkpoint_bytes=self.checkpoint_bytes(),
            stall_s=stall_s,
            persist_s=persist_s,
            restart_s=restart_s,
            startup_s=startup_s,
        )

    def economics(
        self,
        *,
        mtbf_hours: float | None = None,
        preemption_rate: float | None = None,
        price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
        run_hours: float = DEFAULT_RUN_HOURS,
        times: CheckpointTimes | None = None,
    ) -> Economics:
        """Preemption economics of this job on :attr:`n_gpus` GPUs with the checkpoint times
        ``times`` (default: :meth:`checkpoint_times`, calibrated when a calibration was given).

        Example:
            >>> res = gpumem.plan("llama-2-70b", n_gpus=64, seq_len=4096,
            ...                   calibration="calibration.json")            # doctest: +SKIP
            >>> print(res.economics(mtbf_hours=6, run_hours=168).table())   # doctest: +SKIP
        """
        t = times or self.checkpoint_times()
        return economics(
            n_gpus=self.n_gpus,
            price_per_gpu_hour=price_per_gpu_hour,
            mtbf_hours=mtbf_hours,
            preemption_rate=preemption_rate,
            run_hours=run_hours,
            **t.values(),
        )

    def bill(self, candidate: Candidate | None = None, **overrides: Any) -> Bill:
        """The full estimator bill of a candidate (the best by default); ``overrides``
        replace the plan's estimator arguments (e.g. ``alloc_conf=``)."""
        c = candidate or self.best
        if c is None:
            raise ValueError(f"no layout of {self.model.name} fits {self.n_gpus} x {self.gpu.name}")
        kw = {**self.kwargs, **overrides}
        fw = resolve_framework(kw.get("framework"), c.layout, hf=self.model.is_hf)
        if engine(fw, c.layout) != "deepspeed":
            kw.pop("deepspeed", None)  # DeepSpeed's knobs apply to its layouts only
        bill = estimate(
            self.model,
            layout=c.layout,
            batch_size=c.micro_batch,
            recompute=c.recompute,
            grad_accum=c.grad_accum,
            gpu=self.gpu,
            **kw,
        )
        # the estimator sees these as passed in; here the sweep chose them
        return dataclasses.replace(bill, sources={**bill.sources, **SWEPT_SOURCES})

    def table(self, top: int = 10) -> str:
        head = (
            f"{self.model.name} on {self.n_gpus} x {self.gpu.name}: {len(self.candidates)} of "
            f"{self.n_configs} configurations fit (searched in {self.seconds * 1e3:.0f} ms)\n"
            + self.inputs_line()
        )
        if not self.candidates:
            return (
                head
                + "\nnothing fits: add GPUs (--min-gpus), recompute, ZeRO-3, a shorter seq_len, "
                "or less --headroom"
            )
        lines = [head, f"{'rank':<5}{'layout':<44}{'peak GiB':>10}{'step s':>9}{'bubble':>8}"]
        for i, c in enumerate(self.candidates[:top], 1):
            lines.append(
                f"{i:<5}{c.describe():<44}{c.total_bytes / 2**30:>10.2f}"
                f"{c.step_seconds:>9.2f}{c.bubble:>8.1%}"
            )
        lines.append(self.reserved_line())
        return "\n".join(lines)


def _show(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=1)
def _kernels():
    """Compile (or load from numba's on-disk cache) the sweep kernel on first use.

    The kernel lives in ``peak.py`` next to ``assemble``: numba keys its cache on the source
    file of the function it compiles, so an edit to the formula invalidates the sweep too.
    """
    import numba

    peak._assemble_jit = numba.njit(cache=True)(peak.assemble)
    return numba.njit(cache=True)(peak.sweep_rows)


def sweep(terms: np.ndarray, owner: np.ndarray, n_configs: int) -> np.ndarray:
    """Peak categories (weights..total, phase) of each configuration, numba-compiled."""
    return _kernels()(terms, owner, n_configs)


NUMBA_FROM_ROWS = 50_000
"""Below this many term rows the pure-Python ``assemble`` (tens of thousands of rows per
second) finishes before numba would have loaded its cached kernel (~1 s of imports and
registry set-up in a fresh process): a single `gpumem plan` stays well under a second."""


class PythonSweepNotice(UserWarning):
    """A large sweep ran in Python because numba is not installed (``gpumem[plan]``)."""


def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def evaluate(rows: list[list[float]], owner: list[int], n_configs: int) -> np.ndarray:
    """``sweep`` of the rows: the numba kernel for large sweeps, the same function in Python
    for small ones (identical results: one formula), and for large ones without numba."""
    if len(rows) >= NUMBA_FROM_ROWS:
        if not _numba_installed():
            warnings.warn(
                f"{len(rows)} term rows evaluated in Python, slower than compiled: numba is "
                "not installed (pip install 'gpumem[plan]'); the results are the same",
                PythonSweepNotice,
                stacklevel=2,
            )
        else:
            return sweep(
                np.asarray(rows, dtype=np.float64), np.asarray(owner, dtype=np.int64), n_configs
            )
    out = np.zeros((n_configs, peak.N_OUT), dtype=np.int64)
    best = [-1] * n_configs
    for x, c in zip(rows, owner, strict=True):
        res = peak.assemble(x)
        if res[peak.OUT_TOTAL] > best[c]:
            best[c] = res[peak.OUT_TOTAL]
            out[c] = res
    return out


LONG_CONTEXT = 32768  # from this many tokens per sample on, the sweep adds context parallelism


def plan(
    model: Any,
    *,
    gpu: str | GPU = "H100-80GB",
    n_gpus: int = 8,
    gpu_memory: str | int | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    precision: str | None = None,
    optimizer: str | None = None,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    recompute: tuple[str, ...] = ("none", "selective", "full"),
    zero: tuple[int, ...] = (0, 1, 2, 3),
    max_tp: int | None = None,
    framework: str | None = None,
    context_parallel: tuple[int, ...] | None = None,
    calibration: Any = None,
    progress: Any = None,
    headroom: str | int | float | Margin | None = None,
    alloc_conf: Any = None,
    **estimate_kwargs: Any,
) -> PlanResult:
    """Every layout of ``model`` on ``n_gpus`` that fits, ranked by the throughput proxy.

    Args:
        global_batch: sequences per optimizer step (default max(n_gpus, 256)); layouts whose
            dp × micro-batch does not divide it are skipped.
        max_tp: largest tensor-parallel degree (default: GPUs per node).
        framework: whose buffer conventions (default: each layout's, see
            ``gpumem.estimate``); layouts the framework cannot run are skipped.
        context_parallel: cp degrees to try (default: 1, and for sequences of at least 32k
            tokens also 2, 4, 8, 16 where they divide the GPUs: long contexts run that way).
        calibration: a ``gpumem.Calibration`` or a calibration.json path: the GPU gets the
            measured reserve, :meth:`PlanResult.economics` the measured checkpoint times, and
            with a ``memory`` section (``gpumem calibrate --memory``) the sweep scales each
            category by the fitted coefficients and :meth:`PlanResult.bill` is calibrated.
        progress: called as ``progress(done, total)`` while layouts are enumerated (a CLI
            progress bar).
        headroom: memory every GPU keeps free beyond the peak: a share (``"5%"``, ``0.05``)
            or a size (``"4GiB"``, bytes); default ``DEFAULT_HEADROOM`` (``gpumem.planner.margin``).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` every candidate's step is simulated under
            (as ``gpumem.estimate``: None reads the environment, False keeps the flat
            fragmentation share): a layout fits, and ties rank, on allocated plus what the
            caching allocator cannot release, plus the CUDA context and NCCL.
        estimate_kwargs: passed to the estimator (grads, attention, lora_rank, ...).
    """
    t0 = time.perf_counter()
    # what the caller passed is "given" in the plan, even a default's value
    given = job_inputs.given_inputs(precision=precision, optimizer=optimizer)
    precision = job_inputs.DEFAULT_PRECISION if precision is None else precision
    optimizer = job_inputs.DEFAULT_OPTIMIZER if optimizer is None else optimizer
    spec = resolve_model(model)
    cal, mem = split_calibration(calibration)
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    if cal is not None:
        g = cal.apply_to(g)
    conf, conf_note = resolve_alloc_conf(alloc_conf, g)
    if not isinstance(n_gpus, int) or isinstance(n_gpus, bool) or n_gpus <= 0:
        raise ValueError(f"n_gpus must be a positive integer, got {n_gpus!r}")
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch <= 0):
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    gb = global_batch or max(n_gpus, 256)
    if framework == "torchtitan":
        raise ValueError(
            "the planner does not sweep framework='torchtitan' (its peak terms are its own); "
            "estimate each layout with gpumem.estimate(..., framework='torchtitan')"
        )
    margin = Margin.parse(DEFAULT_HEADROOM if headroom is None else headroom)
    usable = g.total_bytes - margin.bytes_of(g.total_bytes)
    if framework is not None:
        resolve_framework(framework, Layout())  # an unknown name fails here, once
    if estimate_kwargs.get("deepspeed") is not None:  # once, checked; a stage in it is moot
        estimate_kwargs["deepspeed"] = ZeroConfig.from_dict(estimate_kwargs["deepspeed"])
    seq, seq_source = job_inputs.seq_len(spec, seq_len)
    if context_parallel is None:
        context_parallel = (1, 2, 4, 8, 16) if spec.is_decoder and seq >= LONG_CONTEXT else (1,)
    scale = category_scales(mem, spec, "cuda") if mem is not None else None
    job_kw = {
        k: v for k, v in estimate_kwargs.items() if k in ("attention", "dropout", "keep_logits")
    }
    jobs: dict[str, PresetTerms] = {}

    def job_for(fw: str, simulated: bool = False) -> PresetTerms:
        if (fw, simulated) not in jobs:
            grads = estimate_kwargs.get("grads") or default_grads(
                fw, Training(precision).master_bytes > 0
            )
            zero = None
            if fw in ("deepspeed", "transformers"):  # the Trainer runs ZeRO through DeepSpeed
                zero = ZeroConfig.from_dict(estimate_kwargs.get("deepspeed"))
                if zero.offload_param == "cpu":
                    raise ValueError("plan searches ZeRO stages; offload_param is ZeRO-3 only")
            training = Training(
                precision,
                optimizer,
                grads,
                estimate_kwargs.get("offload_optimizer", False),
                estimate_kwargs.get("lora_rank", 0),
                estimate_kwargs.get("base_quant"),
                deepspeed=zero,
            )
            jobs[fw, simulated] = PresetTerms(
                spec, training, g, seq, framework=fw, alloc_conf=conf if simulated else None,
                **job_kw,
            )  # fmt: skip
        return jobs[fw, simulated]

    training = job_for(resolve_framework(framework, Layout(), hf=spec.is_hf)).training
    shown = {
        "seq_len": (seq, seq_source),
        "global_batch": (gb, "given" if global_batch else "default: max(GPUs, 256)"),
        "micro_batch": (tuple(micro_batches), "searched"),
        "grad_accum": ("global batch / (dp x micro-batch)", "derived"),
        "recompute": (tuple(recompute), "searched"),
        "precision": (training.precision, "given" if "precision" in given else "default"),
        "optimizer": (training.optimizer, "given" if "optimizer" in given else "default"),
        "headroom": (
            f"{margin.describe(g.total_bytes)} kept free",
            "default" if headroom is None else "given",
        ),
    }
    extra = {
        "inputs": {k: v for k, (v, _) in shown.items()},
        "sources": {k: s for k, (_, s) in shown.items()},
        "calibration": cal,
        "alloc_note": conf_note,
    }
    # the bill of a candidate: the GPU above already carries the reserve; the memory fit rides
    bill_kwargs = dict(
        precision=precision if "precision" in given else None,
        optimizer=optimizer if "optimizer" in given else None,
        seq_len=seq_len,
        framework=framework,
        calibration=mem,
        alloc_conf=False if conf is None else conf,
        **estimate_kwargs,
    )
    configs, rows, owner = [], [], []
    tp_cap = max_tp or g.gpus_per_node
    grid = [
        (tp, pp, cp)
        for tp, pp, cp in itertools.product(_divisors(n_gpus), _divisors(n_gpus), context_parallel)
        if tp <= tp_cap and not n_gpus % (tp * pp * cp)
    ]
    for i, (tp, pp, cp) in enumerate(grid):
        if progress is not None:
            progress(i, len(grid))
        dp = n_gpus // (tp * pp * cp)
        eps = [e for e in _divisors(dp * cp * tp) if e <= spec.n_experts] if spec.is_moe else [1]
        for ep, z, sp, mb, rc in itertools.product(
            eps, zero, (False, True), micro_batches, recompute
        ):
            if (sp and tp == 1) or (z and dp * cp == 1) or gb % (dp * mb):
                continue
            try:
                lay = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=z, sp=sp, cp=cp)
                fw = resolve_framework(framework, lay, hf=spec.is_hf)
            except ValueError:
                continue
            if lay.errors(spec, seq_len=seq):
                continue
            ga = gb // (dp * mb)
            for x in job_for(fw).terms(lay, mb, rc, ga, None):
                if conf is not None:  # the allocated peak first: fragmentation only adds
                    x[peak.FRAG] = 0.0
                rows.append(x)
                owner.append(len(configs))
            configs.append((lay, mb, rc, ga, fw))
    if progress is not None:
        progress(len(grid), len(grid))
    if not configs:
        return PlanResult(spec, g, n_gpus, [], 0, time.perf_counter() - t0, bill_kwargs, **extra)
    res = evaluate(rows, owner, len(configs))
    if scale is not None:
        res = scaled_totals(res, scale)
    if conf is not None:
        res = _with_fragmentation(res, configs, lambda fw: job_for(fw, True), usable, scale)
    cands = []
    for (lay, mb, rc, ga, _), r in zip(configs, res, strict=True):
        total = int(r[peak.OUT_TOTAL])
        if total <= usable:
            step, bubble, comm = _proxy(spec, g, lay, mb, rc, ga, seq, training)
            states = {
                "weight_bytes": int(r[0]),
                "grad_bytes": int(r[1]),
                "optimizer_bytes": int(r[2]),
            }
            cands.append(Candidate(lay, mb, rc, ga, total, step, bubble, comm, **states))
    cands.sort(key=lambda c: (c.step_seconds, c.total_bytes))
    return PlanResult(
        spec, g, n_gpus, cands, len(configs), time.perf_counter() - t0, bill_kwargs, **extra
    )


def _with_fragmentation(
    res: np.ndarray, configs: list, job_for: Any, capacity: int, scale: dict | None
) -> np.ndarray:
    """The sweep's rows with the simulated caching allocator's fragmentation, for the
    configurations whose allocated peak fits (the rest cannot fit with more): the simulations
    are cached per layer shape (``step_trace``), so the survivors share a few hundred."""
    keep = [i for i in range(len(configs)) if res[i, peak.OUT_TOTAL] <= capacity]
    rows, owner = [], []
    for j, i in enumerate(keep):
        lay, mb, rc, ga, fw = configs[i]
        for x in job_for(fw).terms(lay, mb, rc, ga, None):
            rows.append(x)
            owner.append(j)
    if not keep:
        return res
    sim = evaluate(rows, owner, len(keep))
    out = res.copy()
    out[keep] = scaled_totals(sim, scale) if scale is not None else sim
    return out


def scaled_totals(res: np.ndarray, scale: dict[str, float]) -> np.ndarray:
    """The sweep's rows with each category scaled by a calibration's coefficients (the total
    recomputed; overhead kept)."""
    out = res.copy()
    cats = ("weights", "gradients", "optimizer", "activations", "communication", "temporary")
    total = out[:, peak.OUT_OVERHEAD].astype(np.float64)
    for k, c in enumerate(cats):
        col = np.minimum(out[:, k] * scale.get(c, 1.0), peak.LIMIT)
        out[:, k] = col.astype(np.int64)
        total += out[:, k]
    out[:, peak.OUT_TOTAL] = np.minimum(total, peak.LIMIT * 8).astype(np.int64)
    return out


def _proxy(
    spec: ModelSpec, g: GPU, lay: Layout, mb: int, rc: str, ga: int, seq: int, tr: Training
) -> tuple[float, float, float]:
    """(step seconds, bubble fraction, communication bytes per GPU) of the throughput proxy."""
    tokens = lay.dp * mb * ga * seq
    compute = 6 * spec.n_params * tokens / (lay.n_gpus * g.bf16_tflops * 1e12 * MFU)
    rc_cost = RECOMPUTE_COST.get(rc, RECOMPUTE_COST["full"])
    bubble = (lay.pp - 1) / (ga * lay.vpp) if lay.pp > 1 else 0.0
    bubble = min(bubble, 0.95)
    p_rank = spec.n_params / (lay.tp * lay.pp)
    replicas = lay.dp * lay.cp  # context-parallel ranks reduce gradients too
    dp_bytes = (
        2 * p_rank * tr.grad_bytes * (1.5 if lay.stage >= 3 else 1.0) if replicas > 1 else 0.0
    )
    tp_bytes = (
        4 * spec.n_layers / lay.pp * ga * mb * seq * spec.hidden * tr.compute_bytes
        if lay.tp > 1
        else 0.0
    )
    # context parallelism: every rank's K/V chunk travels the ring cp - 1 times forward, and
    # again with dK/dV in backward (~3 passes), per layer and micro-batch
    kv = 2 * spec.kv_heads * spec.dhead // min(lay.tp, max(spec.kv_heads, 1))
    cp_bytes = (
        3 * (lay.cp - 1) * spec.n_layers / lay.pp * ga * mb * seq / lay.cp * kv * tr.compute_bytes
        if lay.cp > 1
        else 0.0
    )
    intra = g.intra_gbps * 1e9 or g.inter_gbps * 1e9
    dp_bw = intra if lay.n_gpus <= g.gpus_per_node else g.inter_gbps * 1e9
    cp_bw = intra if lay.tp * lay.cp <= g.gpus_per_node else g.inter_gbps * 1e9
    comm = dp_bytes / dp_bw + tp_bytes / intra + cp_bytes / cp_bw
    step = compute * (1 + rc_cost) / (1 - bubble) + EXPOSED_COMM * comm
    return step, bubble, dp_bytes + tp_bytes + cp_bytes


def min_gpus(
    model: Any, *, gpu: str | GPU = "H100-80GB", max_gpus: int = 4096, **kwargs: Any
) -> PlanResult:
    """The smallest GPU count (powers of two up to ``max_gpus``, then refined over multiples
    of the node size) with at least one fitting layout."""
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, kwargs.pop("gpu_memory", None))
    n, last = 1, None
    while n <= max_gpus:
        res = plan(model, gpu=g, n_gpus=n, **kwargs)
        if res.candidates:
            lo = n // 2 + 1 if n > 1 else 1
            step = g.gpus_per_node if lo > g.gpus_per_node else 1
            for m in range(max(lo, step) - (max(lo, step) % step or 0), n, step):
                if m <= 0 or m < lo:
                    continue
                r = plan(model, gpu=g, n_gpus=m, **kwargs)
                if r.candidates:
                    return r
            return res
        last = res
        n *= 2
    assert last is not None
    return last
