"""gpumem.fake(): the same numbers as a real run, at any size, without allocating."""

import contextlib

import pytest
import torch
from torch import nn

import gpumem
from gpumem.models import build_model, default_dtype, example_batch, get_config
from gpumem.models.transformer import Block

from .conftest import train_steps


def _profile(arch, fake):
    torch.manual_seed(0)
    with gpumem.fake() if fake else contextlib.nullcontext():
        model = build_model(arch, "tiny")
        opt = torch.optim.AdamW(model.parameters())
        x, y = example_batch(model.config, 2, 16)
        with gpumem.profile(model, opt) as prof:
            train_steps(model, opt, x, y, steps=2)
    return prof.report()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "vit", "resnet"])
def test_fake_equals_real(arch):
    real, fake = _profile(arch, False), _profile(arch, True)
    assert fake.fake and not real.fake and not fake.estimate
    assert fake.peak_bytes == real.peak_bytes
    assert fake.at_peak == real.at_peak
    assert [s.peak for s in fake.steps] == [s.peak for s in real.steps]
    assert {k: v.activations for k, v in fake.layers.items()} == {
        k: v.activations for k, v in real.layers.items()
    }


def test_moe_under_fake_is_labelled_estimate():
    """Mixtral routing is data dependent: under fake tensors the built-in MoE assumes uniform
    top-k routing and says so. Real routing on random weights is not uniform, so only the
    model-state categories must agree exactly."""
    real, fake = _profile("mixtral", False), _profile("mixtral", True)
    assert fake.estimate and "uniform" in fake.assumptions[0]
    assert not real.estimate
    for c in ("weights", "gradients", "optimizer"):
        assert fake.steps[-1].layers[""].__dict__[c] == real.steps[-1].layers[""].__dict__[c]


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x[x > 0].view(-1, 8) if x.numel() else x)


def test_data_dependent_op_names_op_and_layer():
    with gpumem.fake():
        model = nn.Sequential(nn.Linear(8, 8), _Masked())
        x = torch.randn(4, 8)
        with (
            pytest.raises(
                gpumem.profiler.DataDependentError, match=r"aten.index.Tensor in module '1'"
            ),
            gpumem.profile(model) as prof,
        ):
            model(x).sum().backward()
    assert prof.report().error.startswith("DataDependentError")


def test_item_under_fake_names_op():
    class Item(nn.Module):
        def forward(self, x):
            return x * x.sum().item()

    with gpumem.fake():
        model = nn.Sequential(Item())
        x = torch.randn(4, requires_grad=True)
        with (
            pytest.raises(gpumem.profiler.DataDependentError, match=r"_local_scalar_dense.*'0'"),
            gpumem.profile(model),
        ):
            model(x)


def test_llama2_70b_layer_profiles_under_fake():
    """Full-size Llama-2-70B decoder layer, bf16, batch 1, seq 4096, AdamW, on this CPU box.

    Hand calculation of the model state (bf16 = 2 bytes):
      params = q 8192² + k,v 2·8192·1024 + o 8192² + gate/up/down 3·8192·28672 + 2 norms·8192
             = 855,654,400  ->  weights 1,711,308,800 B, plus the RoPE cos/sin buffers
               (float32, 2·4096·64·4 = 2,097,152 B).
      gradients = 1,711,308,800 B.  AdamW state = exp_avg + exp_avg_sq in the parameter dtype
      (2·1,711,308,800) + one float32 step counter per parameter tensor (9·4)."""
    cfg = get_config("llama", "70b")
    with gpumem.fake():
        with default_dtype(torch.bfloat16):
            block = Block(cfg)
        opt = torch.optim.AdamW(block.parameters())
        x = torch.randn(1, 4096, cfg.hidden_size, dtype=torch.bfloat16)
        with gpumem.profile(block, opt) as prof:
            block(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    n_params = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert n_params == 855_654_400
    root = rep.layers[""]
    assert root.weights == 2 * n_params + 2 * 4096 * 64 * 4
    assert root.gradients == 2 * n_params
    assert root.optimizer == 2 * 2 * n_params + 9 * 4
    assert rep.layers["mlp.gate_proj"].weights == 2 * 8192 * 28672
    assert rep.at_peak["inputs"] == 2 * 4096 * 8192
    # peak: state created in the first AdamW step on top of weights and gradients
    assert rep.peak_phase == "optimizer"
    assert rep.peak_bytes > root.weights + root.gradients + root.optimizer
    assert rep.fake and rep.device == "cpu (fake)"


def test_fake_cuda_emulates_block_rounding():
    """device='cuda' builds fake CUDA tensors even without a GPU; storages count in 512-byte
    allocator blocks: a 3-element float32 bias (12 B) costs 512 B."""
    with gpumem.fake(device="cuda"):
        model = nn.Linear(5, 3)
        assert model.weight.device.type == "cuda"
        with gpumem.profile(model) as prof:
            pass
    assert prof.report().layers[""].weights == 512 + 512


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the refusal applies without a usable CUDA device"
)
def test_fake_cuda_without_gpu_refuses_autograd_instead_of_aborting():
    """PyTorch aborts the process (std::terminate) when autograd records on fake CUDA tensors
    without a usable CUDA device; gpumem refuses those ops with an error, in a subprocess so an
    abort would show as a signal rather than kill the test run. No-grad profiling still works."""
    import subprocess
    import sys

    code = """
import torch, gpumem
with gpumem.fake(device="cuda"):
    m = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.no_grad(), gpumem.profile(m) as prof:
        m(x)
    print("peak", prof.report().peak_bytes)
    for call in (lambda: m(x), lambda: m(x.requires_grad_()).sum().backward()):
        try:
            call()
        except RuntimeError as e:
            print("refused", "usable CUDA device" in str(e))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # weights 512 + 512 (8x8 fp32 = 256 B and 8 B bias, each a 512-byte block), input 512,
    # output 512
    assert out.stdout.split() == ["peak", "2048", "refused", "True", "refused", "True"]


def test_cuda_kernels_on_cpu_and_back():
    """CUDA autocast's fp32 softmax and norms, and dropout's bool mask, on the CPU for the
    block only (the nn.Module path prices a CUDA job on a machine without a GPU)."""
    from gpumem.profiler.fake import cuda_kernels_on_cpu

    x = torch.randn(4, 8, requires_grad=True)
    with cuda_kernels_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(x.half(), -1).dtype == torch.float32
        assert torch.log_softmax(x.half(), -1, dtype=torch.float16).dtype == torch.float16
        assert torch.nn.functional.layer_norm(x.half(), (8,)).dtype == torch.float32
        d = torch.nn.functional.dropout(x, 0.5, True)
        assert type(d.grad_fn).__name__ == "NativeDropoutBackward0"
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(x.half(), -1).dtype == torch.float16
        assert type(torch.nn.functional.dropout(x, 0.5, True).grad_fn).__name__ != (
            "NativeDropoutBackward0"
        )
