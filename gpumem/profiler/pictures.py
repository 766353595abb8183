"""Pictures of a report: a matplotlib PNG and a Chrome/Perfetto trace.

matplotlib is imported when a picture is drawn, not with the module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from gpumem._plots import pyplot
from gpumem.profiler.categories import CATEGORIES, PHASES


class ReportLike(Protocol):
    """What a picture reads of a report (``report.Report`` has it all).

    Typed by shape rather than by import: ``Report.plot`` calls into this module, so this module
    must not import ``report`` back.
    """

    model: str
    device: str
    fake: bool
    mode: str
    estimate: bool
    peak_bytes: int
    measured: list[str]
    layers: dict[str, Any]
    """``LayerStats`` by module: the categories as attributes, and ``total``."""
    timeline: dict[str, list[int]]
    spans: list[dict[str, Any]]
    schema_version: int


_COLORS = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#e15759",
    "activations": "#76b7b2",
    "communication": "#59a14f",
    "temporary": "#edc948",
    "inputs": "#b07aa1",
}
_PHASE_COLORS = {"forward": "#d4e6f1", "backward": "#fadbd8", "optimizer": "#d5f5e3"}
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
DPI = 110


def _unit(n: int) -> tuple[str, int]:
    for name, scale in _UNITS:
        if n >= scale:
            return name, scale
    return "B", 1


def _bar_layers(rep: ReportLike, depth: int | None) -> list[str]:
    """Modules drawn as bars.

    Default: every module on the way down to a numbered container (a ModuleList or Sequential
    of blocks) is replaced by its children and the container by its blocks, so the bars are
    the repeated blocks *and* what surrounds them (embedding, final norm, head), however deep
    a wrapper (``model.layers`` of a transformers model) puts them. With ``depth``: the tree
    cut there, the modules at that depth and the shallower ones that have no children.
    """
    names = [n for n in rep.layers if n]
    kids: dict[str, list[str]] = {}
    for n in names:
        kids.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(n)
    if depth is not None:
        level = {n: n.count(".") + 1 for n in names}
        cut = [n for n in names if level[n] == depth or (level[n] < depth and n not in kids)]
        return cut or [""]

    def numbered(n: str) -> bool:
        ks = kids.get(n, [])
        return 0 < len(ks) <= 96 and all(k.rsplit(".", 1)[1].isdigit() for k in ks)

    def has_blocks(n: str) -> bool:
        return numbered(n) or any(has_blocks(k) for k in kids.get(n, []))

    def expand(n: str) -> list[str]:
        if numbered(n):
            return kids[n]
        if has_blocks(n):
            return [x for k in kids[n] for x in expand(k)]
        return [n]

    return [x for n in kids.get("", []) for x in expand(n)] or [""]


def plot_report(rep: ReportLike, path: Path, depth: int | None = None) -> Path:
    """Write :func:`report_figure` as a PNG (110 dpi) and close it."""
    plt = pyplot()
    fig = report_figure(rep, depth)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def report_figure(rep: ReportLike, depth: int | None = None) -> Any:
    """The matplotlib Figure of a report: per-layer bars stacked by category (left axes, one
    ``barh`` container per category, in the unit of the x label) and live memory over time with
    the phases shaded (right axes). Each legend stands right of its axes, never over the data.

    A fake run's timeline is drawn against its operations in order, not time: how long each
    took is this CPU running fake tensors (its flat stretches are scheduling), not the step."""
    plt = pyplot()
    layers = _bar_layers(rep, depth)
    # light mode on CPU has no temporaries to draw; communication only under sharding; inputs
    # are no layer's
    cats = [
        c
        for c in CATEGORIES
        if c != "inputs"
        and c in rep.measured
        and (c != "communication" or any(st.communication for st in rep.layers.values()))
    ]
    top = max([rep.peak_bytes, *(rep.layers[n].total for n in layers)], default=1)
    uname, scale = _unit(top)
    fig, (ax1, ax2) = plt.subplots(
        1,
        2,
        figsize=(14, max(4.0, 0.28 * len(layers) + 1.5)),
        gridspec_kw={"width_ratios": [1, 1.4]},
    )
    left = [0.0] * len(layers)
    for c in cats:
        vals = [getattr(rep.layers[n], c) / scale for n in layers]
        ax1.barh(range(len(layers)), vals, left=left, color=_COLORS[c], label=c)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax1.set_yticks(range(len(layers)), [n or "(model)" for n in layers], fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"{uname} (max over steps)")
    ax1.set_title("per layer")
    outside = {
        "fontsize": 7,
        "loc": "upper left",
        "bbox_to_anchor": (1.01, 1.0),
        "borderaxespad": 0,
    }
    ax1.legend(**outside)

    _draw_timeline(ax2, rep, scale, uname, outside)
    ax2.set_xlabel(_time_label(rep))
    ax2.set_ylabel(f"live tensor memory ({uname})")
    ax2.set_title(f"{rep.model} on {rep.device}" + (" (estimate)" if rep.estimate else ""))
    fig.tight_layout()
    return fig


def _draw_timeline(ax: Any, rep: ReportLike, scale: float, uname: str, legend: dict) -> None:
    """Live memory over the run (operations in order for a fake run), phases shaded, the peak
    and communication marked, the legend placed as ``legend`` says."""
    tl = rep.timeline
    if tl.get("t_ns"):
        t = list(range(len(tl["t_ns"]))) if rep.fake else [x / 1e6 for x in tl["t_ns"]]
        y = [b / scale for b in tl["bytes"]]
        start = 0
        for i in range(1, len(t) + 1):
            if (
                i == len(t)
                or tl["phase"][i] != tl["phase"][start]
                or tl["step"][i] != tl["step"][start]
            ):
                end = t[i] if i < len(t) else t[-1]
                ax.axvspan(t[start], end, color=_PHASE_COLORS[PHASES[tl["phase"][start]]], lw=0)
                start = i
        ax.step(t, y, where="post", color="black", lw=1)
        comm = tl.get("communication")  # absent before schema 3
        if comm and any(comm):
            ax.fill_between(
                t,
                [c / scale for c in comm],
                step="post",
                color=_COLORS["communication"],
                alpha=0.6,
                lw=0,
                label="communication",
            )
        ax.axhline(
            rep.peak_bytes / scale,
            color="red",
            ls="--",
            lw=0.8,
            label=f"peak {rep.peak_bytes / scale:.2f} {uname}",
        )
        for ph in PHASES:
            ax.fill_between([], [], color=_PHASE_COLORS[ph], label=ph)
        ax.legend(**legend)


def _time_label(rep: ReportLike) -> str:
    if not rep.fake:
        return "time (ms)"
    what = "operations" if rep.mode == "exact" else "module boundaries"
    return f"{what}, in order (a fake run has no real timing)"


def chrome_trace(rep: ReportLike) -> dict[str, Any]:
    """Trace events (microseconds): memory counters (live bytes; communication bytes when there
    are any) on pid 0, phases on tid 0, modules on tid 1 (forward) and 2 (backward)."""
    ev: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"gpumem {rep.model}"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "phases"}},
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": 1,
            "args": {"name": "modules (forward)"},
        },
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": 2,
            "args": {"name": "modules (backward)"},
        },
    ]
    tl = rep.timeline
    ts, bs = tl.get("t_ns", []), tl.get("bytes", [])
    for t, b in zip(ts, bs, strict=True):
        ev.append({"name": "live bytes", "ph": "C", "pid": 0, "ts": t / 1e3, "args": {"bytes": b}})
    comm = tl.get("communication")  # absent before schema 3
    if comm and any(comm):
        for t, c in zip(ts, comm, strict=True):
            ev.append(
                {
                    "name": "communication bytes",
                    "ph": "C",
                    "pid": 0,
                    "ts": t / 1e3,
                    "args": {"bytes": c},
                }
            )
    start = 0
    for i in range(1, len(ts) + 1):
        if (
            i == len(ts)
            or tl["phase"][i] != tl["phase"][start]
            or tl["step"][i] != tl["step"][start]
        ):
            end = ts[i] if i < len(ts) else ts[-1]
            ev.append(
                {
                    "name": f"step {tl['step'][start]} {PHASES[tl['phase'][start]]}",
                    "ph": "X",
                    "pid": 0,
                    "tid": 0,
                    "ts": ts[start] / 1e3,
                    "dur": max(end - ts[start], 0) / 1e3,
                }
            )
            start = i
    for s in rep.spans:
        ev.append(
            {
                "name": s["module"] or "(model)",
                "ph": "X",
                "pid": 0,
                "tid": 2 if s["phase"] == "backward" else 1,
                "ts": s["start_ns"] / 1e3,
                "dur": max(s["end_ns"] - s["start_ns"], 0) / 1e3,
                "args": {"step": s["step"], "phase": s["phase"]},
            }
        )
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {"peak_bytes": rep.peak_bytes, "schema_version": rep.schema_version},
    }
