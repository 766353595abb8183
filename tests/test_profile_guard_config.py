"""Issue 23 (5): the memory guard of `gpumem profile <config.json>` estimates in the dtype the
model is built in (the config's torch_dtype, as transformers builds it), and the command it
suggests works for a config.json (no --size, which a config.json refuses)."""

from __future__ import annotations

import json

import pytest

from gpumem.cli import main
from gpumem.estimator.preflight import profile_preflight
from gpumem.profiler.runner import build_precision, profile_model

pytest.importorskip("transformers")

LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
TINY = {
    **LLAMA_3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def _config(tmp_path, fields, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


def test_guard_estimates_in_the_configs_dtype(tmp_path):
    cfg = _config(tmp_path, TINY)
    check = profile_preflight(cfg, batch_size=2, seq_len=32)
    rep = profile_model(cfg, batch_size=2, seq_len=32)
    assert check.precision == "bf16"
    # was fp32: about twice the run's peak
    assert abs(check.estimate_bytes - rep.peak_bytes) / rep.peak_bytes < 0.05


def test_guard_of_llama_3_8b_is_the_bf16_estimate(tmp_path):
    # the fake run of this config peaks at 61.88 GiB; the fp32 estimate was 2x that
    check = profile_preflight(_config(tmp_path, LLAMA_3_8B))
    assert (check.precision, check.estimate_bytes) == ("bf16", 66409113600)
    assert "(gpumem.estimate, bf16)" in check.message()


def test_precision_given_beats_the_configs_dtype(tmp_path):
    cfg = _config(tmp_path, TINY)
    assert build_precision(cfg, None) == "bf16"
    assert build_precision(cfg, "fp32") == "fp32"
    assert build_precision(_config(tmp_path, {**TINY, "torch_dtype": None}, "b.json"), None) == (
        "fp32"
    )
    assert build_precision("gpt2", None) == "fp32"
    # --precision fp32 builds in fp32 (transformers alone would build the config's bf16)
    kw = {"batch_size": 1, "seq_len": 8, "steps": 1}
    fp32 = profile_model(cfg, precision="fp32", **kw).layers[""].gradients
    assert fp32 == 2 * profile_model(cfg, **kw).layers[""].gradients == 4 * 106816  # parameters
    assert profile_preflight(cfg, precision="fp32").precision == "fp32"


def test_guard_suggests_a_command_that_works_for_a_config(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path, TINY)
    monkeypatch.setattr(
        "gpumem.estimator.preflight.available_bytes", lambda device: (1 << 10, "available")
    )
    assert main(["profile", cfg, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    hint = f"`gpumem profile {cfg} --batch-size 2 --fake`"
    assert hint in err and "--size" not in err and err.count("\n") == 1
    assert main(hint.strip("`").split()[1:]) == 0  # the hint works


def test_size_with_a_config_is_refused_not_ignored(capsys, tmp_path):
    cfg = _config(tmp_path, TINY)
    assert main(["profile", cfg, "--size", "tiny", "--fake"]) == 2
    err = capsys.readouterr().err
    assert "sets its own size" in err and "leave --size out" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="leave --size out"):
        profile_preflight(cfg, size="7b")
