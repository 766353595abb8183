"""gpumem.device against what real nvidia-ml-py raises on drivers and containers that are not the
newest: a library-mismatch error that is not an NVMLError, and GPUs NVML cannot open.

The stand-in mirrors nvidia-ml-py 12/13: the unversioned ``nvmlDeviceGet*RunningProcesses``
calls the ``_v3`` C function and, where the driver lacks it (before R510), raises
``NVMLLibraryMismatchError`` (a plain Exception); the ``_v2`` functions still answer.
"""

import os
import sys
import types

from gpumem import device

H200_TOTAL = 150_754_820_096


def _nvml(*, has_v3: bool = True, broken_gpu: int | None = None, count_error: bool = False):
    class NVMLError(Exception):
        pass

    class NVMLLibraryMismatchError(Exception):  # deliberately not an NVMLError, as in pynvml
        pass

    procs = {
        0: [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=700 << 20)],
        1: [types.SimpleNamespace(pid=12345, usedGpuMemory=None)],
    }

    def unversioned(h):
        if not has_v3:
            raise NVMLLibraryMismatchError("Unversioned function called ... use _v2")
        return procs[h]

    def handle(i):
        if i == broken_gpu:
            raise NVMLError("Insufficient Permissions")
        return i

    def count():
        if count_error:
            raise NVMLError("Unknown Error")
        return 2

    def mig(h):
        raise NVMLError("Not Supported")

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLLibraryMismatchError=NVMLLibraryMismatchError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=count,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=H200_TOTAL, used=1 << 30, free=H200_TOTAL - (1 << 30)
        ),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-0000-{h}",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetMigMode=mig,
        nvmlDeviceGetComputeRunningProcesses=unversioned,
        nvmlDeviceGetComputeRunningProcesses_v2=lambda h: procs[h],
        nvmlDeviceGetGraphicsRunningProcesses=unversioned,
        nvmlDeviceGetGraphicsRunningProcesses_v2=lambda h: [],
        nvmlSystemGetDriverVersion=lambda: "470.256.02",
        nvmlSystemGetCudaDriverVersion=lambda: 11040,
        nvmlSystemGetNVMLVersion=lambda: b"11.470.256.02",
    )


def test_old_driver_without_v3_process_calls_falls_back_to_v2(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _nvml(has_v3=False))
    info = device.query()
    assert info.has_gpu and len(info.gpus) == 2
    assert info.gpus[0].processes == (device.GPUProcess(os.getpid(), 700 << 20),)
    assert info.gpus[1].processes == (device.GPUProcess(12345, None),)
    assert info.driver_version == "470.256.02" and info.cuda_driver_version == "11.4"
    assert info.nvml_version == "11.470.256.02"
    assert device.process_used_bytes() == {0: 700 << 20}


def test_unreadable_gpu_is_a_note_not_an_exception(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _nvml(broken_gpu=1))
    info = device.query()
    assert [g.index for g in info.gpus] == [0]
    assert info.notes == ("GPU 1: NVML cannot read it (Insufficient Permissions)",)
    assert device.process_used_bytes() == {0: 700 << 20}  # GPU 1 skipped, GPU 0 still read


def test_nvml_that_cannot_count_gpus_answers_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _nvml(count_error=True))
    info = device.query()
    assert info.has_gpu is False and info.reason == "NVML: cannot count GPUs (Unknown Error)"
    assert device.process_used_bytes() == {}
