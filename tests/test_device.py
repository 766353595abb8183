"""gpumem.device: NVML parsing against a stand-in NVML, the clean CPU answer, and the real GPU
tier."""

import sys
import types

import pytest

from gpumem import device


def test_cpu_machine_gets_clean_no_gpu_answer(monkeypatch):
    class Err(Exception):
        pass

    fake = types.SimpleNamespace(NVMLError=Err)

    def init():
        raise Err("NVML Shared Library Not Found")

    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    info = device.query()
    assert info.has_gpu is False
    assert info.gpus == ()
    assert "NVML: library not found" in info.reason
    assert device.process_used_bytes() == {}


def _fake_nvml(pid_here: int):
    """A stand-in for pynvml with two GPUs; values are what the real bindings return."""

    class Err(Exception):
        pass

    mem = [
        types.SimpleNamespace(total=150_754_820_096, used=1_000_000, free=150_753_820_096),
        types.SimpleNamespace(total=85_899_345_920, used=5 << 30, free=85_899_345_920 - (5 << 30)),
    ]
    procs = {0: [types.SimpleNamespace(pid=pid_here, usedGpuMemory=600 << 20)], 1: []}
    calls = {"shutdown": 0}

    def shutdown():
        calls["shutdown"] += 1

    def mig(h):
        raise Err("Not Supported")

    fake = types.SimpleNamespace(
        NVMLError=Err,
        nvmlInit=lambda: None,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: mem[h],
        nvmlDeviceGetName=lambda h: [b"NVIDIA H200", "NVIDIA H100 80GB HBM3"][h],
        nvmlDeviceGetUUID=lambda h: f"GPU-0000-{h}",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetMigMode=mig,
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs[h],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12080,
        nvmlSystemGetNVMLVersion=lambda: "12.570.86.15",
    )
    return fake, calls


def test_nvml_values_are_read_exactly(monkeypatch):
    import os

    fake, calls = _fake_nvml(os.getpid())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    info = device.query()
    assert info.has_gpu
    assert [g.name for g in info.gpus] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert info.gpus[0].total_bytes == 150_754_820_096
    assert info.gpus[1].free_bytes == 85_899_345_920 - (5 << 30)
    assert info.gpus[0].processes == (device.GPUProcess(os.getpid(), 600 << 20),)
    assert info.gpus[0].compute_capability == (9, 0)
    assert info.gpus[0].mig_mode is None  # "Not Supported" is not an error
    assert info.driver_version == "570.86.15"
    assert info.cuda_driver_version == "12.8"
    assert calls["shutdown"] == 1
    assert device.process_used_bytes() == {0: 600 << 20}
    assert calls["shutdown"] == 2


@pytest.mark.gpu
def test_real_gpu_matches_torch():
    import torch

    info = device.query(cross_check=True)
    assert info.has_gpu, info.reason
    assert len(info.gpus) >= torch.cuda.device_count()
    g = info.gpus[0]
    assert g.torch_free_total is not None and g.name
    # NVML's total is the memory on the card; cudaMemGetInfo's can leave out what the driver
    # reserves for itself (hundreds of MiB): close, not necessarily equal; a note says so
    nvml_total, torch_total = g.total_bytes, g.torch_free_total[1]
    assert abs(torch_total - nvml_total) <= 0.03 * nvml_total, (nvml_total, torch_total)
    assert (torch_total == nvml_total) == (not any("torch.cuda total" in n for n in info.notes))
