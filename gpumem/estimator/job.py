"""The checked arguments of one ``gpumem.estimate`` (``Job``), and the checks that make it.

Every argument is checked here, before the model is read and before a calibration file is
loaded, so a bad value fails in one line however costly the rest would have been. The
framework is known here too: a described model's default (``transformers`` for a config.json)
follows from what was passed (``resolver.describes_hf``), not from reading it. ``Job`` is what
both paths read (``preset.estimate_preset``, ``module_estimate.estimate_module``).

The flat spellings of earlier releases (``grads=``, ``attention=``, ``fp8_recipe=``,
``loss_chunks=``, ``moe_imbalance=``, ``offload_param=``, ``gpu_memory=``, ...) still work:
``regroup`` puts each into its group (``FLAT``); one given beside its group is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator import inputs
from gpumem.estimator.finetune import FineTune
from gpumem.estimator.frameworks.conventions import default_grads, engine, resolve_framework
from gpumem.estimator.frameworks.deepspeed import ZeroConfig
from gpumem.estimator.frameworks.megatron import MegatronKnobs, check_knobs
from gpumem.estimator.frameworks.torchtitan import (
    TorchtitanKnobs,
    check_recompute,
    titan_knobs,
    titan_layout,
)
from gpumem.estimator.gpus import GPU, find_gpu
from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs, TrainingKnobs
from gpumem.estimator.layout import Layout
from gpumem.estimator.resolver import describes_hf
from gpumem.estimator.states import Training, split_fp8_precision

GROUPS: dict[str, type] = {
    "training": TrainingKnobs,
    "activations": ActivationKnobs,
    "megatron": MegatronKnobs,
    "torchtitan": TorchtitanKnobs,
    "moe": MoEKnobs,
}
# a flat keyword of earlier releases -> (its group, its field); "extra": routed by the checks
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: (g, f.name) for g in ("training", "activations") for f in fields(GROUPS[g])},
    **{f.name: (g, f.name) for g in ("megatron", "torchtitan") for f in fields(GROUPS[g])},
    **{f"moe_{f.name}": ("moe", f.name) for f in fields(MoEKnobs)},
    "fp8_recipe": ("extra", "fp8_recipe"),  # Megatron's or torchtitan's, by the framework
    "offload_param": ("extra", "offload_param"),  # DeepSpeed's (ZeroConfig.offload_param)
    "gpu_memory": ("extra", "gpu_memory"),  # a GPU not in the catalog
}


@dataclass(frozen=True)
class Job:
    """The checked arguments of one estimate: what both paths read."""

    training: Training
    layout: Layout
    gpu: GPU
    framework: str
    batch_size: int | None
    seq_len: int | None
    recompute: str
    grad_accum: int
    device: str
    activations: ActivationKnobs
    persistent_grads: bool | None
    megatron: MegatronKnobs
    torchtitan: TorchtitanKnobs
    moe: MoEKnobs
    given: frozenset[str]
    example_input: Any = None
    loss_fn: Any = None
    alloc_conf: AllocConf | None = None
    reserved_note: str = ""
    sharding: str = ""
    """Where the layout's sharding came from, when the framework decides it (torchtitan)."""
    finetune: FineTune | None = None


def regroup(flat: dict[str, Any], groups: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each group's fields as given (its object's, or the flat keywords'), and ``extra``.

    Raises:
        TypeError: an unknown keyword, or a group that is not its knobs object.
        ValueError: a flat keyword given beside its group.
    """
    out: dict[str, dict[str, Any]] = {g: {} for g in (*GROUPS, "extra")}
    for g, obj in groups.items():
        if obj is None:
            continue
        if not isinstance(obj, GROUPS[g]):
            raise TypeError(f"{g} must be a {GROUPS[g].__name__}, got {type(obj).__name__}")
        out[g] = {f.name: getattr(obj, f.name) for f in fields(obj)}
    for name, value in flat.items():
        if name not in FLAT:
            raise TypeError(f"estimate() got an unexpected keyword argument {name!r}")
        g, key = FLAT[name]
        beside = [g] if groups.get(g) is not None else []
        if name == "fp8_recipe" and value is not None:  # either framework's knobs hold one
            beside = [k for k in ("megatron", "torchtitan") if groups.get(k) is not None]
        if beside:
            raise ValueError(
                f"{name}= and {beside[0]}= both given: give {name} in {beside[0]}= only"
            )
        out[g][key] = value
    return out


def check_job(model: Any, *, module: bool, flat: dict[str, Any], **a: Any) -> Job:
    """Every check of ``gpumem.estimate``'s arguments (``a``: its keywords, ``flat``: the flat
    spellings), before any work; ``module``: the model is an ``nn.Module``.

    Raises:
        ValueError / LookupError / TypeError: one line naming the bad argument.
    """
    # what the caller passed is "given" in the bill, even a default's value
    defaulted = ("precision", "optimizer", "recompute", "grad_accum")
    given = inputs.given_inputs(**{k: a[k] for k in defaulted})
    for name in defaulted:
        if a[name] is None:
            a[name] = getattr(inputs, f"DEFAULT_{name.upper()}")
    layout = a["layout"] or Layout()
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a gpumem.Layout, got {type(layout).__name__}")
    if not module and (a["example_input"] is not None or a["loss_fn"] is not None):
        raise ValueError("example_input and loss_fn apply to an nn.Module model only")
    g = regroup(flat, {k: a[k] for k in GROUPS})
    ft = g["training"].get("finetune")
    if isinstance(ft, FineTune) and ft.source == "torchtune" and a["framework"] is None:
        a["framework"] = "fsdp2" if layout.fsdp else "torch"  # torchtune's own recipes
    hf = not module and describes_hf(model)
    fw, precision, megatron, titan = framework_knobs(a["framework"], layout, hf, a["precision"], g)
    sharding = ""
    if fw == "torchtitan":  # FSDP over every data-parallel rank unless told otherwise
        layout, sharding = titan_layout(layout)
    acts = ActivationKnobs(**g["activations"])
    tr = TrainingKnobs(**g["training"])
    training = make_training(precision, a["optimizer"], tr, fw, layout, a["deepspeed"], g["extra"])
    gpu = a["gpu"]
    gpu = gpu if isinstance(gpu, GPU) else find_gpu(gpu, g["extra"].get("gpu_memory"))
    _check_scalars(a)
    if fw == "torchtitan" and acts.keep_logits:
        raise ValueError(
            "keep_logits=True does not apply to framework='torchtitan': its train step deletes "
            "pred before backward (leave keep_logits unset)"
        )
    if megatron.recompute_modules and a["recompute"] != "selective":
        raise ValueError(
            f"recompute_modules are Megatron's selective recompute: give recompute='selective' "
            f"(got {a['recompute']!r})"
        )
    if not module:
        check_recompute(a["recompute"], fw)
    elif fw == "torchtitan":
        raise ValueError(
            "framework='torchtitan' prices torchtitan's own Llama from a described model "
            "(a preset, config.json or ModelSpec), not an nn.Module"
        )
    elif megatron != MegatronKnobs():
        raise ValueError("the Megatron-LM knobs apply to a described model, not an nn.Module")
    check_finetune(tr.finetune, fw, module)
    return Job(
        training=training,
        layout=layout,
        gpu=gpu,
        framework=fw,
        batch_size=a["batch_size"],
        seq_len=a["seq_len"],
        recompute=a["recompute"],
        grad_accum=a["grad_accum"],
        device=a["device"],
        activations=acts,
        persistent_grads=tr.persistent_grads,
        megatron=megatron,
        torchtitan=titan,
        moe=MoEKnobs(**g["moe"]),
        given=given,
        example_input=a["example_input"],
        loss_fn=a["loss_fn"],
        sharding=sharding,
        finetune=tr.finetune,
    )


def _check_scalars(a: dict[str, Any]) -> None:
    """batch_size and grad_accum positive integers (or unset), device cuda or cpu."""
    for name in ("batch_size", "grad_accum"):
        value = a[name]
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if a["device"] not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {a['device']!r}")


FINETUNE_FRAMEWORKS = ("transformers", "torch", "fsdp2", "deepspeed")
"""The frameworks a fine-tuning recipe runs under: PEFT under transformers' Trainer, plain
torch, FSDP2 or DeepSpeed; torchtune's recipes are single-device or FSDP2 (torch, fsdp2)."""


def check_finetune(ft: FineTune | None, framework: str, module: bool) -> None:
    """A recipe applies to a described model under a framework that runs it.

    Raises:
        ValueError: one line naming the recipe, the framework and the choices.
    """
    if ft is None:
        return
    if module:
        raise ValueError(
            "finetune= describes a recipe for a described model; an nn.Module carries its own "
            "adapters: wrap it with PEFT (get_peft_model) and pass it without finetune="
        )
    allowed = ("torch", "fsdp2") if ft.source == "torchtune" else FINETUNE_FRAMEWORKS
    if framework not in allowed:
        raise ValueError(
            f"finetune= ({ft.source}'s {ft.method} recipe) does not apply to "
            f"framework={framework!r}: it runs under {', '.join(allowed)}"
        )


def framework_knobs(
    framework: str | None, layout: Layout, hf: bool, precision: str, g: dict[str, dict[str, Any]]
) -> tuple[str, str, MegatronKnobs, TorchtitanKnobs]:
    """(the framework, the precision without its fp8 part, Megatron's knobs, torchtitan's).

    An fp8 recipe (``precision="fp8..."`` or ``fp8_recipe``) goes to torchtitan's float8 under
    ``framework="torchtitan"``, else to Megatron's Transformer Engine, which it also picks when
    no framework is named and the layout is one Megatron runs."""
    mk, tk = g["megatron"], g["torchtitan"]
    if mk.get("fp8_recipe") is not None and tk.get("fp8_recipe") is not None:
        raise ValueError("an fp8 recipe for both Megatron-LM and torchtitan: give one framework's")
    recipe = g["extra"].get("fp8_recipe") or mk.get("fp8_recipe") or tk.get("fp8_recipe")
    fw = resolve_framework(framework, layout, hf=hf)
    precision, recipe = split_fp8_precision(precision, recipe)
    if recipe is not None and framework is None:
        fw = "megatron" if layout.zero in (0, 1, 3) and not layout.fsdp else fw
    titan_recipe, recipe = (recipe, None) if fw == "torchtitan" else (None, recipe)
    titan = titan_knobs(fw, **{**tk, "fp8_recipe": titan_recipe})
    return fw, precision, check_knobs(fw, **{**mk, "fp8_recipe": recipe}), titan


def make_training(
    precision: str,
    optimizer: str,
    tr: TrainingKnobs,
    framework: str,
    layout: Layout,
    deepspeed: dict[str, Any] | ZeroConfig | None,
    extra: dict[str, Any],
) -> Training:
    """The model states' ``Training``, with the framework's gradient dtype by default and
    DeepSpeed's offload when DeepSpeed runs the job."""
    grads = tr.grads
    if grads is None:
        grads = default_grads(framework, Training(precision).master_bytes > 0)
    zero = zero_config(deepspeed, framework, layout, bool(extra.get("offload_param")))
    if zero is not None and tr.offload_optimizer:  # one offload, whichever way it was spelled
        zero = dataclasses.replace(zero, offload_optimizer="cpu")
    return Training(
        precision,
        optimizer,
        grads,
        tr.offload_optimizer or (zero is not None and zero.offload_optimizer == "cpu"),
        tr.finetune.rank if tr.finetune is not None and tr.finetune.adapters else tr.lora_rank,
        tr.base_quant,
        tr.foreach,
        tr.fused,
        offload_param=zero is not None and zero.offload_param == "cpu",
        deepspeed=zero,
    )


def zero_config(
    cfg: dict[str, Any] | ZeroConfig | None, framework: str, layout: Layout, offload_param: bool
) -> ZeroConfig | None:
    """The DeepSpeed knobs of a job (None unless DeepSpeed runs it: ``framework="deepspeed"``,
    or ``transformers`` with ZeRO, the HF Trainer's DeepSpeed integration), checked."""
    if engine(framework, layout) != "deepspeed":
        if cfg is not None or offload_param:
            raise ValueError(
                f"deepspeed= and offload_param are DeepSpeed's knobs; framework is {framework!r}, "
                "use framework='deepspeed'"
            )
        return None
    zero = ZeroConfig.from_dict(cfg)
    stage = ZeroConfig.stage_of(cfg)
    if stage is not None and stage != layout.zero:
        raise ValueError(
            f"the ds_config's zero_optimization.stage is {stage} but the layout has "
            f"zero={layout.zero}; give the same stage (--zero {stage})"
        )
    if offload_param:
        zero = dataclasses.replace(zero, offload_param="cpu")
    if zero.offload_param == "cpu" and layout.zero < 3:
        raise ValueError(
            f"offload_param needs ZeRO-3 (DeepSpeed partitions parameters only there); "
            f"the layout has zero={layout.zero}"
        )
    return zero
