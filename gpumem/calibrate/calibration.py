"""``calibration.json``: what was measured on a machine, and the two ways the rest of gpumem uses
it.

The estimator and the planner never read this file themselves (the estimator stays a pure
function of its inputs): the planner asks :meth:`Calibration.checkpoint_times` for a checkpoint
size, and the estimator receives a GPU that :meth:`Calibration.apply_to` has given the measured
reserve.

The file is JSON, read as plain data (no pickle, nothing executed) and validated field by field
on load: known format and schema version, no unknown or duplicate keys, every number typed,
finite and non-negative. Anything else is a :class:`CalibrationError` naming the field.

Example:
    >>> cal = gpumem.calibrate.measure("/ckpts", sizes=[64 << 20, 256 << 20])  # doctest: +SKIP
    >>> cal.save("calibration.json")                                          # doctest: +SKIP
    >>> cal = gpumem.calibrate.load("calibration.json")                       # doctest: +SKIP
    >>> stall_s, persist_s, restore_s = cal.checkpoint_times(14 << 30)        # doctest: +SKIP
    >>> gpu = cal.apply_to(gpumem.estimator.find_gpu("H100-80GB"))            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumem import _strict_json as strict_json
from gpumem.calibrate._schema import REDO, CalibrationError, Fields, check_int, utc_now
from gpumem.calibrate.checkpoint_cost import (
    MAX_EXTRAPOLATION,
    CheckpointCost,
    measure_checkpoint,
)
from gpumem.calibrate.checkpoint_cost import QUANTITIES as _QUANTS
from gpumem.calibrate.memory import MemoryCalibration
from gpumem.calibrate.reserve import GpuReserve, ReportReserve, from_report, measure_gpu_reserve

FORMAT = "gpumem-calibration"
SCHEMA_VERSION = 2  # 2: the memory section; every section optional (version 1 files still read)
READABLE_VERSIONS = (1, 2)
MAX_FILE_BYTES = 16 << 20
STALL_MODES = ("overlap", "blocking")


@dataclass(frozen=True)
class Machine:
    """Where a calibration was measured."""

    host: str
    cpu: str
    cpu_count: int
    memory_bytes: int
    gpu: str | None

    @classmethod
    def this(cls, gpu: str | None = None) -> Machine:
        """This machine; ``gpu`` defaults to the first GPU NVML lists (no CUDA context made)."""
        from gpumem.doctor import cpu_model

        if gpu is None:
            from gpumem.device import query

            gpus = query().gpus
            gpu = gpus[0].name if gpus else None
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(
            host=platform.node(),
            cpu=cpu_model(),
            cpu_count=os.cpu_count() or 1,
            memory_bytes=int(mem),
            gpu=gpu,
        )

    @classmethod
    def from_fields(cls, f: Fields) -> Machine:
        out = cls(
            host=f.str("host"),
            cpu=f.str("cpu"),
            cpu_count=f.int("cpu_count", minimum=1),
            memory_bytes=f.int("memory_bytes", minimum=1),
            gpu=f.str("gpu", optional=True),
        )
        f.done()
        return out


@dataclass(frozen=True)
class Calibration:
    """Measured coefficients of one machine and its checkpoint storage.

    Attributes:
        created_utc: when it was measured (ISO 8601, UTC).
        machine: host name, CPU, cores, RAM, GPU name.
        versions: python, torch, gpumem.
        checkpoint: the checkpoint cost lines (None if not measured).
        gpu_reserve: context bytes and pinned bandwidth of a CUDA device (None if not measured).
        report: fragmentation and outside-allocator memory from a profile of the user's own
            training step (None if none was given).
        memory: the estimator's fitted per-architecture coefficients (``gpumem calibrate
            --memory``; None if not fitted).
    """

    created_utc: str
    machine: Machine
    versions: dict[str, str]
    checkpoint: CheckpointCost | None = None
    gpu_reserve: GpuReserve | None = None
    report: ReportReserve | None = None
    memory: MemoryCalibration | None = None
    schema_version: int = SCHEMA_VERSION
    path: str | None = field(default=None, compare=False)
    """The file it was loaded from (None when measured in this process); not part of it."""

    # -- consumers -----------------------------------------------------------------------------
    def checkpoint_times(self, nbytes: int, mode: str = "overlap") -> tuple[float, float, float]:
        """Predicted ``(stall_s, persist_s, restore_s)`` of a checkpoint of ``nbytes`` tensor bytes.

        Args:
            nbytes: what one rank saves (weights and optimizer state on that GPU).
            mode: the stall of ``"overlap"`` saves (the Checkpointer's default with an optimizer;
                measured in its worst case, optimizer.step() right after save()) or ``"blocking"``.

        Raises:
            CalibrationError: no checkpoint measurement in this calibration, or bad arguments.
        """
        if self.checkpoint is None:
            raise CalibrationError(
                "this calibration has no checkpoint measurement: run `gpumem calibrate --dir DIR`"
            )
        n = check_int(nbytes, "nbytes")
        if mode not in STALL_MODES:
            raise CalibrationError(f"mode={mode!r}: use 'overlap' or 'blocking'")
        p = self.checkpoint.predict(n)
        return p[f"{mode}_stall_s"], p["durable_s"], p["restore_s"]

    def context_bytes(self) -> tuple[int | None, str]:
        """Measured memory outside the allocator and its source: the profile report's when it
        is one process's per-process NVML figure (the user's own step, libraries included),
        else the probe's (context and cuBLAS handles after a matmul); ``(None, "")`` if neither."""
        if self.report is not None and self.report.context_bytes is not None:
            return self.report.context_bytes, "profile report (outside the allocator)"
        if self.gpu_reserve is not None:
            return self.gpu_reserve.context_bytes, f"probe on {self.gpu_reserve.device_name}"
        return None, ""

    def apply_to(self, gpu: Any) -> Any:
        """``gpu`` (an estimator ``GPU``) with the measured reserve; fields not measured stay.

        ``context_bytes`` from :meth:`context_bytes`, ``fragmentation`` from the profile report.
        NCCL buffers are never replaced (no single-process measurement isolates them).
        """
        changes: dict[str, Any] = {}
        ctx, _ = self.context_bytes()
        if ctx is not None:
            changes["context_bytes"] = ctx
        if self.report is not None:
            changes["fragmentation"] = self.report.fragmentation
        return dataclasses.replace(gpu, **changes) if changes else gpu

    def origin(self) -> str:
        """Where the numbers come from, for messages: ``FILE (measured DATE on HOST)``."""
        where = self.path or "calibration"
        return f"{where} (measured {self.created_utc} on {self.machine.host})"

    def reserve_line(self, gpu: Any) -> str:
        """Which reserve numbers of ``gpu`` (as :meth:`apply_to` made it) were measured."""
        from gpumem.units import format_bytes

        ctx, source = self.context_bytes()
        ctx_src = f"measured: {source}" if ctx is not None else "default"
        frag_src = "measured: profile report" if self.report else "default"
        parts = (
            f"context {format_bytes(gpu.context_bytes)} ({ctx_src})",
            f"fragmentation {gpu.fragmentation:.2%} ({frag_src})",
            f"NCCL {format_bytes(gpu.nccl_bytes)} (default)",
        )
        return f"GPU reserve of {gpu.name} from {self.origin()}: " + ", ".join(parts)

    def with_report(self, report: Any) -> Calibration:
        """A copy holding :func:`from_report` of ``report`` (a Report, its dict, or its JSON
        path)."""
        return dataclasses.replace(self, report=from_report(report))

    def table(self) -> str:
        """The readable summary ``gpumem calibrate`` prints."""
        return table(self)

    # -- file format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "schema_version": self.schema_version,
            "created_utc": self.created_utc,
            "machine": dataclasses.asdict(self.machine),
            "versions": dict(self.versions),
            "checkpoint": self.checkpoint.to_dict() if self.checkpoint else None,
            "gpu_reserve": self.gpu_reserve.to_dict() if self.gpu_reserve else None,
            "report": self.report.to_dict() if self.report else None,
            "memory": self.memory.to_dict() if self.memory else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file atomically (temporary file, fsync, rename); returns its path."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def from_dict(cls, data: Any) -> Calibration:
        """Validate and build; every problem is a CalibrationError naming the field."""
        if not isinstance(data, dict):
            raise CalibrationError(
                f"not a calibration file: expected a JSON object at the top; {REDO}"
            )
        f = Fields(data, "")
        if data.get("format") != FORMAT:
            raise CalibrationError(
                f"format: {data.get('format')!r} is not {FORMAT!r}: not a gpumem calibration "
                f"file; {REDO}"
            )
        f.str("format")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise CalibrationError(
                f"schema_version: {version!r}; this gpumem reads "
                f"{', '.join(map(str, READABLE_VERSIONS))}: {REDO}"
            )
        f.int("schema_version")
        created = f.timestamp("created_utc")
        machine = Machine.from_fields(f.obj("machine"))  # type: ignore[arg-type]
        versions = f.str_map("versions")
        parts = {
            name: f.obj(name, optional=True)
            for name in ("checkpoint", "gpu_reserve", "report", "memory")
        }
        f.done()
        out = cls(
            created_utc=created,
            machine=machine,
            versions=versions,
            checkpoint=CheckpointCost.from_fields(parts["checkpoint"])
            if parts["checkpoint"]
            else None,
            gpu_reserve=GpuReserve.from_fields(parts["gpu_reserve"])
            if parts["gpu_reserve"]
            else None,
            report=ReportReserve.from_fields(parts["report"]) if parts["report"] else None,
            memory=MemoryCalibration.from_fields(parts["memory"]) if parts["memory"] else None,
        )
        if all(x is None for x in (out.checkpoint, out.gpu_reserve, out.report, out.memory)):
            raise CalibrationError(
                "the file holds no measurement (checkpoint, gpu_reserve, report, memory: null); "
                f"{REDO}"
            )
        return out

    @classmethod
    def from_json(cls, text: str | bytes) -> Calibration:
        try:
            data = strict_json.loads(text)
        except (
            ValueError,
            RecursionError,
        ) as exc:  # bad JSON or UTF-8, duplicate keys, NaN, nesting
            raise CalibrationError(f"not valid JSON: {str(exc)[:200]}; {REDO}") from None
        return cls.from_dict(data)


def load(path: str | os.PathLike) -> Calibration:
    """Read and validate a calibration file.

    Raises:
        CalibrationError: missing, too large, not JSON, or any field invalid (the message starts
            with the path and names the field).
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CalibrationError(
                f"{size} bytes, more than a calibration file holds ({MAX_FILE_BYTES}); {REDO}"
            )
        raw = p.read_bytes()
    except CalibrationError as exc:
        raise CalibrationError(f"{p}: {exc}") from None
    except OSError as exc:
        raise CalibrationError(
            f"{p}: cannot read the calibration file ({exc.strerror or exc}); "
            "write one with `gpumem calibrate --out FILE`"
        ) from None
    try:
        return dataclasses.replace(Calibration.from_json(raw), path=str(p))
    except CalibrationError as exc:
        raise CalibrationError(f"{p}: {exc}") from None


def memory_section(calibration: Any) -> MemoryCalibration:
    """The memory section of a calibration: a file path, a :class:`Calibration`, or the
    section itself.

    Raises:
        CalibrationError: an unreadable file, or one without a memory section (naming the
            command that writes one).
    """
    if isinstance(calibration, MemoryCalibration):
        return calibration
    cal = calibration if isinstance(calibration, Calibration) else load(calibration)
    if cal.memory is None:
        raise CalibrationError(
            "this calibration has no memory section: run `gpumem calibrate --memory --arch "
            "FAMILY` (or --config config.json) to fit the estimator's coefficients"
        )
    return cal.memory


def split_calibration(
    calibration: Any,
) -> tuple[Calibration | None, MemoryCalibration | None]:
    """(the whole calibration, its memory section) from a Calibration, a path, a memory
    section alone (a fit in hand: no reserve, no checkpoint times), or None."""
    if isinstance(calibration, MemoryCalibration):
        return None, calibration
    cal = as_calibration(calibration)
    return cal, cal.memory if cal is not None else None


def as_calibration(calibration: Calibration | str | os.PathLike | None) -> Calibration | None:
    """A Calibration from itself, a file path (:func:`load`), or None."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, os.PathLike)):
        return load(calibration)
    raise TypeError(
        f"calibration must be a Calibration or the path of a calibration.json, got "
        f"{type(calibration).__name__}"
    )


def versions() -> dict[str, str]:
    """python, torch and gpumem versions (torch's from its metadata unless already imported)."""
    from gpumem._version import __version__

    torch_v = getattr(sys.modules.get("torch"), "__version__", None)
    if torch_v is None:
        import importlib.metadata  # here: its import (email, zipfile) costs every CLI run 0.1 s

        try:
            torch_v = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_v = "not installed"
    return {"python": platform.python_version(), "torch": str(torch_v), "gpumem": __version__}


def measure(
    directory: str | os.PathLike = ".",
    sizes: Any = None,
    *,
    device: str = "cpu",
    repeat: int = 5,
    gpu_reserve: bool | None = None,
    report: Any = None,
    **checkpoint_kwargs: Any,
) -> Calibration:
    """Measure this machine: the GPU reserve first (CUDA, before anything else loads), then the
    checkpoint cost in ``directory``; optionally read a profile report.

    Args:
        directory / sizes / device / repeat: see :func:`measure_checkpoint` (default sizes:
            ``default_sizes``, up to 2 GiB as this host's free memory allows).
        gpu_reserve: measure the GPU reserve (default: when ``device="cuda"``).
        report: a CUDA ``gpumem.profile`` report (object, dict or JSON path): see
            :func:`from_report`.
        checkpoint_kwargs: passed to :func:`measure_checkpoint` (tensors, warmup, staging_bytes,
            ...).
    """
    rep = (
        from_report(report) if report is not None else None
    )  # bad input fails before minutes of work
    reserve = (
        measure_gpu_reserve()
        if (device == "cuda" if gpu_reserve is None else gpu_reserve)
        else None
    )
    cost = measure_checkpoint(directory, sizes, device=device, repeat=repeat, **checkpoint_kwargs)
    return Calibration(
        created_utc=utc_now(),
        machine=Machine.this(reserve.device_name if reserve else None),
        versions=versions(),
        checkpoint=cost,
        gpu_reserve=reserve,
        report=rep,
    )


def table(cal: Calibration) -> str:
    """A readable summary: what was measured where, the raw medians and the fitted lines."""
    from gpumem.units import format_bytes

    m = cal.machine
    head = (
        f"calibration {cal.created_utc} on {m.host} ({m.cpu}, {m.cpu_count} cores, "
        f"{format_bytes(m.memory_bytes)} RAM, {m.gpu or 'no GPU'}); "
        + ", ".join(f"{k} {val}" for k, val in cal.versions.items())
    )
    lines = [head]
    if cal.memory is not None:
        mem = cal.memory
        lines += [
            "",
            f"estimator memory fit for {mem.arch} on {mem.device} ({mem.mode} profiles, "
            f"{len(mem.points)} proxy runs): measured = coefficient x estimated",
            *(
                f"  {c:<14}{fit.coefficient:>8.4f}   residual {fit.residual_pct:.2f} %"
                for c, fit in mem.fits.items()
            ),
        ]
        if mem.fragmentation is not None:
            lines.append(f"  fragmentation {mem.fragmentation:.2%}")
    if cal.checkpoint is not None:
        lines += ["", *_checkpoint_lines(cal.checkpoint)]
    r = cal.gpu_reserve
    if r is not None:
        rates = (("pinned D2H", r.d2h_gb_per_s), ("H2D", r.h2d_gb_per_s))
        bw = "".join(f"; {k} {x:.2f} GB/s" for k, x in rates if x is not None)
        ctx = f"context {format_bytes(r.context_bytes)} ({r.context_source})"
        lines += [
            "",
            f"GPU reserve ({r.device_name}): {ctx}{bw}",
            *(f"  note: {n}" for n in r.notes),
        ]
    rep = cal.report
    if rep is not None:
        out = (
            "unknown"
            if rep.outside_allocator_bytes is None
            else format_bytes(rep.outside_allocator_bytes)
        )
        frag = (
            f"fragmentation {rep.fragmentation:.2%} ({format_bytes(rep.fragmentation_bytes)} "
            f"over an allocated peak of {format_bytes(rep.allocated_peak_bytes)})"
        )
        outside = f"outside the allocator {out} ({rep.outside_allocator_source})"
        lines += ["", f"profile report ({rep.device}): {frag}; {outside}"]
    return "\n".join(lines)


_LABELS = {
    "blocking_stall_s": "blocking stall",
    "overlap_stall_s": "overlap stall*",
    "durable_s": "durable",
    "restore_s": "restore",
}


def _checkpoint_lines(c: CheckpointCost) -> list[str]:
    from gpumem.units import format_bytes

    widths = (16, 16, 10, 10)
    where = f"{c.directory} ({c.filesystem or 'file system unknown'})"
    lines = [
        f"checkpoint cost in {where}, tensors on {c.device}, median of {c.repeat}",
        f"  {'state':>12}{'tensors':>9}"
        + "".join(f"{_LABELS[q]:>{w}}" for q, w in zip(_QUANTS, widths, strict=True)),
    ]
    for p in c.points:
        cells = "".join(
            f"{p.median(q):>{w - 2}.3f} s" for q, w in zip(_QUANTS, widths, strict=True)
        )
        modes = (p.blocking_mode, p.overlap_mode)
        note = "" if modes == ("blocking", "overlap") else f"  (modes: {', '.join(modes)})"
        lines.append(f"  {format_bytes(p.nbytes):>12}{p.tensors:>9}{cells}{note}")
    lines.append(
        f"  {'fit: seconds = a + b * bytes':<30}{'a (s)':>10}{'b (s/GiB)':>12}"
        f"{'GB/s':>9}{'rms (s)':>10}"
    )
    for q in _QUANTS:
        f = c.fits[q]
        gbps = f"{f.gb_per_s:.2f}" if f.gb_per_s else "-"
        lines.append(
            f"  {_LABELS[q]:<30}{f.intercept_s:>10.4f}{f.seconds_per_byte * 2**30:>12.4f}{gbps:>9}"
            f"{f.rms_residual_s:>10.4f}"
        )
    lines.append(
        "  * overlap: save() plus the optimizer pre-step hook's wait with optimizer.step() "
        "right after save(), its worst case; a real forward/backward hides part of it"
    )
    reach = format_bytes(int(MAX_EXTRAPOLATION * c.largest_bytes))
    lines.append(
        f"  predictions are checked up to {MAX_EXTRAPOLATION:g}x the largest size ({reach}); "
        "the planner says when a checkpoint is larger"
    )
    return lines
