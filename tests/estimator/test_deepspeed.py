"""DeepSpeed ZeRO: its own published estimator reproduced to the printed digit, and gpumem's
``deepspeed`` bill (what its ZeRO code allocates) computed by hand for t5-3b's shapes.

Reference: DeepSpeed's docs/code-docs/source/memory.rst (research/published-memory.md, C).
"""

import json

import pytest

import gpumem
from gpumem import Layout
from gpumem.estimator import peak
from gpumem.estimator.frameworks.deepspeed import (
    ZeroConfig,
    gpu_buffers,
    host_bytes,
    published_estimate,
    step_bytes,
)
from gpumem.estimator.gpus import find_gpu
from gpumem.estimator.knobs import TrainingKnobs
from gpumem.estimator.param_count import param_groups
from gpumem.estimator.resolver import resolve_model
from gpumem.estimator.states import Training
from gpumem.estimator.terms import model_states


def t5_params(d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int = 32128):
    """(total, largest module) of transformers' T5Model, counted by hand: a shared embedding,
    per encoder layer self-attention q/k/v/o, FF wi/wo and two RMS norms, per decoder layer a
    cross-attention and a third norm more, a relative-position bias (32 buckets x heads) in
    each stack's first layer, a final norm per stack."""
    inner = heads * d_kv
    attn = 4 * d_model * inner
    ff = 2 * d_model * d_ff
    enc = layers * (attn + ff + 2 * d_model) + 32 * heads + d_model
    dec = layers * (2 * attn + ff + 3 * d_model) + 32 * heads + d_model
    embed = vocab * d_model
    return embed + enc + dec, embed


T5_3B = t5_params(1024, 16384, 24, 32, 128)
T5_LARGE = t5_params(1024, 4096, 24, 16, 64)


def gb(b: int) -> str:
    return f"{b / 2**30:.2f}GB"  # DeepSpeed's own print format


def test_t5_counts_match_deepspeeds_printed_ones():
    assert T5_3B[0] // 10**6 == 2851  # "2851M total params, 32M largest layer params"
    assert T5_3B == (2_851_598_336, 32_899_072)
    assert (f"{T5_LARGE[0] / 1e6:.2f}M", f"{T5_LARGE[1] / 1e6:.2f}M") == ("737.67M", "32.90M")


@pytest.mark.parametrize(
    "params, offload, cpu, gpu",
    [
        (T5_3B[0], True, "127.48GB", "5.31GB"),  # _all_live
        (T5_3B[0], False, "127.48GB", "15.93GB"),
        (2851e6, True, "127.45GB", "5.31GB"),  # _all_cold(total_params=2851e6)
        (2851e6, False, "127.45GB", "15.93GB"),
    ],
)
def test_zero2_published_table(params, offload, cpu, gpu):
    c, g = published_estimate(params, stage=2, num_gpus_per_node=8, offload_optimizer=offload)
    assert (gb(c), gb(g)) == (cpu, gpu)


ZERO3 = [  # offload_param, offload_optimizer, zero_init: live (cpu, gpu), cold (cpu, gpu)
    (True, True, True, "71.71GB", "0.12GB", "71.69GB", "0.12GB"),
    (True, True, False, "127.48GB", "0.12GB", "127.45GB", "0.12GB"),
    (False, True, True, "63.74GB", "0.79GB", "63.72GB", "0.78GB"),
    (False, True, False, "127.48GB", "0.79GB", "127.45GB", "0.78GB"),
    (False, False, True, "1.47GB", "6.10GB", "1.43GB", "6.09GB"),
    (False, False, False, "127.48GB", "6.10GB", "127.45GB", "6.09GB"),
]


@pytest.mark.parametrize("op, oo, zi, live_cpu, live_gpu, cold_cpu, cold_gpu", ZERO3)
def test_zero3_published_table(op, oo, zi, live_cpu, live_gpu, cold_cpu, cold_gpu):
    kw = {
        "stage": 3,
        "num_gpus_per_node": 8,
        "offload_param": op,
        "offload_optimizer": oo,
        "zero_init": zi,
    }
    live = published_estimate(T5_3B[0], largest_layer_params=T5_3B[1], **kw)
    cold = published_estimate(2851e6, largest_layer_params=32e6, **kw)
    assert (gb(live[0]), gb(live[1])) == (live_cpu, live_gpu)
    assert (gb(cold[0]), gb(cold[1])) == (cold_cpu, cold_gpu)


def test_t5_large_worked_example():
    """memory.rst's t5-large on 4 GPUs: 125MB largest layer, 3291 / 125 / 477 MB per GPU for
    case 1 (no offload), 2 (params and optimizer offloaded), 3 (optimizer offloaded)."""
    p, big = T5_LARGE
    mb = [
        published_estimate(
            p,
            stage=3,
            largest_layer_params=big,
            num_gpus_per_node=4,
            offload_optimizer=oo,
            offload_param=op,
        )[1]
        // 2**20
        for oo, op in ((False, False), (True, True), (True, False))
    ]
    assert mb == [3291, 125, 477]
    assert 4 * big // 2**20 == 125


# --- gpumem's bill: what the ZeRO code allocates ----------------------------------------

PSI, BIG = T5_3B
BUCKET = 500_000_000  # reduce_bucket_size default


@pytest.mark.parametrize(
    "zero, weights, grads",
    [
        (1, 2 * PSI, 2 * PSI),  # ZeRO-1: every 16-bit .grad until the boundary
        (2, 2 * PSI, 2 * PSI // 8),  # ZeRO-2: grads_in_partition only
        (3, 2 * PSI // 8, 2 * PSI // 8),  # ZeRO-3: partitions of both
    ],
)
def test_t5_3b_model_states_by_hand(zero, weights, grads):
    """t5-3b on 8 GPUs, bf16 + AdamW: fp32 master + two moments = 12 B/param sharded at every
    stage; the 16-bit weights and gradients as the stage shards them."""
    ms = model_states(PSI, Training(), Layout(dp=8, zero=zero))
    assert ms["weights"] == weights
    assert ms["gradients"] == grads
    assert ms["optimizer"] == 12 * PSI // 8
    if zero == 2:  # gpumem's 9.96 GB against DeepSpeed's formula's 15.93 GB
        assert gb(ms["total"]) == "9.96GB"
        _, theirs = published_estimate(PSI, stage=2, num_gpus_per_node=8, offload_optimizer=False)
        # the difference: the full 16-bit grads less their partition, and the fp32 grad partition
        assert theirs - ms["total"] == 2 * PSI - 2 * PSI // 8 + 4 * PSI // 8


def test_t5_3b_buffers_by_hand():
    """The buffers on top: one IPG bucket of 5e8 bf16 elements (two with overlap_comm at
    ZeRO-1/2), the step's fp32 partition and its flattened 16-bit source (6 B per sharded
    parameter), ZeRO-3's live parameters (the largest module, the 5e7 prefetch and the ~5e8
    trailing parameters reused within max_reuse_distance at the turn to backward) and one
    module's full gradients."""
    cfg = ZeroConfig()
    kw = {"trainable": PSI, "layer_params": BIG, "weight_bytes": 2, "grad_bytes": 2}
    assert gpu_buffers(cfg, 2, **kw) == (BUCKET * 2, 0.0)
    assert gpu_buffers(ZeroConfig(overlap_comm=True), 2, **kw) == (2 * BUCKET * 2, 0.0)
    assert gpu_buffers(ZeroConfig(contiguous_gradients=False), 1, **kw) == (0.0, 0.0)
    live = BIG + 1e9 / 2 + 5e7
    assert gpu_buffers(cfg, 3, **kw) == (BUCKET * 2, live * 2 + BIG * 2)
    # max_live_parameters caps the prefetch, not the module in use
    tight = ZeroConfig(stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
    assert gpu_buffers(tight, 3, **kw) == (BUCKET * 2, BIG * 2 + BIG * 2)
    assert step_bytes(cfg, 2, PSI / 8, master=True) == 6 * PSI / 8
    assert step_bytes(ZeroConfig(sub_group_size=10**8), 3, PSI / 8, master=True) == 6 * 10**8


def test_t5_3b_zero2_offload_host_bill_by_hand():
    """offload_optimizer=cpu: per GPU fp32 master + Adam (12 B), the pinned fp32 grad
    partition (4 B) and the 16-bit copy-back buffer (2 B) of its 1/8; 8 GPUs per node."""
    cfg = ZeroConfig(offload_optimizer="cpu")
    host = host_bytes(
        cfg, 2, trainable=PSI, n_shard=8, gpus_per_node=8, state_bytes=Training().optimizer_bytes
    )
    assert host == PSI * (12 + 4 + 2)
    z3 = ZeroConfig(offload_optimizer="cpu", offload_param="cpu")
    assert host_bytes(z3, 3, trainable=PSI, n_shard=8, gpus_per_node=8, state_bytes=12) == (
        PSI * (12 + 4 + 2 + 2)
    )
    assert (
        host_bytes(ZeroConfig(), 2, trainable=PSI, n_shard=8, gpus_per_node=8, state_bytes=12) == 0
    )


# --- through gpumem.estimate ----------------------------------------------------------------

LLAMA = "llama-2-7b"
P7B = resolve_model(LLAMA).n_params


def _est(**kw):
    kw.setdefault("seq_len", 1024)
    return gpumem.estimate(LLAMA, **kw)


def test_estimate_zero2_deepspeed_bill():
    b = _est(layout=Layout(dp=8, zero=2))
    assert b.framework == "deepspeed"
    assert b.model_states == {
        "weights": 2 * P7B,
        "gradients": 2 * P7B // 8,
        "optimizer": 12 * P7B // 8,
        "total": 2 * P7B + 2 * P7B // 8 + 12 * P7B // 8,
    }
    assert b.per_gpu["communication"] == BUCKET * 2
    two = _est(layout=Layout(dp=8, zero=2), deepspeed={"reduce_bucket_size": 2e8})
    assert two.per_gpu["communication"] == 2 * 10**8 * 2
    assert b.host_bytes == 0


def _terms(layout, training=None, **kw):
    from gpumem.estimator.preset import PresetTerms

    job = PresetTerms(
        resolve_model(LLAMA),
        training or Training(),
        find_gpu("H100-80GB"),
        1024,
        framework="deepspeed",
    )
    return job.terms(layout, 1, "none", 1, None, [0])[0]


@pytest.mark.parametrize("zero", [2, 3])
def test_step_temporary_is_the_fp32_partition(zero):
    """DeepSpeed steps a fused Adam on the flat fp32 partition: the step's temporaries are the
    fp32 gradients and the flattened 16-bit copy they are made from, 6 B per sharded param."""
    x = _terms(Layout(dp=8, zero=zero))
    assert x[peak.T_STEP] == 6 * (P7B / 8)
    assert x[peak.COMM] == BUCKET * 2


@pytest.mark.parametrize("dp, temp", [(2, 6 * P7B / 2 - 2 * P7B / 2), (8, 0.0)])
def test_zero1_step_reuses_the_freed_gradients(dp, temp):
    """ZeRO-1 frees the other ranks' 16-bit grads (2Ψ - 2Ψ/N) before making the 6Ψ/N: what is
    left over is billed (the step moment already counts all 2Ψ of gradients)."""
    assert _terms(Layout(dp=dp, zero=1))[peak.T_STEP] == temp


def test_offload_keeps_zero1_gradients_on_the_gpu():
    ds = {"offload_optimizer": "cpu"}
    one = _est(layout=Layout(dp=8, zero=1), deepspeed=ds)
    two = _est(layout=Layout(dp=8, zero=2), deepspeed=ds)
    assert one.model_states["gradients"] == 2 * P7B
    assert two.model_states["gradients"] == 0
    assert one.model_states["optimizer"] == two.model_states["optimizer"] == 0


def test_zero3_gather_term():
    pg = param_groups(resolve_model(LLAMA))
    layer = pg.layer_tp + pg.layer_rep
    x = _terms(Layout(dp=8, zero=3))
    live = layer + 1e9 / 2 + 5e7
    assert x[peak.GATHER] == live * 2 + layer * 2


def test_estimate_zero3_offload_moves_states_to_the_host():
    b = _est(
        layout=Layout(dp=8, zero=3),
        deepspeed={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        offload_param=True,
    )
    assert b.model_states["weights"] == b.model_states["gradients"] == 0
    assert b.model_states["optimizer"] == 0
    assert b.host_bytes == P7B // 8 * (12 + 4 + 2 + 2) * 8
    assert "pinned host memory per node" in b.table()
    assert b.to_dict()["host_bytes_per_node"] == b.host_bytes


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"deepspeed": {"reduce_bucket": 1}}, "unknown deepspeed key 'reduce_bucket'; choose"),
        (
            {"deepspeed": {"offload_optimizer": "gpu"}},
            "offload_optimizer must be one of none, cpu",
        ),
        ({"deepspeed": {"reduce_bucket_size": "auto"}}, "'auto' is filled in by the HF Trainer"),
        ({"deepspeed": {"contiguous_gradients": 1}}, "must be true or false"),
        ({"deepspeed": {"reduce_bucket_size": -1}}, "integer >= 0"),
        ({"offload_param": True}, "offload_param needs ZeRO-3"),
        (
            {"deepspeed": {"zero_optimization": {"stage": 3}}},
            "stage is 3 but the layout has zero=2",
        ),
        ({"deepspeed": {}, "framework": "torch", "layout": Layout(dp=8)}, "framework='deepspeed'"),
    ],
)
def test_bad_deepspeed_knobs(kw, match):
    kw.setdefault("layout", Layout(dp=8, zero=2))
    with pytest.raises(ValueError, match=match):
        _est(**kw)


def test_plan_prices_deepspeed_layouts_with_the_knobs():
    """The planner's compiled peak and the estimate of the same candidate agree under the
    knobs; a ds_config's stage is moot for a search over stages."""
    from gpumem.planner import plan

    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True}}
    result = plan(LLAMA, n_gpus=8, deepspeed=ds)
    seen = set()
    for c in result.candidates[:8]:
        bill = result.bill(c)
        assert c.total_bytes == bill.per_gpu["total"]
        if bill.framework == "deepspeed" and c.layout.zero in (1, 2):
            seen.add(c.layout.zero)
            assert bill.training.deepspeed == ZeroConfig(
                reduce_bucket_size=200_000_000, overlap_comm=True
            )
    assert seen


def test_knobs_from_cli_parse_ds_config_spellings(tmp_path):
    from gpumem.estimator.frameworks.deepspeed import knobs_from_cli

    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"reduce_bucket_size": 5e8, "overlap_comm": false}}')
    pairs = ["overlap_comm=true", "stage3_prefetch_bucket_size=5e7", "offload_param=cpu"]
    got = knobs_from_cli(pairs, str(cfg))
    assert got == {
        "reduce_bucket_size": 5e8,
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": 50_000_000,
        "offload_param": "cpu",
    }
    assert ZeroConfig.from_dict(got) == ZeroConfig(
        overlap_comm=True, stage3_prefetch_bucket_size=50_000_000, offload_param="cpu"
    )
    assert knobs_from_cli(None, None) is None
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match=r"--ds-config .*ds\.json"):
        knobs_from_cli(None, str(cfg))


def test_hf_trainer_with_zero_takes_the_deepspeed_knobs():
    """framework='transformers' (a config.json's default) with ZeRO runs DeepSpeed (the HF
    Trainer's integration): its ds_config knobs and offload apply; without ZeRO they are an
    error naming the framework to use."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
    }
    ds = {"reduce_bucket_size": 10**6, "offload_optimizer": "cpu"}
    b = gpumem.estimate(cfg, seq_len=128, layout=Layout(dp=4, zero=2), deepspeed=ds)
    assert b.framework == "transformers"
    assert b.per_gpu["communication"] == 10**6 * 2
    assert b.model_states["optimizer"] == b.model_states["gradients"] == 0
    assert b.host_bytes == b.n_params // 4 * (12 + 4 + 2) * 4
    with pytest.raises(ValueError, match="use framework='deepspeed'"):
        gpumem.estimate(cfg, seq_len=128, layout=Layout(dp=4), deepspeed=ds)


# --- one host-memory rule for every offload spelling -----------------------------------------

GPT2_XL = resolve_model("gpt2-xl").n_params


@pytest.mark.parametrize(
    "kw",
    [
        {"deepspeed": {"offload_optimizer": "cpu"}},
        {"deepspeed": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
        {"deepspeed": {"offload_optimizer": True}},
        {"offload_optimizer": True},
        {"training": TrainingKnobs(offload_optimizer=True)},
    ],
    ids=["cpu", "device-dict", "true", "flat", "training-knobs"],
)
@pytest.mark.parametrize("offload_param", [False, True])
def test_every_offload_spelling_bills_deepspeeds_host_memory(kw, offload_param):
    """gpt2-xl, ZeRO-3 on 8 GPUs: DeepSpeed's ``estimate_zero3_model_states_mem_needs`` prints
    16Ψ (18Ψ with parameter offload) times its 1.5 headroom per node; gpumem bills the bare sum
    plus the 16-bit gradient partition ZeRO-3 pins on the host beside the fp32 one
    (``grad_partitions_flat_buffer``, 2Ψ/N a GPU): the same for every spelling."""
    b = gpumem.estimate(
        "gpt2-xl",
        seq_len=256,
        layout=Layout(dp=8, zero=3),
        framework="deepspeed",
        offload_param=offload_param,
        **kw,
    )
    theirs, _ = published_estimate(
        GPT2_XL, stage=3, num_gpus_per_node=8, offload_param=offload_param
    )
    assert b.host_bytes == pytest.approx(theirs / 1.5 + 2 * GPT2_XL, abs=8)
    assert b.model_states["optimizer"] == 0
    if not offload_param:
        assert f"{b.host_bytes / 2**30:.2f}" == "26.11"


def test_cli_offload_spellings_agree(capsys):
    from gpumem.cli import main

    base = ["estimate", "gpt2-xl", "--gpus", "8", "--zero", "3", "--seq-len", "256", "--json"]
    seen = set()
    for extra in (
        ["--framework", "deepspeed", "--deepspeed", "offload_optimizer=cpu"],
        ["--framework", "deepspeed", "--deepspeed", "offload_optimizer=true"],
        ["--framework", "deepspeed", "--offload-optimizer"],
        ["--offload-optimizer"],
    ):
        assert main([*base, *extra]) == 0
        seen.add(json.loads(capsys.readouterr().out)["host_bytes_per_node"])
    assert seen == {GPT2_XL // 8 * 18 * 8}


def test_module_path_bills_the_host_memory_too():
    """An nn.Module under ZeRO-2 with the optimizer offloaded: the same rule on its exact
    parameter count (fp32 master + Adam 12 B, fp32 grads 4 B, 16-bit copy 2 B, of 1/4 each GPU)."""
    import torch

    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    n = sum(p.numel() for p in m.parameters())
    kw = {"example_input": torch.randn(2, 64), "loss_fn": lambda y: y.sum(), "device": "cpu"}
    lay = Layout(dp=4, zero=2)
    for spelling in ({"deepspeed": {"offload_optimizer": "cpu"}}, {"offload_optimizer": True}):
        b = gpumem.estimate(m, layout=lay, framework="deepspeed", **spelling, **kw)
        assert b.host_bytes == n // 4 * (12 + 4 + 2) * 4
    assert gpumem.estimate(m, layout=lay, framework="deepspeed", **kw).host_bytes == 0


def test_offload_under_fsdp_keeps_the_same_host_rule():
    """Not DeepSpeed: the CPU step still needs the fp32 master and state, fp32 gradients and
    16-bit weights to copy back, the same 18 B per sharded parameter."""
    b = gpumem.estimate("gpt2-xl", seq_len=256, layout=Layout(dp=8, fsdp="full"),
                        offload_optimizer=True)  # fmt: skip
    assert b.framework == "fsdp2" and b.host_bytes == GPT2_XL // 8 * 18 * 8
