"""`gpumem calibrate` end to end on tmp_path, and `plan` / `estimate` with --calibration: the
economics a hand computation from the file's coefficients predicts."""

import json
import math
import re

import pytest
import torch

from gpumem.calibrate import Calibration, load
from gpumem.cli import main
from gpumem.estimator.gpus import find_gpu

CATS = ("weights", "gradients", "optimizer", "activations", "communication", "temporary")

MiB, GiB = 2**20, 2**30
GPT2_PARAMS = 124_439_808  # the preset's exact count (HF model card)


def test_calibrate_end_to_end(tmp_path, capsys, monkeypatch):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    monkeypatch.chdir(tmp_path)
    argv = [
        "calibrate",
        "--dir",
        str(ckpts),
        "--sizes",
        "2MiB,5MiB",
        "--repeat",
        "1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "wrote calibration.json (in the current directory)" in out
    assert re.search(r"2\.\d\d MiB\s+384\s+[\d.]+ s\s+[\d.]+ s\s+[\d.]+ s\s+[\d.]+ s", out), out
    assert "s/GiB" in out and "GB/s" in out
    assert re.search(r"predictions are checked up to 4x the largest size \(20\.0\d MiB\)", out)
    cal = load(tmp_path / "calibration.json")
    assert [p.target_bytes for p in cal.checkpoint.points] == [2 * MiB, 5 * MiB]
    assert cal.checkpoint.directory == str(ckpts.resolve()) and cal.gpu_reserve is None
    assert cal.machine.cpu_count >= 1 and cal.versions["gpumem"]
    assert list(ckpts.iterdir()) == []  # the measurement left nothing behind


def test_calibrate_without_sizes_measures_the_defaults(tmp_path, capsys, monkeypatch):
    # default_sizes picks up to 2 GiB from free memory; tiny ones here keep the test quick
    import gpumem.calibrate.checkpoint_cost as cc

    monkeypatch.setattr(cc, "default_sizes", lambda d: [2 * MiB, 3 * MiB, 5 * MiB])
    argv = ["calibrate", "--dir", str(tmp_path), "--repeat", "1", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "cal.json")]) == 0
    cal = load(tmp_path / "cal.json")
    assert [p.target_bytes for p in cal.checkpoint.points] == [2 * MiB, 3 * MiB, 5 * MiB]


def test_calibrate_json_with_a_profile_report(tmp_path, capsys):
    # the allocator summary a CUDA profile writes (gpumem.profiler.cuda.AllocatorProbe.finish)
    alloc = {
        "device": "NVIDIA H100 80GB HBM3",
        "allocated_peak": 8 * GiB,
        "reserved_peak": 9 * GiB,
        "fragmentation_at_peak": GiB // 2,
        "outside_allocator": 640 * MiB,
        "outside_allocator_source": "nvml process used - reserved",
    }
    report = tmp_path / "profile.json"
    report.write_text(json.dumps({"device": "cuda:0", "world_size": None, "allocator": alloc}))
    out_file = tmp_path / "cal.json"
    argv = [
        "calibrate",
        "--dir",
        str(tmp_path),
        "--sizes",
        "2MiB,4MiB",
        "--repeat",
        "1",
        "--device",
        "cpu",
        "--out",
        str(out_file),
        "--json",
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data == json.loads(out_file.read_text())
    assert f"wrote {out_file}" in captured.err
    assert all(
        isinstance(p["nbytes"], int) for p in data["checkpoint"]["points"]
    )  # integer bytes in JSON
    assert (
        data["report"]["fragmentation"] == 1 / 16
        and data["report"]["outside_allocator_bytes"] == 640 * MiB
    )
    gpu = load(out_file).apply_to(find_gpu("H100-80GB"))
    assert (gpu.context_bytes, gpu.fragmentation) == (640 * MiB, 1 / 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_calibrate_cuda_without_a_gpu(tmp_path, capsys):
    argv = [
        "calibrate",
        "--dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "c.json"),
        "--device",
        "cuda",
    ]
    assert main(argv) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--sizes", "lots"], "cannot read 'lots' as a size"),
        (["--sizes", "2MiB"], "give 2 to 64 different sizes"),
        (["--dir", "/nonexistent/dir"], "argument --dir: /nonexistent/dir does not exist"),
        (["--out", "/nonexistent/dir/c.json"], r"the directory of /nonexistent/dir/c.json"),
        (["--report", "/nonexistent/p.json"], "/nonexistent/p.json does not exist"),
    ],
)
def test_calibrate_bad_input(tmp_path, capsys, extra, match):
    argv = [
        "calibrate",
        "--dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "c.json"),
        "--device",
        "cpu",
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem calibrate: error:") and re.search(match, err), err
    assert not (tmp_path / "c.json").exists()


def _write(tmp_path, data) -> str:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return str(path)


def _checkpoint_bytes(layout: str) -> int:
    """Weights + optimizer state of one GPU, by hand: bf16 weights (2 B/param, sharded only under
    ZeRO-3), fp32 master + AdamW moments (12 B/param, sharded from ZeRO-1)."""
    m = re.match(r"dp(\d+)/tp(\d+)/pp(\d+)(?:/zero(\d))?", layout)
    dp, tp, pp, zero = int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0)
    assert tp == pp == 1, layout  # the hand count below covers data parallel layouts only
    weights = 2 * GPT2_PARAMS // (dp if zero >= 3 else 1)
    optimizer = 12 * GPT2_PARAMS // (dp if zero >= 1 else 1)
    return weights + optimizer


def test_plan_uses_the_measured_times(valid, tmp_path, capsys):
    path = _write(tmp_path, valid)
    argv = [
        "plan",
        "gpt2",
        "--gpus",
        "8",
        "--mtbf-hours",
        "24",
        "--startup-s",
        "100",
        "--calibration",
        path,
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    n = _checkpoint_bytes(out["fitting"][0]["layout"])
    cal = out["calibration"]
    assert (
        cal["checkpoint_bytes"] == n and cal["extrapolated"] is True
    )  # 415 MiB: beyond the 64-256 MiB measured
    stall, persist, restart = 0.5 + 1e-9 * n, 2.0 + 4e-9 * n, 1.0 + 3e-9 * n + 100
    e = out["economics"]
    assert (e["stall_s"], e["persist_s"], e["restart_s"]) == pytest.approx(
        (stall, persist, restart), rel=1e-9
    )
    mtbf = 24 * 3600.0
    tau = max(math.sqrt(2 * stall * mtbf), persist)
    assert e["interval_s"] == pytest.approx(tau, rel=1e-12)
    # the random-failure model (planner/economics.py), 24 h run by default
    run = 24 * 3600.0
    expected = run / tau * (mtbf + restart + persist) * math.expm1((tau + stall) / mtbf)
    assert e["expected_hours_with"] == pytest.approx(expected / 3600, rel=1e-12)
    assert e["waste_fraction"] == pytest.approx(expected / run - 1, rel=1e-9)
    assert cal["stall_s"]["source"].startswith("measured") and cal["restart_s"][
        "value"
    ] == pytest.approx(restart)
    assert cal["created_utc"] == "2026-01-31T12:00:00Z" and cal["host"] == "node-7"


def test_plan_explicit_flags_win(valid, tmp_path, capsys):
    path = _write(tmp_path, valid)
    argv = [
        "plan",
        "gpt2",
        "--gpus",
        "8",
        "--mtbf-hours",
        "24",
        "--calibration",
        path,
        "--stall-s",
        "3",
        "--restart-s",
        "42",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    out_line = next(line for line in text.splitlines() if line.startswith("checkpoint times for"))
    assert "per GPU (weights + optimizer state of the best layout)" in out_line
    assert "measured 2026-01-31T12:00:00Z on node-7" in out_line
    assert re.search(r"stall C\s+3\.000 s\s+given", text)
    assert re.search(r"persist P\s+[\d.]+ s\s+measured: time to durable", text)
    assert re.search(r"restart R\s+42\.000 s\s+given", text)
    assert "stall C 3 s" in text
    assert (
        "context 900.00 MiB (measured: profile report" in text
        and "fragmentation 10.00% (measured" in text
    )


def test_plan_reserve_is_applied(valid, tmp_path, capsys):
    path = _write(tmp_path, valid)
    assert main(["plan", "gpt2", "--gpus", "8", "--calibration", path, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["bill"]["per_gpu"]
    allocated = sum(
        p[c]
        for c in ("weights", "gradients", "optimizer", "activations", "communication", "temporary")
    )
    assert p["overhead"] == int(
        900 * MiB + GiB + allocated * 0.1
    )  # measured context, default NCCL, measured frag


def test_plan_without_calibration_is_unchanged(capsys):
    assert main(["plan", "gpt2", "--gpus", "8", "--mtbf-hours", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "calibration" not in out
    assert (
        out["economics"]["stall_s"],
        out["economics"]["persist_s"],
        out["economics"]["restart_s"],
    ) == (1.0, 60.0, 300.0)


def test_estimate_with_calibration(valid, tmp_path, capsys):
    valid["report"] = None
    path = _write(tmp_path, valid)
    assert main(["estimate", "gpt2", "--calibration", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["per_gpu"]
    # probe's context; the default fragmentation: simulated, what the allocator cannot release
    assert out["reserved"]["simulated"]
    assert p["overhead"] == 512 * MiB + out["reserved"]["unreleasable_bytes"]
    assert main(["estimate", "gpt2", "--calibration", path]) == 0
    text = capsys.readouterr().out
    assert "context 512.00 MiB (measured: probe on NVIDIA H100 80GB HBM3)" in text
    assert "fragmentation 5.00% (default)" in text


@pytest.mark.parametrize("cmd", ["plan", "estimate"])
def test_bad_calibration_file_is_one_line(valid, tmp_path, capsys, cmd):
    valid["checkpoint"]["fits"]["durable_s"]["intercept_s"] = -1
    path = _write(tmp_path, valid)
    assert main([cmd, "gpt2", "--calibration", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: checkpoint.fits.durable_s.intercept_s: -1.0 is below 0" in err
    assert "re-run `gpumem calibrate`" in err and err.count("\n") == 1


def test_plan_says_which_checkpoint_times_are_guesses(capsys):
    assert main(["plan", "gpt2", "--gpus", "8", "--mtbf-hours", "24", "--stall-s", "2"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint times are guesses (persist P 60 s, restart R 300 s)" in out
    assert "gpumem calibrate --dir CKPT_DIR" in out
    assert main(["plan", "gpt2", "--gpus", "8"]) == 0  # no economics asked for: no such line
    assert "guesses" not in capsys.readouterr().out


def test_startup_needs_a_calibration(capsys):
    assert main(["plan", "gpt2", "--gpus", "8", "--mtbf-hours", "24", "--startup-s", "10"]) == 2
    assert "startup_s adds to the restore time a calibration measured" in capsys.readouterr().err


def test_calibration_round_trips_through_the_cli_file(valid, tmp_path):
    path = _write(tmp_path, valid)
    assert load(path) == Calibration.from_dict(valid)
