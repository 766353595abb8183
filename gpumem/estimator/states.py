"""Model states: bytes per parameter of weights, gradients and optimizer state.

Conventions (the ZeRO paper's, Rajbhandari et al. 2020, Fig. 1, K = 12): ``weights`` are the
parameters in their storage dtype; fp32 master weights count under ``optimizer``; gradients are
in the compute dtype unless ``grads`` says otherwise:

===================  =====================================================  ==============
grads                what is kept                                           source
===================  =====================================================  ==============
``"compute"``        16-bit grads (2 B)                                     ZeRO paper
``"fp32"``           fp32 main grads only (4 B): 2 + 4 + 12 = 18 B/param    Megatron-LM
``"compute+fp32"``   16-bit grads and an fp32 copy (6 B): 2Ψ + 18Ψ/N        DeepSpeed ZeRO-2
===================  =====================================================  ==============

Example:
    >>> t = Training(precision="bf16-mixed", optimizer="adamw")
    >>> t.weight_bytes, t.grad_bytes, t.optimizer_bytes     # 2 + 2 + 12 = 16 B/param
    (2, 2, 12)
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = {
    # name: (weight bytes, compute bytes, master fp32 copy, autocast, state bytes)
    "fp32": (4, 4, False, False, 4),
    "bf16-mixed": (2, 2, True, False, 4),
    "fp16-mixed": (2, 2, True, False, 4),
    "bf16-autocast": (4, 2, False, True, 4),  # torch.autocast over fp32 params ("amp")
    "fp16-autocast": (4, 2, False, True, 4),
    "bf16": (2, 2, False, False, 2),  # pure bf16: params, grads and states in bf16
}
_PRECISION_ALIASES = {
    "mixed": "bf16-mixed",
    "amp": "bf16-autocast",
    "amp-bf16": "bf16-autocast",
    "amp-fp16": "fp16-autocast",
    "float32": "fp32",
    "fp16": "fp16-mixed",
    "bfloat16": "bf16",
}

# optimizer: number of fp32-sized state tensors per parameter (state dtype scales them)
OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adafactor": -1, "adam8bit": -2}
_OPTIMIZER_ALIASES = {
    "momentum": "sgd-momentum",
    "adam-8bit": "adam8bit",
    "adamw8bit": "adam8bit",
    "8bit-adam": "adam8bit",
    "adamw-8bit": "adam8bit",
}
GRADS = ("compute", "fp32", "compute+fp32")
FP8_PRECISIONS = {
    # Transformer Engine fp8 training: bf16 weights with fp32 master weights, fp8 GEMMs
    "fp8": "delayed",
    "fp8-delayed": "delayed",
    "fp8-tensorwise": "tensorwise",
    "fp8-current": "tensorwise",
    "fp8-mxfp8": "mxfp8",
    "mxfp8": "mxfp8",
    "fp8-blockwise": "blockwise",
}


def split_fp8_precision(precision: str, recipe: str | None) -> tuple[str, str | None]:
    """``precision="fp8..."`` as (``bf16-mixed``, its recipe): fp8 changes what the GEMMs read
    and save (``megatron.py``), not the model states. Another precision passes through.

    Raises:
        ValueError: an fp8 precision that names another recipe than ``recipe``.
    """
    key = str(precision).strip().lower()
    if key not in FP8_PRECISIONS:
        return precision, recipe
    named = FP8_PRECISIONS[key]
    if recipe is not None and recipe != named:
        raise ValueError(
            f"precision={precision!r} is the {named} recipe, not fp8_recipe={recipe!r}"
        )
    return "bf16-mixed", named


def _pick(value: str, table: dict, aliases: dict, what: str) -> str:
    key = str(value).strip().lower()
    key = aliases.get(key, key)
    if key not in table:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(table)}")
    return key


@dataclass(frozen=True)
class Training:
    """Precision, optimizer and what is trainable.

    Attributes:
        precision: fp32, bf16-mixed / fp16-mixed (16-bit params + fp32 master),
            bf16-autocast (fp32 params under torch.autocast), bf16 (pure).
        optimizer: sgd, sgd-momentum, adam, adamw, adafactor, adam8bit.
        grads: "compute", "fp32" (Megatron) or "compute+fp32" (DeepSpeed); see module doc.
        offload_optimizer: optimizer state (and master weights) live in CPU memory.
        trainable_fraction: share of parameters that train (LoRA: set by ``lora_rank``).
        lora_rank: LoRA adapters of this rank on every Linear of every layer; the base freezes.
        base_quant: ``"nf4"`` stores the frozen base in 4 bits (QLoRA).
        foreach: multi-tensor optimizer step (default on CUDA; CPU runs per tensor).
        fused: torch's fused Adam/AdamW kernel (``fused=True``): no per-op temporaries.
    """

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    grads: str = "compute"
    offload_optimizer: bool = False
    lora_rank: int = 0
    base_quant: str | None = None
    foreach: bool | None = None
    fused: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "precision", _pick(self.precision, PRECISIONS, _PRECISION_ALIASES, "precision")
        )
        object.__setattr__(
            self, "optimizer", _pick(self.optimizer, OPTIMIZERS, _OPTIMIZER_ALIASES, "optimizer")
        )
        if self.grads not in GRADS:
            raise ValueError(f"unknown grads {self.grads!r}; choose one of {', '.join(GRADS)}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.base_quant not in (None, "nf4"):
            raise ValueError(f"base_quant must be None or 'nf4', got {self.base_quant!r}")
        if self.base_quant and not self.lora_rank:
            raise ValueError("a 4-bit base (QLoRA) needs lora_rank > 0: the base cannot train")

    @property
    def _p(self) -> tuple:
        return PRECISIONS[self.precision]

    @property
    def compute_bytes(self) -> int:
        return self._p[1]

    @property
    def autocast(self) -> bool:
        return self._p[3]

    @property
    def weight_bytes(self) -> int:
        return self._p[0]

    @property
    def frozen_weight_bytes(self) -> float:
        """Bytes per frozen base parameter: NF4 is 4 bits + one fp8 absmax per 64 values + one
        fp32 per 256 absmax blocks (QLoRA double quantisation), else the storage dtype."""
        if self.base_quant == "nf4":
            return 0.5 + 1 / 64 + 4 / (64 * 256)
        return self.weight_bytes

    @property
    def grad_bytes(self) -> int:
        if self.precision in ("fp32", "bf16-autocast", "fp16-autocast", "bf16"):
            return self.weight_bytes  # .grad matches the param dtype
        return {"compute": 2, "fp32": 4, "compute+fp32": 6}[self.grads]

    @property
    def master_bytes(self) -> int:
        return 4 if self._p[2] else 0

    @property
    def optimizer_bytes(self) -> float:
        """Per trainable parameter, master weights included (K of the ZeRO paper)."""
        n = OPTIMIZERS[self.optimizer]
        if n == -2:  # bitsandbytes 8-bit Adam: two 1-byte states + fp32 absmax per 2048 values
            states = 2 + 2 * 4 / 2048
        elif n == -1:  # Adafactor: factored second moment, ~(rows + cols) per matrix (small)
            states = 0.0
        else:
            states = n * self._p[4]
        return self.master_bytes + states

    def step_temp_bytes(self, trainable: int, scratch: int, cuda: bool) -> int:
        """Transient memory of one optimizer step.

        torch's Adam/AdamW, measured on CPU with gpumem.profile
        (benchmarks/results/estimator_accuracy.md): the foreach path (torch's CUDA default)
        allocates ``sqrt(exp_avg_sq)`` for every parameter at once (1 state-size per
        parameter); the per-tensor path (CPU default) holds ``scratch`` elements at once
        (``ParamGroups.step_scratch``: sqrt and quotient of one tensor while the previous
        tensor's quotient is still referenced); ``fused=True`` allocates nothing.

        Mixed precision with fp32 master weights is not a torch.optim recipe but a framework's:
        Megatron-core's optimizer keeps the 16-bit grad buffer and hands the fp32 master params
        ``model_grad.float()`` copies of their (ZeRO-sharded) grads for the step, then a fused
        Adam (Transformer Engine / apex: no per-op temporaries) — hence 4 B per trainable
        parameter on top of the 2 B grads during the step, unless fp32 grads are kept anyway
        (``grads="fp32"``: ``.float()`` is then a no-op; DeepSpeed's bf16 optimizer keeps fp32
        grads, ``grads="compute+fp32"``). This is the CUDA assumption; it cannot be measured
        with torch.optim on CPU.
        """
        foreach = cuda if self.foreach is None else self.foreach
        fused = self.fused
        if self.master_bytes and self.foreach is None:
            foreach, fused = False, True
        sb = self._p[4] if not self.master_bytes else 4
        temp = 0
        if self.optimizer in ("adam", "adamw") and not fused:
            temp = trainable * sb if foreach else scratch * sb
        if self.master_bytes and self.grads == "compute":
            temp += trainable * 4
        return int(temp)
