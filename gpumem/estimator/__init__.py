"""Estimate: the per-GPU memory bill of a training (or inference) job, before booking GPUs.

    >>> import gpumem
    >>> layout = gpumem.Layout(dp=8, tp=8, zero=1)
    >>> bill = gpumem.estimate("llama-2-70b", seq_len=4096, layout=layout)
    >>> bill.per_gpu["total"], bill.fits

Modules, bottom up: ``specs`` (``ModelSpec``: presets, config.json, exact counts), ``gpus``
(catalog and reserve), ``layout``, ``states`` (bytes per parameter), ``activations`` /
``backward`` (what ops save, the widest backward moment), ``peak`` (the one assembly formula),
``terms`` (the terms every model shares), ``bill`` (the ``Bill`` and how terms become one),
``preset`` (described models), ``module_structure`` / ``module_inputs`` / ``module_pass`` /
``module_estimate`` (an ``nn.Module``: exact counts and a fake-tensor pass), ``api``
(``estimate``, the front door), ``inference`` (KV cache), ``accuracy`` (estimate against a
measured profile), ``memory_fit`` (its coefficients fitted to profiles).
"""

from gpumem.estimator.api import estimate
from gpumem.estimator.bill import Bill
from gpumem.estimator.gpus import CATALOG, GPU, find_gpu
from gpumem.estimator.layout import Layout
from gpumem.estimator.specs import PRESETS, ModelSpec, module_param_count, resolve_model
from gpumem.estimator.states import Training

__all__ = [
    "CATALOG",
    "GPU",
    "PRESETS",
    "Bill",
    "Layout",
    "ModelSpec",
    "Training",
    "estimate",
    "find_gpu",
    "module_param_count",
    "resolve_model",
]
