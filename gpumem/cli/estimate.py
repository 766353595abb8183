"""gpumem estimate: the per-GPU memory bill of a training (or inference) job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from gpumem.cli import _args
from gpumem.estimator.activations import FUSED_OPS
from gpumem.estimator.frameworks.conventions import FRAMEWORKS
from gpumem.estimator.knobs import MOE_DISPATCHERS
from gpumem.estimator.states import FP8_PRECISIONS, PRECISIONS


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Model, precision, optimizer and GPU flags shared by `estimate` and `plan`."""
    p.add_argument(
        "model", help="preset name (case-insensitive), config.json, or a directory holding one"
    )
    p.add_argument(
        "--alloc-conf",
        metavar="SETTINGS",
        type=_args.alloc_conf,
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF the simulated caching allocator follows for the reserved "
        "peak and the verdict (default: the environment's), e.g. expandable_segments:True",
    )
    p.add_argument(
        "--seq-len",
        type=_args.positive_int,
        default=None,
        help="tokens per sample (default: the model's context; printed with the result)",
    )
    p.add_argument(
        "--precision",
        default=None,  # None: the default, and the bill says so (a given bf16-mixed is given)
        help=f"{', '.join(PRECISIONS)} (default bf16-mixed), or an fp8 recipe: "
        f"{', '.join(FP8_PRECISIONS)}; with --inference the weights: fp32, bf16, fp16, fp8, "
        "int8, int4, nf4",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, sgd-momentum, adam, adamw, adafactor, adam8bit, muon (Muon for the hidden "
        "matrices, AdamW for the rest) (default adamw)",
    )
    p.add_argument(
        "--grads",
        default=None,
        choices=("compute", "fp32", "compute+fp32"),
        help="gradient storage: compute dtype (ZeRO paper), fp32 (Megatron), both (DeepSpeed); "
        "default: the framework's",
    )
    p.add_argument(
        "--framework",
        default=None,
        choices=FRAMEWORKS,
        help="whose recipe and buffer conventions (default: transformers for a config.json; "
        "else fsdp2 with --fsdp, deepspeed with --zero, else torch)",
    )
    p.add_argument(
        "--loss-chunks",
        type=_args.non_negative_int,
        default=0,
        help="--framework torchtitan: its ChunkedLossWrapper(num_chunks=N) (0.3.0's llama3 "
        "recipes use 8; default 0: the loss on the whole logits)",
    )
    p.add_argument(
        "--fsdp-float8-all-gather",
        action="store_true",
        help="--framework torchtitan --fp8-recipe tensorwise: FSDP gathers the float8 weights "
        "(torchao's enable_fsdp_float8_all_gather)",
    )
    p.add_argument(
        "--compiled-loss",
        action="store_true",
        help="--framework torchtitan: its loss compiled by Inductor, as --training.compile "
        "does from 2025 (the blocks are priced eager)",
    )
    p.add_argument(
        "--pp-schedule",
        default=None,
        help="--framework torchtitan with --pp: its pipeline_parallel_schedule (1F1B, GPipe, "
        "Interleaved1F1B; default 1F1B)",
    )
    p.add_argument(
        "--pp-microbatch-size",
        type=_args.positive_int,
        default=None,
        help="--framework torchtitan with --pp: its pipeline_parallel_microbatch_size (default "
        "1): --batch-size is the local batch, run as batch / this micro-batches",
    )
    p.add_argument(
        "--keep-logits",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the training loop holds the logits through backward (default: the framework's "
        "loop; transformers' Trainer does not, a plain loss_fn(model(x)) loop does)",
    )
    p.add_argument(
        "--ds-config",
        metavar="FILE",
        type=_args.existing_path,
        default=None,
        help="a DeepSpeed ds_config.json: its zero_optimization buckets and offload",
    )
    p.add_argument(
        "--deepspeed",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="a DeepSpeed zero_optimization knob, e.g. reduce_bucket_size=2e8, "
        "overlap_comm=true, stage3_max_live_parameters=1e9, offload_optimizer=cpu (repeatable)",
    )
    p.add_argument("--gpu", default="H100-80GB", help="catalog GPU (default H100-80GB)")
    p.add_argument(
        "--gpu-memory", type=_args.size, default=None, help="memory of a GPU not in the catalog"
    )
    p.add_argument(
        "--lora-rank",
        type=_args.non_negative_int,
        default=0,
        help="train LoRA adapters of this rank only (alone: on every Linear, a fully trained "
        "model's activations; with --finetune: the recipe's rank, default 8)",
    )
    p.add_argument(
        "--qlora", action="store_true", help="4-bit (NF4) frozen base; needs --lora-rank"
    )
    add_finetune_args(p)
    p.add_argument(
        "--calibration",
        metavar="FILE",
        type=_args.existing_path,
        default=None,
        help=(
            "calibration.json from `gpumem calibrate`: measured GPU reserve, the estimator's "
            "fitted memory coefficients (--memory), and (plan) checkpoint times"
        ),
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=("fp32", "bf16", "fp16", "fp8", "int8"),
        help="inference: the KV cache's dtype (default: the weights', bf16 for 8/4-bit weights)",
    )
    p.add_argument(
        "--engine",
        default="vllm",
        choices=("vllm", "sglang", "hf"),
        help="inference: the serving engine's memory conventions (default vllm: 0.9 of the GPU)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="estimate the per-GPU memory of a training job and whether it fits",
        description="Estimate the per-GPU memory bill (weights, gradients, optimizer, "
        "activations, temporary, overhead) of training MODEL, on the most loaded GPU.",
    )
    add_job_arguments(p)
    p.add_argument(
        "--batch-size",
        type=_args.positive_int,
        default=None,  # None, not 1: the bill labels a --batch-size 1 given, its absence default
        help="micro-batch per GPU (default 1)",
    )
    p.add_argument(
        "--grad-accum",
        type=_args.positive_int,
        default=None,
        help="micro-batches per step (default 1)",
    )
    p.add_argument("--gpus", type=_args.gpu_count, default=1, help="number of GPUs (default 1)")
    for flag in ("dp", "tp", "pp", "ep", "cp", "etp"):
        p.add_argument(
            f"--{flag}", type=_args.gpu_count, default=None, help=f"{flag.upper()} degree"
        )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=None,
        help="MoE: most loaded expert-parallel rank's tokens over the mean (default 1.25)",
    )
    p.add_argument(
        "--pipeline-ranks",
        action="store_true",
        help="print the bill of every pipeline rank side by side",
    )
    p.add_argument(
        "--vpp", type=_args.positive_int, default=1, help="virtual pipeline stages (interleaved)"
    )
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--fsdp", default=None, choices=("full", "hybrid"), help="FSDP sharding")
    p.add_argument(
        "--recompute",
        default=None,
        help="none (the default), selective, full or every-K; under --framework torchtitan "
        "its own: none, selective (= selective:op, per-op SAC), selective:N (layer SAC), full",
    )
    p.add_argument("--attention", default="sdpa", help="sdpa, flash, efficient, eager")
    p.add_argument("--activation-model", default="ops", choices=("ops", "korthikanti"))
    add_knob_arguments(p)
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer state in CPU memory")
    p.add_argument(
        "--offload-param",
        action="store_true",
        help="DeepSpeed ZeRO-3: 16-bit parameter partitions in CPU memory (needs --zero 3)",
    )
    p.add_argument(
        "--inference", action="store_true", help="weights + KV cache instead of training"
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        type=_args.png_file,
        default=None,
        help="write a PNG: this layout's bill by category beside the planner's best layouts",
    )
    add_megatron_arguments(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the bill as JSON")
    out.add_argument("--markdown", action="store_true", help="print the bill as a Markdown table")
    p.set_defaults(func=run)


def add_knob_arguments(p: argparse.ArgumentParser) -> None:
    """The rest of ``TrainingKnobs``, ``ActivationKnobs`` and ``MoEKnobs`` (and ``device``):
    every knob of ``gpumem.estimate`` has its flag (tests/test_cli.py holds the list)."""
    p.add_argument(
        "--attention-dropout",
        type=_args.probability,
        default=0.0,
        help="attention dropout probability (Megatron's --attention-dropout; default 0; a BERT "
        "config.json's attention_probs_dropout_prob when 0)",
    )
    p.add_argument(
        "--target-seq",
        type=_args.positive_int,
        default=None,
        help="an encoder-decoder's (T5's) target tokens per sample: the decoder's length and "
        "the loss's (default: --seq-len, the encoder's)",
    )
    p.add_argument(
        "--fused-ops",
        type=_args.name_list(FUSED_OPS),
        default=None,
        help=f"kernels that run fused, comma-separated from {', '.join(FUSED_OPS)}, or 'none' "
        "(default: the framework's; Megatron fuses norm, swiglu, rope)",
    )
    p.add_argument(
        "--moe-dispatcher",
        default=None,
        choices=MOE_DISPATCHERS,
        help="MoE token dispatch under expert parallelism (Megatron's "
        "--moe-token-dispatcher-type; default alltoall)",
    )
    p.add_argument(
        "--moe-grouped-gemm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="experts as one grouped GEMM (Megatron's --moe-grouped-gemm; default: on for "
        "config.json models and Megatron, a loop over experts for gpumem.models)",
    )
    p.add_argument(
        "--foreach",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.optim's foreach step (default: torch's choice for the device)",
    )
    p.add_argument("--fused-optimizer", action="store_true", help="torch.optim's fused=True step")
    p.add_argument(
        "--persistent-grads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gradients stay allocated across steps (default: when distributed or "
        "accumulating; torchtitan: no)",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: compare with a CPU run (no CUDA context or NCCL reserve; default cuda)",
    )


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's arguments of the same names (``--framework megatron``; see
    gpumem/estimator/frameworks/megatron.py)."""
    from gpumem.estimator.frameworks.cuda_graphs import CUDA_GRAPH_SCOPES
    from gpumem.estimator.frameworks.megatron import (
        FP8_RECIPES,
        OFFLOAD_MODULES,
        RECOMPUTE_MODULES,
    )
    from gpumem.estimator.frameworks.torchtitan import FLOAT8_RECIPES

    g = p.add_argument_group("Megatron-LM (--framework megatron)")
    g.add_argument(
        "--fp8-recipe",
        default=None,
        choices=tuple(dict.fromkeys(FP8_RECIPES + FLOAT8_RECIPES)),
        help="fp8 recipe: Transformer Engine's under --framework megatron (delayed, tensorwise, "
        "mxfp8, blockwise); torchao's under --framework torchtitan (tensorwise, rowwise, "
        "rowwise_with_gw_hp)",
    )
    g.add_argument("--fp8-param-gather", action="store_true", help="fp8 primary weights")
    g.add_argument(
        "--hidden-dropout", type=float, default=0.0, help="--hidden-dropout (Megatron: 0.1)"
    )
    g.add_argument("--defer-embedding-wgrad", action="store_true", help="deferred output wgrad")
    g.add_argument("--wgrad-deferral-limit", type=_args.non_negative_int, default=0)
    g.add_argument("--pipeline-first-layers", type=_args.non_negative_int, default=None)
    g.add_argument("--pipeline-last-layers", type=_args.non_negative_int, default=None)
    g.add_argument("--pipeline-split-embedding", action="store_true")
    g.add_argument("--pipeline-split-loss", action="store_true")
    g.add_argument(
        "--moe-layer-freq", default=None, help="MoE layer pattern: k or e.g. '([0]*1+[1]*27)'"
    )
    g.add_argument("--mtp-layers", type=_args.non_negative_int, default=0, help="MTP layers")
    g.add_argument(
        "--pipeline-model-parallel-layout",
        dest="pipeline_layout",
        default=None,
        metavar="LAYOUT",
        help="Megatron's layout string, e.g. 'Et*3|(tt|)*6L' (its chunks over --pp ranks set "
        "--vpp)",
    )
    for flag, known, what in (
        ("--recompute-modules", RECOMPUTE_MODULES, "with --recompute selective:"),
        ("--offload-modules", OFFLOAD_MODULES, "--fine-grained-activation-offloading of"),
        ("--cuda-graph-scope", CUDA_GRAPH_SCOPES, "per-layer CUDA graphs (TE) of"),
    ):
        g.add_argument(
            flag,
            type=_args.name_list(known),
            default=None,
            help=f"{what} {', '.join(known)} (comma-separated)",
        )
    g.add_argument(
        "--cuda-graph-warmup-steps",
        dest="cuda_graph_warmup_steps",
        type=_args.non_negative_int,
        default=None,
        help="steps before the CUDA graphs' capture (Megatron: 3; 0 captures before the first "
        "optimizer step)",
    )
    g.add_argument(
        "--num-distributed-optimizer-instances",
        dest="dist_opt_instances",
        type=_args.positive_int,
        default=None,
        help="copies of the distributed optimizer, each sharded over dp*cp / N ranks",
    )


FINETUNE_FLAGS = (
    "finetune", "target_modules", "target_regex", "lora_attn_modules", "apply_lora_to_mlp",
    "apply_lora_to_output", "lora_dropout", "finetune_source", "packed",
    "offload_activations", "optimizer_in_bwd", "compile_loss", "compile_layers",
)  # fmt: skip


def add_finetune_args(p: argparse.ArgumentParser) -> None:
    """A fine-tuning recipe's flags (``finetune.FineTune``; docs/estimator.md, "Fine-tuning")."""
    g = p.add_argument_group("fine-tuning recipe (PEFT or torchtune; docs/estimator.md)")
    g.add_argument(
        "--finetune",
        choices=("lora", "dora", "qlora", "full"),
        default=None,
        help="a recipe: adapters of --lora-rank (default 8) on the target modules over a "
        "frozen base (qlora: NF4), or torchtune's full fine-tune",
    )
    g.add_argument(
        "--target-modules",
        metavar="NAMES",
        default=None,
        help="PEFT's target_modules: comma-separated names matched as suffixes "
        "(q_proj,v_proj), or all-linear (default: PEFT's for the model type, q_proj,v_proj)",
    )
    g.add_argument(
        "--target-regex",
        metavar="REGEX",
        default=None,
        help="PEFT's target_modules as a string: a regex over full module names (re.fullmatch)",
    )
    g.add_argument(
        "--lora-attn-modules",
        metavar="NAMES",
        default=None,
        help="torchtune's lora_attn_modules: q_proj,k_proj,v_proj,output_proj",
    )
    g.add_argument("--apply-lora-to-mlp", action="store_true", default=None, help="torchtune's")
    g.add_argument("--apply-lora-to-output", action="store_true", default=None, help="torchtune's")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="lora_dropout (default 0)")
    g.add_argument(
        "--finetune-source",
        choices=("peft", "torchtune"),
        default=None,
        help="whose modules and adapters (default: torchtune when one of its flags is given)",
    )
    g.add_argument(
        "--packed", action="store_true", help="rows packed to --seq-len tokens (dataset.packed)"
    )
    g.add_argument(
        "--offload-activations",
        action="store_true",
        help="torchtune's enable_activation_offloading",
    )
    g.add_argument("--optimizer-in-bwd", action="store_true", help="torchtune's optimizer_in_bwd")
    g.add_argument(
        "--compile-loss",
        action="store_true",
        help="torchtune's compile=True: its compiled loss (a chunk keeps its 16-bit logits)",
    )
    g.add_argument(
        "--compile-layers",
        action="store_true",
        help="torchtune's compile=True: its Inductor-compiled decoder layers (--finetune full)",
    )


def training_knobs(args: argparse.Namespace) -> Any:
    """``TrainingKnobs`` from the flags: a ``FineTune`` recipe when a recipe flag is given."""
    from gpumem.estimator.finetune import FineTune
    from gpumem.estimator.knobs import TrainingKnobs

    given = [n for n in FINETUNE_FLAGS if getattr(args, n, None) not in (None, False, 0.0)]
    common = {
        "grads": args.grads,
        "offload_optimizer": args.offload_optimizer,
        "foreach": args.foreach,
        "fused": args.fused_optimizer,
        "persistent_grads": args.persistent_grads,
    }
    if not given:
        return TrainingKnobs(
            **common, lora_rank=args.lora_rank, base_quant="nf4" if args.qlora else None
        )
    if args.target_modules and args.target_regex:
        raise ValueError("--target-modules and --target-regex both given: give one")
    targets: Any = args.target_regex
    if args.target_modules:
        names = tuple(n.strip() for n in args.target_modules.split(",") if n.strip())
        targets = "all-linear" if names == ("all-linear",) else names
    attn = args.lora_attn_modules
    method = args.finetune or ("qlora" if args.qlora else "lora")
    recipe = FineTune(
        method=method,
        rank=args.lora_rank or 8,
        target_modules=targets,
        lora_attn_modules=tuple(a.strip() for a in attn.split(",")) if attn else None,
        apply_lora_to_mlp=args.apply_lora_to_mlp,
        apply_lora_to_output=args.apply_lora_to_output,
        dropout=args.lora_dropout,
        source=args.finetune_source,
        packed=args.packed,
        offload_activations=args.offload_activations,
        optimizer_in_bwd=args.optimizer_in_bwd,
        compile_loss=args.compile_loss,
        compile_layers=args.compile_layers,
    )
    return TrainingKnobs(**common, finetune=recipe)


def knobs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The grouped knobs of ``gpumem.estimate`` from the command line (checked as made)."""
    from gpumem.estimator.frameworks.deepspeed import ZeroConfig, knobs_from_cli
    from gpumem.estimator.frameworks.megatron import check_knobs
    from gpumem.estimator.frameworks.torchtitan import titan_knobs
    from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs

    fw = args.framework
    titan = fw == "torchtitan"  # --fp8-recipe is torchtitan's float8 there
    megatron = {n: getattr(args, n) for n in MEGATRON if n != "fp8_recipe" or not titan}
    megatron = {k: v for k, v in megatron.items() if v is not None}
    deepspeed = knobs_from_cli(args.deepspeed, args.ds_config)
    if args.offload_param:  # ZeRO-3's parameter offload, also a ds_config key
        deepspeed = dataclasses.replace(ZeroConfig.from_dict(deepspeed), offload_param="cpu")
    return {
        "training": training_knobs(args),
        "activations": ActivationKnobs(
            attention=args.attention,
            dropout=args.attention_dropout,
            activation_model=args.activation_model,
            keep_logits=args.keep_logits,
            fused_ops=args.fused_ops,
            target_seq=args.target_seq,
        ),
        # a knob of a framework not named is named as such, before its value is checked
        "megatron": check_knobs(fw if fw is not None else "megatron", **megatron),
        "torchtitan": titan_knobs(
            fw if fw is not None else "torchtitan",
            fp8_recipe=args.fp8_recipe if titan else None,
            fsdp_float8_all_gather=args.fsdp_float8_all_gather,
            loss_chunks=args.loss_chunks,
            compiled_loss=args.compiled_loss,
            **{
                k: v
                for k, v in (
                    ("pp_schedule", args.pp_schedule),
                    ("pp_microbatch_size", args.pp_microbatch_size),
                )
                if v is not None
            },
        ),
        "deepspeed": deepspeed,
        "moe": MoEKnobs(
            **({} if args.moe_imbalance is None else {"imbalance": args.moe_imbalance}),
            **({} if args.moe_dispatcher is None else {"dispatcher": args.moe_dispatcher}),
            grouped_gemm=args.moe_grouped_gemm,
        ),
    }


MEGATRON = (
    "fp8_recipe",
    "fp8_param_gather",
    "hidden_dropout",
    "defer_embedding_wgrad",
    "wgrad_deferral_limit",
    "pipeline_first_layers",
    "pipeline_last_layers",
    "pipeline_split_embedding",
    "pipeline_split_loss",
    "dist_opt_instances",
    "pipeline_layout",
    "recompute_modules",
    "offload_modules",
    "cuda_graph_scope",
    "cuda_graph_warmup_steps",
)


def model_with_shape(args: argparse.Namespace):
    """The model, with ``--moe-layer-freq`` / ``--mtp-layers`` applied when given."""
    if args.moe_layer_freq is None and not args.mtp_layers:
        return args.model
    from gpumem.estimator.frameworks.megatron import layer_pattern
    from gpumem.estimator.resolver import resolve_model

    spec = resolve_model(args.model)
    changes: dict = {"mtp_layers": args.mtp_layers}
    if args.moe_layer_freq is not None:
        freq = args.moe_layer_freq.strip()
        changes["moe_layer_freq"] = layer_pattern(
            int(freq) if freq.isdigit() else freq, spec.n_layers
        )
        changes["first_k_dense"] = 0
    return spec.replace(**changes)


def layout_from_args(args: argparse.Namespace):
    """A Layout from --gpus/--dp/--tp/--pp/--cp/--ep/--etp; dp defaults to what the others
    leave."""
    from gpumem.estimator import Layout

    tp, pp, ep, cp = args.tp or 1, args.pp or 1, args.ep or 1, args.cp or 1
    if args.gpus % (tp * pp * cp):
        raise ValueError(f"--gpus {args.gpus} is not divisible by tp*pp*cp = {tp * pp * cp}")
    vpp = args.vpp
    if getattr(args, "pipeline_layout", None) and vpp == 1:  # the layout's chunks per rank
        from gpumem.estimator.frameworks.megatron import layout_chunks

        vpp = max(1, len(layout_chunks(args.pipeline_layout)) // pp)
    dp = args.dp or args.gpus // (tp * pp * cp)
    if dp * tp * pp * cp != args.gpus:
        raise ValueError(
            f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * tp * pp * cp}, but --gpus is {args.gpus}"
        )
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        zero=args.zero,
        fsdp=args.fsdp,
        sp=args.sp,
        vpp=vpp,
        cp=cp,
        etp=args.etp,
    )


def inference_layout(args: argparse.Namespace) -> tuple[int, int, str]:
    """(tp, pp, note) for serving on --gpus: the given --tp/--pp, else all GPUs as tensor
    parallelism; never silently one GPU's worth when more were asked for."""
    gpus = args.gpus or 1
    tp, pp = args.tp, args.pp
    if tp is None and pp is None:
        tp, pp = gpus, 1
        note = (
            f"all {gpus} GPUs as tensor parallelism; --tp/--pp split otherwise" if gpus > 1 else ""
        )
    else:
        tp, pp = tp or max(1, gpus // (pp or 1)), pp or max(1, gpus // (tp or 1))
        note = ""
    if tp * pp != gpus:
        raise ValueError(
            f"--inference: tp*pp = {tp}*{pp} = {tp * pp} but --gpus is {gpus}; one model "
            "replica spans the GPUs given (use `gpumem plan --inference` for replicas)"
        )
    return tp, pp, note


def inference_precision(precision: str | None) -> str:
    """A training precision name read as the weights' dtype for serving (bf16-mixed -> bf16;
    None: the default, bf16)."""
    p = (precision or "bf16-mixed").lower()
    for train, serve in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")):
        if p.startswith(train):
            return serve
    return p


def run(args: argparse.Namespace) -> int:
    if args.inference:
        if args.plot:
            raise ValueError("--plot draws a training bill; leave it out with --inference")
        from gpumem.estimator.inference import estimate_inference

        tp, pp, note = inference_layout(args)
        bill = estimate_inference(
            args.model,
            batch_size=args.batch_size or 1,
            context=args.seq_len,
            precision=inference_precision(args.precision),
            kv_dtype=args.kv_dtype,
            gpu=args.gpu,
            gpu_memory=args.gpu_memory,
            tp=tp,
            pp=pp,
            engine=args.engine,
            calibration=args.calibration,
            layout_source=note or None,
        )
        print(json.dumps(bill.to_dict(), indent=2) if args.json else bill.table())
        return 0
    from gpumem.estimator import estimate, find_gpu

    layout = layout_from_args(args)
    bill = estimate(
        model_with_shape(args),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        gpu=find_gpu(args.gpu, args.gpu_memory),
        layout=layout,
        precision=args.precision,
        optimizer=args.optimizer,
        recompute=args.recompute,
        grad_accum=args.grad_accum,
        framework=args.framework,
        calibration=args.calibration,
        alloc_conf=args.alloc_conf,
        device=args.device,
        **knobs_from_args(args),
    )
    if args.json:
        print(bill.to_json())
    else:
        if args.calibration is not None:
            from gpumem.calibrate import load

            print(load(args.calibration).reserve_line(bill.gpu))
        print(bill.table(markdown=args.markdown))
        if args.pipeline_ranks:
            print()
            print(bill.pipeline_table())
        if bill.calibration:
            from gpumem.calibrate.memory import calibration_lines

            print("\n".join(["", *calibration_lines(bill)]))
    if args.plot:
        from gpumem.planner.layout_chart import plot_layouts

        plot_layouts(bill, args.plot, n_gpus=args.gpus)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
