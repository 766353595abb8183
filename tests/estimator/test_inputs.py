"""Inputs shown: every bill and plan states its sequence length, micro-batch, gradient
accumulation, recompute, precision and optimizer with where each came from; sequences beyond
a model's context warn (rotary) or fail (learned positions); bad configs are errors."""

import json
import warnings

import pytest

import gpumem
from gpumem.cli import main


def test_bill_states_its_inputs_and_their_sources():
    bill = gpumem.estimate("llama-2-7b", batch_size=2)
    assert bill.to_dict()["inputs"] == {
        "seq_len": {"value": 4096, "source": "default: the model's context"},
        "batch_size": {"value": 2, "source": "given"},
        "grad_accum": {"value": 1, "source": "default"},
        "recompute": {"value": "none", "source": "default"},
        "precision": {"value": "bf16-mixed", "source": "default"},
        "optimizer": {"value": "adamw", "source": "default"},
        "loss": {
            "value": "outside the model (loss_fn(model(x))), logits held through backward",
            "source": "default: the torch loop",
        },
    }
    assert bill.table().splitlines()[1] == (
        "inputs: seq_len 4096 (default: the model's context), micro-batch 2 (given), grad "
        "accumulation 1 (default), recompute none (default), precision bf16-mixed (default), "
        "optimizer adamw (default), loss outside the model (loss_fn(model(x))), logits held "
        "through backward (default: the torch loop)"
    )


def test_plan_states_its_inputs(capsys):
    assert main(["plan", "qwen2-72b", "--gpus", "64", "--json", "--top", "1"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["seq_len"] == {"value": 8192, "source": "default: the model's context"}
    assert inputs["global_batch"] == {"value": 256, "source": "default: max(GPUs, 256)"}
    assert inputs["micro_batch"] == {"value": [1, 2, 4, 8], "source": "searched"}
    assert inputs["recompute"]["source"] == "searched"
    assert inputs["precision"] == {"value": "bf16-mixed", "source": "default"}
    assert main(["plan", "gpt2", "--gpus", "8", "--seq-len", "512"]) == 0
    assert "inputs: seq len 512 (given), global batch 256" in capsys.readouterr().out


def test_beyond_the_context():
    with pytest.warns(UserWarning, match="beyond llama-2-7b's context of 4096 tokens"):
        bill = gpumem.estimate("llama-2-7b", seq_len=8192)
    assert bill.inputs["seq_len"] == 8192
    with pytest.raises(ValueError, match="exceeds gpt2's 1024 learned positions"):
        gpumem.estimate("gpt2", seq_len=1025)
    with pytest.raises(ValueError, match="exceeds gpt2's 1024 learned positions"):
        gpumem.plan("gpt2", n_gpus=8, seq_len=2048)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpumem.estimate("llama-2-7b", seq_len=4096)  # at the context: no warning


@pytest.mark.parametrize("seq", [0, -1, 2.5, True])
def test_bad_sequence_lengths(seq):
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        gpumem.estimate("llama-2-7b", seq_len=seq)


def test_vit_sequence_is_fixed_by_the_image():
    bill = gpumem.estimate("vit-b-16")
    assert bill.inputs["seq_len"] == 197
    assert bill.sources["seq_len"] == "fixed: the image's patches + class token"
    res = gpumem.plan("vit-b-16", n_gpus=8, micro_batches=(1,))
    assert res.inputs["seq_len"] == 197  # the planner and the estimator agree
    assert res.candidates and res.bill().per_gpu["total"] == res.candidates[0].total_bytes


def test_profile_config_without_the_family_fields(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama"}))
    assert main(["profile", str(cfg), "--fake"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama' needs vocab_size, hidden_size, num_hidden_layers" in err
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_embd": 32}))
    assert main(["profile", str(cfg), "--fake"]) == 2
    assert "num_hidden_layers (n_layer), num_attention_heads (n_head)" in capsys.readouterr().err


def test_a_value_passed_in_is_given_even_when_it_is_the_default(capsys):
    """Issue #23: inputs are labelled by whether the caller passed them, not by their value:
    precision="bf16-mixed", optimizer="adamw", recompute="none", grad_accum=1 passed in are
    given; left out they are defaults (library, estimate and plan command lines)."""
    passed = gpumem.estimate(
        "llama-2-7b", precision="bf16-mixed", optimizer="adamw", recompute="none", grad_accum=1
    )
    assert {
        k: passed.sources[k] for k in ("precision", "optimizer", "recompute", "grad_accum")
    } == {
        "precision": "given",
        "optimizer": "given",
        "recompute": "given",
        "grad_accum": "given",
    }
    left = gpumem.estimate("llama-2-7b")
    assert {left.sources[k] for k in ("precision", "optimizer", "recompute", "grad_accum")} == {
        "default"
    }
    assert main(["estimate", "llama-2-7b", "--precision", "bf16-mixed", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["precision"]["source"] == "given" and inputs["optimizer"]["source"] == "default"
    assert main(["plan", "qwen2-72b", "--gpus", "64", "--optimizer", "adamw", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["optimizer"]["source"] == "given" and inputs["precision"]["source"] == "default"
