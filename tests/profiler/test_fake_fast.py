"""The fast path of fake profiles (``profiler/fake.py``: FakeTensorMode's cache key memoised on
a cheap key, cache hits and metadata queries answered before torch's dispatch path) against the
full dispatch (``GPUMEM_FAKE_FULL_DISPATCH=1``): every report field equal, on models whose
blocks are identical, differ, or only look identical. Also the profile command's progress."""

import importlib
import io
import json

import pytest
import torch
import torch.nn.functional as F

import gpumem
from gpumem.cli import main
from gpumem.models import build_model, default_dtype, example_batch
from gpumem.models.transformer import Block, MoE
from gpumem.profiler.runner import profile_model

fake_module = importlib.import_module("gpumem.profiler.fake")  # the package exports fake()


def _comparable(rep) -> dict:
    """Every field of the report except wall-clock times (the timeline's and spans' ns)."""
    d = rep.to_dict()
    d["timeline"] = {k: v for k, v in d["timeline"].items() if k != "t_ns"}
    d["spans"] = [{k: v for k, v in s.items() if not k.endswith("_ns")} for s in d["spans"]]
    return d


def _profile(make, monkeypatch, full: bool, steps: int = 2):
    """Build ``make()`` -> (model, batch) under gpumem.fake() and profile AdamW steps."""
    monkeypatch.setenv("GPUMEM_FAKE_FULL_DISPATCH", "1" if full else "0")
    with gpumem.fake() as mode:
        net, (x, y) = make()
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        with gpumem.profile(net, opt) as prof:
            for _ in range(steps):
                out = net(x)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del out, loss
    memo = mode._gpumem_keys
    assert (memo is None) == full  # the switch decides which path ran
    if not full:
        assert memo  # the fast path was taken
    return prof.report()


def _llama(layers: int = 5, **kw):
    def make():
        net = build_model("llama", "tiny", num_layers=layers, **kw)
        return net, example_batch(net.config, 2, 32)

    return make


def _mixed_moe_dense():
    """Dense blocks with one MoE block in the middle: the blocks are not all alike."""

    def make():
        net = build_model("llama", "tiny", num_layers=4)
        moe_cfg = build_model("mixtral", "tiny").config
        net.layers[2].mlp = MoE(moe_cfg)
        return net, example_batch(net.config, 2, 32)

    return make


def _buffer_shape_differs():
    """Blocks with equal parameters; one block's rotary cache (a buffer) is longer."""

    def make():
        net = build_model("llama", "tiny", num_layers=4)
        rot = net.layers[1].attn.rotary
        rot.register_buffer("cos", torch.cat([rot.cos, rot.cos]), persistent=False)
        rot.register_buffer("sin", torch.cat([rot.sin, rot.sin]), persistent=False)
        return net, example_batch(net.config, 2, 32)

    return make


def _hooked_block():
    """Identical-looking blocks, but a forward hook on one adds work (a temporary)."""

    def make():
        net = build_model("llama", "tiny", num_layers=4)
        net.layers[2].register_forward_hook(lambda _m, _a, out: out * 1.0 + 0.0)
        return net, example_batch(net.config, 2, 32)

    return make


def _dtype_differs():
    """One block in float64 between float32 ones (its input cast in, its output cast back)."""

    def make():
        net = build_model("llama", "tiny", num_layers=4)
        with default_dtype(torch.float64):
            block = Block(net.config)
        block.register_forward_pre_hook(lambda _m, args: (args[0].double(),))
        block.register_forward_hook(lambda _m, _a, out: out.float())
        net.layers[1] = block
        return net, example_batch(net.config, 2, 32)

    return make


@pytest.mark.parametrize(
    "make",
    [
        _llama(),
        _llama(layers=3, tie_word_embeddings=True),
        _mixed_moe_dense(),
        _buffer_shape_differs(),
        _hooked_block(),
        _dtype_differs(),
    ],
    ids=["dense", "tied", "moe-dense", "buffer-shape", "hooked-block", "float64-block"],
)
def test_fast_path_equals_full_dispatch(make, monkeypatch):
    full = _profile(make, monkeypatch, full=True)
    fast = _profile(make, monkeypatch, full=False)
    assert _comparable(fast) == _comparable(full)
    assert fast.table(None) == full.table(None)
    assert fast.peak_reserved_bytes == full.peak_reserved_bytes is not None
    assert [s.layers for s in fast.steps] == [s.layers for s in full.steps]


def test_blocks_that_differ_give_their_own_rows(monkeypatch):
    # the fast path must not hand one block's numbers to another that only looks alike
    rep = _profile(_hooked_block(), monkeypatch, full=False)
    temps = [rep.layers[f"layers.{i}"].forward_temporary for i in range(4)]
    assert temps[0] == temps[1] == temps[3]
    rep = _profile(_buffer_shape_differs(), monkeypatch, full=False)
    weights = [rep.layers[f"layers.{i}"].weights for i in range(4)]
    assert weights[1] > weights[0] == weights[2] == weights[3]
    rep = _profile(_mixed_moe_dense(), monkeypatch, full=False)
    assert rep.layers["layers.2"].weights != rep.layers["layers.1"].weights


def test_sliding_window_layers_hf(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    reps, ticks = [], []
    for full in ("1", "0"):
        monkeypatch.setenv("GPUMEM_FAKE_FULL_DISPATCH", full)
        # the fast run with the progress hooks too: neither changes the report
        bar = (lambda *a: ticks.append(a)) if full == "0" else None
        reps.append(profile_model(str(path), seq_len=16, steps=2, fake=True, progress=bar))
    assert _comparable(reps[0]) == _comparable(reps[1])
    said = [t[2] for t in ticks[1:-1]]
    assert "step 2 of 2: backward block 4/4" in said and "step 2 of 2: forward block 4/4" in said


def _tensor(mode, *shape, **kw):
    with mode:
        return torch.empty(*shape, **kw)


def test_fast_key_sees_every_difference():
    with gpumem.fake() as mode:
        pass
    key = fake_module._fast_key
    add = torch.ops.aten.add.Tensor
    a = _tensor(mode, 4, 6)
    same = _tensor(mode, 4, 6)
    base = key(mode, add, (a, a), {})
    assert base is not None and key(mode, add, (same, same), {}) == base
    others = [
        _tensor(mode, 4, 6, dtype=torch.float64),
        _tensor(mode, 6, 4).t(),  # strides
        _tensor(mode, 4, 7)[:, :6],  # storage bytes and strides
        _tensor(mode, 25)[1:].view(4, 6),  # storage offset
        _tensor(mode, 4, 6, requires_grad=True),
        _tensor(mode, 4, 6, device="meta"),
    ]
    for o in others:
        assert key(mode, add, (o, a), {}) != base
    assert key(mode, torch.ops.aten.mul.Tensor, (a, a), {}) != base
    assert key(mode, add, (a, a), {"alpha": 2}) != key(mode, add, (a, a), {"alpha": 2.0})
    with torch.no_grad():
        assert key(mode, add, (a, a), {}) != base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(mode, add, (a, a), {}) != base
    # what it cannot describe goes to torch's own key
    assert key(mode, add, (torch.empty(4, 6), a), {}) is None
    assert key(mode, add, (a, lambda: 0), {}) is None


def test_progress_moves_block_by_block_and_changes_nothing(monkeypatch):
    ticks = []
    rep = profile_model(
        "llama", batch_size=1, seq_len=16, steps=2, fake=True, progress=lambda *a: ticks.append(a)
    )
    plain = profile_model("llama", batch_size=1, seq_len=16, steps=2, fake=True)
    assert _comparable(rep) == _comparable(plain)
    blocks = len(build_model("llama", "tiny").layers)
    total = 1 + 2 * (2 * blocks + 1)
    assert ticks[0] == (0, None, "building the model")
    assert ticks[-1] == (total, total)
    done = [t[0] for t in ticks]
    assert done == sorted(done)
    said = [t[2] for t in ticks[1:-1]]
    for step in (1, 2):
        for i in range(1, blocks + 1):
            assert f"step {step} of 2: forward block {i}/{blocks}" in said
            assert f"step {step} of 2: backward block {i}/{blocks}" in said
        assert f"step {step} of 2: optimizer step" in said


def test_progress_counts_checkpointed_blocks_once():
    ticks = []
    profile_model(
        "llama",
        seq_len=16,
        steps=1,
        fake=True,
        checkpointing=True,
        progress=lambda *a: ticks.append(a),
    )
    said = [t[2] for t in ticks[1:-1]]
    blocks = len(build_model("llama", "tiny").layers)
    assert sum("forward block" in s for s in said) == blocks
    assert sum("backward block" in s for s in said) == blocks


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_profile_bar_only_on_a_terminal(capsys, monkeypatch):
    for name in ("TERM", "TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "120")
    args = ["profile", "llama", "--fake", "--seq-len", "16", "--steps", "1"]
    tty = _Terminal()
    monkeypatch.setattr("sys.stderr", tty)
    assert main(args) == 0
    assert "profiling llama" in tty.getvalue()
    table = capsys.readouterr().out
    assert table.startswith("gpumem profile of CausalLM")
    pipe = io.StringIO()  # a pipe or a CI log: no bar, the same table
    monkeypatch.setattr("sys.stderr", pipe)
    assert main(args) == 0
    assert pipe.getvalue() == ""
    assert capsys.readouterr().out.splitlines()[2:] == table.splitlines()[2:]
    quiet = _Terminal()  # --json -: only the JSON, even on a terminal
    monkeypatch.setattr("sys.stderr", quiet)
    assert main([*args, "--json", "-"]) == 0
    json.loads(capsys.readouterr().out)
    assert quiet.getvalue() == ""
