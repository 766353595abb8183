"""C, P and R resolution (gpumem.planner.checkpoint_times) and calibrated economics from the
Python API: gpumem.plan(..., calibration=...)."""

import copy
import json
import math

import pytest

import gpumem
from gpumem.calibrate import Calibration
from gpumem.planner import checkpoint_times
from gpumem.planner.economics import DEFAULT_PERSIST_S, DEFAULT_RESTART_S, DEFAULT_STALL_S

MiB, GiB = 2**20, 2**30


def test_defaults_and_given_values():
    t = checkpoint_times()
    assert t.values() == {
        "stall_s": DEFAULT_STALL_S,
        "persist_s": DEFAULT_PERSIST_S,
        "restart_s": DEFAULT_RESTART_S,
    }
    assert t.guessed == ["stall_s", "persist_s", "restart_s"] and "guesses" in t.notes[-1]
    t = checkpoint_times(stall_s=2, restart_s=0)
    assert t.sources == {"stall_s": "given", "persist_s": "default guess", "restart_s": "given"}


def test_a_given_stall_above_the_default_persist_raises_p():
    t = checkpoint_times(stall_s=120)
    assert t.persist_s == 120 and t.sources["persist_s"].startswith("raised to the stall C")
    assert any("P = C is used" in n for n in t.notes)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"stall_s": 5, "persist_s": 1}, "persist_s 1 is shorter than stall_s 5"),
        ({"restart_s": -1}, "restart_s must be"),
        ({"startup_s": 10}, "startup_s adds to the restore time"),
    ],
)
def test_contradictions_are_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_times(**kw)


def _calibration(valid, durable=(2.0, 4e-9), stall=(0.5, 1e-9)) -> Calibration:
    data = copy.deepcopy(valid)
    fits = data["checkpoint"]["fits"]
    fits["durable_s"]["intercept_s"], fits["durable_s"]["seconds_per_byte"] = durable
    fits["overlap_stall_s"]["intercept_s"], fits["overlap_stall_s"]["seconds_per_byte"] = stall
    return Calibration.from_dict(data)


def test_extrapolated_persist_below_the_stall_is_raised_to_it(valid):
    # at 1 GiB the fits give stall 0.5 + 1e-8 * 2^30 = 11.24 s but durable 0.1 + 1e-9 * 2^30
    # = 1.17 s: a checkpoint durable before it was taken; P = C is used instead
    cal = _calibration(valid, durable=(0.1, 1e-9), stall=(0.5, 1e-8))
    t = checkpoint_times(cal, checkpoint_bytes=GiB)
    stall = 0.5 + 1e-8 * GiB
    assert t.stall_s == pytest.approx(stall) and t.persist_s == pytest.approx(stall)
    assert t.sources["persist_s"] == "raised to the stall C (measured: time to durable)"
    assert t.calibration["extrapolated"] is True  # 1 GiB is beyond the 64-256 MiB measured
    assert t.restart_s == pytest.approx(1.0 + 3e-9 * GiB + 300)  # restore + default startup


def test_plan_with_a_calibration_file_prices_the_best_layout(valid, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(valid))
    res = gpumem.plan("gpt2", n_gpus=8, calibration=str(path))
    assert res.calibration is not None and res.calibration.path == str(path)
    assert res.gpu.context_bytes == 900 * MiB  # the measured reserve is applied
    n = res.checkpoint_bytes()
    states = res.bill().model_states
    assert n == states["weights"] + states["optimizer"]
    e = res.economics(mtbf_hours=24, run_hours=100, price_per_gpu_hour=2.0)
    stall, persist = 0.5 + 1e-9 * n, 2.0 + 4e-9 * n
    restart = 1.0 + 3e-9 * n + 300
    assert (e.stall_s, e.persist_s, e.restart_s) == pytest.approx((stall, persist, restart))
    tau = max(math.sqrt(2 * stall * 24 * 3600), persist)
    M, T = 24 * 3600.0, 100 * 3600.0
    expected = T / tau * (M + restart + persist) * math.expm1((tau + stall) / M)
    assert e.expected_hours_with == pytest.approx(expected / 3600, rel=1e-12)
    assert e.n_gpus == 8 and e.expected_cost_with == pytest.approx(expected / 3600 * 16)


def test_within_the_checked_factor_the_times_say_how_far_they_reach(valid):
    cal = Calibration.from_dict(valid)  # measured up to 256 MiB (+ 4 KiB of step counters)
    t = checkpoint_times(cal, checkpoint_bytes=768 * MiB)
    top = 256 * MiB + 4096
    assert t.extrapolation_factor == pytest.approx(768 * MiB / top)
    assert t.extrapolation_limit == 4.0 and not t.beyond_calibration
    assert t.extrapolation_warning is None
    assert "3x the largest: within the 4x the calibration was checked to" in t.notes[0]
    assert t.calibration["largest_bytes"] == top and t.calibration["extrapolation_limit"] == 4.0


def test_past_the_checked_factor_the_headline_line_says_so(valid):
    # the demo's case: a 28 GiB state from a calibration that measured up to 256 MiB
    t = checkpoint_times(Calibration.from_dict(valid), checkpoint_bytes=28 * GiB)
    assert t.beyond_calibration and t.extrapolation_factor == pytest.approx(112, rel=1e-4)
    assert t.extrapolation_warning == (
        "checkpoint times extrapolated to 112x the largest size calibrated "
        "(256.00 MiB; checked to 4x): calibrate nearer the checkpoint size"
    )
    assert "extrapolated to 112x the largest size measured" in t.notes[0]
    assert "beyond the 4x the calibration was checked to" in t.notes[0]
    d = t.to_dict()
    assert (d["extrapolation_factor"], d["extrapolation_limit"]) == (t.extrapolation_factor, 4.0)


def test_no_calibrated_prediction_has_no_factor(valid):
    assert checkpoint_times(stall_s=1).extrapolation_factor is None
    t = checkpoint_times(Calibration.from_dict(valid), checkpoint_bytes=None)
    assert t.extrapolation_factor is None and t.extrapolation_warning is None
    assert not t.beyond_calibration
