"""The estimate checked against measurement: run a built-in model for real (CPU), profile it
with ``gpumem.profile``, estimate the same job with ``gpumem.estimate``, compare.

Shared by ``benchmarks/bench_estimator_accuracy.py`` (the committed table) and
``tests/estimator/test_vs_profiler.py`` (the CI guard), so both run the very same loop:

    for step in range(steps):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(ids)                      # held by the loop through backward
            loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

Example:
    >>> from gpumem.estimator.validate import Case, compare
    >>> c = compare(Case("llama-gqa", "llama", {"num_kv_heads": 2}, batch=2, seq=64))
    >>> c.error_pct, c.measured_phase, c.estimated["total"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator.api import estimate
from gpumem.estimator.bill import Bill
from gpumem.estimator.specs import from_model_config

PROFILER_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporary", "inputs")


@dataclass(frozen=True)
class Case:
    """One small training configuration of a built-in model (``gpumem.models``).

    Attributes:
        name: label for tables.
        arch: gpt2, llama or mixtral; ``overrides`` change the ``tiny`` preset's fields.
        batch, seq: micro-batch and sequence length.
        optimizer: adamw, sgd or sgd-momentum (torch.optim, lr 1e-3).
        autocast: torch.autocast(bfloat16) around forward and loss (fp32 parameters).
        recompute: torch.utils.checkpoint around every layer.
        steps: optimizer steps profiled (the first creates the optimizer state).
        foreach: the optimizer's ``foreach`` flag (None: torch's default, per-tensor on CPU).
    """

    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    batch: int = 2
    seq: int = 64
    optimizer: str = "adamw"
    autocast: bool = False
    recompute: bool = False
    steps: int = 2
    foreach: bool | None = None

    @property
    def precision(self) -> str:
        return "bf16-autocast" if self.autocast else "fp32"


@dataclass
class Comparison:
    """Measured vs estimated peak of one :class:`Case`, in the profiler's categories."""

    case: Case
    measured_peak: int
    measured: dict[str, int]
    measured_phase: str
    measured_step: int
    bill: Bill
    estimated: dict[str, int]
    routing_imbalance: float | None = None
    """MoE only: tokens per expert, max / mean over experts and layers (1.0 = balanced)."""
    assumptions: list[str] = field(default_factory=list)

    @property
    def error_pct(self) -> float:
        """(estimate - measured) / measured, in percent."""
        return 100.0 * (self.estimated["total"] - self.measured_peak) / self.measured_peak


def estimate_case(case: Case) -> Bill:
    """The estimator's bill for ``case`` on the CPU (no CUDA context, allocator or NCCL)."""
    from gpumem.models import get_config

    cfg = get_config(case.arch, "tiny", **case.overrides)
    return estimate(
        from_model_config(cfg),
        batch_size=case.batch,
        seq_len=case.seq,
        precision=case.precision,
        optimizer=case.optimizer,
        device="cpu",
        attention="sdpa",
        keep_logits=True,
        persistent_grads=False,
        recompute="full" if case.recompute else "none",
        gpu_memory=2**40,
        foreach=case.foreach,
    )


def compare(case: Case, seed: int = 0) -> Comparison:
    """Train ``case`` for real on the CPU under ``gpumem.profile`` and estimate it."""
    import torch
    import torch.nn.functional as F

    import gpumem
    from gpumem.models import build_model, example_batch, get_config

    torch.manual_seed(seed)
    cfg = get_config(case.arch, "tiny", **case.overrides)
    model = build_model(cfg).train()
    model.gradient_checkpointing = case.recompute
    opt = _optimizer(case, model.parameters())
    ids, targets = example_batch(cfg, case.batch, case.seq)
    imbalance = _routing_imbalance(model, ids) if cfg.num_experts else None
    with gpumem.profile(model, optimizer=opt) as prof:
        for _ in range(case.steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
                logits = model(ids)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rep = prof.report()
    if cfg.num_experts:  # routing after the steps too: report the worse of the two
        imbalance = max(imbalance or 0.0, _routing_imbalance(model, ids))
    bill = estimate_case(case)
    return Comparison(
        case=case,
        measured_peak=rep.peak_bytes,
        measured=dict(rep.at_peak),
        measured_phase=rep.peak_phase,
        measured_step=rep.peak_step,
        bill=bill,
        estimated=bill.profiler_categories(),
        routing_imbalance=imbalance,
        assumptions=list(rep.assumptions),
    )


def _optimizer(case: Case, params: Any) -> Any:
    import torch

    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=case.foreach)
    if case.optimizer in ("sgd", "sgd-momentum"):
        momentum = 0.9 if case.optimizer == "sgd-momentum" else 0.0
        return torch.optim.SGD(params, lr=1e-3, momentum=momentum, foreach=case.foreach)
    raise ValueError(f"Case.optimizer must be adamw, sgd or sgd-momentum, got {case.optimizer!r}")


def _routing_imbalance(model: Any, ids: Any) -> float:
    """Max / mean tokens per expert of gpumem.models.MoE layers, from the router's top-k on the
    real batch (a no-grad forward outside any profile region)."""
    import torch

    from gpumem.models.transformer import MoE

    counts: list[torch.Tensor] = []

    def hook(mod: Any, args: Any) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        chosen = mod.router(x).float().softmax(-1).topk(mod.top_k, dim=-1).indices
        counts.append(torch.bincount(chosen.flatten(), minlength=len(mod.experts)).float())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return max(float(c.max() / c.mean()) for c in counts)
