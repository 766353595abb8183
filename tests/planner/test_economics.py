"""Preemption economics against hand computations.

The model (planner/economics.py): preemptions at random with mean M; a segment of s seconds
(work + stall) is retried until it runs without a preemption. Expected retries e^{s/M} - 1, each
losing the mean time run before the preemption, M - s/(e^{s/M} - 1), plus the restart R and
(with checkpoints) the persist lag P; so a segment takes (M + R + P)(e^{s/M} - 1). Without
checkpoints the run is one segment: (M + R)(e^{T/M} - 1), the issue's (e^{T/M} - 1)·M for R = 0.
Every number below is recomputed here with math only.
"""

import math

import pytest

from gpumem.planner import economics, realised
from gpumem.planner.economics import NO_FINISH_FACTOR

H = 3600.0


def test_without_checkpoints_is_the_restart_from_zero_formula():
    # issue #13: T = 47 h, M = 100 h, R = 0: (e^{T/M} - 1) * M
    e = economics(
        n_gpus=64,
        price_per_gpu_hour=3.0,
        mtbf_hours=100,
        run_hours=47,
        stall_s=0,
        persist_s=0,
        restart_s=0,
    )
    expected_h = (math.exp(47 / 100) - 1) * 100
    assert expected_h == pytest.approx(59.9994, abs=1e-4)  # by hand: e^0.47 = 1.5999942
    assert e.finishes_without
    assert e.expected_hours_without == pytest.approx(expected_h, rel=1e-12)
    assert e.expected_cost_without == pytest.approx(expected_h * 64 * 3.0, rel=1e-12)
    assert e.expected_preemptions_without == pytest.approx(math.exp(0.47) - 1, rel=1e-12)


def test_the_47_hour_64_h100_case():
    """64 H100 at $3/GPU-h, a 47 h run, MTBF 100 h, C = 2 s, P = 60 s, R = 300 s."""
    M, T, C, P, R = 100 * H, 47 * H, 2.0, 60.0, 300.0
    e = economics(
        n_gpus=64,
        price_per_gpu_hour=3.0,
        mtbf_hours=100,
        run_hours=47,
        stall_s=C,
        persist_s=P,
        restart_s=R,
    )
    tau = math.sqrt(2 * C * M)
    assert tau == pytest.approx(1200.0)  # Young/Daly: sqrt(2 * 2 * 360000)
    assert e.interval_s == pytest.approx(tau)
    s = tau + C
    with_s = T / tau * (M + R + P) * (math.exp(s / M) - 1)
    assert e.expected_hours_with == pytest.approx(with_s / H, rel=1e-12)
    without_s = (M + R) * (math.exp(T / M) - 1)
    assert e.expected_hours_without == pytest.approx(without_s / H, rel=1e-12)
    assert e.expected_cost_with == pytest.approx(with_s / H * 192, rel=1e-12)
    assert e.expected_saving == pytest.approx((without_s - with_s) / H * 192, rel=1e-12)
    assert e.cost_failure_free == 47 * 192 == 9024
    # the parts add up: failure-free time (with stalls) + preemptions x loss each
    ff = T * (1 + C / tau)
    assert ff + e.expected_preemptions_with * e.loss_per_preemption_with_s == pytest.approx(
        with_s, rel=1e-9
    )
    assert T + e.expected_preemptions_without * e.loss_per_preemption_without_s == pytest.approx(
        without_s, rel=1e-9
    )
    # first order (Daly): T (1 + C/tau + (tau/2 + P + R)/M), close for tau << M
    assert e.waste_fraction == pytest.approx(C / tau + (tau / 2 + P + R) / M, rel=0.01)
    # the realised loss of the story: preempted at hour 47 with no checkpoint
    loss = realised(
        hours=47,
        n_gpus=64,
        price_per_gpu_hour=3.0,
        mtbf_hours=100,
        stall_s=C,
        persist_s=P,
        restart_s=R,
    )
    assert loss.without_checkpoint == 9024.0
    assert loss.with_checkpoint_at_most == pytest.approx(64 * 3 * (tau + P + R) / H)


def test_a_week_at_six_hours_mtbf_does_not_finish_without_checkpoints():
    """The issue's case: 168 h, MTBF 6 h. (M + R)(e^28 - 1) is ~1.5e12 h: no finish."""
    e = economics(n_gpus=64, price_per_gpu_hour=3.0, mtbf_hours=6, run_hours=168)
    assert not e.finishes_without
    assert e.expected_hours_without is None and e.expected_cost_without is None
    assert e.expected_saving is None
    text = e.table()
    assert "does not finish in expectation" in text
    assert "$16,144" not in text and "half the run" not in text  # the old understatement
    # with checkpoints: C 1, P 60, R 300 (the defaults), tau = sqrt(2 * 21600) = 207.85 s
    tau = math.sqrt(2 * 1 * 6 * H)
    with_s = 168 * H / tau * (6 * H + 300 + 60) * (math.exp((tau + 1) / (6 * H)) - 1)
    assert e.expected_hours_with == pytest.approx(with_s / H, rel=1e-12)


@pytest.mark.parametrize(
    "run, finishes",
    [
        (6.0, True),  # (e^6 - 1)/6 = 67.1x the run
        (7.0, False),  # (e^7 - 1)/7 = 156.5x the run
        (1000.0, False),  # e^1000 overflows a float
    ],
)
def test_no_finish_threshold_is_100x_the_run(run, finishes):
    e = economics(n_gpus=1, mtbf_hours=1, run_hours=run, stall_s=0, persist_s=0, restart_s=0)
    ratio = math.expm1(run) / run if run < 700 else math.inf
    assert (ratio <= NO_FINISH_FACTOR) == finishes == e.finishes_without


def test_headline_and_table_agree():
    e = economics(
        n_gpus=64,
        price_per_gpu_hour=3.0,
        mtbf_hours=100,
        run_hours=47,
        stall_s=2,
        persist_s=60,
        restart_s=300,
    )
    head = e.headline()
    row_with = next(line for line in e.table().splitlines() if "with checkpoints" in line)
    row_without = next(line for line in e.table().splitlines() if "without checkpoints" in line)
    hours, cost = f"{e.expected_hours_with:,.1f} h", f"${e.expected_cost_with:,.0f}"
    assert hours in head and cost in head and hours in row_with and cost in row_with
    hours_no, cost_no = f"{e.expected_hours_without:,.1f} h", f"${e.expected_cost_without:,.0f}"
    assert hours_no in head and cost_no in head and hours_no in row_without
    assert f"${e.expected_saving:,.0f}" in head
    d = e.to_dict()
    assert d["expected_cost_with"] == e.expected_cost_with and d["finishes_without"] is True


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"stall_s": 5, "persist_s": 2}, "persist_s 2 is shorter than stall_s 5"),
        ({"restart_s": -1}, "restart_s must be"),
        ({"stall_s": float("nan")}, "stall_s must be"),
        ({"mtbf_hours": 0}, "mtbf_hours must be a positive finite number"),
        ({"mtbf_hours": float("inf")}, "mtbf_hours must be a positive finite number"),
        ({"run_hours": -3}, "run_hours must be a positive finite number"),
    ],
)
def test_physical_limits_are_enforced(kw, match):
    args = {"n_gpus": 8, "mtbf_hours": 24, **kw}
    with pytest.raises(ValueError, match=match):
        economics(**args)
