"""Pictures: the profile PNG (file, size, and the bars against the report), the estimate's
layouts chart, the memory-snapshot export read back by PyTorch's own memory_viz code, and every
chart the CLI writes rendered and checked for clipped text and legends over data."""

from __future__ import annotations

import json
import pickle
import struct

import pytest

from gpumem.cli import main
from gpumem.profiler.pictures import DPI, _bar_layers, report_figure
from gpumem.profiler.runner import profile_model

CATS = ("weights", "gradients", "optimizer", "activations", "temporary")


@pytest.fixture(scope="module")
def rep():
    return profile_model("gpt2", batch_size=2, seq_len=32)


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_report_plot_png_has_the_expected_size(rep, tmp_path):
    path = rep.plot(tmp_path / "p.png")
    n = len(_bar_layers(rep, None))
    # figsize (14, max(4, 0.28 n + 1.5)) inches at DPI dots per inch
    assert png_size(path) == (14 * DPI, round(max(4.0, 0.28 * n + 1.5) * DPI))


def test_report_figure_bars_are_the_report(rep):
    import matplotlib.pyplot as plt

    fig = report_figure(rep)
    try:
        ax = fig.axes[0]
        layers = _bar_layers(rep, None)
        label = ax.get_xlabel().split()[0]
        scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[label]
        assert [c.get_label() for c in ax.containers] == list(CATS)
        for cat, bars in zip(CATS, ax.containers, strict=True):
            widths = [b.get_width() for b in bars]
            assert widths == pytest.approx([getattr(rep.layers[n], cat) / scale for n in layers])
        # stacked: each bar starts where the previous categories end
        total = [sum(b.get_width() for b in col) for col in zip(*ax.containers, strict=True)]
        assert total == pytest.approx([rep.layers[n].total / scale for n in layers])
        assert ax.get_title() == "per layer"
    finally:
        plt.close(fig)


def test_cli_profile_plot(tmp_path, capsys):
    out = tmp_path / "p.png"
    assert main(["profile", "gpt2", "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    assert png_size(out)[0] == 14 * DPI


def test_estimate_plot_draws_the_layout_beside_the_planners_best(tmp_path):
    import matplotlib.pyplot as plt

    import gpumem
    from gpumem.planner.layout_chart import CATEGORIES, best_layouts, bills_figure

    bill = gpumem.estimate("llama-2-7b", seq_len=2048, layout=gpumem.Layout(dp=8))
    bills = [("asked", bill), *best_layouts(bill, n_gpus=8, top=3)]
    assert len(bills) == 4
    fig = bills_figure(bills)
    try:
        ax = fig.axes[0]
        for cat, bars in zip(CATEGORIES, ax.containers, strict=True):
            heights = [b.get_height() for b in bars]
            assert heights == pytest.approx([b.per_gpu[cat] / 2**30 for _, b in bills])
        assert ax.get_xticklabels()[0].get_text() == "asked"
    finally:
        plt.close(fig)
    out = tmp_path / "bill.png"
    argv = ["estimate", "llama-2-7b", "--seq-len", "2048", "--gpus", "8", "--plot", str(out)]
    assert main(argv) == 0
    assert png_size(out)[1] > 0


def test_memory_snapshot_replays_the_timeline(rep, tmp_path):
    path = rep.to_memory_snapshot(tmp_path / "snap.pickle")
    snap = pickle.loads(path.read_bytes())
    events = snap["device_traces"][0]
    tl = rep.timeline
    # replay: the live total after the events of each sample is the timeline's level
    live: dict[int, int] = {}
    levels, i = [], 0
    for t in tl["t_ns"]:
        while i < len(events) and events[i]["time_us"] <= t // 1000:
            e = events[i]
            if e["action"] == "alloc":
                assert e["addr"] not in live
                live[e["addr"]] = e["size"]
            elif e["action"] == "free_completed":
                assert live.pop(e["addr"]) == e["size"]
            i += 1
        levels.append(sum(live.values()))
    assert levels[-1] == tl["bytes"][-1]
    assert max(levels) == max(tl["bytes"])
    assert {e["action"] for e in events} <= {"alloc", "free_requested", "free_completed"}
    assert snap["segments"][0]["total_size"] == max(tl["bytes"])
    # PyTorch's own memory_viz code reads it (the page pytorch.org/memory_viz renders)
    from torch.cuda._memory_viz import trace_plot

    assert "snapshot.pickle" in trace_plot(snap)


def test_estimate_chart_shows_every_category_of_the_table():
    """Issue 23 (6): the chart left out communication, so a ZeRO-3 bar fell short of the
    table's total."""
    import matplotlib.pyplot as plt

    import gpumem
    from gpumem.estimator.bill import CATEGORIES as TABLE
    from gpumem.planner.layout_chart import bills_figure

    bill = gpumem.estimate("llama-2-7b", layout=gpumem.Layout(dp=8, zero=3))
    assert bill.per_gpu["communication"] == 2909533440  # a category the chart must draw
    fig = bills_figure([("asked", bill)])
    try:
        ax = fig.axes[0]
        assert [c.get_label() for c in ax.containers] == [c for c in TABLE if c != "total"]
        top = sum(bars[0].get_height() for bars in ax.containers)
        assert top == pytest.approx(bill.per_gpu["total"] / 2**30)
    finally:
        plt.close(fig)


@pytest.fixture(scope="module")
def hf_rep(tmp_path_factory):
    pytest.importorskip("transformers")
    cfg = tmp_path_factory.mktemp("hf") / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    return profile_model(str(cfg), batch_size=2, seq_len=16, steps=1)


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
HF_BARS = [
    "model.embed_tokens",
    "model.layers.0",
    "model.layers.1",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
]


def test_plot_of_a_transformers_model_shows_blocks_and_what_surrounds_them(hf_rep):
    """Issue 23 (6): the bars of an HF model were `model` and `lm_head` only."""
    assert _bar_layers(hf_rep, None) == HF_BARS


def test_plot_depth_cuts_the_tree_and_keeps_the_shallower_leaves(hf_rep):
    """Issue 23 (6): depth=3 dropped the embedding, norm and head (depth 2 and 1 leaves)."""
    assert _bar_layers(hf_rep, 3) == HF_BARS
    assert _bar_layers(hf_rep, 1) == ["model", "lm_head"]
    assert _bar_layers(hf_rep, 2) == [
        "model.embed_tokens",
        "model.layers",
        "model.norm",
        "model.rotary_emb",
        "lm_head",
    ]


def test_cli_profile_depth_is_documented_and_reaches_the_plot(tmp_path, capsys, monkeypatch):
    import gpumem.profiler.report as report

    seen = []
    monkeypatch.setattr(report.Report, "plot", lambda self, path, depth=None: seen.append(depth))
    assert main(["profile", "--help"]) == 0
    assert "--plot's bars" in " ".join(capsys.readouterr().out.split())
    out = str(tmp_path / "p.png")
    assert main(["profile", "gpt2", "--steps", "1", "--plot", out]) == 0
    assert main(["profile", "gpt2", "--steps", "1", "--plot", out, "--depth", "1"]) == 0
    assert seen == [None, 1]


def test_memory_snapshot_passes_memory_viz_stats(rep, tmp_path):
    """Issue 23 (6): `python -m torch.cuda._memory_viz stats` raised "Segment size mismatch"
    (the segment had no blocks)."""
    from torch.cuda._memory_viz import segsum, trace_plot

    snap = pickle.loads(rep.to_memory_snapshot(tmp_path / "snap.pickle").read_bytes())
    seg = snap["segments"][0]
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"] == max(rep.timeline["bytes"])
    active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert active == rep.timeline["bytes"][-1]  # the end of the trace: what is still alive
    text = segsum(snap)
    assert "total_reserved" in text and "snapshot.pickle" in trace_plot(snap)


def layout_problems(fig) -> list[str]:
    """What is wrong with ``fig`` once drawn: its tight bounding box (every drawn artist: tick
    labels, titles, legends) or a title, axis label or legend text reaching past the figure's
    edges (clipped in the PNG), a legend over the plotting area of any axes (over data), a title
    or axis label over another axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # plt.close() left the saved figure without one
    canvas.draw()
    r = canvas.get_renderer()
    page = fig.bbox  # display pixels
    w, h = fig.get_size_inches()
    tight = fig.get_tightbbox(r)  # inches
    bad = []
    if tight.x0 < -0.01 or tight.y0 < -0.01 or tight.x1 > w + 0.01 or tight.y1 > h + 0.01:
        bad.append(f"drawn artists span {tight.bounds} of a {w} x {h} inch figure")
    texts = [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    texts += [
        t for leg in fig.legends + [ax.get_legend() for ax in fig.axes] if leg for t in leg.texts
    ]
    for t in texts + fig.texts:
        if not t.get_visible() or not t.get_text().strip():
            continue
        box = t.get_window_extent(r)
        if (
            box.x0 < page.x0 - 1
            or box.y0 < page.y0 - 1
            or box.x1 > page.x1 + 1
            or box.y1 > page.y1 + 1
        ):
            bad.append(f"text {t.get_text()!r} at {box.bounds} is clipped by {page.bounds}")
    for ax in fig.axes:
        labels = [ax.title, ax.xaxis.label, ax.yaxis.label]
        for other in fig.axes:
            for t in labels:
                if t.get_text() and t.get_window_extent(r).overlaps(other.bbox):
                    bad.append(f"{t.get_text()!r} lies over the axes {other.get_title()!r}")
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(r)
        for other in fig.axes:
            if box.overlaps(other.bbox):
                bad.append(f"the legend of {ax.get_title()!r} lies over {other.get_title()!r}")
    return bad


@pytest.fixture
def drawn(monkeypatch):
    """The figures the code under test saves, kept to be checked after it closed them."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


ESTIMATES = {
    "one GPU, one bar": ["llama-2-7b"],
    "beside the planner's best": ["llama-2-7b", "--seq-len", "2048", "--gpus", "8"],
    "the demo's suggestion": ["llama-2-70b", "--gpus", "64", "--tp", "8", "--zero", "1"],
}


@pytest.mark.parametrize("case", list(ESTIMATES))
def test_every_estimate_chart_reads_at_a_glance(case, tmp_path, drawn):
    """Issue 43 (4): the title was clipped at both edges, said "the planner's best 0" over one
    bar, and the legend hid the top of the bar."""
    out = tmp_path / "bill.png"
    assert main(["estimate", *ESTIMATES[case], "--plot", str(out)]) == 0
    (fig,) = drawn
    assert layout_problems(fig) == []
    w, h = fig.get_size_inches()
    assert png_size(out) == (round(w * 110), round(h * 110))
    title, bars = fig.axes[0].get_title(), len(fig.axes[0].containers[0])
    assert "best 0" not in title
    assert ("planner's best" in title) == (bars > 1), (title, bars)


PROFILES = {
    "real": ["gpt2"],
    "fake": ["gpt2", "--fake"],
    "fake, transformers": ["CONFIG", "--fake"],
    "fake, 32 blocks": ["llama", "--size", "7b", "--fake", "--seq-len", "64", "--batch-size", "1"],
}


@pytest.mark.parametrize("case", list(PROFILES))
def test_every_profile_chart_reads_at_a_glance(case, tmp_path, drawn):
    """Issue 43 (4): fake-mode charts put the legend over `lm_head` and labelled the x axis
    "time (ms)", which is how long the fake run took on this CPU, not the step's timeline."""
    if case == "fake, transformers":
        pytest.importorskip("transformers")
    argv = [_config(tmp_path) if a == "CONFIG" else a for a in PROFILES[case]]
    out = tmp_path / "p.png"
    assert main(["profile", *argv, "--steps", "1", "--plot", str(out)]) == 0
    (fig,) = drawn
    assert layout_problems(fig) == []
    assert png_size(out) == tuple(round(x * DPI) for x in fig.get_size_inches())
    label = fig.axes[1].get_xlabel()
    assert (
        label == "time (ms)" if "--fake" not in argv else label.startswith("operations, in order")
    )


def test_the_demos_loss_chart_reads_at_a_glance(tmp_path, drawn):
    from gpumem.demo import DemoResult, _loss_chart

    losses = [float.hex(3.0 - 0.05 * i) for i in range(30)]
    path = _loss_chart(DemoResult(out=tmp_path, losses=losses, reference=losses), 12)
    (fig,) = drawn
    assert path.is_file() and layout_problems(fig) == []
