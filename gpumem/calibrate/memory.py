"""The ``memory`` section of a calibration file: per-architecture coefficients of the estimator,
fitted to profiles, and how an estimate uses them.

For each category the estimator prices (weights, gradients, optimizer, activations,
communication, temporary) the fit holds one coefficient ``c`` with ``measured ≈ c · estimated``
over the proxy runs: least squares through the origin, ``c = Σxy / Σx²`` (a multiplicative
correction: a wrong rule scales with the model, a constant would not), and the fit's residual,
the root-mean-square of ``measured − c · estimated`` over the mean measured bytes, in percent.
On CUDA the section also carries the allocator's fragmentation (reserved over allocated at the
peak) measured on the proxies.

The estimator reads this section only through ``calibration.memory_section`` (the file
format), :func:`apply_memory_calibration` and :func:`category_scales`. The fitting runs the
estimator, so it lives with it (``estimator/memory_fit.py``): calibrate/ imports nothing of the
estimator (measure → report → calibrate → estimate).

Example:
    >>> bill = gpumem.estimate("config.json", calibration="calibration.json")  # doctest: +SKIP
    >>> bill.calibration["per_category"]["activations"]                       # doctest: +SKIP
    {'calibrated': ..., 'uncalibrated': ..., 'coefficient': 1.002, 'residual_pct': 0.4}
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpumem.calibrate._schema import REDO, CalibrationError, Fields, check_float

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "communication", "temporary")
MAX_POINTS = 1000
_COEF_RANGE = (0.05, 20.0)  # a coefficient outside means a broken fit, not a correction


@dataclass(frozen=True)
class CategoryFit:
    """``measured ≈ coefficient · estimated`` for one category."""

    coefficient: float
    residual_pct: float
    n_points: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MemoryCalibration:
    """Fitted coefficients of one architecture on one device kind.

    Attributes:
        arch: the architecture key (``arch_key(spec)``), e.g. ``hf/llama`` or ``gpumem/gpt2``.
        device: ``cpu`` or ``cuda`` (where the proxies ran, real or fake).
        mode: ``real`` or ``fake`` (how the proxies were profiled).
        fits: per category, the coefficient and residual.
        fragmentation: CUDA only: reserved / allocated − 1 at the proxies' peaks (None on CPU).
        points: the proxy runs: their label with measured and estimated bytes per category.
    """

    arch: str
    device: str
    mode: str
    fits: dict[str, CategoryFit]
    fragmentation: float | None = None
    points: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "device": self.device,
            "mode": self.mode,
            "fits": {c: f.to_dict() for c, f in self.fits.items()},
            "fragmentation": self.fragmentation,
            "points": [dict(p) for p in self.points],
        }

    @classmethod
    def from_fields(cls, f: Fields) -> MemoryCalibration:
        arch = f.str("arch")
        device = f.str("device", choices=("cpu", "cuda"))
        mode = f.str("mode", choices=("real", "fake"))
        fits_f = f.obj("fits")
        assert fits_f is not None
        fits = {}
        for c in list(fits_f.data):
            if c not in CATEGORIES:
                raise CalibrationError(
                    f"{fits_f.path(c)}: unknown category; known: {', '.join(CATEGORIES)}; {REDO}"
                )
            g = fits_f.obj(c)
            assert g is not None
            coef = g.float("coefficient")
            assert coef is not None
            if not _COEF_RANGE[0] <= coef <= _COEF_RANGE[1]:
                raise CalibrationError(
                    f"{g.path('coefficient')}: {coef} is outside {_COEF_RANGE}: not a "
                    f"plausible correction; {REDO}"
                )
            fits[c] = CategoryFit(coef, g.float("residual_pct") or 0.0, g.int("n_points", 1) or 1)
            g.done()
        fits_f.done()
        frag = f.float("fragmentation", optional=True)
        points = tuple(
            _point(p, f.path(f"points[{i}]")) for i, p in enumerate(f.list("points", MAX_POINTS))
        )
        f.done()
        return cls(arch or "", device or "cpu", mode or "fake", fits, frag, points)

    def scales(self) -> dict[str, float]:
        return {c: fit.coefficient for c, fit in self.fits.items()}


def _point(p: Any, where: str) -> dict[str, Any]:
    f = Fields(p, where)
    out: dict[str, Any] = {"label": f.str("label")}
    for side in ("measured", "estimated"):
        g = f.obj(side)
        assert g is not None
        out[side] = {c: g.int(c) for c in list(g.data)}
        g.done()
    f.done()
    return out


def fit_category(measured: Sequence[float], estimated: Sequence[float]) -> CategoryFit:
    """Least squares through the origin: ``c = Σxy / Σx²``, with the RMS residual relative to
    the mean measured bytes (a category near zero at some points does not blow it up).

    Raises:
        CalibrationError: no points, or the estimate is zero at every point.
    """
    if not measured or len(measured) != len(estimated):
        raise CalibrationError("a fit needs as many measured as estimated points, at least one")
    sxx = sum(x * x for x in estimated)
    if sxx == 0:
        return CategoryFit(1.0, 0.0, len(measured))
    c = sum(x * y for x, y in zip(estimated, measured, strict=True)) / sxx
    n = len(measured)
    mean = sum(measured) / n
    sq = sum((y - c * x) ** 2 for x, y in zip(estimated, measured, strict=True)) / n
    resid = 100.0 * math.sqrt(sq) / mean if mean else 0.0
    return CategoryFit(c, resid, n)


def arch_key(spec: Any) -> str:
    """The architecture a calibration belongs to: implementation and family."""
    impl = getattr(spec, "impl", "") or "gpumem"
    family = getattr(spec, "family", "") or getattr(spec, "arch", "") or type(spec).__name__
    return f"{impl}/{family}"


def category_scales(mem: MemoryCalibration, spec: Any, device: str) -> dict[str, float]:
    """The per-category coefficients to apply to ``spec`` on ``device``, warning (never
    silently) when the file was fitted for another architecture or device."""
    _warn_mismatch(mem, arch_key(spec), device)
    return mem.scales()


def _warn_mismatch(mem: MemoryCalibration, arch: str, device: str) -> None:
    problems = []
    if mem.arch != arch:
        problems.append(f"fitted for architecture {mem.arch!r}, used for {arch!r}")
    if mem.device != device:
        problems.append(f"fitted on {mem.device!r}, used for {device!r}")
    if problems:
        warnings.warn(
            "memory calibration " + " and ".join(problems) + ": its coefficients are applied "
            "anyway; fit one for this model with `gpumem calibrate --memory --config "
            "config.json --device " + device + "`",
            stacklevel=3,
        )


def apply_memory_calibration(bill: Any, mem: MemoryCalibration) -> Any:
    """``bill`` with each category scaled by the fitted coefficient (every pipeline rank), the
    total, ``fits`` and headroom recomputed, and ``bill.calibration`` recording per category
    the calibrated and uncalibrated bytes and the fit's residual."""
    _warn_mismatch(mem, arch_key(bill.model), bill.inputs.get("device", "cuda"))
    ranks = [_scaled(r, mem) for r in (bill.pipeline_ranks or [bill])]
    worst = max(ranks, key=lambda b: (b.per_gpu["total"], -b.stage))
    return dataclasses.replace(worst, pipeline_ranks=ranks)


def _scaled(bill: Any, mem: MemoryCalibration) -> Any:
    per = dict(bill.per_gpu)
    record = {}
    for c in CATEGORIES:
        fit = mem.fits.get(c)
        before = per[c]
        if fit is not None:
            per[c] = int(min(before * fit.coefficient, 2.0**59))
        record[c] = {
            "calibrated": per[c],
            "uncalibrated": before,
            "coefficient": fit.coefficient if fit else 1.0,
            "residual_pct": fit.residual_pct if fit else None,
        }
    if mem.fragmentation is not None and bill.inputs.get("device", "cuda") == "cuda":
        allocated = sum(per[c] for c in CATEGORIES)
        frag_before = int(allocated * bill.gpu.fragmentation)
        if bill.peak_reserved_bytes is not None:  # the simulated fragmentation in overhead
            frag_before = bill.unreleasable_bytes
        per["overhead"] = max(0, per["overhead"] - frag_before) + int(allocated * mem.fragmentation)
    per["total"] = sum(per[c] for c in CATEGORIES) + per["overhead"]
    cal = {
        "arch": mem.arch,
        "device": mem.device,
        "mode": mem.mode,
        "fragmentation": mem.fragmentation,
        "per_category": record,
    }
    return dataclasses.replace(
        bill,
        per_gpu=per,
        fits=per["total"] <= bill.gpu.total_bytes,
        headroom_bytes=bill.gpu.total_bytes - per["total"],
        calibration=cal,
    )


def calibration_lines(bill: Any) -> list[str]:
    """Per category: calibrated, uncalibrated and the fit's residual (what the CLI prints)."""
    cal = bill.calibration
    if not cal:
        return []
    lines = [
        f"memory calibration ({cal['arch']}, fitted on {cal['device']} {cal['mode']} profiles):",
        f"  {'category':<14}{'calibrated':>16}{'uncalibrated':>16}{'coef':>8}{'residual':>10}",
    ]
    for c, r in cal["per_category"].items():
        res = "-" if r["residual_pct"] is None else f"{r['residual_pct']:.2f} %"
        lines.append(
            f"  {c:<14}{r['calibrated']:>16,}{r['uncalibrated']:>16,}{r['coefficient']:>8.3f}"
            f"{res:>10}"
        )
    if cal["fragmentation"] is not None:
        lines.append(f"  fragmentation (measured): {cal['fragmentation']:.2%}")
    return lines


def check_points(points: Sequence[dict[str, Any]]) -> None:
    """Each point's bytes are finite and non-negative (the fit's input)."""
    for p in points:
        for side in ("measured", "estimated"):
            for c, v in p[side].items():
                check_float(v, f"points.{p['label']}.{side}.{c}")
