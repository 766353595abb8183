"""mode="light": hooks only, no dispatch mode; the categories it measures equal exact mode's."""

import copy
import json

import pytest
import torch
from torch import nn

import gpumem
from gpumem.models import build_model, example_batch
from gpumem.profiler import Report

from .conftest import train_steps

B, D0, D1, D2, D3 = 16, 8, 64, 32, 4
F32 = 4
MEASURED = ("weights", "gradients", "optimizer", "activations")


def _linear_stack():
    return nn.Sequential(
        nn.Linear(D0, D1, bias=False), nn.Linear(D1, D2, bias=False), nn.Linear(D2, D3, bias=False)
    )


def _linear_run(mode, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(B, D0)
    with gpumem.profile(model, opt, mode=mode) as prof:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return prof.report()


def _assert_same_measured(exact, light):
    """Every measured category of every layer, in every step and rolled up, is identical."""
    assert len(exact.steps) == len(light.steps)
    for name, st in exact.layers.items():
        for c in MEASURED:
            assert getattr(light.layers[name], c) == getattr(st, c), (name, c)
    for se, sl in zip(exact.steps, light.steps, strict=True):
        assert (se.forwards, se.backwards) == (sl.forwards, sl.backwards)
        for name, st in se.layers.items():
            for c in MEASURED:
                assert getattr(sl.layers[name], c) == getattr(st, c), (se.index, name, c)


def test_linear_stack_light_equals_exact_and_hand_derivation():
    """Light mode on the three bias-free Linear layers (see test_exact for the exact peak).

    Hand derivation of the measured categories (f32 = 4 bytes):
      W = 4(D0·D1 + D1·D2 + D2·D3) = 10752, X = 4·B·D0 = 512.
      activations: layer 1 saves h1 (4·B·D1 = 4096), layer 2 saves h2 (4·B·D2 = 2048); layer 0
        saves x (an input) and the weights only. forward peak = W + X + 6144.
      backward: each Mm node releases its saved input before the weight gradient is accumulated,
        so the measured level ends the pass at W + X + G with G = W (every weight has its .grad):
        2·10752 + 512 = 22016, the peak. Temporaries are not measured on CPU: None, not 0."""
    model = _linear_stack()
    ref = copy.deepcopy(model)
    light = _linear_run("light", model)
    exact = _linear_run("exact", ref)
    _assert_same_measured(exact, light)
    W = F32 * (D0 * D1 + D1 * D2 + D2 * D3)
    X = F32 * B * D0
    assert (W, X) == (10752, 512)
    assert light.mode == "light" and light.measured == [
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "communication",
        "inputs",
    ]
    assert light.steps[0].forward_peak == W + X + F32 * B * (D1 + D2)
    assert light.peak_bytes == 2 * W + X and light.peak_phase == "backward"
    assert light.at_peak == {
        "weights": W,
        "gradients": W,
        "optimizer": 0,
        "activations": 0,
        "communication": 0,
        "temporary": None,
        "inputs": X,
    }
    assert light.layers["1"].activations == F32 * B * D1 == exact.layers["1"].activations
    for st in light.layers.values():
        assert st.temporary is None and st.forward_temporary is None
        assert st.backward_temporary is None
    # exact mode's peak (test_exact's derivation) is higher: it sees the temporaries too
    assert exact.peak_bytes == W + X + 8 * B * D1 + 4 * B * D2 + 4 * D2 * D3 + 4 * D1 * D2 + 8
    assert (
        exact.peak_bytes - light.peak_bytes
        == 8 * B * D1 + 4 * B * D2 + 4 * D2 * D3 + 4 * D1 * D2 + 8 - W
        == 8200
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpt_light_equals_exact(checkpointing):
    """GPT-style model, AdamW, two steps (the first creates the optimizer state): weights,
    gradients, optimizer state and activations per layer and per step are the exact mode's, with
    and without activation checkpointing; so are the inputs at the peak."""
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny")
    model.gradient_checkpointing = checkpointing
    ref = copy.deepcopy(model)
    x, y = example_batch(model.config, 2, 32)
    reps = []
    for mode, m in (("exact", ref), ("light", model)):
        opt = torch.optim.AdamW(m.parameters())
        with gpumem.profile(m, opt, mode=mode) as prof:
            train_steps(m, opt, x, y, steps=2)
        reps.append(prof.report())
    exact, light = reps
    _assert_same_measured(exact, light)
    assert light.at_peak["inputs"] == exact.at_peak["inputs"] == x.numel() * 8
    assert light.at_peak["temporary"] is None
    # AdamW state: two moments per parameter element plus a 4-byte step per tensor
    n = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert light.layers[""].optimizer == 2 * 4 * n + 4 * n_tensors
    assert light.layers[""].activations > 0
    # exact mode's peak includes temporaries on top of what light mode measures
    assert light.peak_bytes <= exact.peak_bytes


def test_light_mode_installs_no_dispatch_mode_and_cleans_up():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = _linear_stack()
    resize = torch.UntypedStorage.resize_
    with gpumem.profile(model, mode="light"):
        assert not _get_current_dispatch_mode_stack()
        assert torch.UntypedStorage.resize_ is not resize  # FSDP-style frees are still seen
        model(torch.randn(2, D0)).sum().backward()
    assert torch.UntypedStorage.resize_ is resize
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_light_without_optimizer_closes_steps_at_backward():
    model = _linear_stack()
    x = torch.randn(4, D0)
    with gpumem.profile(model, mode="light") as prof:
        for _ in range(2):
            model(x).sum().backward()
    rep = prof.report()
    assert [(s.forwards, s.backwards) for s in rep.steps] == [(1, 1), (1, 1)]
    assert all(s.optimizer_peak is None for s in rep.steps)
    # step 1 starts with step 0's gradients alive (no zero_grad): they are the same storages
    assert (
        rep.steps[1].layers[""].gradients
        == rep.steps[0].layers[""].gradients
        == (F32 * (D0 * D1 + D1 * D2 + D2 * D3))
    )


def test_light_fake_equals_light_real():
    def run(fake):
        torch.manual_seed(0)
        import contextlib

        with gpumem.fake() if fake else contextlib.nullcontext():
            model = build_model("llama", "tiny")
            opt = torch.optim.AdamW(model.parameters())
            x, y = example_batch(model.config, 2, 16)
            with gpumem.profile(model, opt, mode="light") as prof:
                train_steps(model, opt, x, y, steps=2)
        return prof.report()

    real, fake = run(False), run(True)
    assert fake.peak_bytes == real.peak_bytes and fake.at_peak == real.at_peak
    assert {k: v.activations for k, v in fake.layers.items()} == {
        k: v.activations for k, v in real.layers.items()
    }


def test_light_report_formats_say_what_is_not_measured(tmp_path):
    rep = _linear_run("light", _linear_stack())
    table = rep.table()
    assert "light mode" in table and "temporaries not measured" in table
    assert "peak of measured categories" in table
    d = rep.to_dict()
    assert d["schema_version"] == 4 and d["at_peak"]["temporary"] is None
    back = Report.from_dict(d)
    assert back.layers["1"] == rep.layers["1"] and back.mode == "light"
    assert "| temporary | - | - |" in rep.to_markdown()
    assert rep.plot(tmp_path / "p.png").stat().st_size > 1000


def _before_communication(d):
    """A report dict as versions 1 and 2 wrote it: no ``communication`` anywhere."""
    d = json.loads(json.dumps(d))
    for at in [d["at_peak"], *(s["at_peak"] for s in d["steps"])]:
        del at["communication"]
    for layers in [d["layers"], *(s["layers"] for s in d["steps"])]:
        for stats in layers.values():
            del stats["communication"]
    d["measured"].remove("communication")
    return d


def test_version_1_json_still_reads():
    rep = _linear_run("exact", _linear_stack())
    d = _before_communication(rep.to_dict())
    del d["mode"], d["measured"]
    back = Report.from_dict({**d, "schema_version": 1})
    assert back.mode == "exact" and back.peak_bytes == rep.peak_bytes
    assert back.at_peak == rep.at_peak and back.layers == rep.layers


def test_version_2_json_reads_communication_as_zero():
    rep = _linear_run("light", _linear_stack())
    back = Report.from_dict({**_before_communication(rep.to_dict()), "schema_version": 2})
    assert list(back.at_peak) == list(rep.at_peak) and back.at_peak["communication"] == 0
    assert back.measured == rep.measured and "communication" in back.measured
    assert back.steps[0].at_peak == rep.steps[0].at_peak and back.layers == rep.layers
    assert back.schema_version == 4


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"mode='fast'.*'exact'.*'light'"):
        gpumem.profile(_linear_stack(), mode="fast")


def test_light_torch_compile_matches_eager():
    """Light mode sees a compiled model (aot_eager backend) through its module hooks and saved
    tensors: from the second step on, the measured peak and per-layer activations are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="aot_eager")
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with gpumem.profile(model, mode="light") as eager:
        train_steps(model, None, x, y, steps=2)
    with gpumem.profile(compiled, mode="light") as comp:
        train_steps(compiled, None, x, y, steps=2)
    e, c = eager.report(), comp.report()
    assert c.steps[1].peak == e.steps[1].peak
    assert c.steps[1].layers["_orig_mod.2"].activations == e.steps[1].layers["2"].activations
    # GELU saves its input (8·32·4), layer 2 saves the GELU output (8·32·4); outside any module
    # log_softmax saves its output (8·4·4) and nll_loss its 4-byte total weight and the targets
    # (8 int64), which stay alive and registered after step 0: step 1 does not count them again
    assert e.steps[1].layers["1"].activations == e.steps[1].layers["2"].activations == 1024
    assert (
        c.steps[1].layers[""].activations
        == e.steps[1].layers[""].activations
        == (1024 + 1024 + 128 + 4)
    )
    assert (
        c.steps[0].layers[""].activations
        == e.steps[0].layers[""].activations
        == (1024 + 1024 + 128 + 4 + 64)
    )
