"""Activation models: the paper's formulas by hand, and the ops model against what autograd
really saves (torch.autograd.graph.saved_tensors_hooks on the built-in models, CPU)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from gpumem.estimator import activations as act
from gpumem.estimator import estimate
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.resolver import from_model_config

GPT = ModelSpec(
    name="gpt-22b-like", arch="gpt2", n_layers=1, hidden=6144, n_heads=64, ffn=4 * 6144, vocab=51200
)


@pytest.mark.parametrize(
    "t,sp,rc,expected",
    [
        # Source: Korthikanti et al. 2022, Table 2 (s=2048, b=1, h=6144, a=64), computed by hand.
        (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
        (8, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
        (8, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
        (8, False, "selective", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
        (8, True, "selective", lambda s, b, h, a, t: 34 * s * b * h / t),
        (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    ],
)
def test_korthikanti_table_2(t, sp, rc, expected):
    s, b = 2048, 1
    got = act.korthikanti_layer_bytes(GPT, b, s, tp=t, sp=sp, recompute=rc)
    assert got == pytest.approx(expected(s, b, GPT.hidden, GPT.n_heads, t), abs=1)


def test_flash_drops_s2_term():
    # Source: llm-analysis get_activation_memory_per_layer_attn; FlashAttention keeps no s^2 matrix.
    s, b, h = 2048, 1, GPT.hidden
    assert act.korthikanti_layer_bytes(GPT, b, s, flash=True) == 34 * s * b * h
    w = act.Workload(batch=1, seq=4096, attention="flash")
    items = {i.name for i in act.layer_items(GPT, w)}
    assert not any("softmax" in n or "dropout" in n for n in items)
    math = act.sum_items(act.layer_items(GPT, act.Workload(batch=1, seq=4096, attention="math")))
    # math keeps the 16-bit s^2 softmax (2·a·s²·b) and no fp32 log-sum-exp (4·a·s·b)
    assert math - act.sum_items(act.layer_items(GPT, w)) == 2 * 64 * 4096**2 - 4 * 64 * 4096


def test_korthikanti_through_estimate():
    # Megatron's non-layer terms: input ids 8sb, output layer + CE 4sbh(1 + v/h)
    spec = GPT.replace(n_layers=4, vocab=128)
    s, b, h = 2048, 8, 6144
    bill = estimate(
        spec,
        batch_size=b,
        seq_len=s,
        activation_model="korthikanti",
        attention="eager",
        gpu_memory="1TB",
    )
    per_layer = s * b * h * (34 * h + 5 * 64 * s) // h
    assert bill.inputs["attention"] == "math" and bill.phase == "backward start"
    assert bill.per_gpu["activations"] == 4 * per_layer + 8 * s * b + 4 * s * b * (h + 128)


def _saved_bytes(model, ids, targets, autocast: bool) -> int:
    """Bytes of distinct storages autograd saves, parameters and buffers excluded."""
    skip = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return sum(seen.values())


CASES = [  # arch, overrides, autocast, backend, dropout
    ("gpt2", {}, False, "cpu-flash", 0.0),
    ("gpt2", {}, True, "cpu-flash", 0.0),
    ("gpt2", {}, False, "math", 0.1),
    ("llama", {}, False, "cpu-flash", 0.0),
    ("llama", {"num_kv_heads": 4}, True, "cpu-flash", 0.0),
    ("llama", {}, True, "math", 0.0),
    ("mixtral", {}, False, "cpu-flash", 0.0),
    ("mixtral", {}, True, "cpu-flash", 0.0),
]


@pytest.mark.parametrize("arch,ov,autocast,backend,dropout", CASES)
def test_ops_model_matches_saved_tensors(arch, ov, autocast, backend, dropout):
    # Reference: the bytes autograd actually saves on CPU (saved_tensors_hooks), exact.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpumem.models import build_model, example_batch, get_config

    torch.manual_seed(0)
    cfg = get_config(arch, "tiny", dropout=dropout, **ov)
    model = build_model(cfg).train()
    b, s = 2, 24
    ids, tg = example_batch(cfg, b, s)
    ctx = sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()
    with ctx:
        measured = _saved_bytes(model, ids, tg, autocast)
    spec = from_model_config(cfg)
    w = act.Workload(
        b,
        s,
        compute=2 if autocast else 4,
        residual=4,
        autocast=autocast,
        attention=backend,
        dropout=dropout,
        cuda=False,
    )
    est = (
        spec.n_layers * act.sum_items(act.layer_items(spec, w), saved_only=True)
        + act.sum_items(act.embed_items(spec, w), True)
        + act.sum_items(act.head_items(spec, w), True)
    )
    assert est == measured
