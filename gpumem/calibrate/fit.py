"""``seconds = a + b · bytes``: the least-squares line through measured points, in closed form.

A checkpoint's cost has a fixed part (opening files, fsyncs, the commit's renames, thread
hand-offs: ``a``) and a part proportional to its bytes (copies, checksums, the write: ``b``).
Both are non-negative by nature, so the fit is least squares constrained to ``a >= 0`` and
``b >= 0``. Two unknowns make the constrained problem small enough to solve exactly: the
unconstrained solution when it is feasible, else the better of the two edges, the line through
the origin (``a = 0``, ``b = Σxy / Σx²``) and the constant (``b = 0``, ``a = ȳ``). A negative
intercept from noisy timings is thus read as "no measurable fixed cost", never as a negative one.

:func:`fit_cost` is what a calibration uses: the two parts fitted separately, each where it
dominates. The bandwidth ``b`` is the least-squares slope of the sizes within
:data:`BANDWIDTH_SPAN` of the largest (at least the two largest), the fixed cost ``a`` the
smaller sizes' time less their bandwidth part. Small states are all fixed cost and noise: one
line through every size lets a millisecond's noise at 16 MiB tilt the slope that a 28 GiB
prediction multiplies, where here it moves ``a`` alone.

Example:
    >>> f = fit_line([1_000, 2_000, 4_000], [0.3, 0.5, 0.9])
    >>> round(f.intercept_s, 9), round(f.seconds_per_byte, 12)
    (0.1, 0.0002)
    >>> f.predict(3_000)
    0.7
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpumem.calibrate._schema import CalibrationError, Fields

BANDWIDTH_SPAN = 4  # sizes within this factor of the largest give the bandwidth


@dataclass(frozen=True)
class LinearFit:
    """A fitted cost line.

    Attributes:
        intercept_s: ``a``, the fixed seconds of one operation (>= 0).
        seconds_per_byte: ``b`` (>= 0); ``1 / b`` is the effective bandwidth in bytes/s.
        n_points: how many points it was fitted to.
        min_bytes / max_bytes: the range of sizes measured; predictions outside it extrapolate.
        rms_residual_s: root-mean-square distance of the points from the line.
    """

    intercept_s: float
    seconds_per_byte: float
    n_points: int
    min_bytes: int
    max_bytes: int
    rms_residual_s: float

    def predict(self, nbytes: int) -> float:
        """Seconds for ``nbytes`` bytes (rounded to the nanosecond).

        Above the sizes measured, a line that showed no growth (``b = 0``: sizes too small for
        the proportional part to rise above the noise) would call any state free; the largest
        point is scaled in proportion instead, an upper bound (:attr:`bounded_above`)."""
        if self.bounded_above(nbytes):
            return round(self.intercept_s * nbytes / self.max_bytes, 9)
        return round(self.intercept_s + self.seconds_per_byte * nbytes, 9)

    def bounded_above(self, nbytes: int) -> bool:
        """Whether :meth:`predict` gives an upper bound for ``nbytes`` rather than the line."""
        return self.seconds_per_byte == 0 and nbytes > self.max_bytes

    def extrapolates(self, nbytes: int) -> bool:
        """Whether ``nbytes`` lies outside the measured sizes."""
        return not self.min_bytes <= nbytes <= self.max_bytes

    @property
    def gb_per_s(self) -> float | None:
        """Effective bandwidth of the proportional part in GB/s (None when b is 0)."""
        return 1e-9 / self.seconds_per_byte if self.seconds_per_byte > 0 else None

    def to_dict(self) -> dict:
        return {
            "intercept_s": self.intercept_s,
            "seconds_per_byte": self.seconds_per_byte,
            "n_points": self.n_points,
            "min_bytes": self.min_bytes,
            "max_bytes": self.max_bytes,
            "rms_residual_s": self.rms_residual_s,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> LinearFit:
        out = cls(
            intercept_s=f.float("intercept_s"),
            seconds_per_byte=f.float("seconds_per_byte"),
            n_points=f.int("n_points", minimum=2),
            min_bytes=f.int("min_bytes", minimum=1),
            max_bytes=f.int("max_bytes", minimum=1),
            rms_residual_s=f.float("rms_residual_s"),
        )
        f.done()
        if out.max_bytes <= out.min_bytes:
            raise CalibrationError(
                f"{f.where}: max_bytes {out.max_bytes} must exceed "
                f"min_bytes {out.min_bytes} (a line needs two different "
                "sizes); re-run `gpumem calibrate` with two sizes or more"
            )
        return out


def fit_line(nbytes: Sequence[int], seconds: Sequence[float]) -> LinearFit:
    """Least-squares ``seconds = a + b · nbytes`` with ``a, b >= 0``.

    Args:
        nbytes: sizes in bytes (positive integers), at least two distinct.
        seconds: the measured time at each size (finite, >= 0).

    Raises:
        CalibrationError: fewer than two distinct sizes, mismatched lengths, or bad values.
    """
    xs, ys = _checked(nbytes, seconds, "fit_line")
    n = len(xs)
    # centre the sizes first: sums of squares of ~1e9-byte values lose digits otherwise
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b, a = sxy / sxx, my - sxy / sxx * mx
    if a < 0 or b < 0:
        # the optimum lies on an edge of the quadrant: the better of a = 0 and b = 0
        through_origin = (
            0.0,
            sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs),
        )
        constant = (my, 0.0)
        a, b = min(through_origin, constant, key=lambda ab: _sse(xs, ys, *ab))
    return _line(xs, ys, a, b)


def fit_cost(nbytes: Sequence[int], seconds: Sequence[float]) -> LinearFit:
    """``seconds = a + b · nbytes`` with the bandwidth and the fixed cost fitted separately.

    ``b``: the least-squares slope of the points within :data:`BANDWIDTH_SPAN` of the largest
    size (at least the two largest sizes); ``a``: the mean of ``y - b · x`` over the smaller
    points, or the intercept of that slope's line when every point is large. A negative ``a``
    becomes 0 (no measurable fixed cost); large sizes that show no growth (``b <= 0``) leave
    nothing to call a bandwidth, and :func:`fit_line` over every point decides.

    Raises:
        CalibrationError: as :func:`fit_line`.
    """
    xs, ys = _checked(nbytes, seconds, "fit_cost")
    sizes = sorted(set(xs), reverse=True)
    cut = min(sizes[1], sizes[0] / BANDWIDTH_SPAN)
    large = [(x, y) for x, y in zip(xs, ys, strict=True) if x >= cut]
    small = [(x, y) for x, y in zip(xs, ys, strict=True) if x < cut]
    lx, ly = [x for x, _ in large], [y for _, y in large]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    b = sum((x - mx) * (y - my) for x, y in large) / sum((x - mx) ** 2 for x in lx)
    if b <= 0:
        return fit_line(xs, ys)
    a = sum(y - b * x for x, y in small) / len(small) if small else my - b * mx
    return _line(xs, ys, max(0.0, a), b)


def _checked(
    nbytes: Sequence[int], seconds: Sequence[float], name: str
) -> tuple[list[int], list[float]]:
    xs, ys = [int(x) for x in nbytes], [float(y) for y in seconds]
    if len(xs) != len(ys):
        raise CalibrationError(
            f"{name}: {len(xs)} sizes but {len(ys)} times; give one time per size"
        )
    if any(x <= 0 for x in xs) or any(not math.isfinite(y) or y < 0 for y in ys):
        raise CalibrationError(f"{name}: sizes must be positive and times finite and >= 0")
    if len(set(xs)) < 2:
        raise CalibrationError(
            f"{name}: {len(set(xs))} distinct size(s); a line "
            "needs at least two (e.g. --sizes 64MiB,256MiB)"
        )
    return xs, ys


def _line(xs: list[int], ys: list[float], a: float, b: float) -> LinearFit:
    n = len(xs)
    rms = math.sqrt(_sse(xs, ys, a, b) / n)
    return LinearFit(
        intercept_s=a,
        seconds_per_byte=b,
        n_points=n,
        min_bytes=min(xs),
        max_bytes=max(xs),
        rms_residual_s=rms,
    )


def _sse(xs: list[int], ys: list[float], a: float, b: float) -> float:
    return sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
