"""The estimate against measurement: small built-in models trained for real on the CPU under
gpumem.profile (the reference), estimated by gpumem.estimate for the same job.

Issue #4's target is 5 % of the measured peak before calibration; the categories the two sides
define identically (weights, gradients) must agree to the byte. A regression on either side (a
profiler that miscounts, an estimator formula that drifts) fails here.
"""

import pytest

from gpumem.estimator.accuracy import Case, compare

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 512, "seq_len": 128}
CASES = [
    # peak at the start of backward (saved activations + the loss's backward)
    Case("gpt2-adamw-fp32", "gpt2", SMALL, batch=2, seq=64),
    # peak inside the first layer's backward: recomputed layer, grads mostly present
    Case(
        "llama-gqa-autocast-recompute",
        "llama",
        dict(SMALL, num_kv_heads=2),
        batch=2,
        seq=64,
        autocast=True,
        recompute=True,
    ),
    # MoE: balanced routing assumed by the estimate; the total is routing-independent
    Case(
        "moe-sgd-fp32",
        "mixtral",
        dict(SMALL, num_kv_heads=2, num_experts=4, top_k=2, ffn_hidden_size=128),
        batch=2,
        seq=64,
        optimizer="sgd",
    ),
    # peak in the optimizer step: torch's foreach AdamW allocates sqrt(v) for every parameter
    Case(
        "gpt2-adamw-foreach-step",
        "gpt2",
        dict(SMALL, vocab_size=128),
        batch=1,
        seq=16,
        foreach=True,
    ),
]
PHASE = {"backward start": "backward", "backward end": "backward", "optimizer step": "optimizer"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_estimate_within_5_percent_of_profiled_peak(case):
    c = compare(case)
    assert abs(c.error_pct) < 5.0, (c.measured, c.estimated)
    assert PHASE[c.bill.phase] == c.measured_phase
    # identical definitions on both sides: exact
    assert c.estimated["weights"] == c.measured["weights"]
    assert c.estimated["gradients"] == c.measured["gradients"]
    # AdamW's per-parameter `step` counters (4 B scalars on CPU) are not modelled
    assert 0 <= c.measured["optimizer"] - c.estimated["optimizer"] <= 4 * 64
    assert c.estimated["inputs"] == c.measured["inputs"]
    if case.arch == "mixtral":
        assert c.routing_imbalance is not None and c.routing_imbalance >= 1.0
