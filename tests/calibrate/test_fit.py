"""fit_line: the closed form against hand computations, numpy's least squares, and the KKT
conditions of the non-negative problem; fit_cost: bandwidth and fixed cost fitted apart."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.calibrate import CalibrationError, LinearFit, fit_cost, fit_line

M = 2**20


def test_exact_line_through_three_points():
    f = fit_line([1_000, 2_000, 4_000], [0.3, 0.5, 0.9])
    assert f.intercept_s == pytest.approx(0.1, abs=1e-12)
    assert f.seconds_per_byte == pytest.approx(2e-4, rel=1e-12)
    assert f.rms_residual_s == pytest.approx(0.0, abs=1e-12)
    assert (f.n_points, f.min_bytes, f.max_bytes) == (3, 1_000, 4_000)
    assert f.predict(3_000) == 0.7


def test_least_squares_by_hand():
    # x = 1, 2, 3 MiB, y = 1, 2, 2 s: x̄ = 2M, ȳ = 5/3, Sxx = 2M², Sxy = M
    # -> b = 1/(2M), a = 5/3 - 1 = 2/3; residuals -1/6, 1/3, -1/6 -> SSE 1/6, rms sqrt(1/18)
    f = fit_line([M, 2 * M, 3 * M], [1.0, 2.0, 2.0])
    assert f.seconds_per_byte == pytest.approx(1 / (2 * M), rel=1e-12)
    assert f.intercept_s == pytest.approx(2 / 3, rel=1e-12)
    assert f.rms_residual_s == pytest.approx(math.sqrt(1 / 18), rel=1e-12)


def test_negative_intercept_becomes_line_through_origin():
    # unconstrained: b = 0.4/M, a = -0.3 (infeasible). Through the origin: b = 1.1M/(5M²) = 0.22/M,
    # SSE 0.0144 + 0.0036 = 0.018; constant 0.3: SSE 0.08 -> through the origin wins.
    f = fit_line([M, 2 * M], [0.1, 0.5])
    assert f.intercept_s == 0.0
    assert f.seconds_per_byte == pytest.approx(0.22 / M, rel=1e-12)
    assert f.rms_residual_s == pytest.approx(math.sqrt(0.018 / 2), rel=1e-9)


def test_negative_slope_becomes_constant():
    # unconstrained b < 0. Origin: b = 0.22/M, SSE 0.098; constant 0.4: SSE 0.02 -> constant.
    f = fit_line([M, 2 * M], [0.5, 0.3])
    assert (f.intercept_s, f.seconds_per_byte) == (pytest.approx(0.4), 0.0)
    assert f.gb_per_s is None


def test_no_growth_measured_scales_the_largest_point_above_the_range():
    """Sizes too small to show the proportional part (b = 0) must not call a bigger state free."""
    f = fit_line([M, 2 * M], [0.5, 0.3])  # the constant 0.4 s, as above
    assert f.predict(2 * M) == pytest.approx(0.4) and not f.bounded_above(2 * M)
    assert f.bounded_above(2 * M + 1) and f.predict(200 * M) == pytest.approx(0.4 * 100)
    assert f.predict(M // 2) == pytest.approx(0.4)  # below the range: the constant still holds
    healthy = LinearFit(0.1, 1e-9, 2, 100, 200, 0.0)
    assert not healthy.bounded_above(10**6) and healthy.predict(10**6) == pytest.approx(0.1 + 1e-3)


def test_bandwidth_and_extrapolation():
    f = LinearFit(0.0, 1e-9, 2, 100, 200, 0.0)
    assert f.gb_per_s == pytest.approx(1.0)
    assert not f.extrapolates(150) and f.extrapolates(99) and f.extrapolates(201)


@pytest.mark.parametrize(
    "xs, ys, match",
    [
        ([M, M], [0.1, 0.2], "at least two"),
        ([M], [0.1], "at least two"),
        ([M, 2 * M], [0.1], "one time per size"),
        ([0, M], [0.1, 0.2], "positive"),
        ([M, 2 * M], [0.1, float("nan")], "finite"),
        ([M, 2 * M], [0.1, -0.2], "finite"),
    ],
)
def test_bad_input(xs, ys, match):
    with pytest.raises(CalibrationError, match=match):
        fit_line(xs, ys)


points = st.lists(
    st.tuples(st.integers(1, 2**40), st.floats(0, 1e4, allow_nan=False, allow_infinity=False)),
    min_size=2,
    max_size=12,
).filter(lambda p: len({x for x, _ in p}) >= 2)


@settings(max_examples=300, deadline=None)
@given(points)
def test_constrained_least_squares_is_optimal(pts):
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    f = fit_line(xs, ys)
    a, b = f.intercept_s, f.seconds_per_byte
    assert a >= 0 and b >= 0
    # KKT of min ||y - a - b x||² s.t. a, b >= 0, in units of the data's scale
    x = np.array(xs, dtype=np.float64) / max(xs)
    y = np.array(ys, dtype=np.float64)
    r = y - a - b * max(xs) * x
    scale = max(1.0, float(np.abs(y).max())) * len(xs)
    ga, gb = -r.sum() / scale, -(x * r).sum() / scale
    tol = 1e-7
    assert ga >= -tol and gb >= -tol
    if a > 1e-12 * max(1.0, float(y.max())):
        assert abs(ga) <= tol
    if b * max(xs) > 1e-12 * max(1.0, float(y.max())):
        assert abs(gb) <= tol
    # where the unconstrained solution is feasible it is numpy's
    A = np.stack([np.ones_like(x), x], axis=1)
    (a0, b0), *_ = np.linalg.lstsq(A, y, rcond=None)
    if a0 > 1e-9 and b0 > 1e-9:
        assert a == pytest.approx(a0, rel=1e-6, abs=1e-9 * scale)
        assert b * max(xs) == pytest.approx(b0, rel=1e-6, abs=1e-9 * scale)


# -- fit_cost: the bandwidth where it dominates, the fixed cost apart ---------------------------

G = 2**30


def test_a_bump_at_the_smallest_size_moves_the_fixed_cost_not_the_bandwidth():
    # 0.25 s + 0.8 s/GiB at 512 MiB and 1 GiB; 64 MiB measured 0.15 s slow (noise, a first file).
    # One line through all three takes 20 % off the slope (4 GiB: 2.96 s for 3.45 s); here the
    # bandwidth is the large sizes' own and the bump lands in a alone (4 GiB: 3.60 s, +4 %).
    xs, ys = [64 * M, 512 * M, G], [0.25 + 0.05 + 0.15, 0.25 + 0.4, 0.25 + 0.8]
    f = fit_cost(xs, ys)
    assert f.seconds_per_byte == pytest.approx(0.8 / G, rel=1e-12)
    assert f.intercept_s == pytest.approx(0.40, rel=1e-12)
    assert f.predict(4 * G) == pytest.approx(3.60, rel=1e-9)
    assert fit_line(xs, ys).predict(4 * G) < 3.0  # the old fit, 14 % low
    assert (f.n_points, f.min_bytes, f.max_bytes) == (3, 64 * M, G)


def test_the_bandwidth_is_the_slope_of_the_sizes_within_a_factor_4_of_the_largest():
    # 256 MiB, 512 MiB and 1 GiB give the slope (least squares, 1 s/GiB); 16 MiB gives a
    xs = [16 * M, 256 * M, 512 * M, G]
    ys = [0.07, 0.30, 0.50, 1.05]
    f = fit_cost(xs, ys)
    b = np.polyfit([0.25, 0.5, 1.0], ys[1:], 1)[0] / G
    assert f.seconds_per_byte == pytest.approx(b, rel=1e-9)
    assert f.intercept_s == pytest.approx(0.07 - b * 16 * M, rel=1e-9)


def test_two_sizes_give_the_line_through_both():
    f = fit_cost([64 * M, G], [0.1, 0.85])
    assert f.seconds_per_byte == pytest.approx(0.75 / (G - 64 * M), rel=1e-12)
    assert f.predict(64 * M) == pytest.approx(0.1) and f.predict(G) == pytest.approx(0.85)


def test_no_measurable_fixed_cost_is_zero_not_negative():
    f = fit_cost([64 * M, 256 * M, G], [0.0, 0.2, 1.0])
    assert f.intercept_s == 0.0 and f.seconds_per_byte == pytest.approx(0.8 / (0.75 * G))


def test_large_sizes_without_growth_fall_back_to_the_constrained_line():
    xs, ys = [64 * M, 256 * M, G], [0.1, 0.5, 0.4]
    assert fit_cost(xs, ys) == fit_line(xs, ys)


def test_fit_cost_bad_input_names_itself():
    with pytest.raises(CalibrationError, match="fit_cost: 1 distinct size"):
        fit_cost([M, M], [0.1, 0.2])
