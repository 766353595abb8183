"""What GPUs this machine has: NVML (``pynvml``) first, torch.cuda as a cross-check.

NVML answers without creating a CUDA context, so nothing here touches torch.cuda unless asked
(``cross_check=True``). On a CPU machine every query returns a clean "no GPU" answer with the
reason, never an exception.

Example:
    >>> import gpumem
    >>> info = gpumem.device.query()
    >>> info.has_gpu, info.reason            # (False, 'NVML: library not found ...') on a CPU box
    >>> [g.name for g in info.gpus]          # ['NVIDIA H200', ...] on a GPU box
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

# outside_allocator's label when it is NVML's per-process figure (profiler.cuda, calibrate)
NVML_PROCESS_SOURCE = "nvml process used - reserved"


@dataclass(frozen=True)
class GPUProcess:
    pid: int
    used_bytes: int | None  # None where the driver does not report it (e.g. under some containers)


@dataclass(frozen=True)
class LocalGPU:
    """One GPU of this machine, as NVML reports it (torch.cuda beside it when cross-checked)."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None
    processes: tuple[GPUProcess, ...] = ()
    mig_mode: bool | None = None
    # torch.cuda.mem_get_info() for the same device, when cross-checked (free, total)
    torch_free_total: tuple[int, int] | None = None


@dataclass(frozen=True)
class DeviceInfo:
    has_gpu: bool
    gpus: tuple[LocalGPU, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    reason: str = ""  # why there is no GPU, or what could not be read
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nvml():
    """Import and initialise NVML; returns the module or raises RuntimeError with the reason."""
    try:
        import pynvml
    except ImportError:
        raise RuntimeError(
            "NVML: the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML: {_nvml_reason(exc)}") from None
    return pynvml


def _nvml_reason(exc: Exception) -> str:
    text = str(exc)
    if "Library Not Found" in text or "LibraryNotFound" in type(exc).__name__:
        return "library not found (no NVIDIA driver on this machine)"
    if "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    return text


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _errors(nvml) -> tuple[type[BaseException], ...]:
    """What an NVML call can raise: its errors, and the bindings' library-mismatch error, which
    is not an ``NVMLError`` (nvidia-ml-py raises it where the driver lacks a versioned call)."""
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    return (nvml.NVMLError, AttributeError) + ((mismatch,) if mismatch is not None else ())


def _running(nvml, handle, getter: str) -> list[Any]:
    """The processes one getter lists. nvidia-ml-py's unversioned getters call the ``_v3`` API,
    which drivers before R510 lack; those still answer the ``_v2`` call."""
    for name in (getter, getter + "_v2"):
        try:
            return list(getattr(nvml, name)(handle))
        except _errors(nvml):
            continue
    return []


def _processes(nvml, handle) -> tuple[GPUProcess, ...]:
    procs: dict[int, GPUProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for p in _running(nvml, handle, getter):
            used = getattr(p, "usedGpuMemory", None)
            procs[int(p.pid)] = GPUProcess(int(p.pid), int(used) if used is not None else None)
    return tuple(sorted(procs.values(), key=lambda p: p.pid))


def _gpu(nvml, index: int) -> LocalGPU:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    try:
        cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))
    except nvml.NVMLError:
        cc = None
    try:
        mig = bool(nvml.nvmlDeviceGetMigMode(h)[0])
    except nvml.NVMLError:
        mig = None
    return LocalGPU(
        index=index,
        name=_decode(nvml.nvmlDeviceGetName(h)),
        uuid=_decode(nvml.nvmlDeviceGetUUID(h)),
        total_bytes=int(mem.total),
        used_bytes=int(mem.used),
        free_bytes=int(mem.free),
        compute_capability=cc,  # type: ignore[arg-type]
        processes=_processes(nvml, h),
        mig_mode=mig,
    )


def query(cross_check: bool = False) -> DeviceInfo:
    """Every GPU NVML sees, with memory and per-process usage.

    Args:
        cross_check: also ask torch.cuda (this creates a CUDA context on each device) and attach
            ``torch.cuda.mem_get_info`` to each GPU; disagreement is added to ``notes``.
    """
    try:
        nvml = _nvml()
    except RuntimeError as exc:
        return DeviceInfo(has_gpu=False, reason=f"{exc}; {_torch_cuda_reason()}")
    errors = _errors(nvml)
    notes: list[str] = []
    gpus: list[LocalGPU] = []
    driver = cuda_s = nvml_v = None
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except errors as exc:
            reason = f"NVML: cannot count GPUs ({_nvml_reason(exc)})"
            return DeviceInfo(has_gpu=False, reason=reason)
        for i in range(count):
            try:  # a GPU this container may not open (no permission, fallen off the bus)
                gpus.append(_gpu(nvml, i))
            except errors as exc:
                notes.append(f"GPU {i}: NVML cannot read it ({_nvml_reason(exc)})")
        driver = _call(nvml, "nvmlSystemGetDriverVersion", errors)
        cuda = _call(nvml, "nvmlSystemGetCudaDriverVersion", errors)
        cuda_s = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda is not None else None
        nvml_v = _call(nvml, "nvmlSystemGetNVMLVersion", errors)
    finally:
        nvml.nvmlShutdown()
    if cross_check and gpus:
        gpus, more = _cross_check(gpus)
        notes += more
    return DeviceInfo(
        has_gpu=bool(gpus),
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_driver_version=cuda_s,
        nvml_version=nvml_v,
        reason="" if gpus else "NVML reports no GPU",
        notes=tuple(notes),
    )


def _call(nvml, name: str, errors: tuple[type[BaseException], ...]) -> Any:
    """A system-level NVML query, decoded to str where it returns text; None if it fails."""
    try:
        value = getattr(nvml, name)()
    except errors:
        return None
    return _decode(value) if isinstance(value, (bytes, str)) else value


def _torch_cuda_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "CUDA_VISIBLE_DEVICES is empty"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"


def _cross_check(gpus: list[LocalGPU]) -> tuple[list[LocalGPU], list[str]]:
    """Attach torch.cuda.mem_get_info to each GPU (NVML and CUDA number devices alike only when
    CUDA_DEVICE_ORDER=PCI_BUS_ID; we match on UUID where torch exposes it)."""
    import torch

    notes: list[str] = []
    if not torch.cuda.is_available():
        return gpus, [f"torch.cuda is not available: {_torch_cuda_reason()}"]
    by_uuid = {g.uuid.removeprefix("GPU-"): g for g in gpus}
    out: dict[str, LocalGPU] = {}
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "")).removeprefix("GPU-")
        gpu = by_uuid.get(uuid) or (gpus[i] if i < len(gpus) else None)
        if gpu is None:
            notes.append(f"torch device {i} ({props.name}) has no NVML match")
            continue
        free, total = torch.cuda.mem_get_info(i)
        if total != gpu.total_bytes:
            notes.append(
                f"GPU {gpu.index}: NVML total {gpu.total_bytes} B, torch.cuda total {total} B"
            )
        out[gpu.uuid] = LocalGPU(
            **{**asdict_shallow(gpu), "torch_free_total": (int(free), int(total))}
        )
    return [out.get(g.uuid, g) for g in gpus], notes


def asdict_shallow(obj: Any) -> dict[str, Any]:
    """Dataclass fields without recursing (asdict would turn nested dataclasses into dicts)."""
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


def process_used_bytes(pid: int | None = None) -> dict[int, int | None]:
    """Device memory that NVML attributes to process ``pid`` (default: this one), by GPU index.

    It includes what PyTorch's caching allocator cannot see: the CUDA context, cuBLAS/cuDNN
    workspaces, NCCL buffers. Empty on a machine without NVML.
    """
    pid = os.getpid() if pid is None else pid
    try:
        nvml = _nvml()
    except RuntimeError:
        return {}
    errors = _errors(nvml)
    out: dict[int, int | None] = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except errors:
                continue
            for p in _processes(nvml, handle):
                if p.pid == pid:
                    out[i] = p.used_bytes
    except errors:
        pass  # what was read so far stands; the caller falls back where this GPU is missing
    finally:
        nvml.nvmlShutdown()
    return out


def host_available_bytes() -> int:
    """Memory a new allocation can get on this host: ``MemAvailable`` of ``/proc/meminfo`` (free
    plus reclaimable page cache), lowered to a cgroup's ``memory.max`` less its usage where a
    container sets one; ``SC_AVPHYS_PAGES`` (free pages only) where /proc is absent."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:  # cgroup v2: the container's limit binds before the host runs out
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read().strip())
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(avail)


def available_bytes(device: str = "cpu") -> tuple[int, str]:
    """``(bytes, where)``: what a new allocation can get on ``device`` (``cpu`` or ``cuda[:i]``)
    and a description of the figure. CUDA asks torch (free device memory, which creates a
    context); without a usable device it raises ``ValueError``."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{device}: torch sees no usable CUDA device")
        index = torch.device(device).index or 0
        free, _ = torch.cuda.mem_get_info(index)
        return int(free), f"free on cuda:{index}"
    return host_available_bytes(), "available host memory (MemAvailable)"
