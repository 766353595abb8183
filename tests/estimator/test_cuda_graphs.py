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
    """pp 2, 4 micro-batches, attn scope: the last rank's 2 layers get a graph per
    micro-batch, each keeping 3 boundary tensors of 32 tokens x 64 x 2 B: 3 * 2 * 4 * 4096 B
    more in the steady figure than without graphs."""
    kw = {"seq_len": 32, "batch_size": 1, "framework": "megatron", "grad_accum": 4,
          "layout": gpumem.Layout(pp=2), "gpu": "H100-80GB"}  # fmt: skip
    on = gpumem.estimate(SPEC, megatron=megatron.MegatronKnobs(cuda_graph_scope=("attn",)), **kw)
    off = gpumem.estimate(SPEC, **kw)
    diff = (
        on.pipeline_ranks[-1].model_states["total"] - off.pipeline_ranks[-1].model_states["total"]
    )
    assert diff == 3 * 2 * 4 * (32 * 64 * 2)
    # without pipelining one micro-batch is captured
    kw["layout"] = gpumem.Layout()
    on = gpumem.estimate(SPEC, megatron=megatron.MegatronKnobs(cuda_graph_scope=("attn",)), **kw)
    assert on.model_states["total"] - gpumem.estimate(SPEC, **kw).model_states["total"] == (
        3 * 4 * 1 * (32 * 64 * 2)
    )


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


@pytest.mark.parametrize(
    "name",
    ["gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph", "moe2.0/dsv3_tp2pp2ep4_cudagraph"],
)
def test_ci_cases_with_graphs_within_5_percent(check, name):
    """Megatron-LM's H100 golden values (peak and steady of the last rank)."""
    mc, cases = check
    r = mc.run_case(cases[name])
    assert abs(r["peak_err"]) <= 0.05 and abs(r["steady_err"]) <= 0.05, r


def test_attn_graphs_case_closer_than_without_the_knob(check):
    """The attn-scope case (the issue's +22 %) is not within 5 % (the reason is in the
    results), but both figures move towards the golden values."""
    mc, cases = check
    case = cases["gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph"]
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
