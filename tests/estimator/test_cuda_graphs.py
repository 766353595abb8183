"""Megatron's per-layer CUDA graphs (``cuda_graph_scope``, gpumem/estimator/frameworks/
cuda_graphs.py): the items each scope captures, the static buffers by hand, and the CI cases
whose golden values include memory (``benchmarks/published/megatron_named.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import gpumem
from gpumem.estimator.activations import Workload
from gpumem.estimator.frameworks import cuda_graphs, megatron
from gpumem.estimator.model_spec import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
SPEC = ModelSpec(name="t", arch="llama", n_layers=4, hidden=64, n_heads=4, ffn=128, vocab=256)
MOE = ModelSpec(
    name="m", arch="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=256,
    n_experts=4, top_k=2, n_shared_experts=1, shared_ffn=64,
)  # fmt: skip
W = Workload(batch=1, seq=32, compute=2, residual=2, attention="flash")
ATTN = "gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph"


def _items(spec: ModelSpec, scope: tuple[str, ...], capture: bool = False) -> dict[str, int]:
    k = megatron.MegatronKnobs(cuda_graph_scope=scope)
    return {i.name: i.nbytes for i in megatron.layer_items(spec, W, k, capture)}


def test_attn_scope_moves_the_attention_into_the_pool():
    """A step's allocator no longer sees the input norm, q/k/v and the attention core; the
    MLP stays. The capture sees exactly the rest: the two views partition the layer."""
    plain = _items(SPEC, ())
    step, capture = _items(SPEC, ("attn",)), _items(SPEC, ("attn",), capture=True)
    graphed = {n for n, b in step.items() if b == 0 and plain[n]}
    assert graphed == {"attn_norm.input", "attn_norm.stats", "qkv.input", "attn.q", "attn.k",
                       "attn.v", "attn.out", "attn.lse"}  # fmt: skip
    assert all(step[n] + capture[n] == plain[n] for n in plain)


def test_mlp_scope_is_dense_layers_and_router_scope_moe_layers():
    """``mlp`` captures a dense layer's MLP, not an MoE layer's experts; ``moe_router`` the
    MoE layer's norm, router and shared experts, not the routed experts."""
    dense = _items(SPEC, ("mlp",))
    assert dense["mlp.fc1_out"] == 0 and dense["attn.q"] > 0
    moe = _items(MOE, ("mlp", "moe_router"))
    assert moe["router.input"] == 0 and moe["shared.fc1_out"] == 0
    assert moe["experts.fc1_out"] > 0 and moe["mlp_norm.input"] == 0
    whole = _items(MOE, ("moe",))
    assert all(whole[n] == 0 for n in whole if n.startswith(("experts.", "dispatch.")))
    assert cuda_graphs.graphed_layers(("mlp",), 3, 5) == 3
    assert cuda_graphs.graphed_layers(("moe_router", "moe_preprocess"), 3, 5) == 5
    assert cuda_graphs.graphed_layers(("attn", "mlp"), 3, 5) == 8


def test_static_buffers_by_hand():
    """pp 2, 4 micro-batches, attn scope (TE >= 2.7's buffer reuse, Megatron's
    ``_get_sample_arguments``): the last rank's 2 layers have 1 micro-batch in flight at its
    first backward (1F1B: pp - stage), so 2 static inputs, each the hidden states (32 tokens
    x 64 x 2 B = 4096 B) and the bool attention mask (1 x 32 x 32 = 1024 B); one output
    gradient (4096 B) shared by every graph, and the last backward's input gradient (4096 B):
    2 * 5120 + 2 * 4096 B more in the steady figure than without graphs."""
    kw = {"seq_len": 32, "batch_size": 1, "framework": "megatron", "grad_accum": 4,
          "layout": gpumem.Layout(pp=2), "gpu": "H100-80GB"}  # fmt: skip
    on = gpumem.estimate(SPEC, megatron=megatron.MegatronKnobs(cuda_graph_scope=("attn",)), **kw)
    off = gpumem.estimate(SPEC, **kw)
    diff = (
        on.pipeline_ranks[-1].model_states["total"] - off.pipeline_ranks[-1].model_states["total"]
    )
    assert diff == 2 * (4096 + 1024) + 2 * 4096
    # without pipelining one micro-batch is captured: all 4 layers in flight
    kw["layout"] = gpumem.Layout()
    on = gpumem.estimate(SPEC, megatron=megatron.MegatronKnobs(cuda_graph_scope=("attn",)), **kw)
    assert on.model_states["total"] - gpumem.estimate(SPEC, **kw).model_states["total"] == (
        4 * (4096 + 1024) + 2 * 4096
    )
    # mlp scope: no mask (Megatron adds it only with attn in the scope)
    mlp = megatron.MegatronKnobs(cuda_graph_scope=("mlp",))
    assert (
        gpumem.estimate(SPEC, megatron=mlp, **kw).model_states["total"]
        - gpumem.estimate(SPEC, **kw).model_states["total"]
        == 4 * 4096 + 2 * 4096
    )


def test_moe_router_graphs_read_more_output_gradients():
    """An MoE layer captured up to its router hands out the residual, the norm's output, the
    shared experts' output and the fp32 routing probabilities: their gradients are one more
    set of static buffers beside the attention-only graphs' (cuda_graphs.graph_outputs)."""
    b, probs = 4096, 32 * 4 * 4  # 32 tokens x 4 experts x fp32
    assert cuda_graphs.graph_outputs(("attn", "moe_router"), True, True, b, probs) == 3 * b + probs
    assert cuda_graphs.graph_outputs(("attn", "moe_router"), True, False, b, probs) == 2 * b + probs
    assert cuda_graphs.graph_outputs(("attn", "moe"), True, True, b, probs) == b
    assert cuda_graphs.graph_outputs(("attn",), False, True, b, probs) == b
    # two signatures: one set each; two of the same: one
    assert cuda_graphs.static_bytes(("attn",), 2, b, 10, (b, 3 * b)) == 2 * (b + 10) + 4 * b + b
    assert cuda_graphs.static_bytes(("attn",), 2, b, 10, (b, b)) == 2 * (b + 10) + b + b


def test_warmup_zero_captures_before_the_optimizer_state(check):
    """--cuda-graph-warmup-steps 0 (the attn CI case): the capture decides the last rank's
    peak and the bill says so; it comes before the first step, so Adam's two moments (8 of
    the 12 B the distributed optimizer keeps per parameter) are not there: the peak's
    optimizer is the master weights' third of the steady figure's, which is a step's in both."""
    mc, cases = check
    kw, _ = mc.estimate_kwargs(cases[ATTN]["args"], 8)
    model = kw.pop("model")
    zero = gpumem.estimate(model, **kw).pipeline_ranks[-1]
    kw["cuda_graph_warmup_steps"] = 3
    three = gpumem.estimate(model, **kw).pipeline_ranks[-1]
    assert zero.phase == three.phase == "CUDA-graph capture"
    assert zero.model_states == three.model_states
    assert three.per_gpu["optimizer"] == three.model_states["optimizer"]
    assert zero.per_gpu["optimizer"] == pytest.approx(three.model_states["optimizer"] / 3, abs=2)
    assert three.per_gpu["total"] - zero.per_gpu["total"] > 0


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"cuda_graph_scope": ("attn",), "cuda_graph_warmup_steps": -1}, "integer >= 0, got -1"),
        ({"cuda_graph_scope": ("attn",), "cuda_graph_warmup_steps": True}, "integer >= 0"),
        ({"cuda_graph_warmup_steps": 0}, "no cuda_graph_scope is given (give one of attn"),
    ],
)
def test_bad_warmup_is_one_line(knobs, words):
    with pytest.raises(ValueError) as e:
        megatron.MegatronKnobs(**knobs)
    assert "\n" not in str(e.value) and words in str(e.value)


@pytest.mark.parametrize(
    ("scope", "words"),
    [
        ("attn", "must be a tuple of names"),
        (("attn", "bogus"), "unknown cuda_graph_scope 'bogus'; choose from attn, mlp"),
        (("full_iteration",), "--cuda-graph-impl local's whole step"),
    ],
)
def test_bad_scope_is_one_line(scope, words):
    with pytest.raises(ValueError) as e:
        megatron.MegatronKnobs(cuda_graph_scope=scope)
    assert "\n" not in str(e.value) and words in str(e.value)


def test_scope_under_another_framework_is_one_line():
    with pytest.raises(ValueError, match="cuda_graph_scope is a Megatron-LM option"):
        gpumem.estimate(SPEC, seq_len=32, framework="torch", cuda_graph_scope=("attn",))


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(BENCH))
    try:
        import megatron_check
    finally:
        sys.path.remove(str(BENCH))
    cases = json.loads((BENCH / "megatron_named.json").read_text())["cases"]
    return megatron_check, {c["name"]: c for c in cases}


def test_steady_of_the_current_graphs_case_within_5_percent(check):
    """Megatron-LM's H100 golden values of the newest graphs case (moe2.0, attn + mlp +
    moe_router + moe_preprocess): the steady figure (a step's, the static buffers derived from
    the reuse of TE >= 2.7 and Megatron) within 5 %; its capture-decided peak and the other
    cases' figures, with their reasons, are in benchmarks/results/published_megatron_named.md."""
    mc, cases = check
    r = mc.run_case(cases["moe2.0/dsv3_tp2pp2ep4_cudagraph"])
    assert abs(r["steady_err"]) <= 0.05, r
    assert r["phase"] == "CUDA-graph capture"


def test_attn_graphs_case_closer_than_without_the_knob(check):
    """The attn-scope case (the issue's +22 %) is not within 5 % (the reason is in the
    results), but both figures move towards the golden values."""
    mc, cases = check
    case = cases[ATTN]
    off = json.loads(json.dumps(case))
    del off["args"]["--cuda-graph-impl"], off["args"]["--cuda-graph-scope"]
    on_r, off_r = mc.run_case(case), mc.run_case(off)
    for what in ("peak_err", "steady_err"):
        assert abs(on_r[what]) < abs(off_r[what]), (what, on_r[what], off_r[what])


def test_cli_takes_the_scope(capsys):
    """The flag reaches the bill (the same as the Python knob), and a bad name is one line."""
    from gpumem.cli import main

    base = ["estimate", "llama-2-7b", "--framework", "megatron", "--seq-len", "512", "--json"]
    assert main([*base, "--cuda-graph-scope", "attn,mlp"]) == 0
    got = json.loads(capsys.readouterr().out)
    knob = megatron.MegatronKnobs(cuda_graph_scope=("attn", "mlp"))
    bill = gpumem.estimate("llama-2-7b", framework="megatron", seq_len=512, megatron=knob)
    plain = gpumem.estimate("llama-2-7b", framework="megatron", seq_len=512)
    assert got["per_gpu"]["total"] == bill.per_gpu["total"] != plain.per_gpu["total"]
    assert main([*base, "--cuda-graph-scope", "x"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown 'x'; give names from attn, mlp, moe" in err


def test_release_proxy_layout_and_vocabulary_close_the_issues_minus_55(check):
    """The issue's worst case (-55 %): the DeepSeek-V3 proxy release run (megatron_named.json,
    64 GPUs). Without its layout and with the GPT-2 vocabulary standing in for its 256k
    SentencePiece one the steady figure is 40 % under (55 % on 128 GPUs, the issue's figure);
    with the layout ``Et*2|(tt|)*5t|tmL`` (the last rank: chunks 3 and 7, three MoE layers,
    the MTP layer and the loss) and the 256,000-piece vocabulary both figures are within 10 %."""
    mc, cases = check
    case = cases["deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm"]
    r = mc.run_case(case)
    assert abs(r["steady_err"]) <= 0.10 and abs(r["peak_err"]) <= 0.10, r
    plain = json.loads(json.dumps(case))
    del plain["args"]["--pipeline-model-parallel-layout"], plain["tokenizer_vocab"]
    assert mc.run_case(plain)["steady_err"] < -0.3
