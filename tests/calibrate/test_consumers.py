"""What the estimator and the planner get from a calibration: checkpoint times, a GPU with the
measured reserve, and the reserve read from a profile report."""

import dataclasses
import json

import pytest
import torch

import gpumem
from gpumem.calibrate import Calibration, CalibrationError, from_report
from gpumem.estimator.gpus import CONTEXT_BYTES, FRAGMENTATION, NCCL_BYTES, find_gpu

CATS = ("weights", "gradients", "optimizer", "activations", "communication", "temporary")

MiB, GiB = 2**20, 2**30


def test_checkpoint_times_from_the_coefficients(valid):
    cal = Calibration.from_dict(valid)
    n = 14 * GiB
    stall, persist, restore = cal.checkpoint_times(n)
    assert stall == pytest.approx(0.5 + 1e-9 * n, rel=1e-12)  # overlap_stall_s
    assert persist == pytest.approx(2.0 + 4e-9 * n, rel=1e-12)  # durable_s
    assert restore == pytest.approx(1.0 + 3e-9 * n, rel=1e-12)
    assert cal.checkpoint_times(n, mode="blocking")[0] == pytest.approx(0.25 + 2e-9 * n, rel=1e-12)
    assert cal.checkpoint_times(0) == (0.5, 2.0, 1.0)


def test_checkpoint_times_errors(valid):
    cal = Calibration.from_dict(valid)
    with pytest.raises(CalibrationError, match="nbytes: -1 is below 0"):
        cal.checkpoint_times(-1)
    with pytest.raises(CalibrationError, match="expected an integer"):
        cal.checkpoint_times(1.5)
    with pytest.raises(CalibrationError, match="mode='async'"):
        cal.checkpoint_times(1, mode="async")
    valid["checkpoint"] = None
    with pytest.raises(CalibrationError, match="no checkpoint measurement"):
        Calibration.from_dict(valid).checkpoint_times(1)


def test_apply_to_prefers_the_single_process_report(valid):
    gpu = find_gpu("H100-80GB")
    out = Calibration.from_dict(valid).apply_to(gpu)
    assert out.context_bytes == 900 * MiB  # the report's outside-allocator bytes (per-process NVML)
    assert out.fragmentation == 0.1
    assert out.nccl_bytes == NCCL_BYTES  # never measured: untouched
    assert (
        dataclasses.replace(out, context_bytes=gpu.context_bytes, fragmentation=gpu.fragmentation)
        == gpu
    )
    assert gpu.context_bytes == CONTEXT_BYTES  # the catalog entry itself is not modified


def test_apply_to_uses_the_probe_for_a_distributed_report(valid):
    valid["report"]["world_size"] = 8  # outside bytes then include NCCL buffers: not a context size
    out = Calibration.from_dict(valid).apply_to(find_gpu("H100-80GB"))
    assert (out.context_bytes, out.fragmentation) == (512 * MiB, 0.1)
    valid["report"]["world_size"] = None
    valid["report"]["outside_allocator_source"] = (
        "device used (cudaMemGetInfo, all processes) - reserved"
    )
    assert Calibration.from_dict(valid).apply_to(find_gpu("H100-80GB")).context_bytes == 512 * MiB


def test_apply_to_leaves_unmeasured_fields(valid):
    valid["report"] = None
    out = Calibration.from_dict(valid).apply_to(find_gpu("A100-40GB"))
    assert (out.context_bytes, out.fragmentation, out.name) == (
        512 * MiB,
        FRAGMENTATION,
        "A100-40GB",
    )
    valid["gpu_reserve"] = None
    gpu = find_gpu("A100-40GB")
    assert Calibration.from_dict(valid).apply_to(gpu) is gpu


def test_estimate_with_a_calibrated_gpu_uses_the_measured_reserve(valid):
    gpu = Calibration.from_dict(valid).apply_to(find_gpu("H100-80GB"))
    bill = gpumem.estimate("gpt2", batch_size=2, seq_len=512, gpu=gpu)
    p = bill.per_gpu
    allocated = sum(p[c] for c in CATS)
    assert p["overhead"] == int(900 * MiB + allocated * 0.1)  # one GPU: no NCCL
    # the catalog GPU: the default context and, for fragmentation, the simulated caching
    # allocator (the measured share above wins over it; alloc_conf=False is the flat default)
    default = gpumem.estimate("gpt2", batch_size=2, seq_len=512, gpu="H100-80GB")
    assert default.per_gpu["overhead"] == CONTEXT_BYTES + default.unreleasable_bytes
    flat = gpumem.estimate("gpt2", batch_size=2, seq_len=512, gpu="H100-80GB", alloc_conf=False)
    assert flat.per_gpu["overhead"] == int(CONTEXT_BYTES + allocated * FRAGMENTATION)


ALLOC = {
    "device": "NVIDIA H100 80GB HBM3",
    "allocated_peak": 10 * GiB,
    "reserved_peak": 12 * GiB,
    "fragmentation_at_peak": 1536 * MiB,
    "outside_allocator": 700 * MiB,
    "outside_allocator_source": "nvml process used - reserved",
    "alloc_retries": 0,
    "ooms": 0,
    "out_of_memory": False,
    "snapshot": None,
}


def _cpu_report():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpumem.profile(model, optimizer=opt) as prof:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return prof.report()


def test_from_report_reads_a_profile_json(tmp_path):
    rep = _cpu_report()
    with pytest.raises(CalibrationError, match=r"no CUDA allocator data .* on a CUDA device"):
        from_report(rep)  # a CPU profile has no allocator view
    # the real report format, with the allocator summary a CUDA run writes
    rep.allocator = dict(ALLOC)
    path = tmp_path / "profile.json"
    rep.to_json(path)
    for source in (rep, rep.to_dict(), path, str(path)):
        r = from_report(source)
        assert r.fragmentation == 1536 / 10240
        assert (r.allocated_peak_bytes, r.reserved_peak_bytes, r.fragmentation_bytes) == (
            10 * GiB,
            12 * GiB,
            1536 * MiB,
        )
        assert r.context_bytes == 700 * MiB and r.world_size is None


def test_with_report_round_trips(valid, tmp_path):
    valid["report"] = None
    cal = Calibration.from_dict(valid).with_report(
        {"device": "cuda:0", "world_size": 2, "allocator": dict(ALLOC)}
    )
    assert cal.report.world_size == 2 and cal.report.context_bytes is None
    again = Calibration.from_json(cal.to_json())
    assert again == cal


@pytest.mark.parametrize(
    "alloc, match",
    [
        ({**ALLOC, "allocated_peak": 0}, "allocated nothing"),
        ({**ALLOC, "fragmentation_at_peak": -5}, "fragmentation_at_peak: -5 is below 0"),
        ({**ALLOC, "allocated_peak": "10"}, "allocated_peak: expected an integer"),
        (
            {k: v for k, v in ALLOC.items() if k != "fragmentation_at_peak"},
            "fragmentation_at_peak: missing",
        ),
    ],
)
def test_from_report_rejects_bad_numbers(alloc, match):
    with pytest.raises(CalibrationError, match=match):
        from_report({"device": "cuda:0", "allocator": alloc})


def test_from_report_bad_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text("[1]")
    with pytest.raises(CalibrationError, match="expected a profile report"):
        from_report(p)
    p.write_text(json.dumps({"allocator": None, "device": "cpu"}))
    with pytest.raises(CalibrationError, match="device 'cpu'"):
        from_report(p)
    with pytest.raises(CalibrationError, match="cannot read a profile JSON"):
        from_report(tmp_path / "missing.json")
