"""``gpumem.estimate(nn.Module)``: checks the arguments, measures the module (``module_pass``)
and assembles its bill with the same peak formula as presets."""

from __future__ import annotations

from typing import Any

from gpumem.estimator.bill import RECOMPUTE, Bill, cluster_states, make_bill
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.states import Training


def estimate_module(
    module: Any, *, training: Training, layout: Layout, gpu: GPU, batch_size: int | None,
    seq_len: int | None, recompute: str, grad_accum: int, attention: str, dropout: float,
    activation_model: str, device: str, keep_logits: bool, persistent_grads: bool | None,
    example_input: Any, loss_fn: Any,
) -> Bill:  # fmt: skip
    """The bill of training ``module`` (see ``gpumem.estimate`` and ``module.py``)."""
    from gpumem.estimator.module import find_blocks, resolve_batch
    from gpumem.estimator.module_pass import measure, module_terms

    _check(module, training, layout, recompute, attention, dropout, activation_model, seq_len)
    blocks = find_blocks(module)
    if (layout.pp > 1 or layout.tp > 1) and not blocks:
        raise ValueError(
            f"layout {layout.describe()} is invalid for {type(module).__name__}: tensor and "
            "pipeline parallelism split repeated blocks, and this module repeats none "
            "(no two sibling submodules with the same class and parameter shapes)"
        )
    if layout.pp > len(blocks) and blocks:
        raise ValueError(f"layout {layout.describe()}: pp={layout.pp} exceeds the {len(blocks)} blocks")
    if layout.tp > 1:
        _check_tp(module, layout.tp)
    batch = resolve_batch(module, example_input, batch_size)
    ms = measure(module, training, example_input=example_input, batch=batch, seq=seq_len,
                 device=device, recompute=recompute, keep_logits=keep_logits, loss_fn=loss_fn)  # fmt: skip
    terms = module_terms(ms, training, layout, gpu, device == "cuda", grad_accum, persistent_grads)
    return make_bill(
        ms, ms.n_params, terms, layout=layout, training=training, gpu=gpu,
        cluster_model_state_bytes=cluster_states(training, ms.n_trainable, ms.n_params - ms.n_trainable),
        inputs={"batch_size": batch, "seq_len": seq_len, "recompute": recompute,
                "grad_accum": grad_accum, "device": device, "blocks": len(ms.blocks),
                "measured_moment": f"{ms.moment} of backward"},
    )  # fmt: skip


def _check(module, training, layout, recompute, attention, dropout, activation_model, seq_len) -> None:
    name = type(module).__name__
    if activation_model != "ops":
        raise ValueError(
            f"activation_model={activation_model!r} needs a transformer shape (presets, config.json, "
            f"ModelSpec); {name} is measured, which is the 'ops' model"
        )
    if attention != "sdpa" or dropout:
        raise ValueError(
            f"attention and dropout of an nn.Module are whatever {name}.forward does: set them in "
            "the module (its own attention code and dropout run in the fake pass)"
        )
    if training.lora_rank or training.base_quant:
        raise ValueError(
            "lora_rank/base_quant describe presets; for an nn.Module freeze the base yourself "
            "(requires_grad=False) and add the adapters: only trainable parameters get "
            "gradients and optimizer state"
        )
    if recompute not in RECOMPUTE and recompute != "every-1":
        raise ValueError(
            f"recompute={recompute!r} for an nn.Module: use 'none' or 'full' (every block under "
            "torch.utils.checkpoint); checkpointing inside your module is measured as it runs"
        )
    if recompute == "selective":
        raise ValueError(
            "recompute='selective' drops the attention core, which a generic module does not "
            "name: use 'none' or 'full', or checkpoint the attention inside your module (measured)"
        )
    if layout.ep > 1:
        raise ValueError(
            f"ep={layout.ep}: expert parallelism is modelled for MoE presets/configs only; "
            f"estimate {name} with ep=1"
        )
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0):
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")


def _check_tp(module: Any, tp: int) -> None:
    """Every matrix must split over tp along some dimension (Megatron splits rows or columns)."""
    bad = [
        f"{n} {tuple(p.shape)}" for n, p in module.named_parameters()
        if p.dim() >= 2 and not any(d % tp == 0 for d in p.shape)
    ]  # fmt: skip
    if bad:
        raise ValueError(
            f"tp={tp} cannot split {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}: no "
            "dimension divisible by tp; pick a tp that divides the model's widths"
        )
