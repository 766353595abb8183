"""Activation checkpointing, autocast, SDPA, frozen parameters, torch.compile, transformers."""

import copy

import pytest
import torch
from torch import nn

import gpumem
from gpumem.models import build_model, example_batch

from .conftest import memtracker_peak, train_steps

B, S = 2, 32


def _gpt(checkpointing):
    model = build_model("gpt2", "tiny")
    model.gradient_checkpointing = checkpointing
    return model


def test_checkpointing_inputs_are_activations_and_recompute_is_temporary():
    plain, ckpt = _gpt(False), _gpt(True)
    ckpt.load_state_dict(plain.state_dict())
    x, y = example_batch(plain.config, B, S)
    reps = []
    for model in (plain, ckpt):
        with gpumem.profile(model) as prof:
            train_steps(model, None, x, y)
        reps.append(prof.report())
    rp, rc = reps
    h = plain.config.hidden_size
    # a checkpointed block keeps exactly its input (B, S, h) float32, nothing else
    for i in range(plain.config.num_layers):
        assert rc.layers[f"layers.{i}"].activations == B * S * h * 4
        assert rp.layers[f"layers.{i}"].activations > 4 * B * S * h * 4
        # the recomputation in backward is temporary, so the block's backward temporary grows
        assert (
            rc.layers[f"layers.{i}"].backward_temporary
            > rp.layers[f"layers.{i}"].backward_temporary
        )
    assert rc.layers[""].activations < rp.layers[""].activations
    assert rc.peak_bytes < rp.peak_bytes


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_peak_equals_memtracker(reentrant, monkeypatch):
    import torch.utils.checkpoint as ckpt_mod

    orig = ckpt_mod.checkpoint
    monkeypatch.setattr(
        ckpt_mod, "checkpoint", lambda f, *a, use_reentrant: orig(f, *a, use_reentrant=reentrant)
    )
    model = _gpt(True)
    ref = copy.deepcopy(model)
    x, y = example_batch(model.config, B, S)
    with gpumem.profile(model) as prof:
        train_steps(model, None, x, y)
    assert prof.report().peak_bytes == memtracker_peak(ref, None, x, y)[0]


def test_autocast_bf16_saves_bf16_copies():
    """Under CPU autocast each Linear runs in bf16 on casts it creates itself. Layer 0's input
    needs no gradient, so it saves only the bf16 cast of x (for the weight gradient):
    2·8·16 bytes. Layer 1 saves its bf16 input (layer 0's bf16 output, first saved here: 2·8·32)
    and the bf16 cast of its weight (for the input gradient: 2·4·32)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with gpumem.profile(model, opt) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        opt.step()
    rep = prof.report()
    assert rep.layers["0"].activations == 2 * 8 * 16
    assert rep.layers["1"].activations == 2 * 8 * 32 + 2 * 4 * 32


def test_autocast_peak_equals_memtracker():
    model = build_model("llama", "tiny")
    ref = copy.deepcopy(model)
    x, y = example_batch(model.config, B, S)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten()).backward()

    with gpumem.profile(model) as prof:
        step(model)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(ref, x)
    with mt:
        step(ref)
    (snap,) = mt.get_tracker_snapshot("peak").values()
    assert prof.report().peak_bytes == snap["Total"]


def test_sdpa_attention_saves_qkv_output_and_logsumexp():
    """F.scaled_dot_product_attention on CPU saves q, k, v, the output and the float32
    logsumexp (B, heads, S); the attention module's own activations are exactly those
    (q, k, v are views of the projections' outputs, created inside the module)."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 3 * 64)

        def forward(self, x):
            q, k, v = self.qkv(x).view(B, S, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = nn.Sequential(Attn())
    x = torch.randn(B, S, 64)
    with gpumem.profile(model) as prof:
        model(x).sum().backward()
    rep = prof.report()
    qkv_out = B * S * 3 * 64 * 4
    # the flash-for-CPU kernel saves the qkv projection output (q, k, v are views of one
    # storage), its own output (B, 4, S, 16) and logsumexp (B, 4, S) in float32
    assert rep.layers["0"].activations == qkv_out + B * S * 64 * 4 + B * 4 * S * 4


def test_frozen_parameters_have_no_gradients_or_state():
    class LoRA(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(64, 64)
            self.a = nn.Linear(64, 4, bias=False)
            self.b = nn.Linear(4, 64, bias=False)

        def forward(self, x):
            return self.base(x) + self.b(self.a(x))

    model = LoRA()
    model.base.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with gpumem.profile(model, opt) as prof:
        for _ in range(2):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    assert rep.layers["base"].weights == (64 * 64 + 64) * 4
    assert rep.layers["base"].gradients == rep.layers["base"].optimizer == 0
    lora = 2 * 64 * 4 * 4
    assert rep.layers["a"].gradients + rep.layers["b"].gradients == lora
    assert rep.layers[""].optimizer == 2 * lora + 2 * 4


def test_torch_compile_is_visible_op_by_op():
    """A compiled model runs under the profiler's dispatch mode op by op. Dynamo guards on the
    active mode, so the first step in the region recompiles (tracing runs on dynamo's own fake
    tensors, which are skipped, and the lazily compiled backward is only partly visible); from
    the second step on the profile shows the same storages as eager mode, per layer included
    (names gain the ``_orig_mod.`` prefix of the compiled wrapper)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="aot_eager")
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with gpumem.profile(model) as eager:
        train_steps(model, None, x, y, steps=2)
    with gpumem.profile(compiled) as comp:
        train_steps(compiled, None, x, y, steps=2)
    e, c = eager.report(), comp.report()
    assert c.steps[1].peak == e.steps[1].peak
    assert c.steps[1].layers["_orig_mod.2"].activations == e.steps[1].layers["2"].activations


transformers = pytest.importorskip("transformers")


def _hf(kind):
    t = transformers
    common = {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
    }
    if kind == "gpt2":
        return t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_positions=64)
        )
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(num_key_value_heads=2, **common))
    return t.MixtralForCausalLM(
        t.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common)
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_transformers_models(kind):
    model = _hf(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 16))
    with gpumem.profile(model) as prof:
        model(ids, labels=ids).loss.backward()
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(ref, ids)
    with mt:
        ref(ids, labels=ids).loss.backward()
    (snap,) = mt.get_tracker_snapshot("peak").values()
    rep = prof.report()
    assert rep.peak_bytes == snap["Total"]
    blocks = [n for n in rep.layers if (n.count(".") == 2 and ".layers." in n) or ".h." in n]
    blocks = [n for n in blocks if n.rsplit(".", 1)[1].isdigit()]
    assert len(blocks) == 2 and all(rep.layers[b].activations > 0 for b in blocks)


def test_double_backward_gradients_unchanged():
    """Saved tensors are handed to autograd as detached aliases; autograd rebuilds their graph
    metadata on unpack, so create_graph=True (a gradient penalty) gives the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(5, 4, requires_grad=True)

    def penalty_grads():
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        g.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return grads

    ref = penalty_grads()
    with gpumem.profile(model):
        got = penalty_grads()
    assert len(got) == len(ref) == 3
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
