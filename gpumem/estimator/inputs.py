"""What an estimate was computed for: the sequence length, micro-batch, gradient accumulation,
recompute, precision and optimizer, and where each value came from (given, a default, the
model's context). Every bill and plan prints them, so a number is never read without its inputs.

The sequence length is also checked against the model here: a length beyond the context of a
model with learned positions (GPT-2, ViT) has no position embedding and is an error; beyond the
context of a rotary model (Llama family) it is a warning (the model was not trained for it; the
memory is estimated as asked).

Example:
    >>> from gpumem.estimator.resolver import resolve_model
    >>> spec = resolve_model("llama-2-7b")
    >>> seq_len(spec, None)
    (4096, "default: the model's context")
"""

from __future__ import annotations

import warnings
from typing import Any

from gpumem.estimator.model_spec import ModelSpec

# the defaults of gpumem.estimate for the inputs every bill states
DEFAULT_BATCH_SIZE = 1
DEFAULT_GRAD_ACCUM = 1
DEFAULT_RECOMPUTE = "none"
DEFAULT_PRECISION = "bf16-mixed"
DEFAULT_OPTIMIZER = "adamw"
SHOWN = (
    "seq_len",
    "target_seq",  # an encoder-decoder's decoder length (T5)
    "batch_size",
    "grad_accum",
    "recompute",
    "precision",
    "float8",  # torchtitan's float8 training, when given (framework="torchtitan")
    "optimizer",
    "sharding",  # the framework's sharding when it decides it (framework="torchtitan")
    "pipeline",  # torchtitan's schedule and micro-batches under pp (framework="torchtitan")
    "finetune",  # a fine-tuning recipe, when given (finetune.FineTune)
    "loss",
)
LABELS = {
    "seq_len": "seq_len",
    "target_seq": "target_seq",
    "batch_size": "micro-batch",
    "grad_accum": "grad accumulation",
    "recompute": "recompute",
    "precision": "precision",
    "float8": "float8",
    "optimizer": "optimizer",
    "sharding": "sharding",
    "pipeline": "pipeline",
    "finetune": "recipe",
    "loss": "loss",
}
CONTEXT = "default: the model's context"


def seq_len(spec: ModelSpec, given: int | None) -> tuple[int, str]:
    """``(tokens per sample, source)`` for a described model (checks in the module doc).

    Raises:
        ValueError: not a positive integer, or beyond a learned position table.
    """
    if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given <= 0):
        raise ValueError(f"seq_len must be a positive integer, got {given!r}")
    if spec.arch in ("vit", "resnet"):
        fixed = spec.n_tokens_per_sample if spec.arch == "vit" else 1
        why = "the image's patches + class token" if spec.arch == "vit" else "images, no sequence"
        if given is not None and given != fixed:
            warnings.warn(
                f"seq_len {given} does not apply to {spec.name}: its sequence is fixed by the "
                f"image size ({fixed}: {why}); estimating with {fixed}",
                stacklevel=4,
            )
        return fixed, f"fixed: {why}"
    if given is None:
        return spec.max_seq, CONTEXT
    if given > spec.max_seq:
        if spec.arch == "gpt2":
            raise ValueError(
                f"seq_len {given} exceeds {spec.name}'s {spec.max_seq} learned positions: the "
                f"position table has no row beyond them; use seq_len <= {spec.max_seq}"
            )
        warnings.warn(
            f"seq_len {given} is beyond {spec.name}'s context of {spec.max_seq} tokens "
            "(max_position_embeddings): the model was not trained for it (rotary positions "
            "need scaling or further training there); memory is estimated as asked",
            stacklevel=4,
        )
    return given, "given"


def source(value: Any, default: Any) -> str:
    """``"default"`` when ``value`` is the default, else ``"given"``."""
    return "default" if value == default else "given"


def sources(
    *,
    seq_source: str,
    batch_size: int | None,
    grad_accum: int,
    recompute: str,
    training: Any,
    given: frozenset[str] | None = None,
) -> dict[str, str]:
    """Where each shown input came from (``seq_source`` from :func:`seq_len`). ``given``: the
    inputs the caller passed (a value passed in is given even when it equals the default's:
    ``precision="bf16-mixed"``); None: judged by value, for callers that cannot tell."""

    def src(name: str, value: Any, default: Any) -> str:
        if given is None:
            return source(value, default)
        return "given" if name in given else "default"

    return {
        "seq_len": seq_source,
        # None is the default; a value passed in is given, even the default's (batch_size=1)
        "batch_size": "default" if batch_size is None else "given",
        "grad_accum": src("grad_accum", grad_accum, DEFAULT_GRAD_ACCUM),
        "recompute": src("recompute", recompute, DEFAULT_RECOMPUTE),
        "precision": src("precision", training.precision, DEFAULT_PRECISION),
        "optimizer": src("optimizer", training.optimizer, DEFAULT_OPTIMIZER),
    }


def given_inputs(**values: Any) -> frozenset[str]:
    """The names among ``values`` the caller passed (not None)."""
    return frozenset(k for k, v in values.items() if v is not None)


def describe(values: dict[str, Any], sources: dict[str, str]) -> str:
    """``seq_len 4096 (default: the model's context), micro-batch 1 (default), ...``."""
    parts = []
    for key in SHOWN:
        if key in values:
            src = sources.get(key, "")
            parts.append(f"{LABELS[key]} {values[key]}" + (f" ({src})" if src else ""))
    return ", ".join(parts)


def as_json(values: dict[str, Any], sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{"seq_len": {"value": 4096, "source": "..."}, ...}`` for the shown inputs."""
    return {
        key: {"value": values[key], "source": sources.get(key, "")}
        for key in SHOWN
        if key in values
    }
