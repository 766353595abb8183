"""Optimizers beyond Adam: the estimate's state bytes against a real CPU run of torch's own
implementation under gpumem.profile (torch.optim.Adafactor, torch.optim.Muon), and the
formulas against their sources where torch ships none (bitsandbytes' 8-bit Adam)."""

import pytest
import torch
import torch.nn.functional as F

import gpumem
from gpumem import Layout
from gpumem.estimator.states import Training, param_mix
from gpumem.models import build_model, example_batch, get_config


def _run(model, opt, batch_fn, steps=2):
    with gpumem.profile(model, optimizer=opt) as prof:
        for _ in range(steps):
            batch_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return prof.report().steps[-1]


def _tiny_llama(batch=2, seq=32):
    torch.manual_seed(0)
    cfg = get_config(
        "llama", "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        vocab_size=256, seq_len=64,
    )  # fmt: skip
    model = build_model(cfg).train()
    ids, targets = example_batch(cfg, batch, seq)
    return model, lambda: F.cross_entropy(model(ids).reshape(-1, 256), targets.reshape(-1))


def test_adafactor_state_matches_torch():
    """torch.optim.Adafactor: per matrix a row and a column vector, per vector a full second
    moment, no first moment; plus a float32 ``step`` tensor per parameter (4 B each, which
    the per-parameter formula leaves out)."""
    model, loss = _tiny_llama()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    measured = _run(model, opt, loss).at_peak["optimizer"]
    bill = gpumem.estimate(
        model, precision="fp32", optimizer="adafactor", device="cpu", batch_size=2, seq_len=32
    )
    n_tensors = len(list(model.parameters()))
    assert measured == bill.model_states["optimizer"] + 4 * n_tensors


def test_adafactor_step_temporary_matches_torch():
    """Per tensor: ``row_var @ col_var`` of one tensor while the previous tensor's estimate is
    still named (largest consecutive pair of parameters); the row and column means (a few
    hundred elements) are left out, so the estimate is slightly low."""
    model, loss = _tiny_llama(batch=1, seq=8)  # small activations: the step is the peak
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    step = _run(model, opt, loss)
    bill = gpumem.estimate(
        model, precision="fp32", optimizer="adafactor", device="cpu", batch_size=1, seq_len=8
    )
    sizes = [p.numel() for p in model.parameters()]
    pair = max(a + b for a, b in zip([0, *sizes], sizes, strict=False))
    assert step.peak_phase == "optimizer" and bill.phase == "optimizer step"
    assert bill.per_gpu["temporary"] == 4 * pair
    assert 0 < step.at_peak["temporary"] - 4 * pair < 0.02 * step.at_peak["temporary"]


def _linear_stack(n=3, width=48):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)])


def test_muon_state_and_newton_schulz_workspace_match_torch():
    """torch.optim.Muon on hidden matrices only: one fp32 momentum buffer per parameter, and
    the step's peak temporary is one matrix's Nesterov update (fp32) plus Newton–Schulz's bf16
    X, X·Xᵀ, b·A + c·A·A and the next X: 48·48·4 + 2·(2·48·48 + 2·48²) = 27,648 B."""
    model = _linear_stack()
    x = torch.randn(4, 48)
    opt = torch.optim.Muon(model.parameters(), lr=1e-2)
    step = _run(model, opt, lambda: model(x).sum())
    bill = gpumem.estimate(
        model,
        precision="fp32",
        optimizer="muon",
        device="cpu",
        example_input=torch.randn(4, 48),
        loss_fn=lambda out: out.sum(),
    )
    assert step.at_peak["optimizer"] == bill.model_states["optimizer"] == 3 * 48 * 48 * 4
    assert step.peak_phase == "optimizer" and bill.phase == "optimizer step"
    assert step.at_peak["temporary"] == bill.per_gpu["temporary"] == 27_648


def test_muon_rectangular_workspace_matches_torch():
    """A 32 x 80 matrix: r = 32, c = 80 after Muon's transpose; the estimate uses the
    module's real shape (ParamMix.largest), not a square guess."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(80, 32, bias=False) for _ in "ab")

        def forward(self, x):
            return sum(b(x) for b in self.blocks)

    net = Net()
    x = torch.randn(2, 80)
    opt = torch.optim.Muon(net.parameters(), lr=1e-2)
    step = _run(net, opt, lambda: net(x).sum())
    expect = Training("fp32", "muon").muon_step_bytes(32, 80)
    assert expect == 32 * 80 * 4 + 2 * (2 * 32 * 80 + 2 * 32 * 32)
    assert step.at_peak["temporary"] == expect


def test_muon_splits_hidden_matrices_from_adamw_params():
    """The standard split: Muon for the blocks' 2-D matrices, AdamW (two moments) for the
    embedding, head and norms."""
    model, _ = _tiny_llama()
    bill = gpumem.estimate(
        model, precision="fp32", optimizer="muon", device="cpu", batch_size=2, seq_len=32
    )
    blocks = [n for n, _ in model.named_modules() if n.count(".") == 1 and n.startswith("layers")]
    hidden = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.ndim == 2 and any(n.startswith(b + ".") for b in blocks)
    )
    total = sum(p.numel() for p in model.parameters())
    assert bill.model_states["optimizer"] == pytest.approx(4 * hidden + 8 * (total - hidden))


def test_adam8bit_is_bitsandbytes_blockwise():
    """bitsandbytes Optimizer8bit.init_state: two uint8 states, two fp32 absmax per 256 values;
    paged variants allocate the same bytes (in unified memory)."""
    assert Training(optimizer="adam8bit").optimizer_bytes == 4 + 2 + 8 / 256
    assert Training(optimizer="paged-adamw8bit").optimizer == "adam8bit"


def test_param_mix_counts_factored_vectors():
    mix = param_mix([((6, 4), True), ((10, 4), False), ((4,), False)])
    assert mix.hidden == 24 / 68 and mix.matrices == 64 / 68
    assert mix.factored == (6 + 4 + 10 + 4) / 68 and mix.largest == (6, 4)
    tr = Training("fp32", "adafactor")
    assert tr.optimizer_bytes_for(mix) == 4 * (4 / 68 + 24 / 68)


def test_sharded_muon_gathers_a_full_matrix_in_the_step():
    """Under a sharded optimizer a Muon step gathers each matrix's full fp32 gradient, one at a
    time: the largest hidden matrix of llama-2-7b (the 11008 x 4096 MLP) in fp32 on top."""
    from gpumem.estimator import peak
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.preset import PresetTerms
    from gpumem.estimator.resolver import resolve_model

    tr = Training(optimizer="muon", grads="fp32")
    job = PresetTerms(
        resolve_model("llama-2-7b"), tr, find_gpu("H100-80GB"), 256, framework="megatron"
    )
    t = [job.terms(Layout(dp=8, zero=z), 1, "none", 1, None, [0])[0][peak.T_STEP] for z in (0, 1)]
    assert t[1] - t[0] == 11008 * 4096 * 4
    assert t[0] == tr.muon_step_bytes(11008, 4096)


def test_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; choose one of sgd, .*muon"):
        Training(optimizer="lion")
