"""Exactness on CPU: a hand derivation to the byte, and PyTorch's MemTracker as a reference."""

import copy

import pytest
import torch
from torch import nn

import gpumem
from gpumem.models import build_model, example_batch

from .conftest import memtracker_peak, train_steps

B, D0, D1, D2, D3 = 16, 8, 64, 32, 4
F32 = 4


def _linear_stack():
    return nn.Sequential(
        nn.Linear(D0, D1, bias=False), nn.Linear(D1, D2, bias=False), nn.Linear(D2, D3, bias=False)
    )


def test_linear_stack_peak_matches_hand_derivation():
    """Three bias-free Linear layers, fp32, batch B, loss = out.sum(), plain SGD.

    Derivation (every size in bytes, f32 = 4):
      W = 4(D0·D1 + D1·D2 + D2·D3) weights,  X = 4·B·D0 the input.
      forward: h1 = x@w1ᵀ (4·B·D1, saved by layer 1's mm), h2 (4·B·D2, saved by layer 2),
        out (4·B·D3, saved by nobody, freed once .sum() returns), loss (4).
      loss.backward(): ones_like(loss) (4) lives until the engine returns.
      layer 2 (MmBackward): grad_h2 = g@w3 (4·B·D2) and grad_w3 (4·D2·D3); then h2 is released.
      layer 1: grad_h1 (4·B·D1) and grad_w2 (4·D1·D2) are created while h1, grad_h2 and
        grad_w3 are alive -> the peak:
          W + X + h1 + grad_h2 + grad_w3 + grad_h1 + grad_w2 + loss + ones
        = W + X + 8·B·D1 + 4·B·D2 + 4·D2·D3 + 4·D1·D2 + 8.
      Layer 0's backward (grad_w1) comes after grad_h2 and h1 are freed: lower. SGD without
      momentum updates in place: no optimizer memory.
    """
    model = _linear_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(B, D0)
    with gpumem.profile(model, opt) as prof:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    rep = prof.report()
    W = F32 * (D0 * D1 + D1 * D2 + D2 * D3)
    X = F32 * B * D0
    expected = W + X + 8 * B * D1 + 4 * B * D2 + 4 * D2 * D3 + 4 * D1 * D2 + 8
    assert rep.peak_bytes == expected
    assert rep.peak_phase == "backward"
    # at the peak grad_w2 has not been accumulated yet: it is still a temporary
    assert rep.at_peak == {
        "weights": W,
        "gradients": F32 * D2 * D3,
        "optimizer": 0,
        "activations": F32 * B * D1,
        "communication": 0,
        "temporary": F32 * B * D1 + F32 * B * D2 + F32 * D1 * D2 + 8,
        "inputs": X,
    }
    assert sum(rep.at_peak.values()) == rep.peak_bytes
    # forward peak: W + X + h1 + h2 + out + loss
    assert rep.steps[0].forward_peak == W + X + F32 * B * (D1 + D2 + D3) + 4
    # per layer: the first storage layer i saves is layer i-1's output
    assert rep.layers["0"].activations == 0  # saves x (an input) and its weight
    assert rep.layers["1"].activations == F32 * B * D1
    assert rep.layers["2"].activations == F32 * B * D2
    assert rep.layers[""].activations == F32 * B * (D1 + D2)
    assert rep.layers["1"].weights == F32 * D1 * D2
    assert rep.layers["1"].gradients == F32 * D1 * D2
    assert rep.layers[""].weights == W
    # layer 2's forward creates out (4·B·D3) and saves nothing new
    assert rep.layers["2"].forward_temporary == F32 * B * D3


def test_linear_stack_memtracker_agrees_with_hand_derivation():
    """The same run under PyTorch's MemTracker gives the same peak (independent check of the
    derivation above)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _linear_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(B, D0)
    mt = MemTracker()
    mt.track_external(model, opt, x)
    with mt:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    (snap,) = mt.get_tracker_snapshot("peak").values()
    W = F32 * (D0 * D1 + D1 * D2 + D2 * D3)
    assert (
        snap["Total"] == W + F32 * B * D0 + 8 * B * D1 + 4 * B * D2 + 4 * D2 * D3 + 4 * D1 * D2 + 8
    )


def _copy(model):
    return copy.deepcopy(model)


def _mlp():
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


CASES = {
    "mlp": lambda: (_mlp(), torch.randn(16, 32), torch.randint(0, 10, (16,))),
    "gpt2": lambda: (
        build_model("gpt2", "tiny"),
        *example_batch(build_model("gpt2", "tiny").config, 2, 32),
    ),
    "resnet-bn": lambda: (
        build_model("resnet", "tiny"),
        *example_batch(build_model("resnet", "tiny").config, 4),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("steps", [1, 2])
def test_peak_equals_memtracker(name, steps):
    """PyTorch's MemTracker, given the same pre-existing tensors (model, optimizer, input),
    counts the same storages the same way on CPU (exact bytes, no rounding), so the peaks agree
    to the byte. Targets are pre-existing and never enter the model: neither tool counts them."""
    model, x, y = CASES[name]()
    ref_model = _copy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    with gpumem.profile(model, opt) as prof:
        train_steps(model, opt, x, y, steps)
    ref, snap = memtracker_peak(ref_model, ref_opt, x, y, steps)
    rep = prof.report()
    assert rep.peak_bytes == ref
    assert sum(rep.at_peak.values()) == rep.peak_bytes
    # the categories MemTracker and gpumem define alike agree too
    assert rep.at_peak["weights"] == snap["Parameter"] + snap["Buffer"]
    assert len(rep.steps) == steps
