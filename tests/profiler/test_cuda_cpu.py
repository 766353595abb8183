"""The CUDA tier's arithmetic and failure paths, run on CPU against stand-ins.

A scripted caching allocator replaces ``torch.cuda``'s statistics calls (its numbers follow the
real allocator's rules: ``peak`` is the high-water mark since the last reset, a reset sets it to
``current``), a stand-in ``pynvml`` answers the driver queries, and fake CUDA tensors show where
``gpumem.fake(device="cuda")`` puts what. Expected values are derived by hand in each test.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import gpumem
from gpumem.profiler import cuda

MiB = 1 << 20
SEGMENT = 2 * MiB  # the stand-in reserves whole 2 MiB segments, as the real allocator's large pool


class ScriptedAllocator:
    """Allocated/reserved bytes with the caching allocator's peak semantics, and a log of the
    memory-history calls."""

    def __init__(self, allocated: int, reserved: int, stale_peak: int) -> None:
        self.cur, self.reserved = allocated, reserved
        self.peak, self.reserved_peak = stale_peak, stale_peak  # left over from before the region
        self.ooms = 3
        self.calls: list[tuple] = []
        self.dump_error: Exception | None = None

    def malloc(self, n: int) -> None:
        self.cur += n
        self.reserved = max(self.reserved, -(-self.cur // SEGMENT) * SEGMENT)
        self.peak = max(self.peak, self.cur)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        self.cur -= n

    def stats(self, device=None) -> dict:
        return {
            "allocated_bytes": {"all": {"current": self.cur, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.reserved_peak}},
            "num_alloc_retries": 0,
            "num_ooms": self.ooms,
        }

    def reset_peaks(self, device=None) -> None:
        self.peak, self.reserved_peak = self.cur, self.reserved

    def record_history(self, *args, **kwargs) -> None:
        self.calls.append(("record", args, kwargs))

    def dump(self, filename) -> None:
        self.calls.append(("dump", str(filename)))
        if self.dump_error is not None:
            raise self.dump_error
        with open(filename, "wb") as f:
            f.write(b"snapshot")


def _fake_nvml(procs: list, uuids=("GPU-0000-0",), error=None):
    """Stand-in pynvml: ``procs[i]`` lists the processes on GPU i."""

    class NVMLError(Exception):
        pass

    def running(h):
        if error is not None:
            raise error
        return procs[h]

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(procs),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: uuids[h],
        nvmlDeviceGetComputeRunningProcesses=running,
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
    )


def _proc(pid: int, used: int | None):
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


@pytest.fixture
def alloc(monkeypatch):
    """A CUDA device as far as AllocatorProbe can tell: 10 000 B allocated before the region,
    one 2 MiB segment reserved, a stale peak of 50 000 B from earlier work."""
    a = ScriptedAllocator(allocated=10_000, reserved=SEGMENT, stale_peak=50_000)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", a.stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset_peaks)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (100 * MiB, 1024 * MiB))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(uuid="0000-0")
    )
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", a.record_history)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", a.dump)
    # the model below lives on the CPU: hand the profile a probe of the stand-in device 0
    probe = classmethod(lambda cls, model, device_types, snapshot: cls(0, snapshot))
    monkeypatch.setattr(cuda.AllocatorProbe, "maybe", probe)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([[]]))  # no process entry: fallback
    return a


class Spike(nn.Module):
    """Allocates ``temp`` bytes and frees them, then keeps ``keep`` bytes (an activation)."""

    def __init__(self, a: ScriptedAllocator, temp: int, keep: int, interrupt: bool = False) -> None:
        super().__init__()
        self.a, self.temp, self.keep, self.interrupt = a, temp, keep, interrupt

    def forward(self, x):
        self.a.malloc(self.temp)
        self.a.free(self.temp)
        if self.interrupt:
            raise KeyboardInterrupt
        self.a.malloc(self.keep)
        return x


def test_allocator_peaks_per_layer_phase_and_fragmentation(alloc):
    """Derivation (bytes): entry level 10 000, 2 MiB reserved.
    Layer 0: +3 MiB temporary -> allocated 3 155 728, which needs a second 2 MiB segment
    (reserved 4 MiB); it keeps 1024 -> 11 024. Layer 1 enters at 11 024, peaks at 13 072 (+2048),
    keeps 512. Every running ancestor (block "0", the root) sees layer 0's peak. Fragmentation
    at the peak: 4 MiB - 3 155 728."""
    model = nn.Sequential(nn.Sequential(Spike(alloc, 3 * MiB, 1024), Spike(alloc, 2048, 512)))
    with gpumem.profile(model) as prof:
        model(torch.zeros(4))
    rep = prof.report()
    a = rep.allocator
    assert a["allocated_peak"] == 10_000 + 3 * MiB
    assert a["reserved_peak"] == 4 * MiB
    assert a["fragmentation_at_peak"] == 4 * MiB - (10_000 + 3 * MiB)
    # the stale 50 000 B peak from before the region was reset at entry, and every boundary
    # resets again: layer 1's interval reports its own 13 072, not layer 0's higher peak
    assert rep.layers["0.0"].allocated_peak_delta == 3 * MiB
    assert rep.layers["0.1"].allocated_peak_delta == 2048
    assert rep.layers["0"].allocated_peak_delta == 3 * MiB
    assert rep.layers[""].allocated_peak_delta == 3 * MiB
    assert rep.layers["0.0"].reserved_peak_delta == 2 * MiB
    assert rep.layers["0.1"].reserved_peak_delta == 0
    assert rep.layers[""].reserved_peak_delta == 2 * MiB
    assert rep.steps[0].allocator == {
        "forward": {"allocated_peak": 10_000 + 3 * MiB, "reserved_peak": 4 * MiB}
    }
    assert a["ooms"] == 0 and a["out_of_memory"] is False and a["snapshot"] is None
    assert alloc.calls == []  # no snapshot asked for: no history recorded
    # no NVML entry for this process: device-wide used memory minus reserved (labelled)
    assert a["outside_allocator"] == (1024 - 100) * MiB - 4 * MiB
    assert a["outside_allocator_source"].startswith("device used (cudaMemGetInfo")


def _run(prof, model, exc: BaseException | None = None, alloc=None) -> None:
    """One forward inside the profiled region, then ``exc`` raised inside it (counted as an
    OOM by ``alloc`` first, as the caching allocator does before it raises)."""
    with prof:
        model(torch.zeros(4))
        if exc is not None:
            if alloc is not None:
                alloc.ooms += 1
            raise exc


def test_oom_keeps_report_writes_python_stack_snapshot_and_stops_recording(alloc, tmp_path):
    model = nn.Sequential(Spike(alloc, 4096, 1024))
    path = tmp_path / "oom.pickle"
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    prof = gpumem.profile(model, snapshot=str(path))
    with pytest.raises(torch.OutOfMemoryError) as info:
        _run(prof, model, err, alloc)
    assert info.value is err  # propagated unchanged
    rep = prof.report()
    assert rep.error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rep.allocator["out_of_memory"] is True and rep.allocator["ooms"] == 1
    assert rep.layers["0"].allocated_peak_delta == 4096  # the report up to the OOM survives
    assert rep.allocator["snapshot"] == str(path) and path.read_bytes() == b"snapshot"
    assert rep.allocator["snapshot_error"] is None
    record, dump, stop = alloc.calls
    assert record[0] == "record" and record[1][:1] == ("all",)
    # C++ frames would be symbolized at dump time, which takes minutes on a real job
    assert record[2]["stacks"] == "python" and record[2]["max_entries"] > 0
    assert dump == ("dump", str(path))
    assert stop == ("record", (), {"enabled": None})


def test_failed_snapshot_does_not_replace_the_oom(alloc, tmp_path):
    alloc.dump_error = OSError(28, "No space left on device")
    model = nn.Sequential(Spike(alloc, 4096, 1024))
    prof = gpumem.profile(model, snapshot=str(tmp_path / "oom.pickle"))
    with pytest.raises(torch.OutOfMemoryError), pytest.warns(RuntimeWarning, match="No space left"):
        _run(prof, model, torch.OutOfMemoryError("CUDA out of memory"))
    a = prof.report().allocator
    assert a["out_of_memory"] is True and a["snapshot"] is None
    assert a["snapshot_error"].startswith("OSError") and "No space left" in a["snapshot_error"]
    assert alloc.calls[-1] == ("record", (), {"enabled": None})  # recording still switched off


def test_snapshot_path_is_checked_before_the_region(alloc, tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        gpumem.profile(model, snapshot=str(tmp_path / "missing" / "oom.pickle"))
    with pytest.raises(ValueError, match="is a directory"):
        gpumem.profile(model, snapshot=str(tmp_path))
    assert alloc.calls == []


def test_failed_start_stops_history_recording(alloc, monkeypatch, tmp_path):
    from gpumem.profiler.tracker import StorageTracker

    def broken_enter(self):
        raise RuntimeError("mode stack is busy")

    monkeypatch.setattr(StorageTracker, "__enter__", broken_enter)
    prof = gpumem.profile(nn.Linear(2, 2), snapshot=str(tmp_path / "s.pickle"))
    with pytest.raises(RuntimeError, match="mode stack is busy"):
        prof.__enter__()
    assert [c[0] for c in alloc.calls] == ["record", "record"]
    assert alloc.calls[-1] == ("record", (), {"enabled": None})


def test_interrupt_hands_inner_allocator_peak_to_outer_frames(alloc):
    """Ctrl-C inside a nested forward skips every forward hook, so the region's exit closes the
    inner and outer frames together; the outer one must still see the inner spike (1 MiB)."""
    inner = Spike(alloc, MiB, 0, interrupt=True)
    model = nn.Sequential(nn.Sequential(inner))
    prof = gpumem.profile(model)
    with pytest.raises(KeyboardInterrupt):
        _run(prof, model)
    rep = prof.report()
    assert rep.layers["0.0"].allocated_peak_delta == MiB
    assert rep.layers["0"].allocated_peak_delta == MiB
    assert rep.layers[""].allocated_peak_delta == MiB


# -- memory outside the allocator (NVML) --------------------------------------------------------
def test_outside_allocator_from_nvml_process_figure(alloc, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([[_proc(os.getpid(), 600 * MiB)]]))
    assert cuda.outside_allocator(0, 100 * MiB) == (500 * MiB, "nvml process used - reserved")


@pytest.mark.parametrize(
    "procs",
    [
        [[_proc(os.getpid(), None)]],  # driver does not report per-process usage
        [[_proc(os.getpid(), 0)]],  # reports 0: below the reservation, not a total
        [[_proc(os.getpid() + 1, 900 * MiB)]],  # container: NVML lists host PIDs only
    ],
    ids=["used-none", "used-below-reserved", "pid-not-visible"],
)
def test_outside_allocator_falls_back_to_device_used(alloc, monkeypatch, procs):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(procs))
    value, source = cuda.outside_allocator(0, 100 * MiB)
    assert value == (1024 - 100) * MiB - 100 * MiB  # total - free - reserved (mem_get_info)
    assert source.startswith("device used (cudaMemGetInfo, all processes)")


def test_outside_allocator_matches_torch_device_by_uuid(alloc, monkeypatch):
    """Two GPUs with this process on both (CUDA_VISIBLE_DEVICES reorders them): torch's device 0
    is NVML's GPU 1 by UUID."""
    procs = [[_proc(os.getpid(), 300 * MiB)], [_proc(os.getpid(), 700 * MiB)]]
    nvml = _fake_nvml(procs, uuids=("GPU-aaaa", "GPU-0000-0"))
    nvml.nvmlDeviceGetName = lambda h: "GPU"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=1, used=0, free=1)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    nvml.nvmlDeviceGetMigMode = lambda h: (0, 0)
    nvml.nvmlSystemGetDriverVersion = lambda: "570.86.15"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12080
    nvml.nvmlSystemGetNVMLVersion = lambda: "12.570.86.15"
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert cuda.outside_allocator(0, 100 * MiB)[0] == 600 * MiB


def test_driver_failure_costs_only_the_outside_figure(alloc, monkeypatch):
    def broken(pid=None):
        raise RuntimeError("NVML: GPU is lost")

    monkeypatch.setattr("gpumem.device.process_used_bytes", broken)
    model = nn.Sequential(Spike(alloc, 4096, 0))
    with gpumem.profile(model) as prof:
        model(torch.zeros(4))
    a = prof.report().allocator
    assert a["outside_allocator"] is None and "GPU is lost" in a["outside_allocator_source"]
    assert a["allocated_peak"] == 10_000 + 4096


def test_probe_only_for_real_cuda_models(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = nn.Linear(2, 2)
    assert cuda.AllocatorProbe.maybe(model, {"cpu"}, None) is None
    with gpumem.fake():
        assert cuda.AllocatorProbe.maybe(model, {"cuda"}, None) is None  # inside a fake block
        fake_model = nn.Linear(2, 2)
    assert cuda.AllocatorProbe.maybe(fake_model, {"cuda"}, None) is None  # fake model outside it


# -- gpumem.fake(device="cuda"): placements the meta kernels get wrong ---------------------------
class EfficientAttention(nn.Module):
    def forward(self, q):
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)


def test_fake_cuda_efficient_attention_rng_state_on_host():
    """Eager CUDA returns memory-efficient attention's philox seed and offset as 0-dim int64
    host tensors (8 B each); the meta kernel says device. Derivation of the region's peak:
    q (2, 4, 32, 16) fp32 = 16 384 B input, the output 16 384 B, logsumexp (2, 4, 32) fp32 =
    1024 B, seed + offset 16 B on the host; the CUDA sizes are multiples of 512 already.
    Counted on the device they would cost 2 x 512 B."""
    with gpumem.fake(device="cuda"):
        q, attention = torch.randn(2, 4, 32, 16), EfficientAttention()
        with torch.no_grad(), gpumem.profile(attention) as prof:
            out, lse, seed, offset = attention(q)
        for t in (seed, offset):
            assert t.device.type == "cpu" and t.dim() == 0 and t.dtype == torch.int64
        assert out.device.type == lse.device.type == "cuda"
        back = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            out, q, q, q, None, out, lse, seed, offset, 0.0, [True, True, True, False], True
        )  # backward accepts the host RNG state as the real kernel does
        assert back[0].device.type == "cuda"
    assert prof.report().peak_bytes == 16_384 + 16_384 + 1024 + 16


def test_fake_cuda_flash_attention_rng_state_where_this_torch_puts_it():
    """Flash attention's RNG state is a (2,) uint64 device tensor in current torch (stays on the
    device); before that change it was two 0-dim int64 host tensors (moved to the host)."""
    with gpumem.fake(device="cuda"), torch.no_grad():
        q = torch.randn(2, 4, 32, 16, dtype=torch.float16)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)
        for t in out[6:8]:
            old_layout = t.dim() == 0 and t.dtype == torch.int64
            assert t.device.type == ("cpu" if old_layout else "cuda")
        assert out[0].device.type == "cuda"


def test_fake_cuda_optimizer_step_counters_stay_on_host():
    """torch.optim creates step counters on the host (older versions without naming a device)
    and reads them with .item(); under the fake block's default device a counter created the
    old way must still land on the host, or .item() on a fake CUDA tensor fails."""
    old_adam = {"__name__": "torch.optim.adam", "torch": torch}
    # a function whose globals say it is torch.optim code, doing what older AdamW does
    source = "def init_step():\n    return torch.tensor(0.0, dtype=torch.float32)\n"
    exec(source, old_adam)
    with gpumem.fake(device="cuda"):
        assert torch.zeros(()).device.type == "cuda"  # the block's default device stands
        step = old_adam["init_step"]()
        assert step.device.type == "cpu"
        step += 1
        assert step.item() == 1.0
        model = nn.Linear(8, 4)
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(model.parameters())
        opt.step()
        opt.step()
        states = list(opt.state.values())
        assert all(
            s["step"].device.type == "cpu" and s["exp_avg"].device.type == "cuda" for s in states
        )


def _fake_cuda_adamw_peak(foreach: bool | None) -> int:
    with gpumem.fake(device="cuda"):
        model = nn.Linear(64, 32)
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        with gpumem.profile(model, opt) as prof:
            opt.step()
            opt.step()
    return prof.report().peak_bytes


def test_fake_cuda_optimizer_takes_the_cuda_default_path():
    """On CUDA, AdamW's default is the foreach implementation (scratch for the whole parameter
    list at once); fake parameters must not fall back to the per-tensor loop."""
    assert _fake_cuda_adamw_peak(None) == _fake_cuda_adamw_peak(True)
    assert _fake_cuda_adamw_peak(True) != _fake_cuda_adamw_peak(False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a CPU-only machine")
def test_fake_cuda_training_without_gpu_is_refused_in_one_line(capsys):
    from gpumem.cli import main
    from gpumem.profiler.runner import profile_model

    with pytest.raises(ValueError, match="use --fake without --device"):
        profile_model("gpt2", fake=True, device="cuda")
    with pytest.raises(ValueError, match=r"^--device cuda needs a torch build with a usable CUDA"):
        profile_model("gpt2", device="cuda")
    assert main(["profile", "gpt2", "--fake", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem profile: error: --fake --device cuda") and err.count("\n") == 1


def test_no_warning_without_snapshot(alloc):
    model = nn.Sequential(Spike(alloc, 512, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gpumem.profile(model) as prof:
            model(torch.zeros(4))
    assert prof.report().allocator["snapshot_error"] is None
