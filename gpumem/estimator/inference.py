"""Inference memory: weights + KV cache + activation workspace, and the largest batch × context
that fits a GPU or a MIG slice.

KV cache per token = 2 (K and V) · layers · kv_heads · head_dim · bytes, GQA-aware (Llama-2-70B
with 8 KV heads: 2 · 80 · 8 · 128 · 2 B = 320 KiB per token in bf16). Under tensor parallelism
each rank holds kv_heads/tp heads (at least one: KV heads replicate when tp > kv_heads).

Example:
    >>> bill = estimate_inference("llama-2-7b", batch_size=8, context=4096, gpu="H100-80GB")
    >>> bill.per_gpu["kv_cache"], bill.fits
    >>> max_batch("llama-2-70b", context=4096, gpu="H200-141GB", tp=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpumem.calibrate.calibration import as_calibration
from gpumem.estimator.gpus import GPU, find_gpu
from gpumem.estimator.specs import ModelSpec, resolve_model

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "fp8": 1.0, "nf4": 0.5 + 1 / 64}
CATEGORIES = ("weights", "kv_cache", "activations", "overhead", "total")


@dataclass
class InferenceBill:
    """Per-GPU inference memory in integer bytes (categories: weights, kv_cache, activations,
    overhead, total)."""

    model: ModelSpec
    gpu: GPU
    batch_size: int
    context: int
    tp: int
    per_gpu: dict[str, int]
    fits: bool
    headroom_bytes: int
    kv_bytes_per_token: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_params": self.model.n_params,
            "per_gpu": dict(self.per_gpu),
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "batch_size": self.batch_size,
            "context": self.context,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }

    def table(self) -> str:
        lines = [
            f"{self.model.name} inference, batch {self.batch_size} x context {self.context}, "
            f"tp{self.tp} on {self.gpu.name}"
        ]
        lines += [
            f"{c:<12}{self.per_gpu[c]:>18,}{self.per_gpu[c] / 2**30:>10.2f} GiB" for c in CATEGORIES
        ]
        lines.append(
            f"{'fits' if self.fits else 'does NOT fit'}: "
            f"headroom {self.headroom_bytes / 2**30:.2f} GiB"
        )
        return "\n".join(lines)


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: int = 2, tp: int = 1) -> int:
    """K and V of every layer for one token on one tensor-parallel rank."""
    if not spec.is_decoder:
        raise ValueError(f"{spec.name} is not a decoder: it has no KV cache")
    heads = max(1, spec.kv_heads // tp) if tp <= spec.kv_heads else 1
    return 2 * spec.n_layers * heads * spec.dhead * kv_bytes


def estimate_inference(
    model: Any,
    *,
    batch_size: int = 1,
    context: int | None = None,
    precision: str = "bf16",
    kv_precision: str = "bf16",
    gpu: str | GPU | None = "H100-80GB",
    gpu_memory: str | int | None = None,
    tp: int = 1,
    calibration: Any = None,
) -> InferenceBill:
    """Memory of serving ``batch_size`` sequences of ``context`` tokens.

    The activation workspace is one prefill chunk of the whole batch: the residual stream and
    norm output (2·h), the MLP's widest intermediates (2·ffn/tp, 3 for SwiGLU), and the
    last-token fp32 logits of every sequence. ``calibration`` (a Calibration or its path)
    gives the GPU the measured reserve.
    """
    spec = resolve_model(model)
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    cal = as_calibration(calibration)
    if cal is not None:
        g = cal.apply_to(g)
    ctx = spec.max_seq if context is None else context
    for name, v in (("batch_size", batch_size), ("context", ctx), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    for name, p in (("precision", precision), ("kv_precision", kv_precision)):
        if p not in WEIGHT_BYTES:
            raise ValueError(f"unknown {name} {p!r}; choose one of {', '.join(WEIGHT_BYTES)}")
    if spec.n_heads % tp:
        raise ValueError(f"attention heads {spec.n_heads} not divisible by tp={tp}")
    A = 2 if WEIGHT_BYTES[precision] < 4 else 4
    weights = int(spec.n_params * WEIGHT_BYTES[precision] / tp)
    per_tok = kv_bytes_per_token(spec, int(max(1, WEIGHT_BYTES[kv_precision])), tp)
    kv = batch_size * ctx * per_tok
    n = batch_size * ctx
    width = 2 * spec.hidden + (3 if spec.arch == "llama" else 2) * spec.ffn // tp
    acts = n * width * A + batch_size * spec.vocab // tp * 4
    allocated = weights + kv + acts
    overhead = g.reserve_bytes(allocated, tp)
    total = allocated + overhead
    per_gpu = dict(zip(CATEGORIES, (weights, kv, acts, overhead, total), strict=True))
    return InferenceBill(
        spec,
        g,
        batch_size,
        ctx,
        tp,
        per_gpu,
        total <= g.total_bytes,
        g.total_bytes - total,
        per_tok,
    )


def max_batch(model: Any, *, context: int, **kwargs: Any) -> int:
    """The largest batch of ``context``-token sequences that fits (0 if not even one)."""
    lo, hi = 0, 1
    while estimate_inference(model, batch_size=hi, context=context, **kwargs).fits:
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            return lo
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if estimate_inference(model, batch_size=mid, context=context, **kwargs).fits:
            lo = mid
        else:
            hi = mid
    return lo
