"""The CUDA tier of calibration: the GPU reserve probe, a checkpoint measured from GPU tensors,
and fragmentation from a real CUDA profile. Skipped without a CUDA device."""

import json
import math
import subprocess
import sys

import pytest
import torch

import gpumem
from gpumem.calibrate import Calibration, from_report, measure_checkpoint
from gpumem.estimator.gpus import find_gpu

pytestmark = pytest.mark.gpu
MiB = 2**20

# a fresh process, so the context measured is the probe's own and not this test session's
_PROBE = """
import json
from gpumem.calibrate import measure_gpu_reserve
r = measure_gpu_reserve(nbytes=64 << 20)
print(json.dumps(r.to_dict()))
"""


def test_gpu_reserve_probe_in_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # a CUDA context with cuBLAS loaded is tens to thousands of MiB; never zero, never the whole GPU
    assert 16 * MiB < r["context_bytes"] < r["total_bytes"] // 2, r
    assert r["reserved_bytes"] >= 4 * MiB  # the matmul operands went through the caching allocator
    assert r["d2h_gb_per_s"] > 0.1 and r["h2d_gb_per_s"] > 0.1, r
    assert r["device_name"] == torch.cuda.get_device_name(0)


def test_checkpoint_cost_from_gpu_tensors(tmp_path):
    cost = measure_checkpoint(tmp_path, (8 * MiB, 32 * MiB), device="cuda", repeat=2, warmup=1)
    assert cost.device == "cuda"
    for p in cost.points:
        assert (p.blocking_mode, p.overlap_mode) == ("blocking", "overlap")
        assert all(math.isfinite(s) and s > 0 for q in p.samples for s in p.samples[q])
    assert list(tmp_path.iterdir()) == []


def test_fragmentation_from_a_cuda_profile(valid):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    with gpumem.profile(model, optimizer=opt) as prof:
        for _ in range(2):
            model(torch.randn(64, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    r = from_report(rep)
    a = rep.allocator
    assert r.allocated_peak_bytes == a["allocated_peak"] > 0
    assert r.fragmentation == a["fragmentation_at_peak"] / a["allocated_peak"] >= 0
    cal = Calibration.from_dict(valid).with_report(rep)
    gpu = cal.apply_to(find_gpu("H100-80GB"))
    assert gpu.fragmentation == r.fragmentation
    if r.context_bytes is not None:
        assert gpu.context_bytes == r.context_bytes > 0
    assert Calibration.from_json(cal.to_json()) == cal


def test_memory_fit_on_cuda_measures_fragmentation_and_calibrates():
    """`gpumem calibrate --memory --device cuda`: real CUDA proxies, one coefficient per
    category near 1 (the CUDA allocator rounds storages to 512 B; the estimator does not), and
    the allocator's fragmentation; a held-out configuration calibrated within 3 %."""
    from gpumem.calibrate.memory import apply_memory_calibration
    from gpumem.estimator.accuracy import Case, compare, estimate_case
    from gpumem.estimator.memory_fit import fit_memory

    mem = fit_memory(arch="llama", device="cuda")
    assert mem.device == "cuda" and mem.mode == "real"
    assert mem.fragmentation is not None and mem.fragmentation >= 0
    for fit in mem.fits.values():
        assert 0.8 < fit.coefficient < 1.25
    held_out = Case(
        "held-out",
        "llama",
        {
            "hidden_size": 128,
            "num_layers": 3,
            "num_heads": 4,
            "num_kv_heads": 2,
            "vocab_size": 512,
            "seq_len": 256,
        },
        batch=2,
        seq=256,
    )
    c = compare(held_out, device="cuda")
    after = apply_memory_calibration(estimate_case(held_out, "cuda"), mem).profiler_categories()
    assert abs(after["total"] - c.measured_peak) <= 0.03 * c.measured_peak
