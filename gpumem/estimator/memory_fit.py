"""Fit the estimator's per-architecture coefficients: profile small proxy models of the user's
architecture, estimate the same jobs, and solve ``measured ≈ c · estimated`` per category
(``memory.fit_category``).

Proxies: for a built-in architecture (``gpt2``, ``llama``, ``mixtral``: gpumem.models) real
training steps on the CPU under ``gpumem.profile``; for a transformers family (a
``model_type``, or the family of ``--config config.json``) the model transformers builds from a
shrunken copy of the config, profiled under fake tensors. Each proxy varies batch, sequence
length and precision so that the fit sees the terms move. On CUDA the proxies run for real on
the GPU and the allocator's fragmentation (reserved over allocated at the peak) is measured too.

    mem = fit_memory(arch="llama")                         # or config="path/config.json"
    cal = Calibration(..., memory=mem); cal.save("calibration.json")

It writes a section of calibrate/'s file (``calibrate/memory.py``) but lives here: it runs the
estimator, and calibrate/ sits below the estimator, which reads calibration files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumem.calibrate._schema import CalibrationError
from gpumem.calibrate.memory import (
    CATEGORIES,
    MemoryCalibration,
    arch_key,
    check_points,
    fit_category,
)
from gpumem.estimator.accuracy import (
    HF_SWEEP,
    PROFILER_CATEGORIES,
    Case,
    HFCase,
    compare,
    compare_hf,
)
from gpumem.estimator.hf_config import from_hf_config
from gpumem.estimator.resolver import from_model_config

BUILTIN = ("gpt2", "llama", "mixtral")
# (batch, seq, precision) of the proxy runs: enough spread to separate the terms
PROXY_RUNS = ((1, 32, "fp32"), (2, 64, "fp32"), (2, 64, "bf16-autocast"), (4, 32, "bf16"))
_BUILTIN_SIZES = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256}


def families() -> list[str]:
    """Every architecture ``--arch`` accepts."""
    hf = sorted({cfg["model_type"] for cfg in HF_SWEEP.values()})
    return [*BUILTIN, *hf]


def shrink_config(config: dict[str, Any]) -> dict[str, Any]:
    """A proxy of a transformers config: its family and structure (GQA ratio, experts, MLA,
    dense first layer, shared experts) at a size that profiles in a second."""
    mtype = config.get("model_type")
    base = next((dict(c) for c in HF_SWEEP.values() if c["model_type"] == mtype), None)
    if base is None:
        raise CalibrationError(
            f"model_type {mtype!r} has no proxy; known families: {', '.join(families())}"
        )
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and "num_key_value_heads" in base:
        ratio = max(1, heads // kv)
        base["num_key_value_heads"] = max(1, base["num_attention_heads"] // ratio)
    for key in ("tie_word_embeddings", "attention_bias", "num_experts_per_tok"):
        if key in config:
            base[key] = config[key]
    return base


def _proxy_cases(arch: str | None, config: dict[str, Any] | None) -> list[Any]:
    if config is not None:
        cfg = shrink_config(config)
        return [HFCase(f"proxy b{b} s{s} {p}", cfg, p, False, b, s) for b, s, p in PROXY_RUNS]
    if arch in BUILTIN:
        over = dict(_BUILTIN_SIZES)
        if arch != "gpt2":
            over["num_kv_heads"] = 2
        if arch == "mixtral":
            over.update(num_experts=4, top_k=2, ffn_hidden_size=64)
        return [
            Case(f"proxy b{b} s{s} {p}", arch, dict(over, seq_len=s), b, s, autocast=p != "fp32")
            for b, s, p in PROXY_RUNS
            if p != "bf16"  # gpumem.models' reference loop trains fp32 parameters
        ]
    raise CalibrationError(f"unknown architecture {arch!r}; known: {', '.join(families())}")


def fit_memory(
    arch: str | None = None, config: str | Path | dict[str, Any] | None = None, device: str = "cpu"
) -> MemoryCalibration:
    """Profile the proxies of ``arch`` (or of ``config``'s family) and fit the coefficients.

    Args:
        arch: a built-in architecture (gpt2, llama, mixtral) or a transformers model_type.
        config: a config.json path (or its directory, or the dict) whose family to fit.
        device: ``cpu`` (real runs for built-in models, fake-tensor profiles for transformers
            families) or ``cuda`` (real runs on the GPU, with the allocator's fragmentation).

    Raises:
        CalibrationError: neither or both of arch/config, an unknown family, no GPU for cuda.
    """
    if (arch is None) == (config is None):
        raise CalibrationError("give one of arch= (a family) or config= (a config.json)")
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CalibrationError(
                "--device cuda needs a CUDA GPU, and torch sees none: fit on the GPU machine, "
                "or use --device cpu (fake-tensor and CPU profiles; no fragmentation)"
            )
    cfg = _read_config(config) if config is not None else None
    if cfg is None and arch not in BUILTIN:
        cfg = next((dict(c) for c in HF_SWEEP.values() if c["model_type"] == arch), None)
        if cfg is None:
            raise CalibrationError(f"unknown architecture {arch!r}; known: {', '.join(families())}")
    cases = _proxy_cases(arch, cfg)
    points, measured, estimated, frags = [], [], [], []
    for case in cases:
        if device == "cuda":
            _reset_cuda_peak()
        c = compare_hf(case, device) if isinstance(case, HFCase) else compare(case, device=device)
        m = dict(c.measured)
        e = c.estimated
        m_row = {k: int(m.get(k, 0)) for k in PROFILER_CATEGORIES}
        e_row = {k: int(e.get(k, 0)) for k in PROFILER_CATEGORIES}
        points.append({"label": case.name, "measured": m_row, "estimated": e_row})
        measured.append(m_row)
        estimated.append(e_row)
        if device == "cuda":
            frags.append(_cuda_fragmentation())
    check_points(points)
    fits = {
        k: fit_category([m[k] for m in measured], [e[k] for e in estimated])
        for k in CATEGORIES
        if k in PROFILER_CATEGORIES
    }
    spec = from_hf_config(cfg) if cfg is not None else _builtin_spec(cases[0])
    return MemoryCalibration(
        arch=arch_key(spec),
        device=device,
        mode="fake" if isinstance(cases[0], HFCase) and device == "cpu" else "real",
        fits=fits,
        fragmentation=max(frags) if frags else None,
        points=tuple(points),
    )


def _builtin_spec(case: Case) -> Any:
    from gpumem.models import get_config

    return from_model_config(get_config(case.arch, "tiny", **case.overrides))


def _read_config(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise CalibrationError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise CalibrationError(f"{p}: not a transformers config.json (no 'model_type')")
    return data


def _reset_cuda_peak() -> None:
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _cuda_fragmentation() -> float:
    """Reserved over allocated at the allocator's peak, minus one (the last proxy's)."""
    import torch

    alloc = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    return max(0.0, reserved / alloc - 1.0) if alloc else 0.0
