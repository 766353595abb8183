"""The grouped keyword arguments of ``gpumem.estimate`` that are not one framework's: how the
model states are kept (``TrainingKnobs``), what the activations are (``ActivationKnobs``) and
how a mixture of experts routes (``MoEKnobs``). Each is frozen and checks its values when made,
so a bad one fails before any model is read. The frameworks' own knobs live beside their
formulas: ``megatron.MegatronKnobs``, ``torchtitan.TorchtitanKnobs``, ``deepspeed.ZeroConfig``.

Example:
    >>> import gpumem
    >>> from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs
    >>> bill = gpumem.estimate("mixtral-8x7b", layout=gpumem.Layout(dp=8, ep=8),
    ...                        activations=ActivationKnobs(attention="flash"),
    ...                        moe=MoEKnobs(imbalance=1.0))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpumem.estimator.activations import FUSED_OPS
from gpumem.estimator.finetune import FineTune

MOE_IMBALANCE = 1.25
"""Default tokens of the most loaded expert-parallel rank over the mean: the capacity factor
most MoE recipes use (GShard, Switch Transformer: 1.25). Dropless routing (Megatron's default)
can exceed it early in training; pass the measured max/mean (``MoEKnobs(imbalance=)``)."""
MOE_DISPATCHERS = ("alltoall", "allgather")
ACTIVATION_MODELS = ("ops", "korthikanti")
ATTENTIONS = ("sdpa", "flash", "efficient", "cpu-flash", "eager", "math")


@dataclass(frozen=True)
class TrainingKnobs:
    """How the model states are kept and stepped, beyond the precision and optimizer (checked
    with them, as ``states.Training``).

    Attributes:
        grads: the gradients' dtype (default: the framework's; Megatron: fp32 main grads).
        offload_optimizer: the optimizer state and step on the CPU.
        lora_rank / base_quant: LoRA adapters of this rank on every Linear of a frozen base
            (``"nf4"``: QLoRA), the activations of a fully trained model.
        finetune: a fine-tuning recipe (``finetune.FineTune``: LoRA / DoRA / QLoRA by target
            modules, PEFT's or torchtune's, or torchtune's full fine-tune), whose frozen base
            also changes what the activations are (``lora_ops.py``).
        foreach / fused: torch.optim's step implementation (``Training.step_temp_bytes``).
        persistent_grads: gradients stay allocated across steps (default: when distributed or
            accumulating; torchtitan: False, its ``set_to_none=True`` step).
    """

    grads: str | None = None
    offload_optimizer: bool = False
    lora_rank: int = 0
    base_quant: str | None = None
    foreach: bool | None = None
    fused: bool = False
    persistent_grads: bool | None = None
    finetune: FineTune | None = None

    def __post_init__(self) -> None:
        ft = self.finetune
        if ft is not None and not isinstance(ft, FineTune):
            raise TypeError(f"finetune must be a FineTune, got {type(ft).__name__}")
        if ft is not None and (self.lora_rank or self.base_quant):
            raise ValueError(
                "lora_rank/base_quant and finetune= both given: give the rank and method in "
                "FineTune(rank=, method='qlora') only"
            )


@dataclass(frozen=True)
class ActivationKnobs:
    """What the activations of a step are.

    Attributes:
        attention: ``sdpa`` (the backend PyTorch picks), ``flash``, ``efficient``,
            ``cpu-flash`` or ``eager``/``math`` (s² scores).
        dropout: the attention's dropout (Megatron's ``hidden_dropout`` is its own knob).
        activation_model: ``ops`` (what autograd saves) or ``korthikanti`` (the paper).
        keep_logits: the training loop holds the logits through backward and the step
            (default: the framework's loop; see ``frameworks.default_keep_logits``).
        fused_ops: which of ``norm``, ``swiglu``, ``rope``, ``ce`` run fused (default: the
            framework's; Megatron fuses the first three).
        target_seq: an encoder-decoder's (T5's) target tokens per sample, the decoder's
            length and the loss's (default: ``seq_len``, the encoder's).

    Raises:
        ValueError: one line naming the bad value and the valid ones.
    """

    attention: str = "sdpa"
    dropout: float = 0.0
    activation_model: str = "ops"
    keep_logits: bool | None = None
    fused_ops: tuple[str, ...] | None = None
    target_seq: int | None = None

    def __post_init__(self) -> None:
        check_attention(self.attention)
        t = self.target_seq
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t <= 0):
            raise ValueError(f"target_seq must be a positive integer, got {t!r}")
        if self.activation_model not in ACTIVATION_MODELS:
            raise ValueError(
                f"activation_model must be 'ops' or 'korthikanti', got {self.activation_model!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_fused_ops(self.fused_ops)
        if self.fused_ops is not None:
            object.__setattr__(self, "fused_ops", tuple(self.fused_ops))


@dataclass(frozen=True)
class MoEKnobs:
    """How a mixture of experts routes its tokens (presets and configs with experts).

    Attributes:
        imbalance: tokens of the most loaded expert-parallel rank over the mean (default
            1.25, the usual capacity factor; applies when ``layout.ep > 1``).
        dispatcher: ``alltoall`` or ``allgather`` token dispatch under expert parallelism.
        grouped_gemm: experts as one grouped GEMM (default for config.json models and
            Megatron) or a loop over experts (gpumem.models).

    Raises:
        ValueError: one line per bad value.
    """

    imbalance: float = MOE_IMBALANCE
    dispatcher: str = "alltoall"
    grouped_gemm: bool | None = None

    def __post_init__(self) -> None:
        m = self.imbalance
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise ValueError(f"moe_imbalance must be a number >= 1, got {m!r}")
        if not 1.0 <= m < 1e6:
            raise ValueError(
                f"moe_imbalance is the most loaded rank's tokens over the mean: >= 1, got "
                f"{m!r} (default {MOE_IMBALANCE}, the usual capacity factor)"
            )
        if self.dispatcher not in MOE_DISPATCHERS:
            raise ValueError(
                f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, "
                f"got {self.dispatcher!r}"
            )
        if self.grouped_gemm not in (None, True, False):
            raise ValueError(
                f"moe_grouped_gemm must be True, False or None, got {self.grouped_gemm!r}"
            )


def check_attention(attention: Any) -> None:
    """``attention`` is one of ``ATTENTIONS``."""
    if attention not in ATTENTIONS:
        raise ValueError(
            f"unknown attention {attention!r}; use sdpa, flash, efficient, cpu-flash, eager"
        )


def check_fused_ops(fused_ops: Any) -> None:
    """``fused_ops`` is None or a tuple of known kernel names."""
    if fused_ops is None:
        return
    if isinstance(fused_ops, str) or not all(isinstance(o, str) for o in fused_ops):
        raise ValueError(
            f"fused_ops must be a tuple of names from {', '.join(FUSED_OPS)}, got {fused_ops!r}"
        )
    bad = [o for o in fused_ops if o not in FUSED_OPS]
    if bad:
        raise ValueError(
            f"unknown fused op(s) {', '.join(map(repr, bad))}; known: {', '.join(FUSED_OPS)}"
        )
