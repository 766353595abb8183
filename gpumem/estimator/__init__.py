"""Estimate: the per-GPU memory bill of a training (or inference) job, before booking GPUs.

    >>> import gpumem
    >>> layout = gpumem.Layout(dp=8, tp=8, zero=1)
    >>> bill = gpumem.estimate("llama-2-70b", seq_len=4096, layout=layout)
    >>> bill.per_gpu["total"], bill.fits

Modules, bottom up:

    param_count        exact parameter counts, split the way parallelism splits them
    model_spec         ``ModelSpec``: the shape of a model, checked when made
    model_presets      the built-in models (``PRESETS``), one row of named fields each
    hf_config          a ``ModelSpec`` from a Hugging Face config.json
    resolver           ``resolve_model``: whatever a user passes as a model, as a ``ModelSpec``
    gpus               the GPU catalog and the reserve a job cannot use
    layout             ``Layout``: dp/tp/pp/ep/zero/fsdp/sp and their checks
    states             bytes per parameter of weights, gradients and optimizer state
    activations        what autograd saves, op by op
    hf_ops             what transformers' decoder modules save for backward
    t5_ops             what transformers' T5 (encoder-decoder) saves for backward
    finetune           ``FineTune``: LoRA / DoRA / QLoRA by target modules (PEFT, torchtune)
    lora_ops           what an adapted layer saves over a frozen base
    tune_compiled      what torchtune's Inductor-compiled decoder layer saves (``compile=True``)
    frameworks/        each framework's conventions, knobs and buffers (Megatron, torchtitan, ...)
    backward           a layer's widest backward moment
    peak               the one peak formula (numba-compiled for the planner)
    terms              the peak terms every model shares
    inputs             the inputs a bill states (seq_len, micro-batch, ...) and their sources
    bill               the ``Bill``, and how terms become one
    param_tensors      a described model's parameters as the tensors its modules register
    step_trace         a rank's step as allocations, through the simulated caching allocator
    rank_shapes        a preset rank's tensors for step_trace, and its fragmentation term
    sim_cache          an opt-in on-disk cache of step simulations (GPUMEM_CACHE_DIR), JSON only
    preset             a described model's terms for any layout
    module_structure   an ``nn.Module``'s repeated blocks and counts
    module_inputs      its fake copy and the fake inputs of one micro-batch
    module_pass        the fake-tensor pass and the terms it yields
    module_estimate    the bill of an ``nn.Module``
    knobs              ``TrainingKnobs``, ``ActivationKnobs``, ``MoEKnobs``: grouped, checked
    job                ``Job``: every argument of an estimate checked before any work
    api                ``estimate``, the front door: checks, calibration, then a path above
    preflight          before a real profile: will it fit in this machine's memory?
    inference          KV cache and serving
    accuracy           an estimate against a measured profile (the accuracy check)
    memory_fit         the coefficients fitted to profiles (``gpumem calibrate --memory``)
"""

from gpumem.estimator.api import estimate
from gpumem.estimator.bill import Bill
from gpumem.estimator.frameworks.deepspeed import ZeroConfig
from gpumem.estimator.frameworks.megatron import MegatronKnobs
from gpumem.estimator.frameworks.torchtitan import TorchtitanKnobs
from gpumem.estimator.gpus import CATALOG, GPU, find_gpu
from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs, TrainingKnobs
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_presets import PRESETS
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import module_param_count
from gpumem.estimator.resolver import resolve_model
from gpumem.estimator.states import Training

__all__ = [
    "CATALOG",
    "GPU",
    "PRESETS",
    "ActivationKnobs",
    "Bill",
    "Layout",
    "MegatronKnobs",
    "MoEKnobs",
    "ModelSpec",
    "TorchtitanKnobs",
    "Training",
    "TrainingKnobs",
    "ZeroConfig",
    "estimate",
    "find_gpu",
    "module_param_count",
    "resolve_model",
]
