"""The gpumem command: in-process main(argv), python -m gpumem, and the doctor report."""

import json
import subprocess
import sys

import pytest

from gpumem.cli import main


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_doctor_without_measurement(capsys):
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "GPUs" in out


def test_doctor_json_measures_bandwidth(capsys, tmp_path):
    pytest.importorskip("gpumem._C")
    assert main(["doctor", "--json", "--size", "8MiB", "--dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    whats = [b["what"] for b in report["bandwidth"]]
    assert whats[:3] == ["memcpy (1 thread)", "crc32c (1 thread)", "crc32c (all threads)"]
    assert whats[3].startswith("write+fsync")
    assert all(b["nbytes"] == 8 << 20 and b["gb_per_s"] > 0 for b in report["bandwidth"])
    assert report["problems"] == []
    assert list(tmp_path.iterdir()) == []  # the probe cleans up after itself


def test_bad_size_is_a_clear_error(capsys):
    assert main(["doctor", "--size", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_python_dash_m_works():
    out = subprocess.run(
        [sys.executable, "-m", "gpumem", "doctor", "--no-measure"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpumem doctor")


def test_estimate_takes_deepspeed_knobs(capsys, tmp_path):
    """--ds-config reads a ds_config's zero_optimization; --deepspeed KEY=VALUE goes on top;
    the JSON bill matches gpumem.estimate with the same knobs."""
    import json

    import gpumem

    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e8}}))
    args = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--seq-len", "512"]
    extra = ["--ds-config", str(cfg), "--deepspeed", "offload_optimizer=cpu", "--offload-param"]
    assert main([*args, *extra, "--optimizer", "muon", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    bill = gpumem.estimate(
        "llama-2-7b",
        seq_len=512,
        optimizer="muon",
        layout=gpumem.Layout(dp=8, zero=3),
        deepspeed={"reduce_bucket_size": 200_000_000, "offload_optimizer": "cpu"},
        offload_param=True,
    )
    assert out["per_gpu"] == bill.per_gpu
    assert out["host_bytes_per_node"] == bill.host_bytes > 0
    assert main([*args, "--deepspeed", "reduce_bucket_size"]) == 2
    assert "--deepspeed takes KEY=VALUE" in capsys.readouterr().err
    assert main(["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--offload-param"]) == 2
    assert "offload_param needs ZeRO-3" in capsys.readouterr().err


@pytest.mark.parametrize("mtype", ["bert", "roberta"])
def test_estimate_reads_an_encoder_config(capsys, tmp_path, mtype):
    """A BERT / RoBERTa config.json on the command line: the bill of the same dict in Python."""
    import gpumem
    from gpumem.estimator.accuracy import HF_SWEEP

    cfg = {**HF_SWEEP[mtype], "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["estimate", str(tmp_path), "--batch-size", "4", "--seq-len", "128", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    bill = gpumem.estimate(cfg, batch_size=4, seq_len=128)
    assert out["per_gpu"] == bill.per_gpu and out["framework"] == "transformers"
    assert "logits' dtype" in out["inputs"]["loss"]["value"]
