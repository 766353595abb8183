"""gpumem profile: in-process through gpumem.cli.main."""

import json

import pytest

from gpumem.cli import main


def test_profile_builtin_table_json_plot(tmp_path, capsys):
    rc = main(
        [
            "profile",
            "gpt2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--steps",
            "2",
            "--json",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "r.png"),
            "--trace",
            str(tmp_path / "t.json"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("gpumem profile of CausalLM (cpu)") and "layers.1" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["schema_version"] == 4 and len(d["steps"]) == 2 and d["mode"] == "exact"
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_profile_fake_json_stdout_matches_real(capsys):
    args = ["profile", "resnet", "--batch-size", "2", "--steps", "1", "--json", "-"]
    assert main(args) == 0
    real = json.loads(capsys.readouterr().out)
    assert main([*args, "--fake"]) == 0
    fake = json.loads(capsys.readouterr().out)
    assert fake["peak_bytes"] == real["peak_bytes"] and fake["fake"] and not real["fake"]


def test_profile_markdown_checkpointing_bf16(capsys):
    assert (
        main(
            [
                "profile",
                "llama",
                "--seq-len",
                "16",
                "--precision",
                "bf16",
                "--steps",
                "1",
                "--checkpointing",
                "--markdown",
                "--optimizer",
                "sgd",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("### Memory profile: CausalLM")


def test_profile_bad_input(capsys):
    assert main(["profile", "bert"]) == 2
    assert "unknown model 'bert'" in capsys.readouterr().err
    assert main(["profile", "gpt2", "--optimizer", "lion"]) == 2
    assert "invalid choice: 'lion'" in capsys.readouterr().err
    assert main(["profile", "missing/config.json"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_profile_hf_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["profile", str(tmp_path / "config.json"), "--seq-len", "16", "--steps", "1"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


_LLAMA = {"model_type": "llama", "vocab_size": 128, "intermediate_size": 64, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"hidden_size": 64, "num_attention_heads": 32, "num_key_value_heads": 7},
            "num_attention_heads 32 is not a multiple of num_key_value_heads 7",
        ),
        (
            {"hidden_size": 64, "num_attention_heads": 28, "num_key_value_heads": 7},
            "hidden_size 64 is not divisible by num_attention_heads 28",
        ),
        (  # GPT-2's own names
            {"model_type": "gpt2", "n_embd": 64, "n_head": 5, "n_layer": 2},
            "n_embd 64 is not divisible by n_head 5",
        ),
    ],
)
def test_profile_fake_refuses_heads_that_do_not_divide(tmp_path, capsys, fields, said):
    """A config.json whose heads do not divide is one clear line and exit 2, as `estimate` and
    `plan` refuse it, not torch's or transformers' error passed through as "unexpected"."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, **fields}))
    assert main(["profile", str(tmp_path / "config.json"), "--fake", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem profile: error: ") and err.count("\n") == 1, err
    assert said in err and "unexpected" not in err, err
