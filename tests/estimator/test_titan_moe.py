"""``framework="torchtitan"`` with a mixture of experts (``titan_moe``): torchtitan 0.3.0's
Qwen3-MoE against the fake profile of its own model (``benchmarks/published/
torchtitan_moe_reference.py``), and its states by hand.

The reference tests need torchtitan (``pip install --no-deps torchtitan==0.3.0``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import gpumem
from gpumem.estimator.model_spec import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
# a shrunken Qwen3-MoE: dim 256, GQA 4/2 heads of 64, 8 experts of 256, top-2; vocabulary
# 32 x dim (the loss's moment is the peak, as in Qwen3-30B-A3B: 151936 / 2048 = 74)
DIMS = {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "moe_hidden": 256,
        "experts": 8, "top_k": 2, "vocab": 8192}  # fmt: skip
BATCH, SEQ = 2, 512


def spec(n_layers: int = 2, vocab: int = 8192) -> ModelSpec:
    return ModelSpec(
        name="qwen3-moe-tiny", arch="llama", n_layers=n_layers, hidden=256, n_heads=4,
        n_kv_heads=2, head_dim=64, ffn=256, vocab=vocab, max_seq=SEQ, n_experts=8, top_k=2,
        qk_norm=True,
    )  # fmt: skip


def allocated(bill: gpumem.Bill) -> int:
    return sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))


def estimate(recompute: str, world: int, n_layers: int = 2, vocab: int = 8192, **kw):
    return gpumem.estimate(
        spec(n_layers, vocab), batch_size=BATCH, seq_len=SEQ, framework="torchtitan",
        recompute=recompute, layout=gpumem.Layout(dp=world), device="cpu", **kw,
    )  # fmt: skip


def test_weights_and_optimizer_by_hand() -> None:
    """fp32 sharded parameters (attention, q/k norms, two norms, the gate, 3 E D F experts per
    block; embedding, final norm, lm_head) and AdamW's two fp32 states over the 2 ranks; the
    buffers: a cos/sin RoPE cache (seq x 2 head_dim fp32) and two fp32 E-vectors per block."""
    d, e, f, hd = 256, 8, 256, 64
    block = (4 + 2 * 2) * hd * d + 4 * hd * d + 2 * hd + 2 * d + d * e + 3 * e * d * f
    params = 2 * block + 2 * 8192 * d + d
    bill = estimate("none", 2)
    assert bill.per_gpu["weights"] == 4 * params // 2 + 2 * (SEQ * 2 * hd * 4 + 8 * e)
    assert bill.per_gpu["optimizer"] == 8 * params // 2


@pytest.mark.parametrize(
    ("recompute", "words"),
    [("selective", ("per-op SAC", "none, full or selective:N"))],
)
def test_bad_moe_input_is_one_line(recompute: str, words: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as e:
        estimate(recompute, 2)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(
    ("model", "layout", "words"),
    [
        ("mixtral-8x7b", gpumem.Layout(dp=8), ("Qwen3-MoE", "mixtral-8x7b")),
        (spec(), gpumem.Layout(dp=4, pp=2), ("pp", "not modelled")),
        (spec(), gpumem.Layout(dp=8, ep=8), ("ep", "not modelled")),
    ],
)
def test_moe_knobs_it_does_not_model_are_one_line(model, layout, words) -> None:
    with pytest.raises(ValueError) as e:
        gpumem.estimate(model, framework="torchtitan", layout=layout, batch_size=1, seq_len=512)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(BENCH))  # it imports its sibling torchtitan_reference
    yield importlib.import_module("torchtitan_moe_reference")
    sys.path.remove(str(BENCH))


def _check(reference, recompute: str, world: int, n_layers: int, vocab: int = 8192) -> None:
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = reference.profile_moe_step(
        world=world, batch=BATCH, seq=SEQ, ac=ac, n_layers=n_layers, **{**DIMS, "vocab": vocab}
    )
    bill = estimate(recompute, world, n_layers, vocab)
    assert ref.peak_phase == "backward" and bill.phase == "backward start"
    # AdamW's step counters and the loss's scalars: a few hundred bytes; a block's moment
    # without AC: within 0.02 %
    assert abs(allocated(bill) / ref.peak_bytes - 1) < 2e-4, (allocated(bill), ref.peak_bytes)


@pytest.mark.parametrize(
    ("recompute", "world", "n_layers", "vocab"),
    [
        ("none", 2, 2, 8192),  # the loss's moment
        ("full", 8, 2, 8192),
        ("full", 4, 2, 512),  # block 0's backward: the combine's fp32 gradients
    ],
)
def test_estimate_equals_fake_profile(reference, recompute, world, n_layers, vocab):
    _check(reference, recompute, world, n_layers, vocab)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective:2"])
@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("n_layers", [2, 4])
@pytest.mark.parametrize("vocab", [8192, 512])
def test_estimate_equals_fake_profile_sweep(reference, recompute, world, n_layers, vocab):
    _check(reference, recompute, world, n_layers, vocab)
