"""What a profile says, in the forms people read: table, Markdown, JSON, PNG, Chrome trace.

All numbers are integer bytes; only the text renderings convert to binary units (with the unit
printed). The JSON carries ``schema_version``; bump it when a field changes meaning.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpumem.profiler.categories import (
    ACTIVATIONS,
    BACKWARD,
    CATEGORIES,
    COMMUNICATION,
    FORWARD,
    GRADIENTS,
    OPTIMIZER,
    OPTIMIZER_PHASE,
    PHASES,
    TEMPORARY,
    WEIGHTS,
)
from gpumem.profiler.records import ProfileRecord, StepAcc, ancestors
from gpumem.units import format_bytes

# 2: ``mode``/``measured``; temporaries are null where not measured. 3: ``communication`` (a
# category, a layer column and a timeline series). 4: ``extrapolated``
SCHEMA_VERSION = 4
_READS = (1, 2, 3, 4)
_LAYER_CATS = (WEIGHTS, GRADIENTS, OPTIMIZER, ACTIVATIONS, COMMUNICATION, TEMPORARY)


@dataclass
class LayerStats:
    """Bytes of one module, rolled up over its children (the maximum over steps)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    communication: int = 0
    """The most communication bytes of the module and its children alive at once (FSDP units'
    gathered parameters, gather and reduce-scatter buffers; not a sum over children)."""
    temporary: int | None = 0
    """Largest of ``forward_temporary`` and ``backward_temporary``; ``None`` where not measured
    (light mode on CPU)."""
    forward_temporary: int | None = 0
    backward_temporary: int | None = 0
    allocated_peak_delta: int | None = None
    """CUDA only: allocator allocated-bytes peak above the level at entry (hook resolution)."""
    reserved_peak_delta: int | None = None

    @property
    def total(self) -> int:
        """Sum of the measured categories (``temporary`` only where measured)."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.communication
            + (self.temporary or 0)
        )

    def _max(self, other: LayerStats) -> None:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if b is not None and (a is None or b > a):
                setattr(self, f.name, b)


@dataclass
class StepReport:
    """One optimizer step (or one forward/backward without an optimizer)."""

    index: int
    peak: int
    at_peak: dict[str, int | None]
    peak_phase: str
    forward_peak: int | None
    backward_peak: int | None
    optimizer_peak: int | None
    forwards: int
    backwards: int
    layers: dict[str, LayerStats]
    allocator: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """The result of a ``gpumem.profile`` region.

    Example:
        >>> rep = prof.report()
        >>> rep.peak_bytes, rep.at_peak["optimizer"], rep.steps[1].backward_peak
        >>> rep.layers["layers.0"].activations
        >>> print(rep.table()); rep.to_json("profile.json"); rep.plot("profile.png")
    """

    peak_bytes: int
    """Peak live bytes. Light mode on CPU: the peak of the measured categories only."""
    at_peak: dict[str, int | None]
    peak_step: int
    peak_phase: str
    steps: list[StepReport]
    layers: dict[str, LayerStats]
    model: str
    device: str
    fake: bool
    estimate: bool
    assumptions: list[str]
    error: str | None = None
    allocator: dict[str, Any] | None = None
    timeline: dict[str, list[int]] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)
    rank: int | None = None
    world_size: int | None = None
    mode: str = "exact"
    """``"exact"`` (dispatch mode, every op) or ``"light"`` (hook boundaries only)."""
    measured: list[str] = field(default_factory=lambda: list(CATEGORIES))
    """The categories measured; the others are ``None`` (light mode on CPU: ``temporary``)."""
    peak_reserved_bytes: int | None = None
    """What PyTorch's CUDA caching allocator would reserve at its peak for this region's
    storages (``reserved_bytes.all.peak`` from the region's start), simulated on any device
    (``gpumem.allocator``; exact mode only, else ``None``)."""
    simulated_allocator: dict[str, Any] | None = None
    """The simulation behind ``peak_reserved_bytes``: allocated peak, fragmentation and the
    largest free block at the peak, segments, the ``alloc_conf`` it followed."""
    extrapolated: dict[str, Any] | None = None
    """Set when the figures come from profiles of the same model with fewer identical blocks
    (``gpumem.profiler.extrapolate``): ``blocks`` (N), ``module`` (their list),
    ``profiled_blocks``; such a report has no timeline or spans."""
    schema_version: int = SCHEMA_VERSION

    # -- machine-readable ----------------------------------------------------------------------
    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """Plain JSON-able dict (integer bytes); ``timeline=False`` drops the time series."""
        d = asdict(self)
        if not timeline:
            d["timeline"], d["spans"] = {}, []
        return d

    def to_json(self, path: str | Path | None = None, timeline: bool = True) -> str:
        """The JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(timeline), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """Rebuild a report from ``to_dict``/JSON (plain data only, no code runs).

        Versions 1 and 2 predate ``communication``: it reads as 0, as it was then (sharded
        models could not be profiled)."""
        version = d.get("schema_version")
        if version not in _READS:
            raise ValueError(
                f"profile JSON has schema_version {version!r}, this gpumem reads "
                f"{', '.join(map(str, _READS))}; re-run the profile with this version"
            )
        d = {**d, "schema_version": SCHEMA_VERSION}  # version 1 is version 2 in exact mode
        if version < 3:
            d["at_peak"] = _ordered(d["at_peak"])
            d["steps"] = [{**s, "at_peak": _ordered(s["at_peak"])} for s in d["steps"]]
            if "measured" in d:
                d["measured"] = [c for c in CATEGORIES if c in d["measured"] or c == COMMUNICATION]
        d["layers"] = {k: LayerStats(**v) for k, v in d["layers"].items()}
        d["steps"] = [
            StepReport(**{**s, "layers": {k: LayerStats(**v) for k, v in s["layers"].items()}})
            for s in d["steps"]
        ]
        return cls(**d)

    # -- human-readable ------------------------------------------------------------------------
    def _rows(self, depth: int | None) -> list[tuple[str, LayerStats]]:
        return [
            (name, st)
            for name, st in self.layers.items()
            if depth is None or (0 if name == "" else name.count(".") + 1) <= depth
        ]

    def table(self, depth: int | None = 2, unit: str | None = None) -> str:
        """Text table: one row per module (down to ``depth`` levels), one column per category."""
        head = self._headline()
        cols = ["layer", *_LAYER_CATS]
        rows = [
            [name or "(model)", *(_fmt(getattr(st, c), unit) for c in _LAYER_CATS)]
            for name, st in self._rows(depth)
        ]
        widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]

        def line(r: list[Any] | tuple[Any, ...]) -> str:
            return "  ".join(
                str(v).ljust(w) if i == 0 else str(v).rjust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=True))
            )

        return "\n".join(
            [*head, "", line(cols), "  ".join("-" * w for w in widths), *map(line, rows)]
        )

    def _headline(self) -> list[str]:
        tags = [self.device] + (["estimate"] if self.estimate else [])
        if self.mode != "exact":
            tags.append(f"{self.mode} mode")
        what = "peak" if TEMPORARY in self.measured else "peak of measured categories"
        out = [
            f"gpumem profile of {self.model} ({', '.join(tags)}): {what} "
            f"{format_bytes(self.peak_bytes)} ({self.peak_bytes} B) in step {self.peak_step}, "
            f"{self.peak_phase}",
            "at peak: " + ", ".join(f"{c} {_fmt(v)}" for c, v in self.at_peak.items()),
        ]
        if TEMPORARY not in self.measured:
            out.append("temporaries not measured (light mode on CPU; use mode='exact' for them)")
        for s in self.steps:
            parts = [
                f"{p} {format_bytes(v)}"
                for p, v in (
                    (FORWARD, s.forward_peak),
                    (BACKWARD, s.backward_peak),
                    (OPTIMIZER_PHASE, s.optimizer_peak),
                )
                if v is not None
            ]
            out.append(f"step {s.index}: peak {format_bytes(s.peak)} ({'; '.join(parts)})")
        if self.allocator:
            a = self.allocator
            out.append(
                f"allocator: allocated peak {format_bytes(a['allocated_peak'])}, reserved peak "
                f"{format_bytes(a['reserved_peak'])}, fragmentation at peak "
                f"{format_bytes(a['fragmentation_at_peak'])}, outside allocator "
                + (
                    format_bytes(a["outside_allocator"])
                    if a.get("outside_allocator") is not None
                    else "unknown"
                )
            )
        sim = self.simulated_allocator
        if sim is not None:
            conf = sim.get("alloc_conf") or "default"
            out.append(
                f"reserved (simulated caching allocator, alloc_conf {conf}): peak "
                f"{format_bytes(sim['peak_reserved_bytes'])}, allocated peak "
                f"{format_bytes(sim['peak_allocated_bytes'])}, fragmentation at peak "
                f"{format_bytes(sim['fragmentation_bytes'])}, largest free block "
                f"{format_bytes(sim['largest_free_block_bytes'])}"
            )
        out += [f"assumption: {a}" for a in self.assumptions]
        ext = self.extrapolated
        if ext:
            counts = ", ".join(map(str, ext["profiled_blocks"]))
            out.append(
                f"extrapolated: {ext['blocks']} identical blocks ({ext['module']}) from profiles "
                f"of the model with {counts} of them (timeline periodic, other figures affine in "
                "the block count: checked); no timeline"
            )
        if self.error:
            out.append(f"region raised {self.error}; numbers cover the run up to that point")
        return out

    def to_markdown(self, depth: int | None = 2) -> str:
        """Markdown for pull requests: headline, categories at the peak, steps, layers."""
        md = [f"### Memory profile: {self.model}", ""]
        md += [f"- {line}" for line in self._headline()]
        md += ["", "| category | bytes at peak | |", "|---|---:|---:|"]
        md += [f"| {c} | {'-' if v is None else v} | {_fmt(v)} |" for c, v in self.at_peak.items()]
        md += [
            "",
            "| step | forward peak | backward peak | optimizer peak | peak |",
            "|---:|---:|---:|---:|---:|",
        ]
        for s in self.steps:
            cells = [
                _fmt(v) if v is not None else "-"
                for v in (s.forward_peak, s.backward_peak, s.optimizer_peak, s.peak)
            ]
            md.append(f"| {s.index} | " + " | ".join(cells) + " |")
        md += [
            "",
            "| layer | " + " | ".join(_LAYER_CATS) + " |",
            "|---|" + "---:|" * len(_LAYER_CATS),
        ]
        for name, st in self._rows(depth):
            md.append(
                f"| `{name or '(model)'}` | "
                + " | ".join(_fmt(getattr(st, c)) for c in _LAYER_CATS)
                + " |"
            )
        return "\n".join(md) + "\n"

    def plot(self, path: str | Path, depth: int | None = None) -> Path:
        """PNG: stacked per-layer bars (left) and memory over time with phase bands (right).

        Args:
            depth: the modules drawn as bars. Default: the repeated blocks and the modules
                around them (embedding, final norm, head), however deep a wrapper puts them;
                a number: the module tree cut at that depth (the modules there, and shallower
                ones without children).
        """
        from gpumem.profiler.pictures import plot_report

        return plot_report(self, Path(path), depth)

    def to_memory_snapshot(self, path: str | Path) -> Path:
        """PyTorch's memory-snapshot pickle for https://pytorch.org/memory_viz: the timeline
        replayed as synthetic allocations labelled by step and phase (see
        ``gpumem.profiler.memory_viz`` for what it does and does not contain)."""
        from gpumem.profiler.memory_viz import write_memory_snapshot

        return write_memory_snapshot(self, Path(path))

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto trace JSON: a memory counter, phase spans and module spans."""
        from gpumem.profiler.pictures import chrome_trace

        path = Path(path)
        path.write_text(json.dumps(chrome_trace(self)))
        return path


def _fmt(n: int | None, unit: str | None = None) -> str:
    return "-" if n is None else format_bytes(n, unit)


def _rollup(names: list[str], direct: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(names, 0)
    for k, v in direct.items():
        for a in ancestors(k):
            if a in out:
                out[a] += v
    return out


def _step_layers(prof: ProfileRecord, step: StepAcc) -> dict[str, LayerStats]:
    names = prof.module_names
    weights = _rollup(names, prof.weights)
    grads = _rollup(names, step.gradients)
    opt = _rollup(names, step.optimizer)
    acts = _rollup(names, step.activations)
    alloc = step.allocator.get("layers", {})
    measured = prof.measures_temporary
    fwd_t, bwd_t = dict(step.fwd_temp), dict(step.bwd_temp)
    # containers that are never called themselves (ModuleList) show their busiest child
    for n in sorted(names, key=lambda k: -k.count(".") if k else 1):
        if n and n not in fwd_t and n not in bwd_t:
            kids = [k for k in names if k.startswith(n + ".") and k.count(".") == n.count(".") + 1]
            fwd_t[n] = max((fwd_t.get(k, 0) for k in kids), default=0)
            bwd_t[n] = max((bwd_t.get(k, 0) for k in kids), default=0)
    out = {}
    for n in names:
        ft, bt = (fwd_t.get(n, 0), bwd_t.get(n, 0)) if measured else (None, None)
        a = alloc.get(n)
        out[n] = LayerStats(
            weights=weights[n],
            gradients=grads[n],
            optimizer=opt[n],
            activations=acts[n],
            communication=step.communication.get(n, 0),
            temporary=max(ft, bt) if measured else None,
            forward_temporary=ft,
            backward_temporary=bt,
            allocated_peak_delta=a["allocated_peak_delta"] if a else None,
            reserved_peak_delta=a["reserved_peak_delta"] if a else None,
        )
    return out


def build_report(prof: ProfileRecord) -> Report:
    """Roll a profile's raw per-step record up into a :class:`Report`."""
    steps = []
    layers: dict[str, LayerStats] = {}
    for s in prof.steps:
        sl = _step_layers(prof, s)
        for n, st in sl.items():
            if n in layers:
                layers[n]._max(st)
            else:
                layers[n] = LayerStats(**asdict(st))
        pp = s.phase_peak
        steps.append(
            StepReport(
                index=s.index,
                peak=s.peak.bytes,
                at_peak=_ordered(s.peak.at),
                peak_phase=s.peak.phase,
                forward_peak=pp[FORWARD],
                backward_peak=pp[BACKWARD],
                optimizer_peak=pp[OPTIMIZER_PHASE],
                forwards=s.forwards,
                backwards=s.backwards,
                layers=sl,
                allocator=dict(s.allocator.get("phases", {})),
            )
        )
    ts, lv, ph, st, cm = prof.timeline
    t0 = prof.t_start
    timeline = {
        "t_ns": [t - t0 for t in ts],
        "bytes": list(lv),
        "phase": list(ph),
        "step": list(st),
        "communication": list(cm),
    }
    spans = [
        {"module": m, "phase": p, "start_ns": a - t0, "end_ns": b - t0, "step": k}
        for m, p, a, b, k in prof.spans
    ]
    fake = prof.fake
    devices = prof.device_types or ["cpu"]
    rank, world = _rank()
    return Report(
        peak_bytes=prof.peak.bytes,
        at_peak=_ordered(prof.peak.at),
        peak_step=prof.peak.step,
        peak_phase=prof.peak.phase,
        steps=steps,
        layers=layers,
        model=prof.model_name,
        device="+".join(devices) + (" (fake)" if fake else ""),
        fake=fake,
        estimate=bool(prof.assumptions),
        assumptions=list(prof.assumptions),
        error=prof.error,
        allocator=prof.allocator,
        timeline=timeline,
        spans=spans,
        rank=rank,
        world_size=world,
        mode=prof.mode,
        measured=prof.measured,
        peak_reserved_bytes=None if prof.reserved is None else prof.reserved["peak_reserved_bytes"],
        simulated_allocator=prof.reserved,
    )


def _ordered(at: dict[str, int | None]) -> dict[str, int | None]:
    return {c: None if at.get(c, 0) is None else int(at.get(c, 0)) for c in CATEGORIES}


def _rank() -> tuple[int | None, int | None]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, None


__all__ = ["PHASES", "SCHEMA_VERSION", "LayerStats", "Report", "StepReport", "build_report"]
