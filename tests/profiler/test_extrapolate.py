"""k-block extrapolation (``profiler/extrapolate.py``): a fake profile of N identical blocks
from profiles with 1, 2 and 3 of them, against the full profile of all N blocks, the
independent reference: every field equal (every per-layer and per-step row, every peak and the
categories there). Models that are not periodic in their blocks fall back to the full profile
and say why. The simulated caching allocator's figures are not extrapolated (None)."""

import pytest
import torch

from gpumem.cli import main
from gpumem.models import PRESETS
from gpumem.models.transformer import Block, CausalLM
from gpumem.profiler.extrapolate import twin_problem
from gpumem.profiler.runner import FullProfileNotice, profile_model

SIMULATED = ("peak_reserved_bytes", "simulated_allocator")


def _blocks(monkeypatch, arch: str, n: int) -> None:
    monkeypatch.setitem(PRESETS[arch]["tiny"], "num_layers", n)


def _both(**job):
    fast = profile_model(fake=True, extrapolate=True, **job)
    full = profile_model(fake=True, **job)
    return fast, full


def _fields(rep) -> dict:
    d = rep.to_dict(timeline=False)
    for key in (*SIMULATED, "extrapolated"):
        d.pop(key)
    return d


@pytest.mark.parametrize(
    ("arch", "n", "job"),
    [
        ("llama", 6, {}),
        ("llama", 8, {"checkpointing": True, "optimizer": "sgd"}),
        ("llama", 7, {"precision": "amp-bf16", "optimizer": "adam", "batch_size": 3}),
        ("gpt2", 7, {"steps": 3}),
        ("gpt2", 5, {"optimizer": "none", "precision": "bf16"}),
        ("mixtral", 5, {"steps": 1}),
        ("vit", 6, {}),
    ],
)
def test_fast_report_equals_the_full_profile(monkeypatch, arch, n, job):
    _blocks(monkeypatch, arch, n)
    job = {"model": arch, "seq_len": 16, **job}
    fast, full = _both(**job)
    assert fast.extrapolated == {"blocks": n, "module": "layers", "profiled_blocks": [1, 2, 3]}
    assert full.extrapolated is None
    assert _fields(fast) == _fields(full)
    assert sum(name.count(".") == 1 for name in fast.layers if name.startswith("layers.")) == n
    # what is not produced: the simulation (not periodic), the timeline, the spans
    assert full.peak_reserved_bytes and full.timeline["bytes"] and full.spans
    assert fast.peak_reserved_bytes is None and fast.simulated_allocator is None
    assert fast.timeline == {} and fast.spans == []
    assert f"extrapolated: {n} identical blocks" in fast.table()
    assert fast.table().replace(_note(fast.table()), "") == _without_reserved(full.table())


def _note(table: str) -> str:
    return next(line + "\n" for line in table.splitlines() if line.startswith("extrapolated:"))


def _without_reserved(table: str) -> str:
    return "".join(line for line in table.splitlines(True) if not line.startswith("reserved ("))


def test_per_layer_attribute_falls_back_to_the_full_profile(monkeypatch):
    _blocks(monkeypatch, "llama", 5)
    init = Block.__init__
    count = iter(range(10**6))

    def numbered(self, *a, **k):
        init(self, *a, **k)
        self.layer_idx = next(count)  # as transformers' layers carry

    monkeypatch.setattr(Block, "__init__", numbered)
    with pytest.warns(FullProfileNotice, match=r"not identical twins: layers\.1 differs"):
        fast = profile_model("llama", seq_len=16, fake=True, extrapolate=True)
    full = profile_model("llama", seq_len=16, fake=True)
    assert fast.extrapolated is None
    assert _fields(fast) == _fields(full) and fast.peak_reserved_bytes == full.peak_reserved_bytes


def test_memory_not_periodic_in_the_blocks_falls_back(monkeypatch):
    """A forward that keeps (blocks squared) x 4 KiB alive: twins, but the step is not periodic;
    the rule from 1 and 2 blocks mispredicts 3, so every block is profiled."""
    _blocks(monkeypatch, "llama", 5)
    forward = CausalLM.forward

    def quadratic(self, ids):
        extra = torch.empty(len(self.layers) ** 2, 1024)
        return forward(self, ids) + extra.sum()

    monkeypatch.setattr(CausalLM, "forward", quadratic)
    with pytest.warns(FullProfileNotice, match="not periodic in the blocks"):
        fast = profile_model("llama", seq_len=16, fake=True, extrapolate=True)
    assert fast.extrapolated is None
    assert _fields(fast) == _fields(profile_model("llama", seq_len=16, fake=True))


def test_nothing_to_gain_or_not_applicable_is_the_full_profile_quietly(monkeypatch, recwarn):
    # 2 and 3 blocks (the full profile is as cheap), a real run, light mode, a ResNet
    for n in (2, 3):
        _blocks(monkeypatch, "llama", n)
        assert profile_model("llama", seq_len=16, fake=True, extrapolate=True).extrapolated is None
    _blocks(monkeypatch, "llama", 6)
    for job in ({}, {"fake": True, "mode": "light"}):
        assert profile_model("llama", seq_len=16, extrapolate=True, **job).extrapolated is None
    rep = profile_model("resnet", batch_size=1, steps=1, fake=True, extrapolate=True)
    assert rep.extrapolated is None
    assert not recwarn.list


def test_twin_problem_names_what_differs():
    def stack() -> torch.nn.Module:
        net = torch.nn.Module()
        net.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        net.head = torch.nn.Linear(4, 2)
        return net

    assert twin_problem(stack(), "layers") is None
    net = stack()
    net.layers[2].register_forward_hook(lambda *a: None)
    assert twin_problem(net, "layers") == "layers.2 differs from layers.0 (in (block))"
    net = stack()
    net.layers[1].weight.requires_grad_(False)
    assert "layers.1 differs" in twin_problem(net, "layers")
    net = stack()
    net.layers[1].weight = net.layers[0].weight
    assert twin_problem(net, "layers") == "blocks share parameters or buffers with each other"
    net = stack()
    net.head.weight = net.layers[0].weight
    assert "shares a parameter" in twin_problem(net, "layers")
    net = stack()
    net.layers[0].scale = 1.0
    net.layers[1].scale = 2.0  # a plain attribute that differs
    assert "layers.1 differs" in twin_problem(net, "layers")


def test_cli_extrapolates_fake_profiles_and_says_so(monkeypatch, capsys, tmp_path):
    _blocks(monkeypatch, "llama", 6)
    args = ["profile", "llama", "--fake", "--seq-len", "16"]
    assert main(args) == 0
    fast = capsys.readouterr()
    assert "extrapolated: 6 identical blocks (layers) from profiles" in fast.out
    assert "reserved (simulated" not in fast.out and fast.err == ""
    assert main([*args, "--full"]) == 0
    full = capsys.readouterr()
    assert "extrapolated" not in full.out and "reserved (simulated" in full.out
    assert fast.out.replace(_note(fast.out), "") == _without_reserved(full.out)
    # outputs that need the timeline or the simulation profile every block
    for extra in (
        ["--plot", str(tmp_path / "p.png")],
        ["--alloc-conf", "expandable_segments:True"],
    ):
        assert main([*args, *extra]) == 0
        assert "extrapolated" not in capsys.readouterr().out
    # a fallback is one line on stderr
    init = Block.__init__
    count = iter(range(10**6))

    def numbered(self, *a, **k):
        init(self, *a, **k)
        self.layer_idx = next(count)

    monkeypatch.setattr(Block, "__init__", numbered)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err == (
        "gpumem profile: profiling all 6 blocks (k-block extrapolation not used: the blocks are "
        "not identical twins: layers.1 differs from layers.0 (in (block)))\n"
    )
