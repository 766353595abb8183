"""Pictures: the profile PNG (file, size, and the bars against the report), the estimate's
layouts chart, and the memory-snapshot export read back by PyTorch's own memory_viz code."""

from __future__ import annotations

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
