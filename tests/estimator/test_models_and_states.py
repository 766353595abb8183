"""Presets, config parsing and model-state bytes against published numbers."""

import json

import pytest

from gpumem.estimator import Layout, Training, estimate, resolve_model
from gpumem.estimator.model_presets import PRESETS, preset
from gpumem.estimator.param_count import module_param_count
from gpumem.estimator.resolver import from_model_config
from gpumem.estimator.terms import model_states


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_match_published(name):
    # Source: each preset's `source` (HF model cards / torchvision docs) gives published_params.
    spec = PRESETS[name]
    assert spec.n_params == spec.published_params


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral", "vit"])
def test_counts_match_built_in_modules(arch):
    # Reference: torch counts the parameters of gpumem.models' real nn.Modules.
    from gpumem.models import build_model, get_config

    cfg = get_config(arch, "tiny", num_layers=3)
    total, trainable = module_param_count(build_model(cfg))
    assert from_model_config(cfg).n_params == total == trainable


def test_70b_wall():
    # Source: issue #4 / Transformer Math 101: 16 B/param AdamW mixed precision;
    # 68.98 B -> 1.10 TB, 70 B -> 1.12 TB.
    bill = estimate("llama-2-70b", seq_len=128, gpu_memory="100TB")
    assert bill.n_params == 68_976_648_192
    assert bill.cluster_model_state_bytes == 16 * 68_976_648_192
    assert round(bill.cluster_model_state_bytes / 1e12, 2) == 1.10
    assert model_states(70_000_000_000, Training(), Layout())["total"] == 1_120_000_000_000


@pytest.mark.parametrize("zero,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(zero, gb):
    # Source: Rajbhandari et al. 2020 (ZeRO), Figure 1: Psi = 7.5 B, N_d = 64, K = 12,
    # fp16 grads: 120 / 31.4 / 16.6 / 1.9 GB per GPU.
    # Hand: 16Psi, 4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N.
    exact = {
        0: 16 * 7.5e9,
        1: 4 * 7.5e9 + 12 * 7.5e9 / 64,
        2: 2 * 7.5e9 + 14 * 7.5e9 / 64,
        3: 16 * 7.5e9 / 64,
    }[zero]
    got = model_states(7_500_000_000, Training("fp16-mixed", "adam"), Layout(dp=64, zero=zero))[
        "total"
    ]
    assert got == int(exact)
    assert round(got / 1e9, 1) == gb


def test_fp32_grad_accumulation_options():
    # Source: Megatron-LM theoretical_memory_usage.py / issue #654: 2 + 4 + 4 + 8 = 18 B/param;
    # DeepSpeed stage_1_and_2.py after PR #5099: ZeRO-2 = 2Psi + 18Psi/N.
    psi = 1_000_000_000
    assert model_states(psi, Training(grads="fp32"), Layout())["total"] == 18 * psi
    ds = model_states(psi, Training(grads="compute+fp32"), Layout(dp=8, zero=2))["total"]
    assert ds == 2 * psi + 18 * psi // 8
    # Megatron distributed optimizer: 6 + 12/DP (bf16 weights, fp32 grads, sharded master+Adam)
    assert (
        model_states(psi, Training(grads="fp32"), Layout(dp=8, zero=1))["total"]
        == 6 * psi + 12 * psi // 8
    )


def test_optimizers_and_precisions():
    # Source: Transformer Math 101: SGD-momentum 8 (master 4 + momentum 4),
    # 8-bit Adam 6 (4 + 1 + 1) plus bitsandbytes' two fp32 absmax per 256-value block
    # (Optimizer8bit.init_state, block_wise: blocks = ceil(n / 256); 2048 before 0.45).
    assert Training(optimizer="sgd-momentum").optimizer_bytes == 8
    assert Training(optimizer="adam8bit").optimizer_bytes == 4 + 1 + 1 + 2 * 4 / 256
    assert (
        Training("fp32").weight_bytes,
        Training("fp32").grad_bytes,
        Training("fp32").optimizer_bytes,
    ) == (4, 4, 8)
    assert Training("bf16", "adamw").optimizer_bytes == 4
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        Training(optimizer="adamm")


def test_lora_freezes_base():
    bill = estimate("llama-2-7b", seq_len=256, lora_rank=16, gpu="H100-80GB")
    full = estimate("llama-2-7b", seq_len=256, gpu="H100-80GB")
    assert bill.model_states["gradients"] < full.model_states["gradients"] / 50
    q = estimate("llama-2-7b", seq_len=256, lora_rank=16, base_quant="nf4")
    assert q.model_states["weights"] < bill.model_states["weights"] / 3


def test_unknown_preset_suggests(tmp_path):
    with pytest.raises(LookupError, match="did you mean llama-2-70b"):
        preset("lama-2-70b")
    assert preset("LLaMA-2-7B").name == "llama-2-7b"


def test_hf_config(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(tmp_path)).n_params == PRESETS["mistral-7b"].n_params
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing field 'intermediate_size'"):
        resolve_model(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    gpt = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    }
    assert resolve_model(gpt).n_params == 124_439_808


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"seq_len": -4}, "seq_len must be a positive integer"),
        ({"gpu": "H1000"}, "did you mean H100"),
        ({"gpu_memory": "-3GiB"}, "cannot read|positive"),
        ({"layout": Layout(dp=1, tp=3)}, "heads 32 not divisible by tp=3"),
        ({"layout": Layout(dp=1, pp=64)}, "pp=64 exceeds the 32 layers"),
        ({"layout": Layout(dp=2, ep=2)}, "has no experts"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises((ValueError, LookupError), match=match):
        estimate("llama-2-7b", **kwargs)


def test_layout_rules():
    with pytest.raises(ValueError, match="sequence parallelism"):
        Layout(dp=2, sp=True)
    with pytest.raises(ValueError, match=r"ep\*etp = 3\*1 = 3 must divide dp\*cp\*tp = 4"):
        Layout(dp=4, ep=3)
    # Megatron: experts over TP x DP (ep*etp divides dp*tp); their DP degree dp*tp/(ep*etp)
    lay = Layout(dp=2, tp=2, ep=4, etp=1)
    assert lay.expert_dp == 1 and lay.shard_degree(expert=True) == 1
    assert Layout(dp=4, tp=2, ep=2).expert_dp == 2  # etp defaults to tp: dp*tp/(2*2)
    with pytest.raises(ValueError, match="etp=3 must divide tp=4"):
        Layout(dp=3, tp=4, etp=3)
    spec = PRESETS["llama-2-70b"]  # 8 KV heads: tp=16 replicates them (allowed)
    assert Layout(dp=1, tp=16).errors(spec) == []
    assert "tp=3" in " ".join(Layout(dp=1, tp=3).errors(spec))
