"""``framework="torchtitan"``: torchtitan's recipe against a fake profile of torchtitan's own
model (``benchmarks/published/torchtitan_reference.py``), and its rules on a hand computation.

The reference tests need torchtitan (``pip install --no-deps torchtitan==0.3.0`` and its small
imports: spmd_types, tyro); the others run without it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import gpumem
from gpumem.estimator.model_spec import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "published"

# a shrunken torchtitan Llama: dim 256, 4 blocks, 8 heads (2 KV heads), ffn of _8b's rule
# (compute_ffn_hidden_dim(256, multiple_of=256, ffn_dim_multiplier=1.3) = 1024), vocab 8192
# (vocab / dim = 32, as Llama 3 8B's 128256 / 4096), batch 2 × 512
TINY = {
    "dim": 256,
    "n_layers": 4,
    "n_heads": 8,
    "n_kv_heads": 2,
    "ffn_dim_multiplier": 1.3,
    "multiple_of": 256,
    "vocab": 8192,
}
FFN, BATCH, SEQ = 1024, 2, 512


def tiny_spec(vocab: int = 8192) -> ModelSpec:
    return ModelSpec(
        name="titan-tiny",
        arch="llama",
        n_layers=4,
        hidden=256,
        n_heads=8,
        n_kv_heads=2,
        ffn=FFN,
        vocab=vocab,
        max_seq=SEQ,
    )


def allocated(bill: gpumem.Bill) -> int:
    return sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))


def estimate(recompute: str, world: int, tp: int = 1, cp: int = 1, **kw) -> gpumem.Bill:
    return gpumem.estimate(
        kw.pop("spec", tiny_spec()),
        batch_size=BATCH,
        seq_len=kw.pop("seq", SEQ),
        framework="torchtitan",
        recompute=recompute,
        layout=gpumem.Layout(dp=world, tp=tp, cp=cp, fsdp="full", sp=tp > 1),
        device="cpu",
        **kw,
    )


# --- the rules, by hand (no torchtitan needed) ------------------------------------------------


def test_start_of_backward_by_hand() -> None:
    """Per-op SAC, 2 ranks: the states, every block's SAC cache and input, the head's saved
    tensors, the loss backward's two fp32 logits gradients and the gathered [norm, lm_head]."""
    n, h, f, v, kv, L, N = BATCH * SEQ, 256, FFN, 8192, 64, 4, 2
    block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    params = L * block + 2 * v * h + h
    states = params * (4 + 8) // N  # fp32 sharded master weights + AdamW m, v
    rope = L * SEQ * (32 // 2) * 8  # complex64 cache per block
    lse = BATCH * 8 * SEQ * 4 + 16
    per_block = 2 * n * h + 2 * n * (h + 2 * kv) + 2 * n * f + 2 * n * h + 2 * n * h + lse
    head = (8 * n * h + 4 * n) + 2 * n * h + 4 * n * v + (8 * n + 4)
    expected = states + rope + L * per_block + 8 * n + head + 8 * n * v + (v * h + h) * 2
    bill = estimate("selective", 2)
    assert bill.phase == "backward start"
    assert allocated(bill) == expected


def test_policies_order_and_layer_sac_by_hand() -> None:
    """none > selective:2 > selective > full, and layer SAC every 2 is the mean of none and
    full blocks."""
    peaks = {r: allocated(estimate(r, 1)) for r in ("none", "selective:2", "selective", "full")}
    assert peaks["none"] > peaks["selective:2"] > peaks["selective"] > peaks["full"]
    assert peaks["selective:2"] - peaks["full"] == (peaks["none"] - peaks["full"]) // 2
    assert allocated(estimate("selective:op", 1)) == peaks["selective"]


# the fake profiles of torchtitan's model (benchmarks/results/torchtitan_reference.md)
RECORDED = [
    # model, dp, tp, cp, batch, seq, recompute, peak allocated bytes of the fake profile
    ("llama-3.1-8b", 8, 1, 1, 2, 8192, "selective", 73_544_711_828),  # Table 1
    ("llama-3.1-8b", 128, 1, 1, 2, 8192, "selective", 62_252_156_948),  # Table 3
    ("llama-3.1-8b", 1, 1, 8, 1, 262144, "full", 77_756_119_956),  # Table 2, CP 8
    ("llama-3.1-70b", 32, 8, 1, 16, 8192, "full", 62_231_270_616),  # Table 4
]


@pytest.mark.parametrize(("model", "dp", "tp", "cp", "batch", "seq", "recompute", "ref"), RECORDED)
def test_published_rows_equal_recorded_reference(model, dp, tp, cp, batch, seq, recompute, ref):
    spec = dataclasses.replace(gpumem.estimator.resolve_model(model), max_seq=seq)
    bill = gpumem.estimate(
        spec,
        batch_size=batch,
        seq_len=seq,
        framework="torchtitan",
        recompute=recompute,
        layout=gpumem.Layout(dp=dp, tp=tp, cp=cp, fsdp="full", sp=tp > 1),
    )
    assert abs(allocated(bill) / ref - 1) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"framework": "megatron", "recompute": "selective:op"}, ("torchtitan", "megatron")),
        ({"framework": "torchtitan", "recompute": "every-2"}, ("torchtitan", "selective:N")),
        ({"framework": "torchtitan", "recompute": "selective:0"}, ("torchtitan", "full")),
        ({"framework": "torchtitan", "precision": "bf16"}, ("torchtitan", "bf16-mixed")),
    ],
)
def test_bad_recipe_is_one_line(kwargs: dict, words: tuple[str, ...]) -> None:
    layout = gpumem.Layout(dp=8, fsdp="full") if kwargs["framework"] == "torchtitan" else None
    kwargs.setdefault("recompute", "none")
    with pytest.raises(ValueError) as e:
        gpumem.estimate("llama-3.1-8b", batch_size=1, seq_len=1024, layout=layout, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_torchtitan_refuses_what_it_does_not_model() -> None:
    tied = dataclasses.replace(tiny_spec(), tied_embeddings=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        estimate("selective", 2, spec=tied)
    with pytest.raises(ValueError, match="grad_accum=1"):
        estimate("selective", 2, grad_accum=2)


def test_torchtitan_shards_over_every_dp_rank_by_default() -> None:
    """torchtitan's job_config: data_parallel_shard_degree = -1 (every data-parallel rank),
    replicate degree 1: a plain dp layout is FSDP over all of them, and the bill says so."""
    plain = gpumem.estimate("llama-3.1-8b", framework="torchtitan", layout=gpumem.Layout(dp=8))
    full = gpumem.estimate(
        "llama-3.1-8b", framework="torchtitan", layout=gpumem.Layout(dp=8, fsdp="full")
    )
    zero3 = gpumem.estimate(
        "llama-3.1-8b", framework="torchtitan", layout=gpumem.Layout(dp=8, zero=3)
    )
    assert plain.per_gpu == full.per_gpu == zero3.per_gpu
    assert plain.layout.fsdp == "full"
    assert "sharding fsdp-full over 8 ranks (default: torchtitan's dp_shard=-1" in (
        plain.inputs_line()
    )
    assert "sharding fsdp-full over 8 ranks (given)" in full.inputs_line()
    assert plain.to_dict()["inputs"]["sharding"]["value"] == "fsdp-full over 8 ranks"


def test_torchtitan_refuses_zero12_in_one_line() -> None:
    """(pp is modelled: tests/estimator/test_titan_pipeline.py.)"""
    for layout, words in ((gpumem.Layout(dp=8, zero=1), ("zero=1", "dp_shard=-1", "no ZeRO-1/2")),):
        with pytest.raises(ValueError) as e:
            gpumem.estimate("llama-3.1-8b", framework="torchtitan", layout=layout)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg


# --- against torchtitan's own model, fake-profiled --------------------------------------------


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(BENCH))
    try:
        import torchtitan_reference
    finally:
        sys.path.remove(str(BENCH))
    return torchtitan_reference


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("recompute", ["none", "selective", "full", "selective:2"])
def test_estimate_equals_fake_profile(reference, recompute: str, world: int) -> None:
    """Vocabulary 32 × dim: the loss's backward is the peak, as in Llama 3."""
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = reference.profile_step(**TINY, world=world, batch=BATCH, seq=SEQ, ac=ac)
    bill = estimate(recompute, world)
    assert ref.peak_phase == "backward" and bill.phase == "backward start"
    # AdamW's step counters and the loss's scalars: a few hundred bytes
    assert abs(allocated(bill) - ref.peak_bytes) < 512


@pytest.mark.parametrize(
    ("recompute", "world", "phase"),
    [
        ("none", 1, "backward start"),  # block L-1
        ("selective", 2, "backward start"),
        ("full", 1, "backward end"),  # block 0: every other gradient done
        ("full", 8, "backward start"),  # block L-2: block L-1's fp32 reduce-scatter input
        ("selective:2", 1, "backward start"),  # no prefetch on a single rank
        ("selective:2", 8, "backward start"),
    ],
)
def test_block_moments_equal_fake_profile(reference, recompute: str, world: int, phase: str):
    """Vocabulary 2 × dim: a block's backward is the peak (its recomputed set, SwiGLU's
    gradients, FSDP's gathered, prefetched and reduce-scatter buffers)."""
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = reference.profile_step(**{**TINY, "vocab": 512}, world=world, batch=BATCH, seq=SEQ, ac=ac)
    bill = estimate(recompute, world, spec=tiny_spec(vocab=512))
    assert bill.phase == phase
    assert abs(allocated(bill) - ref.peak_bytes) < 512


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_tensor_parallel_equals_fake_profile(reference, recompute: str) -> None:
    """FSDP 2 × TP 2 (torchtitan's sequence-parallel plan, loss parallel): the loss-parallel
    backward's three fp32 logits-sized tensors, the vocab-parallel embedding's saved indices and
    mask, SAC's saved reduce-scatter outputs."""
    ref = reference.profile_step(**TINY, world=2, batch=BATCH, seq=SEQ, ac=recompute, tp=2)
    bill = estimate(recompute, 2, tp=2)
    assert bill.phase == "backward start"
    assert abs(allocated(bill) - ref.peak_bytes) < 512


def test_tensor_parallel_block_moment_within_one_percent(reference) -> None:
    """Under TP a block's widest backward moment is the sequence-parallel all-gather's backward
    (a gathered input gradient before its reduce-scatter), which the rules approximate by the
    SwiGLU moment: within 1 % (short by one sequence-sharded activation)."""
    ref = reference.profile_step(
        **{**TINY, "vocab": 512}, world=2, batch=BATCH, seq=SEQ, ac="full", tp=2
    )
    bill = estimate("full", 2, tp=2, spec=tiny_spec(vocab=512))
    assert abs(allocated(bill) / ref.peak_bytes - 1) < 0.01


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_context_parallel_equals_fake_profile(reference, recompute: str) -> None:
    """CP 2 of a 1024-token sequence (torchtitan's FlexAttention CP: the attention saves the
    all-gathered K and V; FSDP shards over dp · cp; the RoPE cache holds the whole sequence)."""
    ref = reference.profile_step(**TINY, world=1, batch=BATCH, seq=1024, ac=recompute, cp=2)
    spec = dataclasses.replace(tiny_spec(), max_seq=1024)
    bill = estimate(recompute, 1, cp=2, spec=spec, seq=1024)
    assert bill.phase == "backward start"
    assert abs(allocated(bill) - ref.peak_bytes) < 512


def test_planner_refuses_torchtitan() -> None:
    with pytest.raises(ValueError, match="planner does not sweep framework='torchtitan'"):
        gpumem.plan("llama-3.1-8b", framework="torchtitan")


def test_bill_items_are_torchtitans_block() -> None:
    """The bill's itemised layer is torchtitan's block under the policy (per-op SAC: its cache
    and the block input), and sums to the per-block term."""
    bill = estimate("selective", 2)
    names = [i.name for i in bill.items]
    assert names == ["block_input", "wqkv_out", "w1_out", "w2_out", "attn_out", "attn_lse"]
    n, h, kv = BATCH * SEQ, 256, 64
    assert bill.items[1].nbytes == 2 * n * (h + 2 * kv)


def test_reference_attention_op_is_in_the_sac_save_list(reference) -> None:
    """The reference's attention op is the one torchtitan's per-op SAC saves on CUDA."""
    import torch
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    save = SelectiveAC.Config().build(dump_folder="").get_save_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in save
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in save
    assert torch.ops.aten.mm.default in save


def test_two_blocks_mha_small_vocab_equals_fake_profile(reference) -> None:
    """Two MHA blocks (dim 128, 4 heads), vocabulary 256, full AC on 4 ranks: block 0's
    backward is the peak, with the embedding's unit prefetched."""
    from torchtitan.models.common import compute_ffn_hidden_dim

    cfg = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "vocab": 256}
    ref = reference.profile_step(
        **cfg, ffn_dim_multiplier=None, multiple_of=128, world=4, batch=1, seq=256, ac="full"
    )
    spec = ModelSpec(
        name="titan-mha",
        arch="llama",
        n_layers=2,
        hidden=128,
        n_heads=4,
        n_kv_heads=4,
        ffn=compute_ffn_hidden_dim(128, multiple_of=128),
        vocab=256,
        max_seq=256,
    )
    bill = gpumem.estimate(
        spec,
        batch_size=1,
        seq_len=256,
        framework="torchtitan",
        recompute="full",
        layout=gpumem.Layout(dp=4, fsdp="full"),
        device="cpu",
    )
    assert abs(allocated(bill) - ref.peak_bytes) < 512


def test_persistent_grads_add_every_sharded_grad_at_the_loss() -> None:
    """0.3.0's CUDA-graph default (``zero_grad(set_to_none=False)``): at the loss's backward
    every fp32 sharded gradient is already there, 4 B per parameter over the shard degree."""
    kept = allocated(estimate("selective", 2, persistent_grads=True))
    freed = allocated(estimate("selective", 2))
    assert kept - freed == 4 * tiny_spec().n_params // 2


@pytest.mark.parametrize(
    ("vocab", "recompute", "world"), [(8192, "selective", 2), (512, "full", 8)]
)
def test_persistent_grads_equal_fake_profile(reference, vocab: int, recompute: str, world: int):
    ref = reference.profile_step(
        **{**TINY, "vocab": vocab},
        world=world,
        batch=BATCH,
        seq=SEQ,
        ac=recompute,
        set_to_none=False,
    )
    bill = estimate(recompute, world, spec=tiny_spec(vocab), persistent_grads=True)
    assert abs(allocated(bill) - ref.peak_bytes) < 512


@pytest.mark.parametrize(
    ("vocab", "recompute", "world", "chunks", "cp"),
    [
        (8192, "selective", 2, 4, 1),  # a chunk's log-softmax backward
        (8192, "none", 1, 8, 1),  # the last chunk's reduce-scatter of the head unit
        (32768, "full", 2, 8, 1),
        (512, "selective", 2, 4, 1),  # the last block: the wrapper's cycle holds the hidden
        (8192, "selective", 1, 4, 2),  # CP 2: chunks of the local sequence
    ],
)
def test_chunked_loss_equals_fake_profile(reference, vocab, recompute, world, chunks, cp):
    """0.3.0's llama3 recipes' ``ChunkedLossWrapper`` (``loss_chunks``)."""
    seq = SEQ * cp
    ref = reference.profile_step(
        **{**TINY, "vocab": vocab},
        world=world,
        batch=BATCH,
        seq=seq,
        ac=recompute,
        cp=cp,
        loss_chunks=chunks,
    )
    spec = dataclasses.replace(tiny_spec(vocab), max_seq=seq)
    bill = estimate(recompute, world, cp=cp, spec=spec, seq=seq, loss_chunks=chunks)
    assert abs(allocated(bill) - ref.peak_bytes) < 4096


def test_chunked_loss_by_hand() -> None:
    """At the loss moment of N chunks the whole-logits terms (log-softmax and its two fp32
    gradients: 12 B per logit) become one chunk's plus its bf16 logits, beside the wrapper's
    chunk copies (of the hidden states and the labels), its fp32 accumulator and the lm_head's
    unsharded fp32 grad."""
    n, h, v, N = BATCH * SEQ, 256, 8192, 4
    m = n // N
    whole = allocated(estimate("selective", 2))
    chunked = allocated(estimate("selective", 2, loss_chunks=N))
    wrapper = n * h * 2 + 8 * n + 4 * n * h + 4 * v * h
    assert whole - chunked == 12 * n * v - (14 * m * v + wrapper)


def test_chunked_loss_bad_input() -> None:
    with pytest.raises(ValueError, match="loss_chunks is torchtitan's"):
        gpumem.estimate("llama-3.1-8b", framework="megatron", loss_chunks=8)
    with pytest.raises(ValueError, match="must divide the local sequence"):
        estimate("selective", 2, loss_chunks=3)
    with pytest.raises(ValueError, match="tensor parallelism"):
        estimate("selective", 2, tp=2, loss_chunks=4)
    with pytest.raises(ValueError, match="integer >= 0"):
        estimate("selective", 2, loss_chunks=-1)


# --- float8 (torchao's Float8Linear through torchtitan's converter) ----------------------------

F8_RECIPES = [("rowwise", False), ("rowwise_with_gw_hp", False), ("tensorwise", False)]
F8_RECIPES.append(("tensorwise", True))  # FSDP float8 all-gather


def f8_estimate(recompute: str, world: int, recipe: str | None, all_gather: bool = False, **kw):
    return allocated(
        estimate(recompute, world, fp8_recipe=recipe, fsdp_float8_all_gather=all_gather, **kw)
    )


def test_float8_gathered_weight_bytes_by_hand() -> None:
    """FSDP's float8 all-gather gathers the five converted Linears of a block in 1 B per weight
    and its two norms in bf16; the block moment (the block and its prefetched neighbour
    gathered) is cheaper by one byte per converted weight of each."""
    from gpumem.estimator.frameworks import torchtitan

    spec, h, f, kv = tiny_spec(), 256, FFN, 64
    linears = h * (h + 2 * kv) + h * h + 3 * h * f
    assert torchtitan.float8_gathered(spec, 1, True) == linears + 2 * h * 2
    assert torchtitan.float8_gathered(spec, 1, False) == (linears + 2 * h) * 2
    # a Linear whose dims are not multiples of 16 stays bf16 (torchtitan's module_filter_fn)
    odd = dataclasses.replace(spec, ffn=1000)
    assert torchtitan.float8_linears(odd) == [(h, h + 2 * kv), (h, h)]
    assert (
        torchtitan.float8_gathered(odd, 1, True)
        == h * (h + 2 * kv) + h * h + (3 * h * 1000 + 2 * h) * 2
    )


def test_float8_block_moment_by_hand() -> None:
    """Vocabulary 512 (a block's backward is the peak), 2 ranks, no AC. Rowwise: w2's backward
    holds its bf16 input gradient (n·f·2), the gradient's two fp8 casts (2·n·h), the weight's
    (h·f) and the 9 B per element cast of its saved input (9·n·f), with fp32 row/column scales
    (4·(n + h + 2f)), where bf16's SwiGLU moment held two ffn-wide gradients (4·n·f) and w2's
    unsharded gradient (2·h·f). Tensorwise: scalar scales. Its FSDP float8 all-gather: no weight
    cast, the block and the prefetched one gathered in 1 B per converted weight, and the
    precomputed fp32 scales of every converted weight (4 B each)."""
    n, h, f, L = BATCH * SEQ, 256, FFN, 4
    spec = tiny_spec(vocab=512)
    bf16 = f8_estimate("none", 2, None, spec=spec)
    delta = 7 * n * f + 2 * n * h - h * f
    assert f8_estimate("none", 2, "rowwise", spec=spec) - bf16 == delta + 4 * (n + h + 2 * f)
    assert f8_estimate("none", 2, "tensorwise", spec=spec) - bf16 == delta + 16
    linears = h * (h + 2 * 64) + h * h + 3 * h * f
    ag = delta - h * f - 2 * linears + 12 + 4 * 5 * L
    assert f8_estimate("none", 2, "tensorwise", True, spec=spec) - bf16 == ag


def test_float8_loss_moment_by_hand() -> None:
    """Llama's proportions (the loss's backward is the peak): float8 saves what bf16 saves
    (torchao keeps the high-precision input and weight); per-op SAC adds the tensorwise amax
    scalars of its save list (``aten.max``: 2 B per cast of a bf16 input or weight, 5 Linears
    per block), rowwise nothing; the all-gather keeps one fp32 scale per converted weight."""
    L = 4
    bf16 = f8_estimate("selective", 2, None)
    assert f8_estimate("selective", 2, "rowwise") == bf16
    assert f8_estimate("selective", 2, "rowwise_with_gw_hp") == bf16
    assert f8_estimate("selective", 2, "tensorwise") - bf16 == L * 5 * 2 * 2
    assert f8_estimate("selective", 2, "tensorwise", True) - bf16 == L * 5 * 2 + L * 5 * 4
    assert f8_estimate("none", 2, "tensorwise") == f8_estimate("none", 2, None)


@pytest.fixture(scope="module")
def float8_reference(reference):
    pytest.importorskip("torchao")
    return reference


@pytest.mark.parametrize(
    ("vocab", "world", "recompute", "recipe", "all_gather"),
    [
        # a block's backward (vocabulary 2 × dim): w2's cast moment, its recomputed forward
        *[(512, 2, "none", r, g) for r, g in F8_RECIPES],
        *[(512, 2, "full", r, g) for r, g in F8_RECIPES[1:3]],
        (512, 8, "selective", "rowwise_with_gw_hp", False),
        (512, 8, "selective", "tensorwise", True),
        (512, 1, "selective:2", "rowwise", False),
        (512, 1, "none", "rowwise_with_gw_hp", False),  # the forward, one rank: no flat buffer
        # the loss's backward (vocabulary 32 × dim): SAC's amax scalars, the precomputed scales
        (8192, 2, "selective", "tensorwise", False),
        (8192, 2, "selective", "tensorwise", True),
    ],
)
def test_float8_equals_fake_profile(float8_reference, vocab, world, recompute, recipe, all_gather):
    """torchtitan's ``Float8LinearConverter`` (rowwise recipes) or torchao's tensorwise
    ``convert_to_float8_training`` (with FSDP float8 all-gather) on torchtitan's model."""
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = float8_reference.profile_step(
        **{**TINY, "vocab": vocab},
        world=world,
        batch=BATCH,
        seq=SEQ,
        ac=ac,
        float8=recipe,
        float8_all_gather=all_gather,
    )
    est = f8_estimate(recompute, world, recipe, all_gather, spec=tiny_spec(vocab))
    assert abs(est - ref.peak_bytes) < 512


# tp 4 splits the KV heads: 4 of them (TINY's 2 would not split)
TP_TINY = {**TINY, "vocab": 512, "n_kv_heads": 4}
F8_TP = [
    (tp, recompute, recipe)
    for tp in (2, 4)
    for recipe in ("rowwise", "rowwise_with_gw_hp")
    for recompute in ("none", "selective", "full", "selective:2")
]
F8_TP_SAMPLE = {
    (2, "none", "rowwise"),
    (4, "selective", "rowwise"),
    (2, "full", "rowwise_with_gw_hp"),
    (4, "none", "rowwise_with_gw_hp"),
    (2, "none", "rowwise_with_gw_hp"),
}


@pytest.mark.parametrize(
    ("tp", "recompute", "recipe"),
    [c if c in F8_TP_SAMPLE else pytest.param(*c, marks=pytest.mark.slow) for c in F8_TP],
)
def test_float8_with_tensor_parallelism_equals_fake_profile(
    float8_reference, tp, recompute, recipe
):
    """torchtitan 0.3.0's rowwise recipes under its own TP plan (sequence parallel): the
    Float8Linears cast their local shards. The sample covers each moment the TP shapes change
    (w2's backward, the last block's forward, the recomputed forward, w1's under gw_hp); the
    whole grid (both recipes, four AC policies, tp 2 and 4) runs with --runslow."""
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = float8_reference.profile_step(
        **TP_TINY, world=2, batch=BATCH, seq=SEQ, ac=ac, tp=tp, float8=recipe
    )
    spec = dataclasses.replace(tiny_spec(512), n_kv_heads=4)
    est = f8_estimate(recompute, 2, recipe, tp=tp, spec=spec)
    assert abs(est - ref.peak_bytes) < 512


@pytest.mark.parametrize(
    ("vocab", "recompute", "recipe", "all_gather", "chunks", "persistent"),
    [
        (8192, "selective", "rowwise", False, 4, False),  # with the chunked loss
        (512, "selective", "tensorwise", True, 4, False),
        (512, "full", "rowwise", False, 0, True),  # with 0.3.0's kept gradients
        (8192, "none", "rowwise_with_gw_hp", False, 0, True),
    ],
)
def test_float8_with_other_knobs_equals_fake_profile(
    float8_reference, vocab, recompute, recipe, all_gather, chunks, persistent
):
    ref = float8_reference.profile_step(
        **{**TINY, "vocab": vocab},
        world=2,
        batch=BATCH,
        seq=SEQ,
        ac=recompute,
        float8=recipe,
        float8_all_gather=all_gather,
        loss_chunks=chunks,
        set_to_none=not persistent,
    )
    est = f8_estimate(
        recompute,
        2,
        recipe,
        all_gather,
        spec=tiny_spec(vocab),
        loss_chunks=chunks,
        persistent_grads=persistent,
    )
    assert abs(est - ref.peak_bytes) < 512


def test_float8_reference_sees_what_cuda_saves(float8_reference) -> None:
    """The save list that decides what per-op SAC keeps of a float8 block: ``aten.max`` (the
    tensorwise amax) and ``aten._scaled_mm`` are in it, and SAC's policy sees the ``aten.mm``
    of the float8 tensors (a dispatch mode runs before the tensor subclass), so every second
    matmul is recomputed as in bf16: the rowwise loss moment equals bf16's."""
    import torch
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    save = SelectiveAC.Config().build(dump_folder="").get_save_ops()
    assert torch.ops.aten.max.default in save
    assert torch.ops.aten._scaled_mm.default in save
    assert torch.ops.aten.amax.default not in save
    kw = {**TINY, "world": 2, "batch": BATCH, "seq": SEQ, "ac": "selective"}
    bf16 = float8_reference.profile_step(**kw).peak_bytes
    assert float8_reference.profile_step(**kw, float8="rowwise").peak_bytes == bf16


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"fp8_recipe": "delayed"}, ("torchtitan", "tensorwise, rowwise, rowwise_with_gw_hp")),
        ({"precision": "fp8"}, ("'delayed'", "rowwise_with_gw_hp")),
        (
            {"fp8_recipe": "rowwise", "fsdp_float8_all_gather": True},
            ("tensorwise only", "rowwise"),
        ),
        ({"fsdp_float8_all_gather": True}, ("needs fp8_recipe='tensorwise'",)),
        (
            {"fp8_recipe": "tensorwise", "layout": gpumem.Layout(dp=4, tp=2, fsdp="full", sp=True)},
            ("tensor parallelism", "float8 TP styles", "fp8_recipe='rowwise'", "tp=1"),
        ),
        (
            {"framework": "fsdp2", "fsdp_float8_all_gather": True},
            ("torchtitan", "framework='fsdp2'", "tensorwise"),
        ),
        (
            {"framework": "fsdp2", "fp8_recipe": "rowwise"},
            ("Megatron-LM", "framework='fsdp2'", "rowwise_with_gw_hp"),
        ),
        (
            {"framework": "megatron", "layout": gpumem.Layout(dp=8), "fp8_recipe": "rowwise"},
            ("unknown fp8 recipe 'rowwise'", "delayed, tensorwise, mxfp8, blockwise"),
        ),
    ],
)
def test_float8_bad_input_is_one_line(kwargs: dict, words: tuple[str, ...]) -> None:
    kw = {"framework": "torchtitan", "layout": gpumem.Layout(dp=8, fsdp="full"), **kwargs}
    with pytest.raises(ValueError) as e:
        gpumem.estimate("llama-3.1-8b", batch_size=1, seq_len=1024, recompute="selective", **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_float8_precision_names_the_recipe() -> None:
    """``precision="fp8-tensorwise"`` is ``fp8_recipe="tensorwise"`` under torchtitan too."""
    kw = {"framework": "torchtitan", "layout": gpumem.Layout(dp=8, fsdp="full")}
    kw.update(batch_size=2, seq_len=8192)
    a = gpumem.estimate("llama-3.1-8b", precision="fp8-tensorwise", **kw)
    b = gpumem.estimate("llama-3.1-8b", fp8_recipe="tensorwise", **kw)
    assert a.per_gpu == b.per_gpu
    assert "float8 tensorwise" in b.inputs_line()


def test_float8_on_the_command_line(capsys) -> None:
    from gpumem.cli import main

    args = ["estimate", "llama-3.1-8b", "--gpus", "8", "--fsdp", "full", "--framework"]
    args += ["torchtitan", "--batch-size", "1", "--seq-len", "2048", "--recompute", "selective"]

    def allocated_out() -> int:
        per_gpu = json.loads(capsys.readouterr().out)["per_gpu"]
        return per_gpu["total"] - per_gpu["overhead"]

    assert main([*args, "--json"]) == 0
    bf16 = allocated_out()
    assert main([*args, "--json", "--fp8-recipe", "tensorwise"]) == 0
    # 32 blocks · 5 Linears · 2 amax scalars of 2 B (SAC's save list)
    assert allocated_out() - bf16 == 32 * 5 * 2 * 2
    f8 = [*args, "--fp8-recipe", "tensorwise", "--fsdp-float8-all-gather"]
    assert main(f8) == 0
    assert "FSDP float8 all-gather" in capsys.readouterr().out
    assert main([*args, "--fsdp-float8-all-gather"]) != 0
    err = capsys.readouterr().err.strip()
    assert "needs fp8_recipe='tensorwise'" in err and "\n" not in err
    assert main(["plan", "llama-3.1-8b", "--gpus", "8", "--fsdp-float8-all-gather"]) != 0
    assert "does not sweep torchtitan" in capsys.readouterr().err


def test_the_chunked_loss_on_the_command_line(capsys):
    from gpumem.cli import main

    args = ["estimate", "llama-3.1-8b", "--gpus", "8", "--fsdp", "full", "--framework"]
    args += ["torchtitan", "--batch-size", "2", "--seq-len", "8192", "--json"]
    assert main(args) == 0
    whole = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert main([*args, "--loss-chunks", "8"]) == 0
    chunked = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert chunked < whole
    assert main(["plan", "llama-3.1-8b", "--gpus", "8", "--loss-chunks", "8"]) != 0
    assert "does not sweep torchtitan" in capsys.readouterr().err


@pytest.mark.parametrize(("world", "recompute"), [(8, "selective"), (2, "full"), (1, "none")])
def test_reserved_against_the_recorded_reference(reference, world: int, recompute: str) -> None:
    """The estimate's simulated reserved peak (``titan_trace``: torchtitan's allocation order,
    FSDP2's copy-in and reduce-scatter streams) against the reference run's own recorded
    allocations, tagged with the stream FSDP2 entered, replayed through the same simulator:
    within 6 % (measured -1.9 %, -3.7 %, +5.6 %: the trace's coarser temporaries)."""
    ref = reference.profile_step(**TINY, world=world, batch=BATCH, seq=SEQ, ac=recompute, steps=3)
    bill = estimate(recompute, world, alloc_conf="")
    assert bill.peak_reserved_bytes is not None and bill.alloc_conf == "default"
    # FSDP2's streams keep pools of their own: the stream-tagged replay reserves more
    assert ref.reserved_bytes > ref.reserved_one_stream_bytes >= ref.peak_bytes
    assert abs(bill.peak_reserved_bytes / ref.reserved_bytes - 1) < 0.06


def test_reserved_is_simulated_except_the_chunked_loss() -> None:
    b = estimate("selective", 8, alloc_conf="")
    assert b.alloc_conf == "default" and b.peak_reserved_bytes > allocated(b)
    assert b.fragmentation_bytes == b.peak_reserved_bytes - allocated(b)
    chunked = estimate("selective", 8, alloc_conf="", loss_chunks=8)
    assert chunked.peak_reserved_bytes is None and chunked.alloc_conf is None
    assert "loss_chunks" in chunked.reserved_note


def test_fsdp_streams_keep_pools_of_their_own_by_hand() -> None:
    """A shrunken rank whose every tensor is below 1 MiB: on one stream all would share 2 MiB
    small segments; FSDP2 allocates the all-gather outputs on its copy-in stream and the
    sharded gradients on its reduce-scatter stream, whose pools a default-stream request never
    uses, so each stream holds its own 2 MiB segment: 6 MiB reserved (caching allocator:
    get_pool / get_free_block match the block's stream)."""
    from gpumem.allocator.alloc_conf import AllocConf
    from gpumem.estimator.frameworks import titan_trace as tt

    shape = tt.TitanShape(
        block=(64, 64 * 96, 64 * 64, 64, 64 * 128, 64 * 128, 128 * 64),
        embed=(256 * 64,),
        head=(64, 256 * 64),
        shard=2,
        saved=((4096, 4096),) * 2,
        recomputed=((8192,),) * 2,
        fwd_temp=(4096,),
        bwd_temp=(4096, 8192),
        first=(512, 512),
        head_saved=(8192, 4096),
        logits=16 * 256,
    )
    run = tt.simulated_run(AllocConf(), shape)
    segs = run.segments()
    assert sorted((s.stream, s.size, s.pool) for s in segs) == [
        (tt.DEFAULT, 2 << 20, "small"),
        (tt.COPY_IN, 2 << 20, "small"),
        (tt.REDUCE_SCATTER, 2 << 20, "small"),
    ]
    _, peak, _, _, reserved_peak = run.counters()
    assert reserved_peak == 6 << 20
    assert tt.simulate(AllocConf(), shape)[1] == (6 << 20) - peak
