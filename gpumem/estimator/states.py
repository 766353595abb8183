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

``"compute+fp32"`` holds DeepSpeed's fp32 gradient partition throughout (as its published
formula does); under ``framework="deepspeed"`` the default ``"compute"`` follows its code, which
makes that partition in the optimizer step only (``frameworks/deepspeed.py``).

Example:
    >>> t = Training(precision="bf16-mixed", optimizer="adamw")
    >>> t.weight_bytes, t.grad_bytes, t.optimizer_bytes     # 2 + 2 + 12 = 16 B/param
    (2, 2, 12)
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator.frameworks.deepspeed import ZeroConfig

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

# optimizer: state tensors per parameter in the state dtype (negative: see optimizer_bytes_for)
OPTIMIZERS = {
    "sgd": 0,
    "sgd-momentum": 1,
    "adam": 2,
    "adamw": 2,
    "adafactor": -1,
    "adam8bit": -2,
    "muon": -3,
}
# bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per block of this many values
# (bitsandbytes.optim.optimizer.Optimizer8bit: ``block_wise=True``, blocksize 256 since 0.45,
# 2048 before; gpumem follows the current release)
BNB_BLOCK = 256
_OPTIMIZER_ALIASES = {
    "momentum": "sgd-momentum",
    "adam-8bit": "adam8bit",
    "adamw8bit": "adam8bit",
    "8bit-adam": "adam8bit",
    "adamw-8bit": "adam8bit",
    "paged-adamw8bit": "adam8bit",  # paged: the same bytes, in CUDA unified memory
    "paged-adam8bit": "adam8bit",
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
    and save (``frameworks/megatron.py``), not the model states. Another precision passes through.

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


@dataclass(frozen=True)
class ParamMix:
    """How the trainable parameters split, for optimizers that treat matrices differently.

    Attributes:
        hidden: share of the parameters in 2-D hidden matrices (the blocks' weight matrices:
            what Muon orthogonalises; embeddings, head, norms and biases go to AdamW).
        matrices: share in any parameter of 2 or more dimensions (Adafactor factors them).
        factored: Adafactor's row + column elements of those matrices, per parameter.
        largest: (rows, cols) of the hidden matrix with the widest Newton–Schulz workspace
            ((0, 0): unknown, taken square from the per-tensor step scratch).
        pair: the most elements of two consecutive parameters (registration order): what a
            per-tensor Adafactor step holds at once (0: unknown).
    """

    hidden: float = 1.0
    matrices: float = 1.0
    factored: float = 0.0
    largest: tuple[int, int] = (0, 0)
    pair: int = 0


def param_mix(shapes: list[tuple[tuple[int, ...], bool]]) -> ParamMix:
    """The ParamMix of parameters given as (shape, is a hidden matrix) pairs."""
    total = sum(_numel(s) for s, _ in shapes) or 1
    hidden = sum(_numel(s) for s, h in shapes if h and len(s) == 2)
    mats = [s for s, _ in shapes if len(s) >= 2]
    # torch.optim.Adafactor: row_var = shape[:-1] + (1,), col_var = shape[:-2] + (1, shape[-1])
    fact = sum(_numel(s[:-1]) + _numel(s[:-2]) * s[-1] for s in mats)
    hid = [(s[0], s[1]) for s, h in shapes if h and len(s) == 2]
    largest = max(hid, key=ns_width, default=(0, 0))
    sizes = [_numel(s) for s, _ in shapes]
    pair = max((a + b for a, b in zip([0, *sizes], sizes, strict=False)), default=0)
    matrices = sum(_numel(s) for s in mats) / total
    return ParamMix(hidden / total, matrices, fact / total, largest, pair)


def ns_width(shape: tuple[int, int]) -> int:
    """Newton–Schulz's bf16 elements for a matrix (see ``Training.muon_step_bytes``): 2rc + 2r²."""
    r, c = min(shape), max(shape)
    return 2 * r * c + 2 * r * r


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
        optimizer: sgd, sgd-momentum, adam, adamw, adafactor, adam8bit, muon (see
            ``optimizer_bytes_for``).
        grads: "compute", "fp32" (Megatron) or "compute+fp32" (DeepSpeed); see module doc.
        offload_optimizer: optimizer state (and master weights) live in CPU memory.
        offload_param: DeepSpeed ZeRO-3 keeps the 16-bit parameter partitions in CPU memory.
        deepspeed: DeepSpeed's ``zero_optimization`` knobs (``deepspeed.ZeroConfig``), used
            under ``framework="deepspeed"``.
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
    offload_param: bool = False
    deepspeed: ZeroConfig | None = None

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
        """Per trainable parameter, master weights included (K of the ZeRO paper), for a model
        of hidden matrices only (see ``optimizer_bytes_for``)."""
        return self.optimizer_bytes_for(ParamMix())

    def optimizer_bytes_for(self, mix: ParamMix) -> float:
        """Per trainable parameter, master weights included, for parameters split as ``mix``.

        - ``adam8bit`` (bitsandbytes ``Adam8bit``/``PagedAdamW8bit``): two uint8 moments and an
          fp32 absmax per ``BNB_BLOCK`` values of each (paged: the same bytes, pageable);
        - ``adafactor`` (``torch.optim.Adafactor``, transformers' ``Adafactor`` with its default
          ``beta1=None``): no first moment; a row and a column vector per matrix
          (``mix.factored``), a full second moment for vectors (norms, biases); torch's scalar
          ``step`` tensors are 4 B per parameter tensor, not counted here;
        - ``muon``: one momentum buffer (``torch.optim.Muon``'s ``momentum_buffer``, the
          param's dtype) for the hidden matrices, AdamW's two moments for the rest.
        """
        n = OPTIMIZERS[self.optimizer]
        sb = self._p[4]
        if n == -2:
            states = 2 + 2 * 4 / BNB_BLOCK
        elif n == -1:
            states = sb * ((1 - mix.matrices) + mix.factored)
        elif n == -3:
            states = sb * (mix.hidden + 2 * (1 - mix.hidden))
        else:
            states = n * sb
        return self.master_bytes + states

    def muon_step_bytes(self, rows: int, cols: int) -> int:
        """Newton–Schulz's peak temporary for one ``rows x cols`` matrix (torch.optim.Muon,
        ``_zeropower_via_newtonschulz``, measured on CPU): Nesterov's ``grad.lerp(buf)`` in the
        state dtype, then in bf16 with r = min, c = max of the sides: the iterate X (r·c), X·Xᵀ
        and the polynomial b·A + c·A·A (r² each, ``addmm``) and the next iterate (r·c), all alive
        at once. KellerJordan/Muon's ``zeropower_via_newtonschulz5`` computes the same
        iteration unfused (``b * A + c * A @ A``, ``a * X + B @ X``): up to 4rc + 2r² bf16
        elements at once, and its ``muon_update`` lerps into the gradient in place (no
        Nesterov copy); gpumem bills torch's."""
        return int(rows * cols * self._p[4] + 2 * ns_width((rows, cols)))

    def step_temp_bytes(
        self, trainable: int, scratch: int, cuda: bool, mix: ParamMix | None = None
    ) -> int:
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

        Muon (torch.optim.Muon, measured on CPU): one matrix's Newton–Schulz workspace at a time
        (``muon_step_bytes`` of ``mix.largest``). Adafactor (torch.optim.Adafactor, per tensor):
        the variance estimate of one tensor and of the previous one (``mix.pair``, within 2 % of
        a CPU run: the row and column means come on top). 8-bit Adam: bitsandbytes' fused
        kernel, none.
        """
        foreach = cuda if self.foreach is None else self.foreach
        fused = self.fused
        if self.master_bytes and self.foreach is None:
            foreach, fused = False, True
        sb = self._p[4] if not self.master_bytes else 4
        temp = 0
        if self.optimizer in ("adam", "adamw") and not fused:
            temp = trainable * sb if foreach else scratch * sb
        elif self.optimizer == "muon":
            # one matrix at a time (the AdamW rest steps per tensor: smaller, not added)
            rows, cols = mix.largest if mix is not None else (0, 0)
            if not rows:  # unknown shape: the largest tensor (scratch / 3 elements), square
                rows = cols = int((scratch / 3) ** 0.5)
            temp = self.muon_step_bytes(rows, cols)
        elif self.optimizer == "adafactor":
            # one tensor's variance estimate (``row_var @ col_var``, updated in place into the
            # update) while the previous tensor's is still named; the row/column means are small
            pair = mix.pair if mix is not None and mix.pair else 2 * scratch / 3
            temp = pair * sb
        if self.master_bytes and self.grads == "compute":
            temp += trainable * 4
        return int(temp)
