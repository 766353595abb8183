"""Notice windows: the providers' notices, the node's final save against one (hand-computed),
the advice with the numbers each option needs, bad input, and ``gpumem plan --notice``.

The model: a node's ranks save at once, so its storage takes ``node_bytes = ranks × rank_bytes``
with the calibration's time to durable ``a + b · node_bytes`` (without one: 1 GB/s, a guess);
the notice must hold the step in flight plus that save.
"""

import json

import pytest

from gpumem.calibrate import Calibration
from gpumem.calibrate.calibration import Machine
from gpumem.calibrate.checkpoint_cost import CheckpointCost
from gpumem.calibrate.fit import LinearFit
from gpumem.cli import main
from gpumem.planner import NOTICE_S, final_save_fit, notice_seconds
from gpumem.planner.notice import NOTICE_SOURCES

GB, MiB = 10**9, 2**20


def _cal(a: float, b: float, max_bytes: int = 256 * MiB) -> Calibration:
    durable = LinearFit(a, b, n_points=3, min_bytes=64 * MiB, max_bytes=max_bytes, rms_residual_s=0)
    cost = CheckpointCost("/nvme/ckpt", "xfs", "cpu", 3, (), {"durable_s": durable})
    return Calibration("2026-12-01T00:00:00Z", Machine("h", "cpu", 2, 1 << 30, None), {}, cost)


def test_the_published_notices_and_their_sources():
    assert NOTICE_S == {"aws": 120, "gcp": 30, "azure": 30, "gke": 15}
    assert set(NOTICE_SOURCES) == {*NOTICE_S, "slurm"}
    assert all(url.startswith("https://") for url in NOTICE_SOURCES.values())
    assert [notice_seconds(s) for s in ("aws", " GCP ", "azure", "gke")] == [120, 30, 30, 15]
    assert notice_seconds("45") == notice_seconds("45s") == notice_seconds(45) == 45.0
    assert notice_seconds(0.5) == 0.5


@pytest.mark.parametrize(
    "spec, match",
    [
        ("0", r"^notice '0': must be a number of seconds > 0 \(or aws\|gcp\|azure\|gke\)$"),
        (-3, "notice -3: must be a number of seconds > 0"),
        ("inf", "notice 'inf': must be"),
        ("oracle", r"^notice 'oracle': use aws\|gcp\|azure\|gke or a number of seconds > 0$"),
        ("slurm", "partition's GraceTime, set by the site: give it in seconds"),
        (None, "notice None: use aws"),
    ],
)
def test_bad_notices_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        notice_seconds(spec)
    assert "\n" not in str(info.value)


def test_without_a_calibration_the_guess_fits_or_not_and_says_so():
    # 8 ranks x 2 GB = 16 GB at the guessed 1 GB/s: 16 s
    fit = final_save_fit(rank_bytes=2 * GB, ranks_per_node=8, notice_s=30)
    assert (fit.fits, fit.final_save_s, fit.margin_s, fit.node_bytes) == (True, 16, 14, 16 * GB)
    assert fit.advice == () and fit.node_gbps == 1 and fit.fixed_s == 0
    assert "default guess 1 GB/s per node" in fit.line() and "fits the 30 s notice" in fit.line()
    assert any("is a guess" in a and "gpumem calibrate" in a for a in fit.assumptions)
    assert any("at worst the notice must hold two saves (32.0 s)" in a for a in fit.assumptions)

    late = final_save_fit(rank_bytes=2 * GB, ranks_per_node=8, notice_s=15)
    assert not late.fits and late.margin_s == -1
    assert "does NOT fit the 15 s notice (1.0 s late)" in late.line()
    local, replicas, more = late.advice
    assert "must write 16 GB in 15 s: >= 1.07 GB/s per node" in local  # 16 / 15
    assert "(here: 1.00 GB/s)" in local
    assert ">= 2.13 GB/s per node, of disk and of network" in replicas  # 2 x 16 / 15
    # 15 s x 1 GB/s = 15 GB a node can save: 16 / 15 = 1.07x the nodes, or 7 ranks of 2 GB
    assert "at most 15 GB in the notice here, so >= 1.07x the nodes" in more
    assert "at most 7 per node" in more
    assert late.lines() == [late.line(), *(f"  - {a}" for a in late.advice)]


def test_a_calibration_gives_the_node_time_and_the_advice_numbers():
    # durable = 2 s + bytes / 4 GB/s, applied to the node's 8 x 17.5 GB = 140 GB: 2 + 35 = 37 s
    cal = _cal(2.0, 1 / (4 * GB))
    aws = final_save_fit(rank_bytes=17_500_000_000, ranks_per_node=8, notice_s=120, calibration=cal)
    assert aws.fits and aws.final_save_s == pytest.approx(37) and aws.margin_s == pytest.approx(83)
    assert aws.node_gbps == pytest.approx(4) and aws.fixed_s == 2
    assert aws.source == "calibrated: /nvme/ckpt"
    assert any(a.startswith("extrapolated: the calibration measured") for a in aws.assumptions)
    # GCP, after a 3 s step: 30 - 3 - 37 = -10 s; 27 s are left for the save
    gcp = final_save_fit(
        rank_bytes=17_500_000_000, ranks_per_node=8, notice_s=30, calibration=cal, step_s=3
    )
    assert not gcp.fits and gcp.margin_s == pytest.approx(-10)
    assert "durable in 37.0 s after a 3 s step in flight" in gcp.line()
    local, replicas, more = gcp.advice
    assert "must write 140 GB in 27 s: >= 5.19 GB/s per node" in local  # 140 / 27
    assert "(here: 4.00 GB/s)" in local
    assert ">= 10.37 GB/s per node" in replicas  # 2 x 140 / 27
    # (27 - 2) s x 4 GB/s = 100 GB: 1.40x the nodes, or 5 ranks of 17.5 GB per node
    assert "at most 100 GB in the notice here, so >= 1.40x the nodes" in more
    assert "at most 5 per node" in more
    assert json.loads(json.dumps(gcp.to_dict()))["advice"] == list(gcp.advice)


def test_a_fixed_cost_beyond_the_notice_is_not_fixed_by_more_nodes():
    fit = final_save_fit(rank_bytes=GB, ranks_per_node=8, notice_s=30, calibration=_cal(40, 1e-10))
    assert not fit.fits and fit.final_save_s == pytest.approx(40.8)
    assert "more nodes do not help: this storage's fixed cost of 40 s" in fit.advice[-1]


def test_a_step_longer_than_the_notice_leaves_only_a_shorter_step():
    fit = final_save_fit(rank_bytes=GB, ranks_per_node=8, notice_s=15, step_s=18)
    assert not fit.fits and fit.margin_s == pytest.approx(-11)  # 15 - 18 - 8
    assert len(fit.advice) == 1 and fit.advice[0].startswith("the step in flight alone")


def test_no_growth_measured_scales_the_largest_size_in_proportion():
    # b = 0: 1 s at the largest size, 1 GB; 8 GB on the node -> 8 s, an upper bound
    cal = _cal(1.0, 0.0, max_bytes=GB)
    fit = final_save_fit(rank_bytes=GB, ranks_per_node=8, notice_s=6, calibration=cal)
    assert fit.final_save_s == pytest.approx(8) and fit.node_gbps == pytest.approx(1)
    assert any("an upper bound" in a for a in fit.assumptions)
    assert "at most 6 GB in the notice here, so >= 1.33x the nodes" in fit.advice[-1]


def test_a_calibration_without_a_checkpoint_measurement_falls_back_to_the_guess():
    cal = _cal(1, 1e-9)
    bare = Calibration(cal.created_utc, cal.machine, {})
    fit = final_save_fit(rank_bytes=GB, ranks_per_node=2, notice_s=30, calibration=bare)
    assert fit.final_save_s == 2 and fit.source.startswith("default guess")
    assert "holds no checkpoint measurement" in fit.assumptions[3]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"notice_s": 0}, "notice_s must be a number of seconds > 0, got 0"),
        ({"notice_s": float("nan")}, "notice_s must be"),
        ({"rank_bytes": -1}, "rank_bytes must be a whole number of bytes >= 0, got -1"),
        ({"rank_bytes": 1.5}, "rank_bytes must be a whole number"),
        ({"ranks_per_node": 0}, "ranks_per_node must be a whole number >= 1, got 0"),
        ({"step_s": -1}, "step_s must be a number of seconds >= 0, got -1"),
    ],
)
def test_bad_input_is_one_clear_line(kw, match):
    args = {"rank_bytes": GB, "ranks_per_node": 8, "notice_s": 30, **kw}
    with pytest.raises(ValueError, match=match) as info:
        final_save_fit(**args)
    assert "\n" not in str(info.value)


def test_plan_prints_whether_the_best_layouts_final_save_fits(capsys):
    assert main(["plan", "gpt2", "--gpus", "4", "--notice", "gke"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("final save on notice: "))
    assert "per node (4 ranks x" in line and "the 15 s notice" in line  # min(8, --gpus 4)
    assert main(["plan", "gpt2", "--gpus", "16", "--notice", "0.5", "--json"]) == 0
    notice = json.loads(capsys.readouterr().out)["notice"]
    assert notice["ranks_per_node"] == 8 and notice["notice_s"] == 0.5
    assert not notice["fits"] and len(notice["advice"]) == 3


@pytest.mark.parametrize("bad", ["0", "slurm", "soon"])
def test_plan_refuses_a_bad_notice_in_one_line(bad, capsys):
    assert main(["plan", "gpt2", "--notice", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --notice: notice" in err and "Traceback" not in err
