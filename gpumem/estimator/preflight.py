"""Before a real profile run: will it fit in this machine's memory?

``gpumem profile`` builds and trains a model for real unless ``--fake`` is given. A 70B preset
allocates 70 billion parameters on the host and the kernel's OOM killer ends the process with
no message. So the run's peak is estimated first — by the estimator for the built-in models and
the config.json families it knows (milliseconds), by a one-step profile under fake tensors
otherwise (exact, no memory) — and compared with what the device can still allocate.

Example:
    >>> check = profile_preflight("llama", size="70b", batch_size=1)
    >>> check.fits, check.message()
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpumem.device import available_bytes
from gpumem.units import format_bytes

# gpumem profile's precision and optimizer names -> the estimator's (same bytes per parameter)
_PRECISION = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "bf16",  # pure 16-bit parameters, gradients and states
    "amp-bf16": "bf16-autocast",
    "amp-fp16": "fp16-autocast",
}
_OPTIMIZER = {"adamw": "adamw", "adam": "adam", "sgd": "sgd-momentum", "none": "sgd"}


@dataclass(frozen=True)
class Preflight:
    """The estimated peak of a profile run against the memory available for it."""

    estimate_bytes: int
    available_bytes: int
    where: str
    method: str
    precision: str = "fp32"
    """What the model will be built in (a config.json's torch_dtype unless one was given)."""

    @property
    def fits(self) -> bool:
        return self.estimate_bytes <= self.available_bytes

    def message(self) -> str:
        verdict = "fits in" if self.fits else "exceeds"
        return (
            f"the run's estimated peak {format_bytes(self.estimate_bytes)} ({self.method}, "
            f"{self.precision}) "
            f"{verdict} the {format_bytes(self.available_bytes)} {self.where}"
        )


def profile_preflight(
    model: str,
    *,
    size: str | None = None,
    batch_size: int = 2,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    precision: str | None = None,
    checkpointing: bool = False,
    device: str = "cpu",
) -> Preflight:
    """Estimate the peak of ``gpumem.profiler.runner.profile_model`` with these arguments (not
    fake) and the memory ``device`` has available; in the precision the model will be built in
    (a config.json's ``torch_dtype`` unless ``precision`` is given).

    Raises:
        ValueError: unknown model, size or names (as ``profile_model`` would).
    """
    from gpumem.profiler.runner import build_precision, check_size, is_config_path

    check_size(model, size)
    precision = build_precision(model, precision)
    avail, where = available_bytes(device)
    path = Path(model)
    if is_config_path(model):
        peak, method = _config_peak(path, device, **_job(batch_size, seq_len, optimizer, precision))
    else:
        from gpumem.estimator.resolver import from_model_config
        from gpumem.models import get_config

        spec = from_model_config(get_config(model, "tiny" if size is None else size))
        peak = _estimate(
            spec, device, checkpointing, **_job(batch_size, seq_len, optimizer, precision)
        )
        method = "gpumem.estimate"
    if peak is None:  # a family the estimator does not describe: measure it without memory
        from gpumem.profiler.runner import profile_model

        rep = profile_model(
            model,
            size=size,
            batch_size=batch_size,
            seq_len=seq_len,
            optimizer=optimizer,
            precision=precision,
            checkpointing=checkpointing,
            fake=True,
            steps=1,
        )
        peak, method = rep.peak_bytes, "one step under fake tensors"
    return Preflight(int(peak), int(avail), where, method, precision)


def _job(batch_size: int, seq_len: int | None, optimizer: str, precision: str) -> dict:
    if precision not in _PRECISION or optimizer not in _OPTIMIZER:
        raise ValueError(
            f"precision {precision!r} / optimizer {optimizer!r}: choose precision from "
            f"{', '.join(_PRECISION)} and optimizer from {', '.join(_OPTIMIZER)}"
        )
    return {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "optimizer": _OPTIMIZER[optimizer],
        "precision": _PRECISION[precision],
    }


def _estimate(spec, device: str, checkpointing: bool, **job) -> int:
    from gpumem.estimator.api import estimate
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.knobs import ActivationKnobs, TrainingKnobs

    bill = estimate(
        spec,
        device="cuda" if device.startswith("cuda") else "cpu",
        gpu=find_gpu("H100-80GB", 1 << 60),  # the capacity is compared by the caller, not here
        recompute="full" if checkpointing else "none",
        training=TrainingKnobs(persistent_grads=False),
        activations=ActivationKnobs(keep_logits=True),
        **job,
    )
    # CPU: what the profiler counts; CUDA: plus the context and allocator reserve
    return bill.profiler_categories()["total"] if device == "cpu" else bill.per_gpu["total"]


def _config_peak(path: Path, device: str, **job) -> tuple[int | None, str]:
    from gpumem.estimator.hf_config import HF_FAMILIES, load_config

    try:
        mtype = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None, ""  # the runner reports what is wrong with the file
    if mtype not in HF_FAMILIES:
        return None, ""
    seq = job.pop("seq_len") or 128  # the runner's default for a config.json
    spec = load_config(path)
    return _estimate(spec, device, False, seq_len=seq, **job), "gpumem.estimate"
