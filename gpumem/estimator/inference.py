"""Inference memory: weights + KV cache + activation workspace + the serving engine's reserve,
and the largest batch × context that fits, per layout.

KV cache per token = 2 (K and V) · layers · kv_heads · head_dim · bytes, GQA-aware (Llama-2-70B
with 8 KV heads: 2 · 80 · 8 · 128 · 2 B = 320 KiB per token in bf16); MLA caches the latent and
the rope key instead (``kv_lora_rank + qk_rope_dim`` per layer). Under tensor parallelism each
rank holds kv_heads/tp heads (at least one: KV heads replicate when tp > kv_heads); under
pipeline parallelism each rank holds its stage's layers.

Serving engines pre-allocate (their ``gpu_memory_utilization`` conventions):

=========  ===========================================================================
engine     memory a job may use
=========  ===========================================================================
``vllm``   ``gpu_memory_utilization`` = 0.90 of the GPU's total (vLLM's default); weights,
           activation workspace and the KV cache live inside it
``sglang`` ``mem_fraction_static`` = 0.88 (SGLang's default for large GPUs) for weights and the
           KV cache; the rest is its workspace
``hf``     transformers ``generate``: no pre-allocation; the CUDA context and the allocator's
           fragmentation (the estimator's reserve) are what is lost
=========  ===========================================================================

Example:
    >>> bill = estimate_inference("llama-2-7b", batch_size=8, context=4096, gpu="H100-80GB")
    >>> bill.per_gpu["kv_cache"], bill.fits
    >>> plan_inference("llama-2-70b", n_gpus=8, gpu="H100-80GB", precision="fp8")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumem.calibrate.calibration import as_calibration
from gpumem.estimator.gpus import GPU, find_gpu
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import param_groups
from gpumem.estimator.resolver import resolve_model
from gpumem.estimator.terms import split_layers

# bytes per weight: int4 carries an fp16 scale per group of 128 (GPTQ / AWQ), int8 and fp8 are
# per-channel scaled (negligible), nf4 is bitsandbytes' 4-bit with its absmax blocks
WEIGHT_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2 / 128,
    "nf4": 0.5 + 1 / 64,
}
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
ENGINES = {"vllm": 0.90, "sglang": 0.88, "hf": 1.0}
# tokens one forward processes at once: vLLM's max_num_batched_tokens and SGLang's
# chunked_prefill_size (8192 by default on large GPUs); transformers prefills the whole batch
PREFILL_CHUNK = {"vllm": 8192, "sglang": 8192, "hf": None}
CATEGORIES = ("weights", "kv_cache", "activations", "engine_reserve", "overhead", "total")


@dataclass
class InferenceBill:
    """Per-GPU inference memory in integer bytes (categories: weights, kv_cache, activations,
    engine_reserve, overhead, total) of the most loaded rank."""

    model: ModelSpec
    gpu: GPU
    batch_size: int
    context: int
    tp: int
    per_gpu: dict[str, int]
    fits: bool
    headroom_bytes: int
    kv_bytes_per_token: int
    pp: int = 1
    engine: str = "vllm"
    precision: str = "bf16"
    kv_dtype: str = "bf16"
    input_sources: dict[str, str] = field(default_factory=dict)
    """Where each shown input came from (``given``, ``default``, ``default: the model's
    context``, ...), keyed as :meth:`inputs` is."""

    def inputs(self) -> dict[str, Any]:
        """The inputs the bill was computed for, in the order they are printed."""
        return {
            "context": self.context,
            "batch_size": self.batch_size,
            "precision": self.precision,
            "kv_dtype": self.kv_dtype,
            "engine": self.engine,
            "layout": f"tp{self.tp} pp{self.pp}",
        }

    def inputs_line(self) -> str:
        """``inputs: context 4096 (default: the model's context), batch 1 (default), ...``."""
        labels = {
            "context": "context",
            "batch_size": "batch",
            "precision": "weights",
            "kv_dtype": "KV cache",
            "engine": "engine",
            "layout": "layout",
        }
        parts = []
        for key, value in self.inputs().items():
            src = self.input_sources.get(key, "")
            parts.append(f"{labels[key]} {value}" + (f" ({src})" if src else ""))
        return "inputs: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": {
                k: {"value": v, "source": self.input_sources.get(k, "")}
                for k, v in self.inputs().items()
            },
            "n_params": self.model.n_params,
            "per_gpu": dict(self.per_gpu),
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "batch_size": self.batch_size,
            "context": self.context,
            "tp": self.tp,
            "pp": self.pp,
            "engine": self.engine,
            "precision": self.precision,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }

    def table(self) -> str:
        lines = [
            f"{self.model.name} inference, batch {self.batch_size} x context {self.context}, "
            f"tp{self.tp} pp{self.pp} on {self.gpu.name}, weights {self.precision}, KV "
            f"{self.kv_dtype}, {self.engine} conventions "
            f"({self.kv_bytes_per_token:,} KV bytes per token per GPU)",
            self.inputs_line(),
        ]
        lines += [
            f"{c:<15}{self.per_gpu[c]:>18,}{self.per_gpu[c] / 2**30:>10.2f} GiB" for c in CATEGORIES
        ]
        lines.append(
            f"{'fits' if self.fits else 'does NOT fit'}: "
            f"headroom {self.headroom_bytes / 2**30:.2f} GiB"
        )
        return "\n".join(lines)


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: int = 2, tp: int = 1, pp: int = 1) -> int:
    """K and V of every layer of the most loaded pipeline stage for one token on one tensor-
    parallel rank."""
    if not spec.is_decoder:
        raise ValueError(f"{spec.name} is not a decoder: it has no KV cache")
    layers = split_layers(spec.n_layers, pp)[0]
    if spec.is_mla:  # the compressed latent and the shared rope key, not split by TP
        return layers * (spec.kv_lora_rank + spec.qk_rope_dim) * kv_bytes
    heads = max(1, spec.kv_heads // tp) if tp <= spec.kv_heads else 1
    return 2 * layers * heads * spec.dhead * kv_bytes


def _choice(name: str, value: str, table: dict) -> str:
    if value not in table:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(table)}")
    return value


def estimate_inference(
    model: Any,
    *,
    batch_size: int = 1,
    context: int | None = None,
    precision: str = "bf16",
    kv_precision: str | None = None,
    gpu: str | GPU | None = "H100-80GB",
    gpu_memory: str | int | None = None,
    tp: int = 1,
    pp: int = 1,
    engine: str = "vllm",
    kv_dtype: str | None = None,
    calibration: Any = None,
    layout_source: str | None = None,
) -> InferenceBill:
    """Memory of serving ``batch_size`` sequences of ``context`` tokens on one rank of a
    ``tp`` × ``pp`` layout.

    Args:
        precision: weights: fp32, bf16, fp16, fp8, int8, int4 (GPTQ/AWQ, group 128), nf4.
        kv_dtype: the KV cache's dtype (default: the weights' for 16/32-bit weights, else
            bf16); ``kv_precision`` is its older name.
        engine: vllm, sglang or hf (see the module doc).
        calibration: a Calibration or its path: the GPU gets the measured reserve.
        layout_source: where tp and pp came from, for the stated inputs (default: ``given``
            unless both are 1, ``default``).

    The activation workspace is one prefill chunk (vLLM / SGLang: 8192 tokens; transformers:
    the whole batch × context): the residual stream and norm output (2·h), the MLP's widest
    intermediates (2·ffn/tp, 3 for SwiGLU), and the last-token fp32 logits of every sequence.

    Raises:
        ValueError: a bad size, an unknown dtype or engine, a context beyond the model's
            maximum, or a layout the model cannot split.
    """
    spec = resolve_model(model)
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    cal = as_calibration(calibration)
    if cal is not None:
        g = cal.apply_to(g)
    ctx = spec.max_seq if context is None else context
    kv = (
        kv_dtype or kv_precision or (precision if precision in ("fp32", "bf16", "fp16") else "bf16")
    )
    _check(spec, batch_size, ctx, tp, pp, precision, kv, engine)
    per_gpu, per_tok = _serving_bytes(spec, g, batch_size, ctx, tp, pp, precision, kv, engine)
    total = per_gpu["total"]
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
        pp=pp,
        engine=engine,
        precision=precision,
        kv_dtype=kv,
        input_sources=_sources(
            context,
            batch_size,
            precision,
            kv,
            kv_dtype or kv_precision,
            engine,
            layout_source or ("default" if tp == pp == 1 else "given"),
        ),
    )


def _check(
    spec: ModelSpec,
    batch_size: int,
    ctx: int,
    tp: int,
    pp: int,
    precision: str,
    kv: str,
    engine: str,
) -> None:
    """The serving arguments against each other and the model: one line each."""
    for name, v in (("batch_size", batch_size), ("context", ctx), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if ctx > spec.max_seq:
        raise ValueError(
            f"context {ctx} exceeds {spec.name}'s maximum of {spec.max_seq} tokens "
            "(max_position_embeddings); serve at most that"
        )
    _choice("precision", precision, WEIGHT_BYTES)
    _choice("kv_dtype", kv, KV_BYTES)
    _choice("engine", engine, ENGINES)
    if spec.n_heads % tp:
        raise ValueError(f"attention heads {spec.n_heads} not divisible by tp={tp}")
    if pp > spec.n_layers:
        raise ValueError(f"pp={pp} exceeds the {spec.n_layers} layers")


def _sources(
    context: int | None,
    batch_size: int,
    precision: str,
    kv: str,
    kv_given: str | None,
    engine: str,
    layout: str,
) -> dict[str, str]:
    """Where each stated input of a serving bill came from."""
    return {
        "context": "default: the model's context" if context is None else "given",
        "batch_size": "default" if batch_size == 1 else "given",
        "precision": "default" if precision == "bf16" else "given",
        "kv_dtype": "given"
        if kv_given
        else (
            "default: the weights'" if kv == precision else "default: 16-bit for 8/4-bit weights"
        ),
        "engine": "default" if engine == "vllm" else "given",
        "layout": layout,
    }


def _serving_bytes(
    spec: ModelSpec,
    g: GPU,
    batch_size: int,
    ctx: int,
    tp: int,
    pp: int,
    precision: str,
    kv: str,
    engine: str,
) -> tuple[dict[str, int], int]:
    """(the per-GPU bytes by category, the KV cache's bytes per token) of one serving rank."""
    A = 2 if WEIGHT_BYTES[precision] < 4 else 4
    weights = int(_stage_params(spec, tp, pp) * WEIGHT_BYTES[precision])
    per_tok = kv_bytes_per_token(spec, KV_BYTES[kv], tp, pp)
    kv_cache = batch_size * ctx * per_tok
    chunk = PREFILL_CHUNK[engine]
    n = batch_size * ctx if chunk is None else min(batch_size * ctx, chunk)
    width = 2 * spec.hidden + (3 if spec.arch == "llama" else 2) * spec.dense_layer_ffn // tp
    acts = n * width * A + batch_size * spec.vocab // tp * 4
    allocated = weights + kv_cache + acts
    util = ENGINES[engine]
    reserve = int(g.total_bytes * (1 - util))
    # a pre-allocating engine's pool holds its own fragmentation; hf pays the allocator's
    overhead = g.context_bytes + (g.nccl_bytes if tp * pp > 1 else 0)
    if engine == "hf":
        overhead += int(allocated * g.fragmentation)
    total = allocated + reserve + overhead
    per_gpu = dict(
        zip(CATEGORIES, (weights, kv_cache, acts, reserve, overhead, total), strict=True)
    )
    return per_gpu, per_tok


def _stage_params(spec: ModelSpec, tp: int, pp: int) -> float:
    """Parameters on the most loaded rank: the first stage's layers and the embedding (or
    the last stage's with the head, whichever is larger), matrices split over tp."""
    if pp == 1:
        return spec.n_params / tp
    pg = param_groups(spec)
    layers = split_layers(spec.n_layers, pp)
    per_layer = pg.total - pg.embed_tp - pg.embed_rep - pg.head_tp - pg.head_rep
    per_layer /= spec.n_layers
    first = layers[0] * per_layer / tp + pg.embed_tp / tp + pg.embed_rep
    last = layers[-1] * per_layer / tp + (pg.head_tp or pg.embed_tp) / tp + pg.head_rep
    return max(first, last)


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


CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass
class InferenceLayout:
    """One serving layout: tp × pp per replica, replicas over the GPUs, and what fits."""

    tp: int
    pp: int
    replicas: int
    weights_per_gpu: int
    kv_bytes_per_token: int
    kv_tokens: int
    max_batch: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        return f"tp{self.tp} pp{self.pp} x{self.replicas}"


@dataclass
class InferencePlan:
    """What :func:`plan_inference` found, per layout, fitting layouts first."""

    model: ModelSpec
    gpu: GPU
    n_gpus: int
    precision: str
    kv_dtype: str
    engine: str
    contexts: tuple[int, ...]
    layouts: list[InferenceLayout]
    capped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "n_gpus": self.n_gpus,
            "precision": self.precision,
            "kv_dtype": self.kv_dtype,
            "engine": self.engine,
            "max_context": self.model.max_seq,
            "layouts": [
                {
                    "tp": x.tp,
                    "pp": x.pp,
                    "replicas": x.replicas,
                    "weights_per_gpu": x.weights_per_gpu,
                    "kv_bytes_per_token": x.kv_bytes_per_token,
                    "kv_tokens": x.kv_tokens,
                    "max_batch_by_context": {str(c): b for c, b in x.max_batch.items()},
                }
                for x in self.layouts
            ],
        }

    def table(self, top: int = 10) -> str:
        head = (
            f"{self.model.name} serving on {self.n_gpus} x {self.gpu.name}: weights "
            f"{self.precision}, KV {self.kv_dtype}, {self.engine} conventions; largest batch "
            f"per context (capped at the model's {self.model.max_seq} tokens)"
        )
        cols = "".join(f"{c:>9}" for c in self.contexts)
        lines = [
            head,
            f"{'layout':<14}{'weights/GPU':>13}{'KV B/token':>12}{'KV tokens':>12}{cols}",
        ]
        for x in self.layouts[:top]:
            row = "".join(f"{x.max_batch[c]:>9}" for c in self.contexts)
            lines.append(
                f"{x.describe():<14}{x.weights_per_gpu / 2**30:>10.2f} GiB"
                f"{x.kv_bytes_per_token:>12,}{x.kv_tokens:>12,}{row}"
            )
        if not any(x.kv_tokens for x in self.layouts):
            lines.append("nothing fits: more GPUs (--min-gpus), lower precision, or fp8 KV")
        return "\n".join(lines)


def plan_inference(
    model: Any,
    *,
    n_gpus: int = 1,
    gpu: str | GPU = "H100-80GB",
    gpu_memory: str | int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    precision: str = "bf16",
    kv_dtype: str | None = None,
    engine: str = "vllm",
    contexts: tuple[int, ...] = CONTEXTS,
    calibration: Any = None,
) -> InferencePlan:
    """Every tp × pp layout of ``n_gpus`` (or the one given), the largest batch per context for
    each (contexts above the model's maximum are dropped), KV bytes per token and the tokens
    of KV cache that fit; fitting layouts first, most KV tokens first."""
    spec = resolve_model(model)
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    cal = as_calibration(calibration)
    if cal is not None:
        g = cal.apply_to(g)
    if not isinstance(n_gpus, int) or isinstance(n_gpus, bool) or n_gpus <= 0:
        raise ValueError(f"n_gpus must be a positive integer, got {n_gpus!r}")
    ctxs = tuple(c for c in contexts if c <= spec.max_seq)
    capped = len(ctxs) < len(contexts)
    if capped and spec.max_seq not in ctxs:
        ctxs = (*ctxs, spec.max_seq)
    layouts = []
    for t in [tp] if tp else [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]:
        for p in [pp] if pp else [d for d in range(1, n_gpus // t + 1) if (n_gpus // t) % d == 0]:
            if n_gpus % (t * p) or spec.n_heads % t or p > spec.n_layers:
                if tp or pp:
                    raise ValueError(
                        f"tp={t} pp={p} cannot serve {spec.name} on {n_gpus} GPUs: "
                        f"tp*pp must divide the GPUs, tp the {spec.n_heads} heads, and pp be "
                        f"at most the {spec.n_layers} layers"
                    )
                continue
            kw: dict[str, Any] = {
                "precision": precision,
                "kv_dtype": kv_dtype,
                "gpu": g,
                "tp": t,
                "pp": p,
                "engine": engine,
            }
            one = estimate_inference(spec, batch_size=1, context=1, **kw)
            free = one.headroom_bytes + one.per_gpu["kv_cache"]
            kv_tokens = max(0, free // one.kv_bytes_per_token)
            mb = {c: max_batch(spec, context=c, **kw) for c in ctxs}
            layouts.append(
                InferenceLayout(
                    t,
                    p,
                    n_gpus // (t * p),
                    one.per_gpu["weights"],
                    one.kv_bytes_per_token,
                    int(kv_tokens),
                    mb,
                )
            )
    layouts.sort(key=lambda x: (-(x.kv_tokens > 0), -x.replicas * x.kv_tokens, x.tp * x.pp))
    kv = kv_dtype or (precision if precision in ("fp32", "bf16", "fp16") else "bf16")
    return InferencePlan(spec, g, n_gpus, precision, kv, engine, ctxs, layouts, capped)
