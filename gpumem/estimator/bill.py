"""The ``Bill``: the per-GPU memory bill of a training job, and how peak terms become one.

Example:
    >>> import gpumem
    >>> layout = gpumem.Layout(dp=8, tp=8, zero=1)
    >>> bill = gpumem.estimate("llama-2-70b", seq_len=4096, layout=layout)
    >>> bill.fits, bill.per_gpu["total"]
    >>> print(bill.table())
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator import activations as act
from gpumem.estimator import inputs as job_inputs
from gpumem.estimator import peak
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.states import Training
from gpumem.estimator.terms import offload_host_bytes, steady_states
from gpumem.units import format_bytes

CATEGORIES = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "communication",
    "temporary",
    "overhead",
    "total",
)
PHASES = ("backward start", "backward end", "optimizer step", "forward end")
CAPTURE_PHASE = "CUDA-graph capture"
"""The phase of a peak that Megatron's CUDA-graph capture decides (``cuda_graphs.py``)."""


@dataclass
class Bill:
    """The memory bill of the most loaded GPU, in integer bytes, and whether it fits.

    Attributes:
        n_params: parameters of the whole model.
        per_gpu: bytes by category at the peak of the most loaded rank (profiler categories).
        fits: ``per_gpu["total"] <= gpu.total_bytes`` (allocated + the caching allocator's
            unreleasable fragmentation + CUDA context + NCCL; see ``unreleasable_bytes``).
        headroom_bytes: capacity minus total (negative when it does not fit).
        cluster_model_state_bytes: unique weights + gradients + optimizer state of the job.
        model_states: per-GPU weights/gradients/optimizer outside any phase (steady state).
        phase: the moment of the peak (backward start / end, optimizer step).
        stage: the pipeline stage that is most loaded.
        framework: whose buffer conventions the bill follows (megatron, deepspeed, fsdp2,
            torch; see ``frameworks/conventions.py``).
        pipeline_ranks: one Bill per pipeline rank (first to last); this bill is the worst of
            them and decides ``fits``. Without pipelining, the one rank's bill.
        items: the itemised activations of one layer (one micro-batch), for the table.
        host_bytes: pinned host memory per node that offloading needs (0 without; one rule
            for every spelling and both paths: ``terms.offload_host_bytes``; DeepSpeed's own
            estimator adds half again as headroom).
        peak_reserved_bytes: what PyTorch's caching allocator reserves at its peak with ample
            memory (``reserved_bytes.all.peak``), simulated (``step_trace.py``): the allocated
            peak plus ``fragmentation_bytes``; None when not simulated (CPU, an nn.Module, an
            alloc conf the simulator does not reproduce).
        fragmentation_bytes: that reserved peak minus the allocated peak.
        unreleasable_bytes: the part of the fragmentation the allocator cannot give back when
            the GPU fills (it frees cached segments and retries before an OOM), inside
            ``per_gpu["overhead"]`` with the CUDA context and NCCL: ``per_gpu["total"]`` =
            allocated + this + context + NCCL decides ``fits``. Without the simulator, the
            flat ``gpu.fragmentation`` share of the allocated peak.
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` simulated (``"default"``: none set).
    """

    model: ModelSpec
    layout: Layout
    training: Training
    gpu: GPU
    n_params: int
    per_gpu: dict[str, int]
    fits: bool
    headroom_bytes: int
    cluster_model_state_bytes: int
    model_states: dict[str, int]
    phase: str
    stage: int
    framework: str = "torch"
    pipeline_ranks: list[Bill] = field(default_factory=list, repr=False)
    calibration: dict[str, Any] | None = field(default=None, repr=False)
    """Set when calibrated: per category the uncalibrated bytes and the fit's residual."""
    inputs: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    """Where each of the shown inputs (seq_len, micro-batch, ...) came from: given, default."""
    items: list[act.Item] = field(default_factory=list, repr=False)
    held_logits: int = 0
    """Bytes of ``per_gpu["activations"]`` that are logits the loop holds, not saved by autograd."""
    input_bytes: int = 0
    """Bytes of ``per_gpu["activations"]`` that are the model's input (token ids)."""
    host_bytes: int = 0
    peak_reserved_bytes: int | None = None
    fragmentation_bytes: int = 0
    unreleasable_bytes: int = 0
    alloc_conf: str | None = None
    reserved_note: str = ""
    """Why reserved memory was not simulated, when it was asked for and could not be."""

    @property
    def allocated_bytes(self) -> int:
        """The allocated peak: every category but overhead."""
        return self.per_gpu["total"] - self.per_gpu["overhead"]

    def profiler_categories(self, categories: tuple[str, ...] | None = None) -> dict[str, int]:
        """The peak in ``gpumem.profile``'s categories, to compare with ``rep.at_peak``.

        The one place where the bill's categories map onto the profiler's. The bill follows the
        issue's convention (logits and inputs under activations); the profiler counts only what
        autograd saves as activations, the held logits as temporary and the model's input as
        inputs. Overhead (context, NCCL, fragmentation) is outside the profiler's count and left
        out of ``total`` here. ``communication`` stays its own category where the profiler has
        it and joins ``temporary`` where it does not (profilers before the ``communication``
        category counted gather and bucket buffers as temporary).

        Args:
            categories: the profiler's category names (default: those of
                ``gpumem.profiler.categories`` when it is imported, else with communication).
        """
        if categories is None:
            prof = sys.modules.get("gpumem.profiler.categories")
            categories = getattr(prof, "CATEGORIES", ("communication",))
        p = self.per_gpu
        out = {c: p[c] for c in ("weights", "gradients", "optimizer")}
        out["activations"] = p["activations"] - self.held_logits - self.input_bytes
        out["temporary"] = p["temporary"] + self.held_logits
        if "communication" in categories:
            out["communication"] = p["communication"]
        else:
            out["temporary"] += p["communication"]
        out["inputs"] = self.input_bytes
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        """The public keys (what ``gpumem estimate --json`` prints): inputs (value and source
        of seq_len, batch_size, grad_accum, recompute, precision, optimizer), n_params,
        framework, per_gpu, fits, headroom_bytes, cluster_model_state_bytes, and per pipeline
        rank its stage, per_gpu, fits and phase; with a memory calibration, its record; with
        offload, host_bytes_per_node."""
        out: dict[str, Any] = {
            "inputs": job_inputs.as_json(self.inputs, self.sources),
            "n_params": self.n_params,
            "framework": self.framework,
            "per_gpu": dict(self.per_gpu),
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "cluster_model_state_bytes": self.cluster_model_state_bytes,
            "pipeline_ranks": [
                {"stage": r.stage, "per_gpu": dict(r.per_gpu), "fits": r.fits, "phase": r.phase}
                for r in self.pipeline_ranks
            ],
        }
        if self.host_bytes:  # offload's pinned host memory
            out["host_bytes_per_node"] = self.host_bytes
        out["reserved"] = self.reserved_dict()
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out

    def reserved_dict(self) -> dict[str, Any]:
        """allocated / reserved / fragmentation bytes and the alloc conf (JSON's ``reserved``)."""
        return {
            "allocated_bytes": self.allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "unreleasable_bytes": self.unreleasable_bytes,
            "required_reserved_bytes": self.allocated_bytes + self.unreleasable_bytes,
            "alloc_conf": self.alloc_conf,
            "simulated": self.peak_reserved_bytes is not None,
            **({"note": self.reserved_note} if self.reserved_note else {}),
        }

    def reserved_lines(self) -> list[str]:
        """The allocated, reserved and fragmentation lines of the table."""
        alloc = self.allocated_bytes
        if self.peak_reserved_bytes is None:
            how = self.reserved_note or "not simulated"
            return [
                f"allocated {format_bytes(alloc)}; reserved not simulated ({how}): "
                f"fragmentation as {format_bytes(self.unreleasable_bytes)} "
                f"({self.gpu.fragmentation:.0%} of allocated) in overhead"
            ]
        frag = self.fragmentation_bytes
        return [
            f"allocated {format_bytes(alloc)}, reserved {format_bytes(self.peak_reserved_bytes)} "
            f"(simulated caching allocator, alloc_conf {self.alloc_conf}), fragmentation "
            f"{format_bytes(frag)} ({100 * frag / max(alloc, 1):.1f}%)",
            f"of which {format_bytes(self.unreleasable_bytes)} cannot be released when the GPU "
            "fills (in overhead; cached segments are freed and retried before an OOM)",
        ]

    def inputs_line(self) -> str:
        """``inputs: seq_len 4096 (default: the model's context), micro-batch 1 (default), ...``"""
        return "inputs: " + job_inputs.describe(self.inputs, self.sources)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self, markdown: bool = False) -> str:
        """The bill as a text (or Markdown) table with GiB and share of the total."""
        total = self.per_gpu["total"]
        rows = [(c, self.per_gpu[c]) for c in CATEGORIES]
        head = (
            f"{self.model.name}: {self.n_params / 1e9:.2f} B params, {self.training.precision}, "
            f"{self.training.optimizer}, {self.layout.describe()} on {self.gpu.name}, "
            f"{self.framework} conventions (peak at {self.phase}, stage {self.stage})"
        )
        verdict = (
            f"{'fits' if self.fits else 'does NOT fit'}: headroom "
            f"{format_bytes(self.headroom_bytes)} of {format_bytes(self.gpu.total_bytes)}"
        )
        if self.host_bytes:
            verdict += f"; offload: {format_bytes(self.host_bytes)} pinned host memory per node"
        if markdown:
            lines = [
                f"**{head}**",
                "",
                self.inputs_line(),
                "",
                "| category | bytes | GiB | share |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| {c} | {b} | {b / 2**30:.2f} | {100 * b / max(total, 1):.1f}% |" for c, b in rows
            ]
            return "\n".join([*lines, "", *self.reserved_lines(), "", verdict])
        lines = [head, self.inputs_line(), f"{'category':<12}{'bytes':>18}{'GiB':>10}{'share':>8}"]
        lines += [
            f"{c:<12}{b:>18,}{b / 2**30:>10.2f}{100 * b / max(total, 1):>7.1f}%" for c, b in rows
        ]
        return "\n".join([*lines, *self.reserved_lines(), verdict])

    def __str__(self) -> str:
        return self.table()

    def pipeline_table(self) -> str:
        """The bill of every pipeline rank side by side (GiB), the worst marked."""
        ranks = self.pipeline_ranks or [self]
        width = max(16, *(max(len(f"rank {r.stage}"), len(r.phase)) + 2 for r in ranks))
        head = f"{'category':<14}" + "".join(f"{'rank ' + str(r.stage):>{width}}" for r in ranks)
        lines = [
            f"{self.model.name}, {self.layout.describe()}, {self.framework} conventions: "
            f"per pipeline rank (GiB); rank {self.stage} is the worst",
            head,
        ]
        for c in CATEGORIES:
            lines.append(f"{c:<14}" + "".join(f"{r.per_gpu[c] / 2**30:>{width}.2f}" for r in ranks))
        lines.append(f"{'phase':<14}" + "".join(f"{r.phase:>{width}}" for r in ranks))
        lines.append(
            f"{'fits':<14}" + "".join(f"{'yes' if r.fits else 'NO':>{width}}" for r in ranks)
        )
        return "\n".join(lines)


def make_bill(
    model: Any,
    n_params: int,
    terms_by_stage: list[list[float]],
    stages: list[int],
    capture_by_stage: list[list[float]] | None = None,
    **fields: Any,
) -> Bill:
    """The Bill of the most loaded pipeline rank, with every rank's own bill.

    Args:
        terms_by_stage: peak terms of the ranks in ``stages`` (every rank for an estimate).
        capture_by_stage: the same ranks' terms at Megatron's CUDA-graph capture, if any: a
            rank's peak is the larger of the two views (its phase then ``CAPTURE_PHASE``), its
            steady figures (``model_states``) always a step's.
    """
    gpu = fields["gpu"]
    simulated = fields.get("alloc_conf") is not None
    per_node = min(gpu.gpus_per_node, fields["layout"].n_gpus)
    ranks = []
    captures: list[list[float] | None] = [None] * len(stages)
    if capture_by_stage is not None:
        captures = list(capture_by_stage)
    for i, step_x, capture_x in zip(stages, terms_by_stage, captures, strict=True):
        x, out = step_x, peak.assemble(step_x)
        phase = PHASES[out[peak.OUT_PHASE]]
        if capture_x is not None:
            c_out = peak.assemble(capture_x)
            if c_out[peak.OUT_TOTAL] > out[peak.OUT_TOTAL]:
                x, out, phase = capture_x, c_out, CAPTURE_PHASE
        per_gpu = dict(zip(CATEGORIES, out[: peak.OUT_TOTAL + 1], strict=True))
        # the held logits and the inputs inside the peak's activations (profiler: temporary, inputs)
        ids = x[peak.IDS] * (x[peak.INFLIGHT] if out[peak.OUT_PHASE] in (0, 3) else 1)
        allocated = out[peak.OUT_TOTAL] - out[peak.OUT_OVERHEAD]
        frag = int(x[peak.RESERVED_FRAG]) if simulated else 0
        pinned = int(x[peak.FRAG_BYTES]) if simulated else int(allocated * x[peak.FRAG])
        ranks.append(
            Bill(
                model=model,
                n_params=n_params,
                per_gpu=per_gpu,
                fits=per_gpu["total"] <= gpu.total_bytes,
                headroom_bytes=gpu.total_bytes - per_gpu["total"],
                model_states=steady_states(step_x),
                phase=phase,
                stage=i,
                held_logits=int(x[peak.HELD]),
                input_bytes=int(ids),
                peak_reserved_bytes=allocated + frag if simulated else None,
                fragmentation_bytes=frag,
                unreleasable_bytes=pinned,
                host_bytes=offload_host_bytes(step_x, fields["training"], per_node),
                **fields,
            )
        )
    worst = max(ranks, key=lambda b: (b.per_gpu["total"], -b.stage))
    return dataclasses.replace(worst, pipeline_ranks=ranks)
