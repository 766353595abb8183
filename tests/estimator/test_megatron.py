"""framework="megatron": Megatron-LM's conventions (gpumem/estimator/frameworks/megatron.py) on
the CI's golden values and on hand computations."""

from __future__ import annotations

import pytest

import gpumem
from gpumem.estimator.activations import Workload, sum_items
from gpumem.estimator.frameworks import megatron
from gpumem.estimator.hf_config import from_hf_config
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import param_groups

GIB = 2**30
# gpt/gpt3_7b_*_memory_speed: GQA 8 groups, 4h GeLU MLP, biases, LayerNorm, learned positions,
# untied; Megatron's defaults: hidden and attention dropout 0.1 (shared/research/
# published-memory.md B1a, B1b)
B7 = {
    "name": "gpt3-7b",
    "arch": "gpt2",
    "hidden": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn": 16384,
    "max_seq": 8192,
    "tied_embeddings": False,
    "mlp_act": "gelu",
}
SMALL = ModelSpec(
    name="small", arch="gpt2", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512, max_seq=128
)


def _b7(vocab: int, batch: int, layout: gpumem.Layout, grad_accum: int) -> tuple[int, int]:
    bill = gpumem.estimate(
        dict(B7, vocab=vocab),
        batch_size=batch,
        seq_len=8192,
        optimizer="adam",
        framework="megatron",
        layout=layout,
        grad_accum=grad_accum,
        hidden_dropout=0.1,
        dropout=0.1,
        attention="flash",
    )
    last = bill.pipeline_ranks[-1]  # the logging rank (world_size - 1)
    return last.per_gpu["total"] - last.per_gpu["overhead"], last.model_states["total"]


def test_gpt3_7b_tp1_pp4_vpp8_golden_values():
    # padded vocab 131200 (131073 + EOD to a multiple of 128); dp 2, 4 micro-batches
    peak, steady = _b7(131200, 1, gpumem.Layout(dp=2, pp=4, vpp=8, zero=1), 4)
    assert (peak, steady) == (61_326_134_528, 24_543_390_976)
    assert abs(peak / 60_720_852_992 - 1) < 0.03
    assert abs(steady / 24_808_996_864 - 1) < 0.03
    # 1 GiB of it: the 8 chunks' last received input and its retained gradient (64 MiB each)
    w = Workload(batch=1, seq=8192)
    assert megatron.pipeline_input_bytes(w, 4096, pp=4, vpp=8, stage=3) == 2**30


def test_gpt3_7b_tp4_pp1_golden_values():
    peak, steady = _b7(131584, 2, gpumem.Layout(dp=2, tp=4, zero=1), 2)
    assert (peak, steady) == (57_008_499_968, 20_664_446_208)
    assert abs(peak / 57_143_791_616 - 1) < 0.03
    assert abs(steady / 20_663_519_232 - 1) < 0.03


def _est(spec=SMALL, **kw):
    kw.setdefault("layout", gpumem.Layout(dp=2, pp=2, zero=1))
    kw.setdefault("framework", "megatron")
    return gpumem.estimate(spec, batch_size=2, seq_len=128, grad_accum=2, **kw)


def test_workspace_is_a_weight_on_every_rank():
    mega = _est()
    torch_like = _est(framework="torch", layout=gpumem.Layout(dp=2, pp=2))
    kept = [0, 2 * 2 * 128 * 64 * 2]  # rank 1 keeps its last input and its gradient
    for m, t, k in zip(mega.pipeline_ranks, torch_like.pipeline_ranks, kept, strict=True):
        assert m.model_states["weights"] - t.model_states["weights"] == megatron.WORKSPACE_BYTES + k


def test_grouped_experts_add_te_multi_stream_workspaces():
    moe = SMALL.replace(n_experts=4, top_k=2, arch="llama", mlp_act="swiglu")
    lay = gpumem.Layout(dp=2, ep=2, zero=1)
    grouped = _est(moe, layout=lay, moe_grouped_gemm=True).model_states["weights"]
    looped = _est(moe, layout=lay, moe_grouped_gemm=False).model_states["weights"]
    assert grouped - looped == 4 * 32 * 2**20


def test_loss_inside_forward_holds_no_logits():
    assert _est().held_logits == 0
    assert _est(framework="torch", layout=gpumem.Layout(dp=2, pp=2)).pipeline_ranks[-1].held_logits


def test_cross_entropy_transient_and_fusion():
    w = Workload(batch=2, seq=128, tp=2)
    nv = 2 * 128 * 512 // 2
    assert megatron.loss_transient(SMALL, w, fused=False) == nv * 2  # bf16 logits / gradient
    assert megatron.loss_transient(SMALL, w, fused=True) == nv * 6  # + out-of-place fp32
    fused = _est(fused_ops=("norm", "ce")).pipeline_ranks[-1].per_gpu
    plain = _est(fused_ops=("norm",)).pipeline_ranks[-1].per_gpu
    assert fused["total"] > plain["total"]  # the fusion the CI ran raises the peak


def test_head_items_keep_the_fp32_softmax():
    w = Workload(batch=2, seq=128)
    n = 256
    items = {i.name: i.nbytes for i in megatron.head_items(SMALL, w, megatron.MegatronKnobs())}
    assert items["loss.softmax_fp32"] == n * 512 * 4
    assert items["output_layer.input"] == n * 64 * 2
    assert items["final_norm.stats"] == n * 4 * 2  # LayerNorm: mean and rsigma


def test_te_layer_items_by_hand():
    w = Workload(batch=2, seq=128, tp=1)
    n, h, f = 256, 64, 256
    k = megatron.MegatronKnobs(hidden_dropout=0.1)
    items = megatron.layer_items(SMALL, w, k)
    # norms' inputs and LN-fused Linear outputs (2 B each), q/k/v/out, fc1 out and fc2 in,
    # two 1-byte dropout masks, fp32 statistics and log-sum-exp
    expect = 4 * n * h * 2 + 4 * n * h * 2 + 2 * n * f * 2 + 2 * n * h
    expect += 2 * n * 8 + 2 * 4 * 128 * 4
    assert sum_items(items) == expect
    # fp8: the Linears' inputs in 1 B (qkv, proj copy, fc1, fc2)
    k8 = megatron.MegatronKnobs(hidden_dropout=0.1, fp8_recipe="delayed")
    fp8 = sum_items(megatron.layer_items(SMALL, w, k8))
    assert expect - fp8 == (n * h + n * h + n * f) * 1 - n * h * 1


def test_unfused_attention_keeps_scores_mask_and_dropout():
    w = Workload(batch=2, seq=128, attention="math", dropout=0.1)
    items = {i.name: i.nbytes for i in megatron.layer_items(SMALL, w, megatron.MegatronKnobs())}
    s2 = 2 * 4 * 128 * 128
    assert (items["attn.softmax"], items["attn.dropout_mask"], items["attn.dropout_out"]) == (
        s2 * 2,
        s2,
        s2 * 2,
    )


def test_te_softmax_backward_writes_its_gradient_in_place(monkeypatch):
    """TE's unfused attention runs its fused scaled-masked softmax, whose backward produces
    the scores' gradient in the probabilities' (``scaled_masked_softmax_backward``): one
    s x s gradient in flight, not the two of PyTorch's softmax; attention dropout's backward
    makes the second. A 4-head layer of 2048 tokens whose attention backward is the peak:
    one [1, 4, 2048, 2048] bf16 tensor (32 MiB) less than the two-gradient rule."""
    spec = ModelSpec(name="t", arch="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=256)
    kw = {"seq_len": 2048, "batch_size": 1, "framework": "megatron", "attention": "eager",
          "dropout": 0.0, "gpu": "H100-80GB"}  # fmt: skip
    one = gpumem.estimate(spec, **kw)
    assert megatron.score_grads(Workload(1, 8, 2, 2, dropout=0.1)) == 2
    monkeypatch.setattr(megatron, "score_grads", lambda w: 2)
    two = gpumem.estimate(spec, **kw)
    assert one.phase == two.phase == "backward start"
    assert two.per_gpu["temporary"] - one.per_gpu["temporary"] == 4 * 2048 * 2048 * 2


def test_gelu_and_squared_relu_experts_priced_as_themselves():
    w = Workload(batch=1, seq=128)
    base = {
        "name": "m",
        "arch": "llama",
        "n_layers": 2,
        "hidden": 64,
        "n_heads": 4,
        "ffn": 128,
        "vocab": 512,
    }
    k = megatron.MegatronKnobs()
    sizes = {}
    for act in ("gelu", "squared_relu", "swiglu"):
        spec = ModelSpec(**base, n_experts=4, top_k=2, mlp_act=act)
        items = {i.name: i.nbytes for i in megatron.layer_items(spec, w, k)}
        sizes[act] = items["experts.fc1_out"]
    nk = 128 * 2
    assert sizes == {"gelu": nk * 128 * 2, "squared_relu": nk * 128 * 2, "swiglu": nk * 256 * 2}


def test_fp8_recipes_bytes_and_weight_copies():
    assert [megatron.fp8_saved_bytes(r, 2) for r in megatron.FP8_RECIPES] == [
        1.0,
        1.0,
        1 + 1 / 32,
        1 + 4 / 128,
    ]
    assert megatron.fp8_weight_cache_bytes(megatron.MegatronKnobs(fp8_recipe="delayed")) == 2.0
    gather = megatron.MegatronKnobs(fp8_recipe="delayed", fp8_param_gather=True)
    assert megatron.fp8_weight_cache_bytes(gather) == 0.0
    bf16 = _est(layout=gpumem.Layout(dp=2, zero=1)).model_states["weights"]
    fp8 = _est(layout=gpumem.Layout(dp=2, zero=1), precision="fp8").model_states["weights"]
    pg = param_groups(SMALL)
    linear = SMALL.n_layers * pg.layer_tp  # q/k/v, proj, fc1, fc2 (+ their biases)
    assert fp8 - bf16 == 2 * linear


def test_pipeline_first_last_layers():
    k = megatron.MegatronKnobs(pipeline_first_layers=2, pipeline_last_layers=2)
    assert megatron.stage_chunks(12, 4, 1, k) == [
        [range(0, 2)],
        [range(2, 6)],
        [range(6, 10)],
        [range(10, 12)],
    ]
    with pytest.raises(ValueError, match="do not split evenly over 2 stages"):
        megatron.stage_chunks(11, 4, 1, k)


def test_account_for_embedding_and_loss_in_split():
    k = megatron.MegatronKnobs(pipeline_split_embedding=True, pipeline_split_loss=True)
    chunks = megatron.stage_chunks(6, 4, 2, k)  # 8 slots: the first and last chunk one less
    assert chunks[0] == [range(0, 0), range(3, 4)]
    assert chunks[3] == [range(2, 3), range(6, 6)]
    # rank 3's first backward: 4 forwards of its 1-layer chunk, then one of the empty chunk
    assert megatron.inflight_layers(chunks[3], 4, 2, 4, 3) == 4


def test_deferred_embedding_wgrad_by_hand():
    w = Workload(batch=2, seq=128, tp=2)
    k = megatron.MegatronKnobs(defer_embedding_wgrad=True, wgrad_deferral_limit=2)
    per = 256 * (64 + 512 // 2) * 2
    assert megatron.deferred_wgrad_bytes(SMALL, w, k, grad_accum=4) == 2 * per
    unlimited = megatron.MegatronKnobs(defer_embedding_wgrad=True)
    assert megatron.deferred_wgrad_bytes(SMALL, w, unlimited, grad_accum=4) == 3 * per


def test_moe_layer_freq_patterns():
    assert megatron.layer_pattern("([0]*1+[1]*3)", 4) == (0, 1, 1, 1)
    assert megatron.layer_pattern(2, 4) == (1, 0, 1, 0)
    spec = SMALL.replace(arch="llama", n_experts=4, top_k=2, moe_layer_freq=(0, 1, 0, 1))
    assert spec.n_dense_layers == 2 and spec.is_dense_layer(2) and not spec.is_dense_layer(3)
    assert spec.dense_in(range(1, 3)) == 1
    with pytest.raises(ValueError, match="only lists, integers"):
        megatron.layer_pattern("__import__('os')", 4)
    with pytest.raises(ValueError, match="one 0 \\(dense\\) or 1 \\(MoE\\) per layer"):
        SMALL.replace(arch="llama", n_experts=4, top_k=2, moe_layer_freq=(0, 1))


def test_qwen2_moe_mlp_only_layers_is_a_pattern():
    cfg = {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "moe_intermediate_size": 32,
        "vocab_size": 512,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 1,
    }
    spec = from_hf_config(cfg)
    assert spec.moe_layer_freq == (0, 1, 1, 1)
    assert from_hf_config(dict(cfg, mlp_only_layers=[], decoder_sparse_step=2)).moe_layer_freq == (
        0,
        1,
        0,
        1,
    )


def test_mtp_layers_on_the_last_stage():
    plain = _est().pipeline_ranks
    mtp = _est(SMALL.replace(mtp_layers=1)).pipeline_ranks
    assert mtp[0].model_states == plain[0].model_states
    pg = param_groups(SMALL)
    # eh_proj (2h x h) + a layer + three norms, and the word embedding's copy (pp > 1)
    extra = 2 * 64 * 64 + pg.layer_tp + pg.layer_rep + 3 * 2 * 64 + pg.embed_tp
    assert mtp[1].model_states["weights"] - plain[1].model_states["weights"] == 2 * extra
    assert mtp[1].per_gpu["activations"] > plain[1].per_gpu["activations"]
    # the model's parameter count carries the MTP block (its embedding copy is not unique)
    assert SMALL.replace(mtp_layers=1).n_params - SMALL.n_params == extra - pg.embed_tp


def test_megatron_fsdp_shards_everything():
    lay = gpumem.Layout(dp=4, cp=2, zero=3)
    bill = _est(layout=lay)
    n = SMALL.n_params
    states = bill.model_states
    assert states["weights"] == int(n * 2 / 8) + megatron.WORKSPACE_BYTES
    assert states["gradients"] == int(n * 4 / 8)  # fp32 main grads


def test_knob_of_another_framework_is_one_line_error():
    with pytest.raises(ValueError, match="fp8_recipe is a Megatron-LM option; framework='fsdp2'"):
        _est(framework="fsdp2", layout=gpumem.Layout(dp=2, fsdp="full"), fp8_recipe="delayed")
    with pytest.raises(ValueError, match=r"hidden_dropout is a Megatron-LM option.*'torch'"):
        _est(framework="torch", layout=gpumem.Layout(dp=2), hidden_dropout=0.1)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fp8_recipe": "nvfp4"}, "unknown fp8 recipe 'nvfp4'; choose one of delayed, tensorwise"),
        ({"fp8_param_gather": True}, "fp8_param_gather .* needs an fp8_recipe"),
        ({"hidden_dropout": 1.0}, "hidden_dropout must be in \\[0, 1\\)"),
        ({"pipeline_first_layers": -1}, "pipeline_first_layers must be a non-negative integer"),
        (
            {"pipeline_first_layers": 1, "pipeline_split_loss": True},
            "two ways to split the pipeline",
        ),
        ({"precision": "fp8-mxfp8", "fp8_recipe": "delayed"}, "is the mxfp8 recipe"),
    ],
)
def test_bad_megatron_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        _est(**kw)


def test_fp8_precision_names_its_recipe():
    a = _est(precision="fp8-mxfp8").per_gpu
    b = _est(fp8_recipe="mxfp8").per_gpu
    assert a == b


def test_megatron_knobs_refuse_an_nn_module():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"described model, not an nn\.Module"):
        gpumem.estimate(torch.nn.Linear(4, 4), framework="megatron", fp8_recipe="delayed")


def test_golden_total_gib_sanity():
    # the 7B numbers in GiB, as the research note states them (peak, steady)
    peak, steady = _b7(131584, 2, gpumem.Layout(dp=2, tp=4, zero=1), 2)
    assert (round(peak / GIB, 2), round(steady / GIB, 2)) == (53.09, 19.25)


def test_cli_takes_the_megatron_knobs(capsys):
    import json

    from gpumem.cli import main

    argv = ["estimate", "mixtral-8x7b", "--framework", "megatron", "--gpus", "8", "--tp", "2"]
    argv += ["--pp", "2", "--ep", "2", "--zero", "1", "--seq-len", "1024", "--json"]
    assert main([*argv, "--fp8-recipe", "mxfp8", "--moe-layer-freq", "([0]*1+[1]*31)"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fp8["per_gpu"]["activations"] < plain["per_gpu"]["activations"]
    assert main([*argv, "--mtp-layers", "1"]) == 0
    mtp = json.loads(capsys.readouterr().out)
    assert (
        mtp["pipeline_ranks"][1]["per_gpu"]["weights"]
        > plain["pipeline_ranks"][1]["per_gpu"]["weights"]
    )
    assert main([*argv[:3], "torch", *argv[4:8], "--fp8-recipe", "delayed"]) == 2
    assert "fp8_recipe is a Megatron-LM option" in capsys.readouterr().err


def test_distributed_optimizer_instances_shard_over_the_instance():
    """--num-distributed-optimizer-instances 2 on dp 8: each copy of the distributed
    optimizer is sharded over 4 ranks, so the fp32 master weights and Adam's moments (12 B a
    parameter) are those of dp 4; the gradients (Megatron's fp32 main grads, not sharded)
    and weights do not change. By hand against the ZeRO-1 bill."""
    from gpumem.estimator.frameworks.megatron import MegatronKnobs

    kw = {"seq_len": 1024, "framework": "megatron", "gpu": "H100-80GB"}
    two = gpumem.estimate("llama-2-7b", layout=gpumem.Layout(dp=8, zero=1),
                          megatron=MegatronKnobs(dist_opt_instances=2), **kw)  # fmt: skip
    one = gpumem.estimate("llama-2-7b", layout=gpumem.Layout(dp=8, zero=1), **kw)
    n = two.n_params
    assert two.model_states["optimizer"] == pytest.approx(12 * n / 4, abs=8)
    assert one.model_states["optimizer"] == pytest.approx(12 * n / 8, abs=8)
    assert two.model_states["gradients"] == one.model_states["gradients"]
    with pytest.raises(ValueError, match="dist_opt_instances=3 must divide"):
        gpumem.estimate("llama-2-7b", layout=gpumem.Layout(dp=8, zero=1),
                        megatron=MegatronKnobs(dist_opt_instances=3), **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "chunks"),
    [
        ("Et*3|(tt|)*6L", ["Ettt", *["tt"] * 6, "L"]),
        ("Et*3|(tt|)*6mL", ["Ettt", *["tt"] * 6, "mL"]),
        ("Et\\\\|\\\\(tt\\\\|\\\\)*2L", ["Et", "tt", "tt", "L"]),  # the CI yaml's escaping
    ],
)
def test_pipeline_layout_grammar(text, chunks):
    assert megatron.layout_chunks(text) == chunks


def test_pipeline_layout_places_layers_by_chunk():
    """'Et*3|(tt|)*6L' on pp 2: 8 chunks (vpp 4), rank 0 holds chunks 0, 2, 4, 6 (3 + 2 + 2 + 2
    layers), rank 1 chunks 1, 3, 5, 7 (2 + 2 + 2 + 0)."""
    k = megatron.MegatronKnobs(pipeline_layout="Et*3|(tt|)*6L")
    ranks = megatron.stage_chunks(15, 2, 4, k)
    assert [[len(c) for c in r] for r in ranks] == [[3, 2, 2, 2], [2, 2, 2, 0]]
    assert [c.start for c in ranks[0]] == [0, 5, 9, 13]
    with pytest.raises(ValueError, match="give vpp = chunks / pp = 4"):
        megatron.stage_chunks(15, 2, 2, k)
    for bad, words in (
        ("Ex|tL", r"use E \(embedding\)"),
        ("tt|EL", r"embedding \(E\) in the first"),
    ):
        with pytest.raises(ValueError, match=words):
            megatron.MegatronKnobs(pipeline_layout=bad)


def test_recompute_and_offload_modules_drop_what_the_module_keeps():
    """By name: layernorm recompute drops the norms' statistics and outputs, moe_act the
    activation's output; offloading core_attn moves every tensor saved inside the attention
    core to the host, attn_norm the norm's input and statistics. core_attn not recomputed:
    the attention core stays under recompute='selective'."""
    spec = ModelSpec(name="t", arch="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=256)
    w = Workload(batch=1, seq=32, compute=2, residual=2, attention="flash")
    plain = {i.name: i for i in megatron.layer_items(spec, w, megatron.MegatronKnobs())}
    k = megatron.MegatronKnobs(recompute_modules=("layernorm",), offload_modules=("core_attn",))
    got = {i.name: i for i in megatron.layer_items(spec, w, k)}
    zero = {n for n, i in got.items() if i.nbytes == 0}
    assert zero == {"attn_norm.stats", "qkv.input", "mlp_norm.stats", "mlp.fc1_input",
                    "attn.q", "attn.k", "attn.v", "attn.out", "attn.lse"}  # fmt: skip
    assert not any(i.core for i in got.values())
    assert all(got[n].nbytes == plain[n].nbytes for n in plain if n not in zero)
    with pytest.raises(ValueError, match="recompute='selective'"):
        gpumem.estimate(spec, framework="megatron", seq_len=32,
                        megatron=megatron.MegatronKnobs(recompute_modules=("mlp",)))  # fmt: skip
    with pytest.raises(ValueError, match="offload_modules must be a tuple of names from"):
        megatron.MegatronKnobs(offload_modules=("bogus",))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"moe": {"dispatcher": "allgather"}}, ("moe_dispatcher", "no experts")),
        ({"moe": {"grouped_gemm": False}}, ("moe_grouped_gemm", "no experts")),
        (
            {"megatron": {"dist_opt_instances": 2}, "layout": gpumem.Layout(dp=4)},
            ("dist_opt_instances=2", "zero=1", "zero=0"),
        ),
        ({"megatron": {"pipeline_layout": "Et|tL"}}, ("pipeline_layout", "pp=1")),
    ],
)
def test_a_knob_that_does_not_apply_is_one_line(kw, words):
    from gpumem.estimator.knobs import MoEKnobs

    if "moe" in kw:
        kw = {"moe": MoEKnobs(**kw["moe"])}
    else:
        kw = {**kw, "megatron": megatron.MegatronKnobs(**kw["megatron"]), "framework": "megatron"}
    with pytest.raises(ValueError) as e:
        gpumem.estimate("llama-2-7b", seq_len=512, **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
