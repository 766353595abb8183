"""gpumem ckpt export: a small Llama saved by a Checkpointer comes back through
``transformers.AutoModelForCausalLM.from_pretrained`` bit for bit (and cast to bf16 with
--dtype), sharded into several safetensors files with an index; wrapper prefixes are stripped."""

from __future__ import annotations

import json

import pytest
import torch

import gpumem
from gpumem.checkpoint.errors import CheckpointCorruptError
from gpumem.checkpoint.interop.export import clean_key, export_safetensors
from gpumem.cli import main

transformers = pytest.importorskip("transformers")


def _llama(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    cfg.to_json_file(tmp_path / "config.json")
    return model


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_llama_round_trip_through_from_pretrained(tmp_path, dtype):
    model = _llama(tmp_path)
    with gpumem.Checkpointer(tmp_path / "ck") as ck:
        # a compiled-model key prefix must not reach the exported names
        ck.save(3, model=torch.compile(model), rng=False)
    argv = ["ckpt", "export", str(tmp_path / "ck"), "--format", "safetensors"]
    argv += ["--out", str(tmp_path / "hf"), "--config", str(tmp_path / "config.json")]
    argv += ["--max-shard-size", "40KB"] + (["--dtype", dtype] if dtype else [])
    assert main(argv) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = {k: v.to(torch.bfloat16) if dtype else v for k, v in model.state_dict().items()}
    got = {k: v.to(torch.bfloat16) if dtype else v for k, v in loaded.state_dict().items()}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    if dtype:
        from safetensors.torch import load_file

        assert load_file(tmp_path / "hf" / files[0])[next(iter(index["weight_map"]))].dtype == (
            torch.bfloat16
        )


def test_wrapper_prefixes_are_stripped():
    assert clean_key("module._orig_mod.layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert clean_key("model.layers.0._checkpoint_wrapped_module.mlp.w") == "model.layers.0.mlp.w"
    assert clean_key("module.module.x") == "x"


def test_a_damaged_checkpoint_exports_nothing(tmp_path):
    model = torch.nn.Linear(300, 20)
    with gpumem.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, model=model, rng=False)
    data = tmp_path / "ck" / "step-000000001" / "data-r00000-0000.bin"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="CRC32C"):
        export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert not [p for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")]
    assert main(["ckpt", "export", str(tmp_path / "ck"), "--out", str(tmp_path / "o2")]) == 2
