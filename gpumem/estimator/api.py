"""``gpumem.estimate``: the front door of the estimator.

It checks the arguments every model shares and hands the job to one of two paths, which meet
again in ``bill.make_bill``:

- a described model (preset name, ``config.json``, dict, ``ModelSpec``): ``preset.py``;
- an ``nn.Module``: ``module_estimate.py`` (exact counts and a fake-tensor pass; needs torch).

Example:
    >>> import gpumem
    >>> bill = gpumem.estimate("llama-2-70b", batch_size=1, seq_len=4096, precision="bf16-mixed",
    ...                        optimizer="adamw", gpu="H100-80GB", recompute="selective",
    ...                        layout=gpumem.Layout(dp=8, tp=8, pp=1, zero=1))
    >>> bill.fits, bill.per_gpu["total"]
    >>> print(bill.table())
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf, NotSimulated, resolve
from gpumem.calibrate.calibration import split_calibration
from gpumem.calibrate.memory import apply_memory_calibration
from gpumem.estimator import inputs
from gpumem.estimator.bill import Bill
from gpumem.estimator.deepspeed import ZeroConfig, host_bytes
from gpumem.estimator.frameworks import (
    default_grads,
    default_keep_logits,
    engine,
    resolve_framework,
)
from gpumem.estimator.gpus import FRAGMENTATION, GPU, find_gpu
from gpumem.estimator.layout import Layout
from gpumem.estimator.megatron import MegatronKnobs, check_knobs
from gpumem.estimator.preset import MOE_IMBALANCE, estimate_preset
from gpumem.estimator.specs import ModelSpec, resolve_model
from gpumem.estimator.states import Training, split_fp8_precision


def estimate(
    model: Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str | None = None,
    optimizer: str | None = None,
    gpu: str | GPU | None = "H100-80GB",
    gpu_memory: str | int | None = None,
    layout: Layout | None = None,
    recompute: str | None = None,
    grad_accum: int | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    grads: str | None = None,
    offload_optimizer: bool = False,
    lora_rank: int = 0,
    base_quant: str | None = None,
    activation_model: str = "ops",
    device: str = "cuda",
    keep_logits: bool | None = None,
    persistent_grads: bool | None = None,
    foreach: bool | None = None,
    fused: bool = False,
    example_input: Any = None,
    loss_fn: Any = None,
    framework: str | None = None,
    moe_imbalance: float = MOE_IMBALANCE,
    moe_dispatcher: str = "alltoall",
    moe_grouped_gemm: bool | None = None,
    fused_ops: tuple[str, ...] | None = None,
    calibration: Any = None,
    fp8_recipe: str | None = None,
    fp8_param_gather: bool = False,
    hidden_dropout: float = 0.0,
    defer_embedding_wgrad: bool = False,
    wgrad_deferral_limit: int = 0,
    pipeline_first_layers: int | None = None,
    pipeline_last_layers: int | None = None,
    pipeline_split_embedding: bool = False,
    pipeline_split_loss: bool = False,
    deepspeed: dict[str, Any] | ZeroConfig | None = None,
    offload_param: bool = False,
    alloc_conf: Any = None,
    loss_chunks: int = 0,
    fsdp_float8_all_gather: bool = False,
    compiled_loss: bool = False,
) -> Bill:
    """Estimate the per-GPU peak memory of training ``model``.

    Args:
        model: a preset name, config.json path, dict, ModelSpec, gpumem.models config, or an
            ``nn.Module`` (real, meta or fake: see below).
        batch_size: micro-batch per GPU (default 1; for a module: its example's dim 0).
        seq_len: tokens per sample (default: the model's context; for a module: the example's).
        precision / optimizer / grads / offload_optimizer / lora_rank / base_quant: see Training.
        gpu / gpu_memory: a catalog name, or the memory of a GPU not in the catalog.
        layout: the parallel layout (default: one GPU).
        recompute: ``none``, ``selective``, ``full`` or ``every-K`` (checkpoint K layers at once).
        grad_accum: micro-batches per step (also the pipeline's micro-batch count).
        attention: ``sdpa`` (the backend PyTorch picks), ``flash``, ``efficient``,
            ``cpu-flash`` or ``eager``/``math`` (s² scores).
        activation_model: ``ops`` (what autograd saves) or ``korthikanti`` (the paper).
        device: ``cuda``, or ``cpu`` to compare with a CPU run (no context/NCCL reserve).
        keep_logits: the training loop holds the logits (``logits = model(x)`` lives until the
            next forward replaces it: through backward and the optimizer step). Default: the
            framework's loop (``transformers``' ``Trainer`` keeps only the loss, Megatron's model
            computes it inside forward: False; the others' ``logits = model(x)``: True).
        persistent_grads: gradients stay allocated across steps (default: when distributed or
            accumulating; plain single-GPU ``zero_grad(set_to_none=True)`` frees them; under
            ``framework="torchtitan"`` default False, its ``set_to_none=True`` step: True is
            0.3.0's CUDA-graph default, ``zero_grad(set_to_none=False)``).
        foreach / fused: torch.optim's step implementation (see Training.step_temp_bytes).
        example_input: for an ``nn.Module``: one micro-batch of its forward's inputs, a
            tensor, a tuple (positional) or a dict (keyword), real, meta or fake; dim 0 of every
            tensor is set to ``batch_size`` and dim 1 of integer (token id) tensors to
            ``seq_len`` when given. Or a function ``(batch_size, seq_len) -> inputs`` (called
            under fake tensors). Built-in ``gpumem.models`` modules default to their example batch.
        loss_fn: for an ``nn.Module``: ``output -> scalar loss`` (default: cross-entropy over the
            output's last dimension against integer targets; a scalar output or ``.loss`` is
            the loss itself).
        framework: whose recipe and buffer conventions: ``transformers``, ``megatron``,
            ``deepspeed``, ``fsdp2``, ``torchtitan`` or ``torch`` (default: transformers for a
            config.json model; else fsdp2 when ``layout.fsdp``, deepspeed when
            ``layout.zero >= 1``, else torch); see ``gpumem/estimator/frameworks.py``. ``grads``
            defaults to the framework's (Megatron: fp32 main grads under mixed precision; else
            ``compute``). ``torchtitan`` is its Llama recipe with its own ``recompute`` names
            (``selective`` = per-op SAC, ``selective:N`` = layer SAC, ``full``, ``none``;
            ``gpumem/estimator/torchtitan.py``).
        moe_imbalance: tokens of the most loaded expert-parallel rank over the mean (default
            1.25, the usual capacity factor; applies when ``layout.ep > 1``).
        moe_dispatcher: ``alltoall`` or ``allgather`` token dispatch under expert parallelism.
        moe_grouped_gemm: experts as one grouped GEMM (default for config.json models and
            Megatron) or a loop over experts (gpumem.models).
        fused_ops: which of ``norm``, ``swiglu``, ``rope``, ``ce`` run as fused kernels
            (Transformer Engine, Apex, Liger; default: the framework's, Megatron fuses the
            first three, the others none).
        deepspeed: DeepSpeed's ``zero_optimization`` knobs (a ds_config dict, its
            ``zero_optimization`` section, or a ``ZeroConfig``): ``reduce_bucket_size``,
            ``allgather_bucket_size``, ``contiguous_gradients``, ``overlap_comm``,
            ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
            ``stage3_max_reuse_distance``, ``stage3_param_persistence_threshold``,
            ``sub_group_size``, ``offload_optimizer`` / ``offload_param`` (``"cpu"`` or
            ``{"device": "cpu"}``); DeepSpeed's defaults otherwise. Needs
            DeepSpeed to run the job (``framework="deepspeed"``, the default for ``zero >= 1``,
            or ``transformers`` with ``zero >= 1``); see
            ``gpumem/estimator/deepspeed.py``. ``bill.host_bytes`` is then the pinned host memory
            per node that offload needs.
        offload_param: DeepSpeed ZeRO-3's ``offload_param`` to the CPU (also a ``deepspeed`` key).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` (string or ``gpumem.allocator.AllocConf``)
            under which the step's allocations run through the simulated caching allocator:
            ``bill.peak_reserved_bytes`` and the fragmentation in ``overhead`` come from it
            (docs/estimator.md, "Reserved memory"). None (default): the environment's. A
            malformed setting is a ``ValueError`` naming the option; an environment setting
            the simulator does not reproduce (``backend:cudaMallocAsync``) falls back to the
            flat fragmentation share with ``bill.reserved_note`` saying why. ``False``: the
            flat share without simulating. The nn.Module path and ``device="cpu"`` keep the
            flat share.
        loss_chunks: ``framework="torchtitan"`` only: 0 computes the loss on the whole logits
            (``CrossEntropyLoss``, the published runs), N as 0.3.0's llama3 recipes do with
            ``ChunkedLossWrapper(num_chunks=N)`` (their default 8): lm_head and the loss per
            sequence chunk, each chunk's backward before the decoder's.
        fsdp_float8_all_gather: ``framework="torchtitan"`` with ``fp8_recipe="tensorwise"``
            only: torchao's ``enable_fsdp_float8_all_gather`` (with
            ``precompute_float8_dynamic_scale_for_fsdp``): FSDP gathers the converted weights
            in float8.
        compiled_loss: ``framework="torchtitan"`` only: the loss compiled by Inductor, as
            ``--training.compile`` does from 2025 (``build_cross_entropy_loss``; e7c0cae): the
            logits stay saved and no fp32 logits-sized tensor is made
            (``gpumem/estimator/titan_compile.py``); the compiled blocks are priced as eager.
        calibration: a ``gpumem.Calibration`` or the path of a calibration.json: the GPU gets
            the reserve measured there (``Calibration.apply_to``), and with a ``memory``
            section (``gpumem calibrate --memory``) its fitted coefficients scale the
            categories; ``bill.calibration`` then records per category the uncalibrated bytes
            and the fit's residual (a file fitted for another architecture or device is used
            with a warning naming the mismatch).
        fp8_recipe / fp8_param_gather / hidden_dropout / defer_embedding_wgrad /
            wgrad_deferral_limit / pipeline_first_layers / pipeline_last_layers /
            pipeline_split_embedding / pipeline_split_loss: Megatron-LM's ``--fp8-recipe``
            (``delayed``, ``tensorwise``, ``mxfp8``, ``blockwise``; ``precision="fp8"`` is
            delayed), ``--fp8-param-gather``, ``--hidden-dropout`` (Megatron's default 0.1;
            ``dropout`` is the attention's), ``--defer-embedding-wgrad-compute``,
            ``--wgrad-deferral-limit``, ``--decoder-first/last-pipeline-num-layers``,
            ``--account-for-embedding/loss-in-pipeline-split``; ``framework="megatron"`` only
            (``gpumem/estimator/megatron.py``), except ``fp8_recipe``, which
            ``framework="torchtitan"`` takes with its own recipes: ``tensorwise`` (torchao's,
            the published runs), ``rowwise``, ``rowwise_with_gw_hp`` (0.3.0's
            ``Float8LinearConverter``; ``gpumem/estimator/torchtitan.py``). MTP layers and the
            MoE layer pattern are model shape: ``ModelSpec.mtp_layers``,
            ``ModelSpec.moe_layer_freq``.

    An ``nn.Module`` is never run, moved or changed, and nothing of its size is allocated:
    parameters are counted exactly (tied tensors once; trainable = ``requires_grad``; the
    precision sets the weight dtype as ``module.to(dtype)`` would, buffers count as weights),
    and a copy made of fake tensors runs one forward, loss and backward at the micro-batch under
    ``gpumem.profile``. Its saved activations per block and its widest backward moment become
    the peak terms; model states, layouts, the optimizer step and the CUDA reserve use the same
    formulas as presets. Assumptions (docs/estimator.md, "The nn.Module path"): blocks are the
    largest group of identical sibling modules; tensor parallelism splits every matrix and every
    saved tensor except those the size of a block's input (replicated unless ``layout.sp``);
    ``recompute="full"`` checkpoints every block of the copy (measured); ``"selective"``,
    ``every-K`` (K > 1), ``ep > 1``, LoRA arguments and the Korthikanti model need a preset or
    config. The pass runs on fake CUDA tensors when a GPU is present, else on fake CPU tensors
    (same sizes up to the 512-byte CUDA rounding; SDPA then takes the CPU kernel's shapes).

    Raises:
        ValueError / LookupError: bad sizes, unknown names, invalid layouts, with the reason.
    """
    # what the caller passed is "given" in the bill, even a default's value
    given = inputs.given_inputs(
        precision=precision, optimizer=optimizer, recompute=recompute, grad_accum=grad_accum
    )
    precision = inputs.DEFAULT_PRECISION if precision is None else precision
    optimizer = inputs.DEFAULT_OPTIMIZER if optimizer is None else optimizer
    recompute = inputs.DEFAULT_RECOMPUTE if recompute is None else recompute
    grad_accum = inputs.DEFAULT_GRAD_ACCUM if grad_accum is None else grad_accum
    layout = layout or Layout()
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a gpumem.Layout, got {type(layout).__name__}")
    module = is_module(model)
    if not module and (example_input is not None or loss_fn is not None):
        raise ValueError("example_input and loss_fn apply to an nn.Module model only")
    spec = None if module else model if isinstance(model, ModelSpec) else resolve_model(model)
    fw = resolve_framework(framework, layout, hf=spec is not None and spec.is_hf)
    precision, fp8_recipe = split_fp8_precision(precision, fp8_recipe)
    if fp8_recipe is not None and framework is None:
        fw = "megatron" if layout.zero in (0, 1, 3) and not layout.fsdp else fw
    # torchtitan's float8 (torchao) is its own recipe, not Transformer Engine's: checked there
    titan_fp8, fp8_recipe = (fp8_recipe, None) if fw == "torchtitan" else (None, fp8_recipe)
    if fw != "torchtitan" and fsdp_float8_all_gather:
        raise ValueError(
            f"fsdp_float8_all_gather is torchtitan's (torchao's FSDP float8 all-gather); "
            f"framework={fw!r} has no such knob (use framework='torchtitan' with "
            "fp8_recipe='tensorwise'; Megatron's counterpart is fp8_param_gather)"
        )
    if fw != "torchtitan" and compiled_loss:
        raise ValueError(
            f"compiled_loss is torchtitan's (--training.compile compiles its loss); "
            f"framework={fw!r} does not model torch.compile"
        )
    knobs = check_knobs(
        fw,
        fp8_recipe=fp8_recipe,
        fp8_param_gather=fp8_param_gather,
        hidden_dropout=hidden_dropout,
        defer_embedding_wgrad=defer_embedding_wgrad,
        wgrad_deferral_limit=wgrad_deferral_limit,
        pipeline_first_layers=pipeline_first_layers,
        pipeline_last_layers=pipeline_last_layers,
        pipeline_split_embedding=pipeline_split_embedding,
        pipeline_split_loss=pipeline_split_loss,
    )
    if grads is None:
        grads = default_grads(fw, Training(precision).master_bytes > 0)
    zero = zero_config(deepspeed, fw, layout, offload_param)
    training = Training(
        precision,
        optimizer,
        grads,
        offload_optimizer or (zero is not None and zero.offload_optimizer == "cpu"),
        lora_rank,
        base_quant,
        foreach,
        fused,
        offload_param=zero is not None and zero.offload_param == "cpu",
        deepspeed=zero,
    )
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu, gpu_memory)
    cal, mem = split_calibration(calibration)
    if cal is not None:
        g = cal.apply_to(g)
    for name, value in (("batch_size", batch_size), ("grad_accum", grad_accum)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    common = {
        "training": training,
        "layout": layout,
        "gpu": g,
        "seq_len": seq_len,
        "recompute": recompute,
        "grad_accum": grad_accum,
        "attention": attention,
        "dropout": dropout,
        "activation_model": activation_model,
        "device": device,
        "keep_logits": keep_logits,
        "persistent_grads": persistent_grads,
        "framework": fw,
        "given": given,
    }
    if fw != "torchtitan" and loss_chunks:
        raise ValueError(
            f"loss_chunks is torchtitan's ChunkedLossWrapper; framework={fw!r} has none "
            "(use framework='torchtitan', or loss_chunks=0)"
        )
    if fw == "torchtitan" and keep_logits:
        raise ValueError(
            "keep_logits=True does not apply to framework='torchtitan': its train step deletes "
            "pred before backward (leave keep_logits unset)"
        )
    if spec is None:
        if fw == "torchtitan":
            raise ValueError(
                "framework='torchtitan' prices torchtitan's own Llama from a described model "
                "(a preset, config.json or ModelSpec), not an nn.Module"
            )
        # imported here, not above: the module path needs torch, presets and configs do not
        from gpumem.estimator.module_estimate import estimate_module

        if knobs != MegatronKnobs():
            raise ValueError("the Megatron-LM knobs apply to a described model, not an nn.Module")
        if keep_logits is None:
            common["keep_logits"] = default_keep_logits(fw)
        conf, note = resolve_alloc_conf(alloc_conf, g)
        return estimate_module(
            model,
            batch_size=batch_size,
            example_input=example_input,
            loss_fn=loss_fn,
            alloc_conf=conf,
            reserved_note=note,
            **common,
        )
    conf, note = resolve_alloc_conf(alloc_conf, g)
    bill = estimate_preset(
        spec,
        alloc_conf=conf,
        reserved_note=note,
        batch_size=batch_size,
        moe_imbalance=moe_imbalance,
        moe_dispatcher=moe_dispatcher,
        moe_grouped_gemm=moe_grouped_gemm,
        fused_ops=fused_ops,
        knobs=knobs,
        loss_chunks=loss_chunks,
        titan_float8=(titan_fp8, fsdp_float8_all_gather),
        titan_compiled_loss=compiled_loss,
        **common,
    )
    if mem is not None:
        bill = apply_memory_calibration(bill, mem)
    return with_host_bytes(bill, g)


def resolve_alloc_conf(alloc_conf: Any, gpu: GPU | None = None) -> tuple[AllocConf | None, str]:
    """(the settings to simulate, or None with the reason): ``alloc_conf=`` as given, or the
    environment's; a given setting the simulator does not reproduce is an error, an
    environment's one a note (the estimate then uses the flat fragmentation share). A GPU
    carrying a measured fragmentation (a calibration's profile of the user's own step) keeps
    that measured share unless ``alloc_conf`` is given: a measurement beats the simulation."""
    if alloc_conf is False:
        return None, "alloc_conf=False"
    if alloc_conf is None and gpu is not None and gpu.fragmentation != FRAGMENTATION:
        return None, f"the calibration's measured fragmentation, {gpu.fragmentation:.2%}"
    try:
        return resolve(alloc_conf), ""
    except NotSimulated as exc:
        if alloc_conf is not None:
            raise
        return None, f"{exc}; fragmentation as the flat share"


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


def with_host_bytes(bill: Bill, gpu: GPU) -> Bill:
    """The bill with DeepSpeed offload's pinned host memory per node (``deepspeed.host_bytes``)."""
    tr, lay = bill.training, bill.layout
    if engine(bill.framework, lay) != "deepspeed" or tr.deepspeed is None or lay.stage < 1:
        return bill
    trainable = bill.n_params / (lay.tp * lay.pp)  # full training (LoRA offloads little)
    host = host_bytes(
        tr.deepspeed,
        lay.stage,
        trainable=trainable,
        n_shard=lay.shard_degree(gpu.gpus_per_node),
        gpus_per_node=min(gpu.gpus_per_node, lay.n_gpus),
        state_bytes=tr.optimizer_bytes,
        weight_bytes=tr.weight_bytes,
    )
    return dataclasses.replace(bill, host_bytes=host)


def is_module(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch when nothing did yet)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)
