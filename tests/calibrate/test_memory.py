"""The memory section: the least-squares fit by hand, the file round trip, how an estimate and
a plan use it, the warning for another architecture or device, and `gpumem calibrate
--memory` keeping the file's other sections."""

import json
import warnings

import pytest

import gpumem
from gpumem.calibrate import CalibrationError, load
from gpumem.calibrate.memory import (
    CategoryFit,
    MemoryCalibration,
    apply_memory_calibration,
    fit_category,
)


def test_fit_through_the_origin_by_hand():
    # y = 2x exactly: c = sum(xy)/sum(x^2) = 2, no residual
    f = fit_category([2, 4, 6], [1, 2, 3])
    assert f.coefficient == 2.0 and f.residual_pct == 0.0 and f.n_points == 3
    # y = (1, 3), x = (1, 1): c = 4/2 = 2; residuals -1, +1 -> rms 1 over mean 2 = 50 %
    f = fit_category([1, 3], [1, 1])
    assert f.coefficient == 2.0 and f.residual_pct == pytest.approx(50.0)
    assert fit_category([5], [0]).coefficient == 1.0  # nothing estimated: nothing to scale


def _mem(arch="gpumem/llama", device="cpu", act=1.1):
    fits = {"activations": CategoryFit(act, 0.5, 4), "temporary": CategoryFit(1.0, 0.0, 4)}
    return MemoryCalibration(arch, device, "fake", fits)


def test_estimate_applies_and_records_per_category():
    base = gpumem.estimate("llama-2-7b", seq_len=1024, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same architecture and device: no warning
        cal = apply_memory_calibration(base, _mem())
    rec = cal.calibration["per_category"]["activations"]
    assert rec["uncalibrated"] == base.per_gpu["activations"]
    assert rec["calibrated"] == int(base.per_gpu["activations"] * 1.1) == cal.per_gpu["activations"]
    assert rec["residual_pct"] == 0.5
    assert cal.per_gpu["weights"] == base.per_gpu["weights"]
    parts = ("weights", "gradients", "optimizer", "activations", "communication", "temporary")
    assert cal.per_gpu["total"] == sum(cal.per_gpu[c] for c in parts) + cal.per_gpu["overhead"]
    assert cal.to_dict()["calibration"]["arch"] == "gpumem/llama"


def test_mismatch_is_used_with_a_warning_naming_it():
    with pytest.warns(UserWarning, match=r"fitted for architecture 'hf/qwen2'.*'gpumem/llama'"):
        gpumem.estimate("llama-2-7b", seq_len=512, calibration=_mem("hf/qwen2"))
    with pytest.warns(UserWarning, match=r"fitted on 'cpu', used for 'cuda'"):
        gpumem.estimate("llama-2-7b", seq_len=512, calibration=_mem())


def test_file_round_trip_and_bad_coefficients(tmp_path):
    from gpumem.calibrate.calibration import Calibration, Machine, memory_section

    m = Machine("h", "cpu", 2, 1 << 30, None)
    cal = Calibration("2026-01-31T12:00:00Z", m, {"python": "3"}, memory=_mem())
    path = cal.save(tmp_path / "c.json")
    back = load(path)
    assert back.memory == cal.memory and back.checkpoint is None
    assert memory_section(str(path)).fits["activations"].coefficient == 1.1
    data = json.loads(path.read_text())
    data["memory"]["fits"]["activations"]["coefficient"] = 1e6
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"memory\.fits\.activations\.coefficient"):
        load(path)
    no_mem = Calibration("2026-01-31T12:00:00Z", m, {}, memory=None, report=None)
    with pytest.raises(CalibrationError, match=r"no memory section.*--memory"):
        memory_section(no_mem)


def test_plan_uses_the_coefficients():
    from gpumem.planner import plan

    kw = {"n_gpus": 8, "seq_len": 2048, "micro_batches": (1,), "recompute": ("none",)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = plan("llama-2-7b", **kw)
        b = plan("llama-2-7b", calibration=_mem(device="cuda", act=1.5), **kw)
    best = {c.describe(): c.total_bytes for c in a.candidates}
    assert all(c.total_bytes >= best.get(c.describe(), 0) for c in b.candidates)
    assert b.bill().calibration is not None


def test_cli_memory_fit_keeps_other_sections(tmp_path, capsys):
    from gpumem.cli import main

    from .conftest import VALID

    out = tmp_path / "calibration.json"
    out.write_text(json.dumps(VALID))
    assert main(["calibrate", "--memory", "--arch", "gpt2", "--out", str(out)]) == 0
    cal = load(out)
    assert cal.memory is not None and cal.memory.arch == "gpumem/gpt2"
    assert cal.checkpoint is not None  # the checkpoint section stayed
    assert all(abs(f.coefficient - 1) < 0.01 for f in cal.memory.fits.values())
    assert "estimator memory fit for gpumem/gpt2" in capsys.readouterr().out
    assert main(["calibrate", "--memory", "--out", str(out)]) == 2
    assert "give --arch FAMILY or --config" in capsys.readouterr().err
    assert main(["calibrate", "--memory", "--arch", "bart", "--out", str(out)]) == 2
    assert "unknown architecture 'bart'" in capsys.readouterr().err
    args = ["estimate", "gpt2", "--seq-len", "256", "--calibration", str(out)]
    assert main(args) == 0
    assert "calibrated" in capsys.readouterr().out


def test_an_nn_module_estimate_applies_the_memory_section():
    # the module path returned before the memory section was applied: silently uncalibrated
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    kw = {"example_input": torch.randn(4, 64), "device": "cpu", "alloc_conf": False}
    base = gpumem.estimate(net, **kw)
    with pytest.warns(UserWarning, match=r"fitted for architecture 'gpumem/llama'"):
        cal = gpumem.estimate(net, calibration=_mem(act=1.5), **kw)
    rec = cal.calibration["per_category"]["activations"]
    assert rec["uncalibrated"] == base.per_gpu["activations"] > 0
    assert cal.per_gpu["activations"] == int(base.per_gpu["activations"] * 1.5)
