"""Estimate: the per-GPU memory bill of a training (or inference) job, before booking GPUs.

    >>> import gpumem
    >>> bill = gpumem.estimate("llama-2-70b", seq_len=4096, layout=gpumem.Layout(dp=8, tp=8, zero=1))
    >>> bill.per_gpu["total"], bill.fits

Modules: ``models`` (presets, config.json, exact counts), ``gpus`` (catalog and reserve),
``layout``, ``states`` (bytes per parameter), ``activations`` (ops and Korthikanti models),
``peak`` (the one assembly formula), ``bill`` (estimate), ``inference`` (KV cache),
``module`` / ``module_pass`` / ``module_estimate`` (an ``nn.Module``: exact counts and a
fake-tensor pass).
"""

from gpumem.estimator.bill import Bill, estimate
from gpumem.estimator.gpus import CATALOG, GPU, find_gpu
from gpumem.estimator.layout import Layout
from gpumem.estimator.models import PRESETS, ModelSpec, module_param_count, resolve_model
from gpumem.estimator.states import Training

__all__ = ["Bill", "estimate", "CATALOG", "GPU", "find_gpu", "Layout", "PRESETS", "ModelSpec",
           "module_param_count", "resolve_model", "Training"]  # fmt: skip
