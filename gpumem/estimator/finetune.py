"""Fine-tuning recipes: which Linears carry adapters, what trains, what the recipe changes.

``FineTune`` is one recipe, checked when made, in the words of the library that runs it:

- **PEFT** (``source="peft"``, huggingface/peft ``LoraConfig``): ``target_modules`` as PEFT
  matches it (``tuners_utils.check_target_module_exists``): a list matches a module whose full
  name equals an entry or ends with ``"." + entry``; a string is a regular expression that
  must match the full name (``re.fullmatch``); ``"all-linear"`` is every Linear but the output
  layer; None is PEFT's default for the model type (``q_proj`` and ``v_proj`` for the Llama
  family: ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``). PEFT keeps the adapters in
  fp32 on a 16-bit base (``autocast_adapter_dtype=True``), so each adapted Linear casts its
  input to fp32.
- **torchtune** (``source="torchtune"``, ``torchtune/models/llama3_2/_component_builders.py``
  ``lora_llama3_2``): ``lora_attn_modules`` (``q_proj``, ``k_proj``, ``v_proj``,
  ``output_proj``), ``apply_lora_to_mlp`` (``w1``, ``w2``, ``w3``), ``apply_lora_to_output``;
  adapters in the model's dtype. torchtune's own modules differ from transformers' where memory
  is concerned: GQA's k and v are expanded to every head (a copy each), the attention output is
  made contiguous for ``output_proj`` (a copy), and ``TransformerDecoder`` returns
  ``output(h).float()``, which the recipe's loss consumes and drops (``_loss_step``: ``del
  logits``): the fp32 log-probabilities, no logits held. ``method="full"`` is its full
  fine-tune recipes (no adapters) on the same modules.

The methods: ``lora``; ``dora`` (PEFT ``use_dora``, torchtune ``use_dora``): a magnitude
vector per adapted Linear (``out`` features) and, per call, the identity it pushes through the
adapter (``fin x fin``), the adapter's output and the base output (both saved by the magnitude's
products); ``qlora``: the base Linears in NF4 (4 bits, an 8-bit absmax per 64 values and an
fp32 scale per 256 absmax blocks: bitsandbytes' double quantisation, torchao's ``NF4Tensor``)
— every Linear of the layers (PEFT + bitsandbytes' ``BitsAndBytesConfig(load_in_4bit)``;
torchtune's ``LoRALinear(quantize_base=True)`` and ``FrozenNF4Linear``), not the embedding or
the output layer — and each one's weight dequantized to the compute dtype while it runs;
``full``: every parameter trains.

Recipe settings beside the adapters: ``packed`` (every row holds ``seq_len`` tokens: torchtune's
``dataset.packed``, TRL's ``packing``; unpacked rows are padded to the longest sample of the
batch, which ``seq_len`` then bounds), ``offload_activations`` (torchtune's
``enable_activation_offloading``: saved activations of the layers go to the host, one layer's
come back at a time), ``optimizer_in_bwd`` (torchtune: each parameter steps as soon as its
gradient exists and drops it, so no full set of gradients is ever alive), ``loss_chunks`` and
``compile_loss`` (torchtune's ``CEWithChunkedOutputLoss`` and ``compile=True``'s compiled loss),
``compile_layers`` (``compile=True``'s compiled decoder layers: ``tune_compiled``).

Example:
    >>> import gpumem
    >>> from gpumem.estimator.finetune import FineTune
    >>> from gpumem.estimator.knobs import TrainingKnobs
    >>> bill = gpumem.estimate("config.json", batch_size=2, seq_len=4096, precision="bf16",
    ...     training=TrainingKnobs(finetune=FineTune(rank=16, target_modules=("q_proj", "v_proj"))))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

METHODS = ("lora", "dora", "qlora", "full")
SOURCES = ("peft", "torchtune")
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
"""A decoder layer's Linears in the order its forward calls them."""
_HF_PATHS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_TORCHTUNE_ATTN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
_TORCHTUNE_MLP = ("gate", "down", "up")  # w1, w2, w3
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
"""config.json model types whose adapted layers the rules follow (transformers' Llama layer:
RMSNorm (Qwen3: also per-head q/k norms; Gemma: ``1 + w``), SDPA, a gated MLP of three
Linears); ``describe`` refuses others (Gemma2/3's post-norms and soft-capped eager attention,
Phi-3's fused projections, GPT-2's Conv1D)."""
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class FineTune:
    """One fine-tuning recipe (module docstring: what each knob means and where it comes from).

    Attributes:
        method: ``lora``, ``dora``, ``qlora`` or ``full``.
        rank: the adapters' rank ``r`` (PEFT ``r``, torchtune ``lora_rank``).
        target_modules: PEFT's: a tuple of names (suffix match), a full-match regex string,
            ``"all-linear"``, or None (PEFT's default for the model type).
        lora_attn_modules / apply_lora_to_mlp / apply_lora_to_output: torchtune's.
        dropout: ``lora_dropout`` (a mask and a dropped copy of the input per adapted Linear).
        source: ``peft`` or ``torchtune`` (default: torchtune when one of its knobs is given).
        packed: rows are packed to ``seq_len`` tokens.
        offload_activations: torchtune's activation offloading.
        optimizer_in_bwd: torchtune's optimizer step fused into backward.
        loss_chunks: torchtune's ``CEWithChunkedOutputLoss`` (``num_output_chunks``, 8): the
            model returns the logits in chunks, each upcast and reduced on its own.
        compile_loss: torchtune's ``compile=True`` compiles the loss (``training.compile_loss``):
            a chunk's compiled cross-entropy keeps its 16-bit logits, not fp32 log-probabilities
            (the compiled layers: ``compile_layers``).
        compile_layers: torchtune's ``compile=True`` compiles each decoder layer too: a layer
            saves what Inductor's partitioner keeps (``tune_compiled``; measured on torchtune's
            modules, full and LoRA: DoRA and QLoRA are refused).

    Raises:
        ValueError: one line naming the bad knob and the choices.
    """

    method: str = "lora"
    rank: int = 8
    target_modules: tuple[str, ...] | str | None = None
    lora_attn_modules: tuple[str, ...] | None = None
    apply_lora_to_mlp: bool | None = None
    apply_lora_to_output: bool | None = None
    dropout: float = 0.0
    source: str | None = None
    packed: bool = False
    offload_activations: bool = False
    optimizer_in_bwd: bool = False
    loss_chunks: int = 1
    compile_loss: bool = False
    compile_layers: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        tt = self._torchtune_knobs()
        if self.source is None:
            full = self.method == "full"
            object.__setattr__(self, "source", "torchtune" if tt or full else "peft")
        if self.method == "full" and self.source == "peft":
            raise ValueError(
                "method='full' is torchtune's full fine-tune recipe (source='torchtune'); PEFT "
                "trains adapters: for transformers' full training leave finetune= out"
            )
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; choose one of {', '.join(SOURCES)}")
        if self.source == "peft" and tt:
            raise ValueError(
                f"{', '.join(tt)} are torchtune's knobs, but source='peft': give PEFT's "
                "target_modules, or source='torchtune'"
            )
        if self.source == "torchtune" and self.target_modules is not None:
            raise ValueError(
                "target_modules is PEFT's knob, but source='torchtune': give lora_attn_modules, "
                "apply_lora_to_mlp, apply_lora_to_output (or source='peft')"
            )
        tt_recipe = [
            n
            for n in ("offload_activations", "optimizer_in_bwd", "compile_loss", "compile_layers")
            if getattr(self, n)
        ] + (["loss_chunks"] if self.loss_chunks != 1 else [])
        if self.source == "peft" and tt_recipe:
            raise ValueError(
                f"{', '.join(tt_recipe)}: torchtune's recipe knobs (enable_activation_offloading, "
                "optimizer_in_bwd, compile, CEWithChunkedOutputLoss), but source='peft': "
                "use source='torchtune'"
            )
        lc = self.loss_chunks
        if isinstance(lc, bool) or not isinstance(lc, int) or lc < 1:
            raise ValueError(f"loss_chunks must be a positive integer (8: torchtune's), got {lc!r}")
        _check_rank(self.rank, self.method)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout (lora_dropout) must be in [0, 1), got {self.dropout}")
        if self.method == "full" and (tt or self.target_modules is not None or self.dropout):
            raise ValueError(
                "method='full' trains every parameter: target_modules, lora_* knobs and "
                "dropout apply to lora, dora and qlora"
            )
        if self.compile_layers and self.method not in ("full", "lora"):
            raise ValueError(
                f"compile_layers prices torchtune's compiled full and LoRA layers (measured); "
                f"method={self.method!r}'s compiled layers are not modelled: leave "
                "compile_layers out (its layers priced eager, an upper bound)"
            )
        _check_targets(self.target_modules)
        if self.lora_attn_modules is not None:
            mods = self.lora_attn_modules
            if isinstance(mods, str) or any(m not in _TORCHTUNE_ATTN for m in mods):
                raise ValueError(
                    f"lora_attn_modules must be a list of {', '.join(_TORCHTUNE_ATTN)}, got "
                    f"{mods!r}"
                )
            object.__setattr__(self, "lora_attn_modules", tuple(mods))

    def _torchtune_knobs(self) -> list[str]:
        names = ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output")
        return [n for n in names if getattr(self, n) is not None]

    @property
    def adapters(self) -> bool:
        return self.method != "full"

    def adapter_bytes(self, compute: int, autocast: bool) -> int:
        """Bytes per element of the adapters' weights: PEFT's fp32 (``autocast_adapter_dtype``)
        on a 16-bit base, torchtune's the model's dtype (fp32 under autocast: fp32 params)."""
        if self.source == "peft" or autocast:
            return 4
        return compute


def _check_rank(rank: Any, method: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        if method == "full":
            return
        raise ValueError(f"rank (LoRA r) must be a positive integer, got {rank!r}")


def _check_targets(targets: Any) -> None:
    if targets is None:
        return
    if isinstance(targets, str):
        if targets == "all-linear":
            return
        try:
            re.compile(targets)
        except re.error as exc:
            raise ValueError(
                f"target_modules {targets!r} is not a regular expression ({exc}); give a list "
                "of module names or a valid regex"
            ) from None
        return
    if not isinstance(targets, (tuple, list)) or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"target_modules must be a list of module names, a regex string or 'all-linear', "
            f"got {targets!r}"
        )
    if not targets:
        raise ValueError("target_modules is empty: name at least one module (e.g. q_proj)")


@dataclass(frozen=True)
class AdapterPlan:
    """Which Linears of which layer carry an adapter, and what they add.

    Attributes:
        layers: per layer, the adapted Linears (names from ``LINEARS``).
        head: the output layer (``lm_head`` / torchtune ``output``) is adapted.
        recipe: the recipe it was resolved from.
    """

    layers: tuple[frozenset[str], ...]
    head: bool
    recipe: FineTune

    @property
    def typical(self) -> frozenset[str]:
        """The adapted set most layers have (the per-layer rules price it)."""
        sets = [s for s in self.layers if s] or [frozenset()]
        return max(set(sets), key=sets.count)

    def first_grad_layer(self) -> int:
        """The first layer with an adapter (before it nothing carries a gradient)."""
        return next((i for i, s in enumerate(self.layers) if s), len(self.layers))


def linear_shapes(spec: Any, t: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of a layer on one tensor-parallel rank."""
    h, f = spec.hidden, spec.dense_layer_ffn // t
    qd, kvd = spec.n_heads * spec.dhead // t, max(1, spec.kv_heads // t) * spec.dhead
    return {
        "q": (h, qd),
        "k": (h, kvd),
        "v": (h, kvd),
        "o": (qd, h),
        "gate": (h, f),
        "up": (h, f),
        "down": (f, h),
    }


def module_names(spec: Any) -> list[str]:
    """The full names of the model's Linear modules, as ``named_modules`` gives them (a
    transformers Llama-family CausalLM)."""
    names = [f"model.layers.{i}.{_HF_PATHS[k]}" for i in range(spec.n_layers) for k in LINEARS]
    return [*names, "lm_head"]


def describe(recipe: FineTune, spec: Any) -> AdapterPlan:
    """The adapter plan of ``recipe`` on ``spec``.

    Raises:
        ValueError: a model the rules do not follow, or a target it does not have (naming the
            modules it has).
    """
    family = getattr(spec, "family", "") or ""
    if (
        spec.arch != "llama"
        or spec.is_moe
        or spec.is_mla
        or (spec.is_hf and family not in FAMILIES)
    ):
        raise ValueError(
            f"finetune= models dense Llama-family decoders ({', '.join(FAMILIES)} configs and "
            f"the llama presets); {spec.name!r} is {family or spec.arch}"
            f"{' with experts' if spec.is_moe else ''}: estimate it without finetune= (the "
            "full model), or pass the PEFT-wrapped nn.Module (measured)"
        )
    n = spec.n_layers
    if not recipe.adapters:
        return AdapterPlan(tuple(frozenset() for _ in range(n)), False, recipe)
    if recipe.source == "torchtune":
        per = {_TORCHTUNE_ATTN[m] for m in (recipe.lora_attn_modules or ("q_proj", "v_proj"))}
        if recipe.apply_lora_to_mlp:
            per |= set(_TORCHTUNE_MLP)
        plan = AdapterPlan(
            tuple(frozenset(per) for _ in range(n)), bool(recipe.apply_lora_to_output), recipe
        )
    else:
        plan = _peft_plan(recipe, spec)
    if not any(plan.layers) and not plan.head:
        raise ValueError("the recipe adapts no module: nothing would train")
    return plan


def _peft_plan(recipe: FineTune, spec: Any) -> AdapterPlan:
    """PEFT's matching (``check_target_module_exists``) over the model's Linear names."""
    names = module_names(spec)
    targets = recipe.target_modules
    if targets is None:
        targets = PEFT_DEFAULT_TARGETS
    if targets == "all-linear":  # PEFT: every Linear but the output layer
        hit = set(names[:-1])
    elif isinstance(targets, str):
        hit = {n for n in names if re.fullmatch(targets, n)}
        if not hit:
            raise ValueError(
                f"target_modules regex {targets!r} matches none of the model's Linear modules "
                f"({_name_hint(spec)})"
            )
    else:
        hit = set()
        for t in targets:
            found = {n for n in names if n == t or n.endswith("." + t)}
            if not found:
                raise ValueError(
                    f"target module {t!r} is not in {spec.name!r}; its Linear modules are "
                    f"{_name_hint(spec)}"
                )
            hit |= found
    layers = []
    for i in range(spec.n_layers):
        layers.append(frozenset(k for k in LINEARS if f"model.layers.{i}.{_HF_PATHS[k]}" in hit))
    return AdapterPlan(tuple(layers), "lm_head" in hit, recipe)


def _name_hint(spec: Any) -> str:
    leaf = ", ".join(p.split(".")[-1] for p in _HF_PATHS.values())
    return f"{leaf}, lm_head (full names: model.layers.0.{_HF_PATHS['q']}, ..., lm_head)"


def adapter_params(
    plan: AdapterPlan, spec: Any, layers: range | list[int] | None = None, t: int = 1
) -> int:
    """Trainable parameters of the adapters of ``layers`` (default: all) on one tensor-parallel
    rank: ``r · (in + out)`` per adapted Linear, and DoRA's magnitude vector (``out``)."""
    r, dora = plan.recipe.rank, plan.recipe.method == "dora"
    shapes = linear_shapes(spec, t)
    total = 0
    for i in layers if layers is not None else range(spec.n_layers):
        for k in plan.layers[i]:
            fin, fout = shapes[k]
            total += r * (fin + fout) + (fout if dora else 0)
    return total


def head_adapter_params(plan: AdapterPlan, spec: Any, t: int = 1) -> int:
    """The output layer's adapter (``lm_head``: hidden -> vocab)."""
    if not plan.head:
        return 0
    v = spec.vocab // t
    return plan.recipe.rank * (spec.hidden + v) + (v if plan.recipe.method == "dora" else 0)


def quantized_params(plan: AdapterPlan, spec: Any, layers: range | list[int], t: int = 1) -> int:
    """Base parameters stored in NF4 under ``qlora``: every Linear of the layers, adapted or
    not (PEFT with bitsandbytes' ``load_in_4bit``; torchtune's builders: ``LoRALinear
    (quantize_base=True)`` or ``FrozenNF4Linear``); embeddings, norms and the output layer
    stay in the model's dtype."""
    if plan.recipe.method != "qlora":
        return 0
    per = sum(fin * fout for fin, fout in linear_shapes(spec, t).values())
    return per * len(layers)


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per NF4 parameter: 4 bits, an 8-bit absmax per 64 values, an fp32 scale per 256
absmax blocks (double quantisation)."""
