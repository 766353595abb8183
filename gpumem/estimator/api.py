"""``gpumem.estimate``: the front door of the estimator.

It checks every argument (``job.check_job``) before any work, then hands the job to one of two
paths, which meet again in ``bill.make_bill``:

- a described model (preset name, ``config.json``, dict, ``ModelSpec``): ``preset.py``;
- an ``nn.Module``: ``module_estimate.py`` (exact counts and a fake-tensor pass; needs torch).

A calibration's memory section scales the categories of either path's bill (a file fitted for
another architecture or device is used with a warning naming the mismatch).

``alloc_conf``: a malformed setting is a ``ValueError`` naming the option; an environment setting
the simulator does not reproduce (``backend:cudaMallocAsync``) falls back to the flat
fragmentation share, with ``bill.reserved_note`` saying why; the nn.Module path simulates one
whole replica only, and ``device="cpu"`` keeps the flat share (docs/estimator.md, "Reserved
memory"). ``example_input``: a tensor, a tuple (positional) or a dict (keyword), real, meta or
fake; dim 0 of every tensor is set to ``batch_size`` and dim 1 of integer (token id) tensors to
``seq_len`` when given; built-in ``gpumem.models`` modules default to their example batch.
``loss_fn`` defaults to cross-entropy over the output's last dimension (a scalar output or
``.loss`` is the loss itself).

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
from gpumem.calibrate.memory import MemoryCalibration, apply_memory_calibration
from gpumem.estimator.bill import Bill
from gpumem.estimator.frameworks.deepspeed import ZeroConfig
from gpumem.estimator.frameworks.megatron import MegatronKnobs
from gpumem.estimator.frameworks.torchtitan import TorchtitanKnobs
from gpumem.estimator.gpus import FRAGMENTATION, GPU
from gpumem.estimator.job import Job, check_job
from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs, TrainingKnobs
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.preset import estimate_preset
from gpumem.estimator.resolver import resolve_model


def estimate(
    model: Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    gpu: str | GPU | None = "H100-80GB",
    layout: Layout | None = None,
    precision: str | None = None,
    optimizer: str | None = None,
    recompute: str | None = None,
    grad_accum: int | None = None,
    framework: str | None = None,
    training: TrainingKnobs | None = None,
    activations: ActivationKnobs | None = None,
    megatron: MegatronKnobs | None = None,
    torchtitan: TorchtitanKnobs | None = None,
    deepspeed: dict[str, Any] | ZeroConfig | None = None,
    moe: MoEKnobs | None = None,
    calibration: Any = None,
    alloc_conf: Any = None,
    device: str = "cuda",
    example_input: Any = None,
    loss_fn: Any = None,
    **flat: Any,
) -> Bill:
    """Estimate the per-GPU peak memory of training ``model`` (docs/estimator.md).

    Args:
        model: a preset name, config.json path, dict, ModelSpec, gpumem.models config, or an
            ``nn.Module`` (never run, moved or changed: ``module_estimate.py``).
        batch_size: micro-batch per GPU (default 1; for a module: its example's dim 0).
        seq_len: tokens per sample (default: the model's context; for a module: the example's).
        gpu: a catalog name or a ``GPU`` (``find_gpu(memory="80GiB")`` for one not in it).
        layout: the parallel layout (default: one GPU).
        precision / optimizer: see ``Training`` (``precision="fp8..."``: an fp8 recipe).
        recompute: ``none``, ``selective``, ``full`` or ``every-K`` (torchtitan: its own names).
        grad_accum: micro-batches per step (also the pipeline's micro-batch count).
        framework: ``transformers``, ``megatron``, ``deepspeed``, ``fsdp2``, ``torchtitan`` or
            ``torch``: whose recipe and buffers (default: ``frameworks.resolve_framework``).
        training / activations / moe: ``knobs.TrainingKnobs`` (grads, offload, LoRA, the
            step's implementation, persistent grads), ``knobs.ActivationKnobs`` (attention,
            dropout, activation model, held logits, fused ops), ``knobs.MoEKnobs``.
        megatron / torchtitan / deepspeed: that framework's knobs: ``MegatronKnobs``,
            ``TorchtitanKnobs``, DeepSpeed's ``zero_optimization`` (a ds_config dict, its
            section or a ``ZeroConfig``; ``bill.host_bytes``: offload's pinned host memory).
        calibration: a ``gpumem.Calibration`` or a calibration.json path: the measured reserve;
            its ``memory`` section scales the categories (``bill.calibration`` says how much).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` the step is simulated under (None: the
            environment's; ``False``: the flat fragmentation share; docs/estimator.md).
        device: ``cuda``, or ``cpu`` to compare with a CPU run (no context/NCCL reserve).
        example_input / loss_fn: for an ``nn.Module``: one micro-batch of its forward's inputs
            (or ``(batch_size, seq_len) -> inputs``) and ``output -> scalar loss``.
        flat: the flat spellings of earlier releases (``grads=``, ``attention=``,
            ``fp8_recipe=``, ``loss_chunks=``, ``moe_imbalance=``, ``offload_param=``,
            ``gpu_memory=``, ...; ``job.FLAT``), each put into its group.

    Raises:
        ValueError / LookupError / TypeError: one line naming the bad argument, before any work.
    """
    module = is_module(model)
    job = check_job(
        model, module=module, flat=flat, batch_size=batch_size, seq_len=seq_len, gpu=gpu,
        layout=layout, precision=precision, optimizer=optimizer, recompute=recompute,
        grad_accum=grad_accum, framework=framework, training=training, activations=activations,
        megatron=megatron, torchtitan=torchtitan, deepspeed=deepspeed, moe=moe, device=device,
        example_input=example_input, loss_fn=loss_fn,
    )  # fmt: skip
    if module:
        # imported here, not above: the module path needs torch, presets and configs do not
        from gpumem.estimator.module_estimate import check_module_job, estimate_module

        check_module_job(model, job)
    job, mem = calibrated(job, calibration, alloc_conf)
    if module:
        bill = estimate_module(model, job)
    else:
        spec = model if isinstance(model, ModelSpec) else resolve_model(model)
        bill = estimate_preset(spec, job)
    return bill if mem is None else apply_memory_calibration(bill, mem)


def calibrated(job: Job, calibration: Any, alloc_conf: Any) -> tuple[Job, MemoryCalibration | None]:
    """(the job on the calibrated GPU under the allocator settings to simulate, the memory
    section to scale the bill by): the first work, after every check (it may read a file)."""
    conf, note = resolve_alloc_conf(alloc_conf) if alloc_conf is not None else (None, "")
    cal, mem = split_calibration(calibration)
    gpu = job.gpu if cal is None else cal.apply_to(job.gpu)
    if alloc_conf is None:  # the environment's, unless the calibration measured it
        conf, note = resolve_alloc_conf(None, gpu)
    return dataclasses.replace(job, gpu=gpu, alloc_conf=conf, reserved_note=note), mem


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


def is_module(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch when nothing did yet)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)
