"""Report formats, steps and phases, and defined behaviour for bad input and failures."""

import json

import pytest
import torch
from torch import nn

import gpumem
from gpumem.profiler import Report

from .conftest import train_steps


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _run(steps=2, optimizer=True, accumulate=1):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with gpumem.profile(model, opt) as prof:
        for _ in range(steps):
            for _ in range(accumulate):
                train_steps(model, None, x, y)
            if opt is not None:
                opt.step()
                opt.zero_grad()
    return prof.report(), model


def test_steps_phases_and_first_step_differs():
    rep, model = _run(steps=2)
    assert len(rep.steps) == 2
    s0, s1 = rep.steps
    for s in rep.steps:
        assert s.forwards == 1 and s.backwards == 1
        assert s.peak == max(s.forward_peak, s.backward_peak, s.optimizer_peak)
    n = sum(p.numel() * 4 for p in model.parameters())
    # AdamW state (2 moments + a 4-byte step per tensor) exists only after step 0's update
    assert s0.layers[""].optimizer == s1.layers[""].optimizer == 2 * n + 4 * 4
    assert s0.forward_peak < s1.forward_peak  # step 1's forward carries the optimizer state
    # + the targets (8 int64 = 64 B): they enter the counted set when cross_entropy first views
    # them in step 0 (an op output aliasing them, as in MemTracker) and stay counted while alive
    assert s1.forward_peak - s0.forward_peak == 2 * n + 16 + 64
    assert rep.peak_bytes == max(s.peak for s in rep.steps)


def test_gradient_accumulation_is_one_step():
    rep, _ = _run(steps=2, accumulate=3)
    assert [s.forwards for s in rep.steps] == [3, 3]
    assert [s.backwards for s in rep.steps] == [3, 3]


def test_no_optimizer_only_forward_and_backward():
    rep, _ = _run(steps=2, optimizer=False)
    assert len(rep.steps) == 2
    assert all(s.optimizer_peak is None for s in rep.steps)
    assert rep.at_peak["optimizer"] == 0


def test_json_roundtrip_markdown_table_trace_and_plot(tmp_path):
    rep, _ = _run(steps=2)
    text = rep.to_json(tmp_path / "p.json")
    d = json.loads(text)
    assert d["schema_version"] == 4 and d["mode"] == "exact" and "temporary" in d["measured"]
    assert isinstance(d["peak_bytes"], int) and d["peak_bytes"] == rep.peak_bytes
    assert all(isinstance(v, int) for v in d["at_peak"].values())
    back = Report.from_dict(json.loads((tmp_path / "p.json").read_text()))
    assert back.layers["0"] == rep.layers["0"] and back.steps[1].peak == rep.steps[1].peak
    with pytest.raises(ValueError, match="schema_version"):
        Report.from_dict({**d, "schema_version": 99})
    table = rep.table()
    # headline, at peak, one line per step, the simulated reserved line, a blank, the columns
    assert table.splitlines()[len(rep.steps) + 2].startswith("reserved (simulated caching")
    assert "activations" in table.splitlines()[len(rep.steps) + 4]
    assert f"({rep.peak_bytes} B)" in table and "KiB" in table
    md = rep.to_markdown()
    assert md.startswith("### Memory profile: Sequential") and "| `0` |" in md
    trace = json.loads(rep.to_chrome_trace(tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"live bytes", "step 0 forward", "step 1 optimizer", "0", "(model)"} <= names
    assert (
        max(e["args"]["bytes"] for e in trace["traceEvents"] if e["name"] == "live bytes")
        == rep.peak_bytes
    )
    png = rep.plot(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_layer_rollup_sums_children():
    rep, _ = _run(steps=1)
    for cat in ("weights", "gradients", "optimizer", "activations"):
        assert getattr(rep.layers[""], cat) >= sum(getattr(rep.layers[k], cat) for k in "012")
    assert rep.layers[""].weights == sum(rep.layers[k].weights for k in "012")


def test_not_a_module():
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module, got function"):
        gpumem.profile(lambda x: x)


def test_optimizer_of_another_model():
    model, other = _mlp(), _mlp()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(32, 16\)\)"
    ):
        gpumem.profile(model, opt)


def test_nested_regions_rejected_and_outer_unaffected():
    model = _mlp()
    with gpumem.profile(model) as outer:
        with pytest.raises(RuntimeError, match="cannot be nested"), gpumem.profile(model):
            pass
        model(torch.randn(2, 16)).sum().backward()
    assert outer.report().steps[0].backwards == 1


def _hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_exception_propagates_report_survives_hooks_removed():
    import torch.utils.checkpoint as ckpt
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    gen = ckpt._checkpoint_without_reentrant_generator
    resize = torch.UntypedStorage.resize_
    before = _hook_counts(model)
    with pytest.raises(ZeroDivisionError), gpumem.profile(model, opt) as prof:
        model(torch.randn(4, 16)).sum().backward()
        raise ZeroDivisionError("division by zero")
    rep = prof.report()
    assert rep.error.startswith("ZeroDivisionError") and rep.steps[0].backwards == 1
    assert _hook_counts(model) == before
    assert not _get_current_dispatch_mode_stack()
    assert ckpt._checkpoint_without_reentrant_generator is gen
    assert torch.UntypedStorage.resize_ is resize
    assert "zero_grad" not in vars(opt)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    # autograd saved-tensor hooks are gone: a plain pack hook can be installed and runs
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pass


def test_exception_inside_forward_and_optimizer():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    with pytest.raises(RuntimeError, match="boom"), gpumem.profile(model) as prof:
        model(torch.randn(2, 4))
    assert prof.report().peak_bytes > 0 and not prof.levels.fwd
    assert _hook_counts(model) == 0
