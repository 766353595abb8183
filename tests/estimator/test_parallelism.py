"""Frameworks' buffer conventions, context parallelism, expert parallelism over TP x DP,
pipeline ranks, MoE structure and absurd sizes: each against a hand derivation from the
framework's documented behaviour (docs/estimator.md; /work/shared/research/memory-anchors.md)."""

import warnings

import pytest

from gpumem import Layout, ModelSpec, estimate
from gpumem.estimator import peak
from gpumem.estimator.frameworks.conventions import default_framework
from gpumem.estimator.param_count import param_groups
from gpumem.estimator.resolver import resolve_model
from gpumem.planner import plan

P7B = 6_738_415_616


def _est(model="llama-2-7b", **kw):
    kw.setdefault("seq_len", 1024)
    return estimate(model, **kw)


# --- frameworks ------------------------------------------------------------------------------


def test_default_framework_follows_the_layout():
    assert default_framework(Layout(dp=8, fsdp="full")) == "fsdp2"
    assert default_framework(Layout(dp=8, zero=2)) == "deepspeed"
    assert default_framework(Layout(dp=8)) == "torch"
    for lay, fw in ((Layout(dp=8, zero=1), "deepspeed"), (Layout(dp=8, fsdp="full"), "fsdp2")):
        b = _est(layout=lay)
        assert b.framework == fw and b.to_dict()["framework"] == fw
        assert f"{fw} conventions" in b.table()


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


def test_a_config_json_defaults_to_the_transformers_recipe():
    """Issue #19: a config.json is trained by transformers' own loss path unless told otherwise:
    no logits held through backward, fp32 log-softmax of 16-bit logits; its buffers are those
    of the engine the layout implies (DeepSpeed's buckets at ZeRO-2, FSDP2's gathers)."""
    b = _est(LLAMA_CONFIG, layout=Layout(dp=8, zero=2))
    assert b.framework == "transformers" and "transformers conventions" in b.table()
    assert b.inputs["loss"].startswith("inside the model") and "not held" in b.inputs["loss"]
    ds = _est(LLAMA_CONFIG, layout=Layout(dp=8, zero=2), framework="deepspeed")
    assert b.per_gpu["communication"] == ds.per_gpu["communication"] > 0
    n, v = 8 * 1024, 32000  # tokens of the micro-batch, vocabulary
    # without held logits, the torch loop's log-softmax is 16-bit (2 B); the Trainer's is fp32
    # (4 B): +2 B per logit saved at the start of backward (where both peak)
    torch_loop = _est(LLAMA_CONFIG, batch_size=8, framework="torch", keep_logits=False)
    own = _est(LLAMA_CONFIG, batch_size=8)
    assert own.phase == torch_loop.phase == "backward start"
    assert own.per_gpu["activations"] - torch_loop.per_gpu["activations"] == n * v * (4 - 2)
    # keep_logits stays available and says so
    kept = _est(LLAMA_CONFIG, keep_logits=True)
    assert kept.sources["loss"] == "keep_logits given" and "logits held" in kept.inputs["loss"]
    # presets keep the generic loop
    assert _est().framework == "torch" and "logits held" in _est().inputs["loss"]


@pytest.mark.parametrize(
    "framework,layout,match",
    [
        ("megatron", Layout(dp=8, zero=2), "megatron.*zero 0, 1 .* or 3 \\(Megatron-FSDP\\)"),
        ("torch", Layout(dp=8, zero=1), "torch.*zero 0, no fsdp"),
        ("fsdp2", Layout(dp=8), "fsdp2.*fsdp='full' or 'hybrid'"),
        ("deepspeed", Layout(dp=8, fsdp="full"), "deepspeed.*no fsdp"),
        ("jax", Layout(dp=8), "unknown framework 'jax'; choose one of transformers, megatron"),
    ],
)
def test_invalid_framework_combinations(framework, layout, match):
    with pytest.raises(ValueError, match=match):
        _est(layout=layout, framework=framework)


def test_zero1_buckets_are_deepspeeds_not_megatrons():
    """Issue #12: ZeRO-1 priced DeepSpeed's two 5e8-element buckets into every job; Megatron's
    distributed optimizer reduces and gathers in place (no buckets). With Megatron's 4-byte
    grads and 2-byte weights the phantom was 5e8 * (4 + 2) = 3e9 B (2.8 GiB) on a 7B job.
    Issue #19: DeepSpeed's ZeRO-1 keeps one IPG bucket of ``reduce_bucket_size`` elements in the
    model's 16-bit dtype (``setup_buckets``, whatever the grads' dtype) and all-gathers in place
    (``all_gather_into_tensor``): 5e8 * 2 B = 1e9 B."""
    lay = Layout(dp=8, zero=1)
    meg = _est(layout=lay, framework="megatron")
    ds = _est(layout=lay, framework="deepspeed", grads="fp32")
    assert meg.per_gpu["communication"] == 0
    assert ds.per_gpu["communication"] == 500_000_000 * 2 == 1_000_000_000
    # Megatron: fp32 main grads by default (18 B/param), not sharded by the distributed optimizer
    assert meg.training.grads == "fp32"
    assert meg.model_states["gradients"] == 4 * P7B
    assert meg.model_states["optimizer"] == 12 * P7B // 8


def test_fsdp2_gathers_a_layer_and_prefetches_the_next():
    """FSDP2 (reshard_after_forward): one layer unsharded, the next prefetched, one layer's
    unsharded gradients: layer_params * (2 * 2 B + 2 B) in forward/backward, none in the step."""
    b = _est(layout=Layout(dp=8, fsdp="full"))
    pg = param_groups(resolve_model("llama-2-7b"))
    layer = pg.layer_tp + pg.layer_rep
    x = _terms("llama-2-7b", Layout(dp=8, fsdp="full"))
    assert x[peak.GATHER] == layer * (2 * 2 + 2)
    assert b.per_gpu["communication"] in (layer * 6, 0)
    assert b.profiler_categories(("communication",))["communication"] == b.per_gpu["communication"]
    # a profiler without the category sees the buffers as temporary
    old = b.profiler_categories(("weights", "temporary"))
    assert "communication" not in old
    new = b.profiler_categories(("communication",))
    assert old["temporary"] == new["temporary"] + b.per_gpu["communication"]


def test_ddp_keeps_a_bucket_copy_of_every_gradient():
    """torch DDP (gradient_as_bucket_view=False): flat buckets beside .grad, the size of all
    gradients, once more than one rank reduces."""
    one = _terms("llama-2-7b", Layout(dp=1))
    two = _terms("llama-2-7b", Layout(dp=2))
    assert one[peak.COMM] == 0
    assert two[peak.COMM] == P7B * 2


def _terms(model, layout, **kw):
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.preset import PresetTerms
    from gpumem.estimator.states import Training

    fw = kw.pop("framework", default_framework(layout))
    job = PresetTerms(resolve_model(model), Training(), find_gpu("H100-80GB"), 1024, framework=fw)
    return job.terms(layout, 1, "none", 1, None, [0])[0]


# --- context parallelism ---------------------------------------------------------------------


def test_context_parallel_divides_activations_along_the_sequence():
    """With flash attention nothing is s^2: a layer on one of cp ranks saves exactly what the
    layer saves for seq/cp tokens; Megatron's ring exchange keeps two K/V chunks (current and
    arriving), 2 * 2 * tokens * kv width * 2 B per layer."""
    spec = resolve_model("llama-2-7b")
    x_cp = _terms(spec, Layout(dp=1, cp=4), framework="megatron")
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.preset import PresetTerms
    from gpumem.estimator.states import Training

    quarter = PresetTerms(spec, Training(), find_gpu("H100-80GB"), 256, framework="megatron").terms(
        Layout(dp=1), 1, "none", 1, None, [0]
    )[0]
    assert x_cp[peak.A_LAYER] == quarter[peak.A_LAYER]
    kv_width = spec.kv_heads * spec.dhead
    assert x_cp[peak.GATHER] == 2 * 2 * 256 * kv_width * 2


def test_fsdp_shards_over_dp_times_cp():
    b = _est(layout=Layout(dp=2, cp=4, fsdp="full"))
    assert b.model_states["weights"] == pytest.approx(P7B * 2 / 8, abs=8)
    with pytest.raises(ValueError, match="2\\*cp = 8"):
        _est(layout=Layout(dp=1, cp=4), seq_len=1020)


def test_planner_searches_context_parallelism_for_long_contexts():
    r = plan("llama-3-8b", n_gpus=8, seq_len=131072, micro_batches=(1,), global_batch=8)
    assert r.candidates and any(c.layout.cp > 1 for c in r.candidates)
    assert all(c.layout.cp == 1 for c in plan("gpt2", n_gpus=8, seq_len=1024).candidates)


# --- experts ---------------------------------------------------------------------------------


def test_experts_fold_over_tp_times_dp():
    """Megatron: ep * etp divides dp * tp; the experts' data-parallel degree is
    dp * tp / (ep * etp). Mixtral 8x7B on dp=2, tp=2 with ep=4, etp=1: each rank holds 2
    whole experts of every layer, and their optimizer state is not sharded (expert dp = 1)."""
    spec = resolve_model("mixtral-8x7b")
    pg = param_groups(spec)
    lay = Layout(dp=2, tp=2, ep=4, etp=1, zero=1)
    x = _terms(spec, lay)
    assert x[peak.P_EXP_TRAIN] == spec.n_layers * pg.layer_expert / 4
    assert x[peak.N_SHARD_EXP] == 1 and x[peak.N_SHARD] == 2
    with pytest.raises(ValueError, match="etp=3 must divide tp=2"):
        Layout(dp=3, tp=2, etp=3)
    with pytest.raises(ValueError, match="etp=2 but llama-2-7b has no experts"):
        _est(layout=Layout(dp=1, tp=2, etp=2))


def test_attention_moment_counts_only_the_ranks_experts_grads(monkeypatch):
    """By the attention core's backward the MLP's weight gradients exist: under expert
    parallelism those of the rank's own experts only (Mixtral 8x7B, ep=4: 2 of 8 experts of
    3·h·ffn each), plus the replicated router (h x 8) and the output projection and norms.
    Counting all 8 experts put 6 experts' fp32 gradients (2.1 GiB) into a rank that never
    holds them."""
    from gpumem.estimator import backward

    seen = []
    real = backward.attention_moment

    def spy(spec, s, mlp_saved, mlp_params, *a):
        seen.append(mlp_params)
        return real(spec, s, mlp_saved, mlp_params, *a)

    monkeypatch.setattr(backward, "attention_moment", spy)
    spec = resolve_model("mixtral-8x7b")
    h, f = spec.hidden, spec.moe_ffn
    most = {}
    for ep in (1, 4):  # the MoE layer's moment (the terms also price a dense one)
        seen.clear()
        lay = Layout(dp=4, ep=ep, zero=1)
        estimate(spec, seq_len=256, layout=lay, framework="megatron", moe_imbalance=1.0)
        most[ep] = max(seen)
    rest = h * spec.n_experts + spec.n_heads * spec.dhead * h + 2 * h
    assert most[1] == 8 * 3 * h * f + rest
    assert most[4] == 2 * 3 * h * f + rest


def test_moe_imbalance_and_dispatch_only_with_expert_parallelism():
    spec = resolve_model("mixtral-8x7b")
    one = [estimate(spec, seq_len=512, moe_imbalance=f).per_gpu for f in (1.0, 2.0)]
    assert one[0] == one[1]  # a single rank processes n * k token copies whatever the routing
    lay = Layout(dp=8, ep=8, zero=1)
    a, b = (
        estimate(spec, seq_len=512, layout=lay, moe_imbalance=f, framework="megatron")
        for f in (1.0, 2.0)
    )
    assert b.per_gpu["activations"] > a.per_gpu["activations"]
    n, k, h = 512, spec.top_k, spec.hidden
    # all-to-all: the n*k permuted copies sent and n*k*imbalance received, 2 B each
    assert a.per_gpu["communication"] in (0, (n * k + n * k) * h * 2)
    with pytest.raises(ValueError, match=r"moe_imbalance .* >= 1"):
        estimate(spec, moe_imbalance=0.5)
    with pytest.raises(ValueError, match="moe_dispatcher"):
        estimate(spec, moe_dispatcher="ring")


def test_moe_configs_dense_first_layers_and_shared_experts():
    """DeepSeek-V3's config shape: the first k layers dense (intermediate_size), the others
    routed experts of moe_intermediate_size plus shared experts; counts by hand."""
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "vocab_size": 256,
    }
    spec = resolve_model(cfg)
    h, a = 64, 4
    attn = (
        h * 32
        + 32
        + 32 * a * 24  # q_a, its norm, q_b
        + h * (16 + 8)
        + 16  # kv_a (latent + rope key), its norm
        + 16 * a * (16 + 16)
        + a * 16 * h  # kv_b, o
        + 2 * h  # the layer's two norms
    )
    dense = attn + 3 * h * 128
    moe = attn + 4 * 3 * h * 32 + h * 4 + 3 * h * 32  # experts, router, shared expert
    assert spec.n_params == dense + 2 * moe + 2 * 256 * h + h
    bad = {k: v for k, v in cfg.items() if k != "num_experts_per_tok"}
    with pytest.raises(ValueError, match=r"router field.*'num_experts_per_tok'"):
        resolve_model(bad)


# --- pipeline --------------------------------------------------------------------------------


def test_a_bill_per_pipeline_rank_and_the_worst_decides():
    b = _est(layout=Layout(dp=1, pp=4), grad_accum=8, seq_len=4096)
    assert [r.stage for r in b.pipeline_ranks] == [0, 1, 2, 3]
    worst = max(b.pipeline_ranks, key=lambda r: r.per_gpu["total"])
    assert b.per_gpu == worst.per_gpu and b.stage == worst.stage
    assert b.fits == (b.per_gpu["total"] <= b.gpu.total_bytes)
    # 1F1B: rank r holds min(micro-batches, pp - r) micro-batches of its 8 layers
    acts = [r.per_gpu["activations"] for r in b.pipeline_ranks]
    assert acts[0] > acts[1] > acts[2]
    assert "rank 3" in b.pipeline_table()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_interleaved_in_flight_follows_megatrons_schedule(stage):
    """Megatron-core's interleaved schedule: rank r runs (pp - r - 1) * 2 + (vpp - 1) * pp
    warm-up forwards of model chunks (1/vpp of the rank's layers each), so that + 1 chunks are
    in flight. pp=4, vpp=2: ranks hold 15/2, 13/2, 11/2, 9/2... chunks -> /vpp stages' worth;
    the last rank holds 5 chunks = 2.5 micro-batches' worth, not 1F1B's one (the ~27 % low
    last stage of the issue)."""
    from gpumem.estimator.terms import inflight

    lay = Layout(dp=1, pp=4, vpp=2)
    chunks = (4 - stage - 1) * 2 + (2 - 1) * 4 + 1
    assert inflight(lay, 16, stage) == chunks / 2
    assert inflight(lay, 1, stage) == min(chunks, 2) / 2  # capped by the step's chunks
    assert inflight(Layout(dp=1, pp=4), 16, stage) == 4 - stage  # 1F1B


# --- absurd sizes ----------------------------------------------------------------------------


def test_no_overflow_for_absurd_jobs():
    """1e14 tokens and 1e9 layers: the estimate is astronomically large (never a wrapped
    negative), does not fit, and the planner's numba sweep finds nothing, quickly."""
    huge = ModelSpec(
        name="huge",
        arch="llama",
        n_layers=10**9,
        hidden=4096,
        n_heads=32,
        ffn=11008,
        vocab=32000,
        max_seq=10**15,
    )
    b = estimate(huge, seq_len=10**14, layout=Layout(dp=1, pp=4, vpp=2))
    assert not b.fits and b.headroom_bytes < 0
    assert all(v >= 0 for v in b.per_gpu.values()) and b.per_gpu["total"] > 2**60
    r = plan(huge, seq_len=10**14, n_gpus=8)
    assert r.candidates == [] and r.n_configs > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(huge, seq_len=1, n_gpus=1024, micro_batches=(1,)).candidates == []


# --- fused kernels ---------------------------------------------------------------------------


def test_fused_kernels_save_what_they_keep():
    """bf16 Llama layer, by hand: an unfused RMSNorm keeps x.float() (4 B) and the normalised
    x (2 B) where a fused one keeps x (2 B): 4·s·h less per norm, two norms; fused SwiGLU keeps
    the gate/up output (2·f) and the product (f) instead of four f-wide tensors: 2·s·f less.
    Fused cross-entropy keeps a per-token log-sum-exp instead of s·v fp32 log-probabilities
    (bf16-mixed logits: the log-softmax is bf16 there, 2 B)."""
    from gpumem.estimator.activations import sum_items

    spec = resolve_model("llama-2-7b")
    s, h, f, v = 2048, spec.hidden, spec.ffn, spec.vocab
    plain = estimate(spec, seq_len=s, framework="torch")
    fused = estimate(spec, seq_len=s, fused_ops=("norm", "swiglu"))
    assert sum_items(plain.items) - sum_items(fused.items) == 2 * 4 * s * h + 2 * s * f
    meg = estimate(spec, seq_len=s, layout=Layout(dp=2, zero=1), framework="megatron")
    assert meg.inputs["fused_ops"] == ("norm", "rope", "swiglu")
    x_plain = _terms(spec, Layout(dp=1))
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.preset import PresetTerms
    from gpumem.estimator.states import Training

    job = PresetTerms(spec, Training(), find_gpu("H100-80GB"), 1024, fused_ops=("ce",))
    x_ce = job.terms(Layout(dp=1), 1, "none", 1, None, [0])[0]
    assert x_plain[peak.A_LAST] - x_ce[peak.A_LAST] == 1024 * v * 2 - 1024 * 4
    with pytest.raises(ValueError, match="unknown fused op"):
        estimate(spec, fused_ops=("norm", "attention"))
