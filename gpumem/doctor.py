"""`gpumem doctor`: what this machine is, what gpumem can use on it, and how fast its memory,
checksums and disk are — measured in a few seconds, not quoted from a spec sheet."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpumem.units import format_bytes, format_rate

# what gpumem runs with (pyproject's dependencies and the planner's extra) and what only builds
# its native core (build-system requires): a missing build tool is no problem of an installed
# gpumem, nor a missing extra (said with its install line)
_PACKAGES = ("torch", "triton", "numba", "nvidia-ml-py", "numpy", "matplotlib", "rich")
_EXTRAS = {"numba": "optional: pip install 'gpumem[plan]' compiles large plan sweeps"}
_BUILD_PACKAGES = ("nanobind", "cmake", "ninja")


@dataclass
class Bandwidth:
    what: str
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class DoctorReport:
    versions: dict[str, str]
    """Python, gpumem and its runtime dependencies."""
    native: dict[str, Any]
    machine: dict[str, Any]
    gpus: dict[str, Any]
    bandwidth: list[Bandwidth] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    build: dict[str, str] = field(default_factory=dict)
    """The tools that build gpumem._C (only needed to rebuild it)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bandwidth"] = [{**asdict(b), "gb_per_s": round(b.gb_per_s, 3)} for b in self.bandwidth]
        return d

    def text(self) -> str:
        lines = ["gpumem doctor", "", "versions"]
        lines += [f"  {k:<14} {v}" for k, v in self.versions.items()]
        if self.build:
            lines += ["", "build tools (only to rebuild gpumem._C)"]
            lines += [f"  {k:<14} {v}" for k, v in self.build.items()]
        lines += ["", "native core (gpumem._C)"]
        lines += [f"  {k:<14} {v}" for k, v in self.native.items()]
        lines += ["", "machine"]
        lines += [f"  {k:<14} {v}" for k, v in self.machine.items()]
        lines += ["", "GPUs"]
        if self.gpus.get("has_gpu"):
            lines.append(
                f"  driver {self.gpus.get('driver_version')}, CUDA driver API "
                f"{self.gpus.get('cuda_driver_version')}"
            )
            for g in self.gpus["gpus"]:
                lines.append(
                    f"  [{g['index']}] {g['name']}: total {format_bytes(g['total_bytes'])}, "
                    f"used {format_bytes(g['used_bytes'])}, free {format_bytes(g['free_bytes'])}, "
                    f"{len(g['processes'])} process(es)"
                )
        else:
            lines.append(f"  none: {self.gpus.get('reason')}")
        for note in self.gpus.get("notes", ()):
            lines.append(f"  note: {note}")
        if self.bandwidth:
            lines += ["", "bandwidth (quick measurement, median of 3)"]
            for b in self.bandwidth:
                lines.append(f"  {b.what:<32} {format_rate(b.nbytes, b.seconds):>12}")
        if self.problems:
            lines += ["", "problems"] + [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "gpumem": _gpumem_version(),
        **_installed(_PACKAGES),
    }


def _installed(packages: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed" + (f" ({_EXTRAS[pkg]})" if pkg in _EXTRAS else "")
    return out


def _gpumem_version() -> str:
    from gpumem._version import __version__

    return __version__


def _native(problems: list[str]) -> dict[str, Any]:
    try:
        from gpumem import _native, checksum

        cuda = _native.cuda_runtime()
        feats = checksum.cpu_features()
        return {
            "extension": _native.load().__file__,
            "crc32c": feats.get("crc32c"),
            "crc32c fold": feats.get("crc32c_fold"),
            "threads": feats.get("threads"),
            "cuda runtime": cuda.message,
        }
    except ImportError as exc:
        problems.append(str(exc))
        return {"extension": "not built"}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux; platform's answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> dict[str, Any]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory": format_bytes(total)}


def _best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _bandwidth(nbytes: int, directory: str | None, problems: list[str]) -> list[Bandwidth]:
    import numpy as np

    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out = [Bandwidth("memcpy (1 thread)", nbytes, _best_of(lambda: np.copyto(dst, src)))]
    try:
        from gpumem import _native, checksum, writer

        native = _native.load()
        out.append(
            Bandwidth(
                "crc32c (1 thread)", nbytes, _best_of(lambda: native.crc32c(src, 0, threads=1))
            )
        )
        out.append(
            Bandwidth("crc32c (all threads)", nbytes, _best_of(lambda: checksum.crc32c(src)))
        )
        with tempfile.TemporaryDirectory(dir=directory, prefix="gpumem-doctor-") as tmp:
            path = os.path.join(tmp, "probe.bin")
            out.append(
                Bandwidth(
                    f"write+fsync ({tmp.rsplit('/', 1)[0] or '/'})",
                    nbytes,
                    _best_of(lambda: writer.write_file(path, [(0, src)], fsync=True)),
                )
            )
    except ImportError as exc:
        problems.append(f"native core unavailable, only memcpy measured: {exc}")
    except OSError as exc:
        problems.append(f"write probe failed in {directory or tempfile.gettempdir()}: {exc}")
    return out


def run_doctor(
    measure: bool = True, nbytes: int = 256 << 20, directory: str | None = None
) -> DoctorReport:
    """Collect the report. ``measure=False`` skips the bandwidth probes (a second or so each).

    Raises:
        ValueError: a probe size that is not positive or that this machine's memory cannot
            hold (the probes keep a source and a destination buffer of ``nbytes`` each).
    """
    from gpumem import device

    if measure:
        check_probe_size(nbytes)
    problems: list[str] = []
    report = DoctorReport(
        versions=_versions(),
        build=_installed(_BUILD_PACKAGES),
        native=_native(problems),
        machine=_machine(),
        gpus=device.query().to_dict(),
        problems=problems,
    )
    if measure:
        report.bandwidth = _bandwidth(nbytes, directory, problems)
        # asked of torch even when NVML sees no GPU: nvidia-ml-py may be missing where CUDA works
        report.bandwidth += gpu_bandwidth(nbytes, problems)
    return report


def check_probe_size(nbytes: int) -> None:
    """The probes hold two buffers of ``nbytes``: refuse sizes this host cannot hold."""
    from gpumem.device import host_available_bytes

    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"probe size must be a positive number of bytes, got {nbytes!r}")
    avail = host_available_bytes()
    if 2 * nbytes > avail:
        raise ValueError(
            f"probe size {format_bytes(nbytes)} needs {format_bytes(2 * nbytes)} of memory (a "
            f"source and a destination buffer) but {format_bytes(avail)} is available; use "
            f"--size {format_bytes(max(1 << 20, avail // 8)).replace(' ', '')} or less"
        )


def gpu_bandwidth(nbytes: int, problems: list[str], device: int = 0) -> list[Bandwidth]:
    """Device copies, pinned host copies and the Triton CRC32C on ``device``, timed with CUDA
    events (none without a usable CUDA device; failures are appended to ``problems``)."""
    try:
        import torch
    except ImportError:
        return []
    try:
        if not torch.cuda.is_available():
            return []
        dev = torch.device("cuda", device)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def timed(fn) -> float:
            fn()  # warm-up (and Triton compile)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(3):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return sorted(times)[1]

        from gpumem import checksum

        return [
            Bandwidth("GPU device-to-device copy", 2 * nbytes, timed(lambda: dst.copy_(src))),
            Bandwidth(
                "GPU device-to-host (pinned)",
                nbytes,
                timed(lambda: host.copy_(src, non_blocking=True)),
            ),
            Bandwidth(
                "GPU host-to-device (pinned)",
                nbytes,
                timed(lambda: src.copy_(host, non_blocking=True)),
            ),
            Bandwidth(
                "GPU crc32c (Triton)",
                nbytes,
                timed(lambda: checksum.chunk_crc32c(src, 1 << 20, backend="triton")),
            ),
        ]
    except Exception as exc:
        problems.append(f"GPU bandwidth probe failed: {type(exc).__name__}: {exc}")
        return []
