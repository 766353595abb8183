"""benchmarks/_report.py (the figures and JSON every benchmark writes) and benchmarks/compare.py
(what regressed between two runs), on synthetic runs."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


report = _module("_report")
compare = _module("compare")


# ------------------------------------------------------------------------------------ figures


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 101])
def test_percentiles_match_numpy(n):
    xs = [random.Random(n).uniform(0, 10) for _ in range(n)]
    for q in (0, 20, 50, 80, 100):
        assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_figures_by_hand():
    f = report.figure("t", "ms", [0.004, 0.001, 0.002, 0.003, 0.005], scale=1e3)
    # sorted 1..5 ms: p20 at rank 0.8 -> 1.8, p50 rank 2 -> 3, p80 rank 3.2 -> 4.2
    assert (f.p20, f.p50, f.p80, f.n, f.better) == (
        pytest.approx(1.8),
        pytest.approx(3.0),
        pytest.approx(4.2),
        5,
        "lower",
    )
    r = report.rate_figure("rate", "GB/s", 2.0, [1.0, 2.0, 4.0])
    assert (r.p20, r.p50, r.p80, r.better) == (
        pytest.approx(0.7),
        1.0,
        pytest.approx(1.6),
        "higher",
    )
    num = report.Figure("a", "GB/s", 8.0, 10.0, 12.0, 5, "higher")
    den = report.Figure("b", "GB/s", 4.0, 5.0, 6.0, 3, "higher")
    q = report.ratio_figure("a/b", num, den)
    assert (q.unit, q.p20, q.p50, q.p80, q.n) == ("x", 8 / 6, 2.0, 3.0, 3)
    v = report.value_figure("err", "%", 0.7, tolerance=0.5)
    assert (v.p20, v.p50, v.p80, v.n, v.tolerance) == (0.7, 0.7, 0.7, 1, 0.5)
    with pytest.raises(ValueError, match="better must be"):
        report.Figure("x", "s", 1, 1, 1, 1, "faster")
    with pytest.raises(ValueError, match="out of order"):
        report.Figure("x", "s", 2, 1, 3, 1)


def test_triton_rates_come_from_do_bench_quantiles():
    # do_bench gives the time's p20/p50/p80; the rate's p20 is the time's p80, not a percentile
    # of the three numbers taken as samples
    triton_bench = _module("bench_triton_crc32c")
    f = triton_bench._rate("crc", 2.0, [0.5, 1.0, 4.0])
    assert (f.p20, f.p50, f.p80, f.n, f.better) == (0.5, 2.0, 4.0, 0, "higher")


def test_median_time_keeps_every_sample():
    calls = []
    out = report.median_time(lambda: calls.append(1), repeat=4, warmup=2)
    assert len(calls) == 6 and len(out["samples"]) == 4
    assert out["median"] == report.percentile(out["samples"], 50)
    assert out["min"] <= out["p20"] <= out["median"] <= out["p80"] <= out["max"]


def test_write_results_writes_markdown_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setenv("BENCH_GIT_COMMIT", "abc123")
    info = report.machine_info()
    info["load average"] = "0.5"
    figs = [
        report.figure("copy", "ms", [1.0, 2.0, 3.0]),
        report.value_figure("count", "configs", 7, better="higher"),
    ]
    path = report.write_results("demo", "Demo", ["a"], [[1]], "a note", info, figures=figs)
    assert path == tmp_path / "demo.md"
    text = path.read_text()
    assert "| a |" in text and "a note" in text and "- **git commit**: abc123" in text
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["schema"] == "gpumem-bench/1" and doc["benchmark"] == "demo"
    assert doc["git_commit"] == "abc123" and doc["context"] == {"load average": "0.5"}
    assert set(doc["machine"]) >= {"host", "cpu", "cores", "memory", "gpu"}
    assert set(doc["versions"]) >= {"python", "torch", "numpy", "gpumem"}
    assert doc["date"].endswith("Z") and doc["date"][:10] == info["date"][:10]
    assert doc["figures"][0] == {
        "name": "copy",
        "unit": "ms",
        "p20": 1.4,
        "p50": 2.0,
        "p80": 2.6,
        "n": 3,
        "better": "lower",
        "tolerance": 0.0,
    }
    with pytest.raises(ValueError, match=r"unique in twice: \['copy'\]"):
        report.write_results("twice", "T", ["a"], [], info=info, figures=figs + figs[:1])
    assert not (tmp_path / "twice.md").exists() and not (tmp_path / "twice.json").exists()


def test_git_commit_names_the_checkout(monkeypatch):
    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    if shutil.which("git") is None:
        pytest.skip("no git")
    head = subprocess.run(
        ["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode:
        pytest.skip("not a git checkout")
    assert report.git_commit().removesuffix("+dirty") == head.stdout.strip()


# ------------------------------------------------------------------------------------ compare


def _fig(name, p20, p50, p80, better="lower", tolerance=0.0, unit="ms"):
    return {
        "name": name,
        "unit": unit,
        "p20": p20,
        "p50": p50,
        "p80": p80,
        "n": 5,
        "better": better,
        "tolerance": tolerance,
    }


def _run(figures, commit="old", machine=None):
    return {
        "schema": "gpumem-bench/1",
        "benchmark": "demo",
        "date": "2026-01-01T00:00:00Z",
        "git_commit": commit,
        "machine": machine or {"cpu": "X"},
        "versions": {"torch": "2.13"},
        "figures": figures,
    }


OLD = [
    _fig("slower", 9.5, 10.0, 10.5),  # -> 11.5..12.5: bands apart, +20 %
    _fig("overlap", 9.0, 10.0, 11.0),  # -> 10.5..12: bands overlap: noise
    _fig("faster", 9.5, 10.0, 10.5),  # -> 7..8: improved
    _fig("throughput", 9.0, 10.0, 11.0, "higher", unit="GB/s"),  # -> 7..8.5: regressed
    _fig("single", 1.0, 1.0, 1.0),  # -> 1.02: +2 % < 5 %: noise
    _fig("single big", 1.0, 1.0, 1.0),  # -> 1.2: regressed
    _fig("error", 0.5, 0.5, 0.5, tolerance=0.5, unit="%"),  # -> 0.8 (+60 %) < tolerance: noise
    _fig("dropped", 1, 1, 1),
]
NEW = [
    _fig("slower", 11.5, 12.0, 12.5),
    _fig("overlap", 10.5, 11.0, 12.0),
    _fig("faster", 7.0, 7.5, 8.0),
    _fig("throughput", 7.0, 8.0, 8.5, "higher", unit="GB/s"),
    _fig("single", 1.02, 1.02, 1.02),
    _fig("single big", 1.2, 1.2, 1.2),
    _fig("error", 0.8, 0.8, 0.8, tolerance=0.5, unit="%"),
    _fig("added", 1, 1, 1),
]


def test_compare_applies_the_noise_rule():
    verdicts = {v.name: v.kind for v in compare.compare_runs(_run(OLD), _run(NEW, "new"), 0.05)}
    assert verdicts == {
        "slower": "regressed",
        "overlap": "noise",
        "faster": "improved",
        "throughput": "regressed",
        "single": "noise",
        "single big": "regressed",
        "error": "noise",
        "added": "new",
        "dropped": "gone",
    }
    # a 25 % floor hides the 20 % moves; a run against itself is all noise
    strict = {v.name: v.kind for v in compare.compare_runs(_run(OLD), _run(NEW), 0.25)}
    assert strict["slower"] == strict["single big"] == strict["throughput"] == "noise"
    assert strict["faster"] == "noise"  # 10 -> 7.5 moved by 25 %, not more than 25 %
    same = compare.compare_runs(_run(NEW), _run(NEW), 0.0)
    assert {v.kind for v in same} == {"noise"}


def _write(path: Path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), *args], capture_output=True, text=True
    )


def test_compare_cli_exit_status_and_report(tmp_path):
    old = _write(tmp_path / "a" / "demo.json", _run(OLD, "1111111"))
    new = _write(tmp_path / "b" / "demo.json", _run(NEW, "2222222", machine={"cpu": "Y"}))
    out = _cli(str(old), str(new))
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "== demo: 1111111 (2026-01-01T00:00:00Z) -> 2222222 (2026-01-01T00:00:00Z)"
    assert "warning: machine differ: cpu X -> Y" in lines[1]
    assert "   REGRESSED slower (ms): 10 [9.5, 10.5] -> 12 [11.5, 12.5] +20.0%" in lines
    assert "   improved  faster (ms): 10 [9.5, 10.5] -> 7.5 [7, 8] -25.0%" in lines
    assert lines[-1].startswith("3 regressed, 1 improved, 3 within noise, of 9 figures")
    quiet = _cli(str(old), str(new), "--quiet")
    assert not any("noise" in line for line in quiet.stdout.splitlines()[:-1])
    # nothing regressed: exit 0 (directories pair files by name; other JSON files are skipped)
    _write(tmp_path / "c" / "demo.json", _run(NEW, "3333333"))
    _write(tmp_path / "c" / "calibration_gpu_h200.json", {"version": 1})
    _write(tmp_path / "c" / "other.json", _run(OLD))
    ok = _cli(str(tmp_path / "b"), str(tmp_path / "c"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "other: only in NEW, not compared" in ok.stdout
    assert ok.stdout.splitlines()[-1].startswith("0 regressed, 0 improved, 8 within noise")


def test_compare_cli_refuses_what_it_cannot_read(tmp_path):
    bad = _write(tmp_path / "bad.json", {"figures": []})
    good = _write(tmp_path / "good.json", _run(OLD))
    out = _cli(str(bad), str(good))
    assert out.returncode == 2 and "is not a benchmark results file" in out.stderr
    out = _cli(str(tmp_path / "missing.json"), str(good))
    assert out.returncode == 2 and "no such file or directory" in out.stderr
    broken = _write(tmp_path / "broken.json", _run([{"name": "x", "unit": "s"}]))
    out = _cli(str(broken), str(good))
    assert out.returncode == 2 and "figure 'x' lacks ['p20', 'p50', 'p80']" in out.stderr


def test_compare_reads_committed_results_from_git():
    if shutil.which("git") is None:
        pytest.skip("no git")
    rel = "benchmarks/results/planner.json"
    shown = subprocess.run(
        ["git", "-C", str(BENCH), "cat-file", "-e", f"HEAD:{rel}"], capture_output=True
    )
    if shown.returncode:
        pytest.skip(f"not a git checkout with {rel} committed")
    out = _cli(f"HEAD:{rel}", str(BENCH.parent / rel))
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.startswith("== planner: ")
    same = _cli(f"HEAD:{rel}", f"HEAD:{rel}")
    assert same.returncode == 0 and " 0 regressed, 0 improved" in " " + same.stdout.splitlines()[-1]


def test_every_benchmark_writes_figures():
    import ast

    scripts = sorted(BENCH.glob("bench_*.py"))
    assert len(scripts) >= 7
    for script in scripts:
        calls = [
            node
            for node in ast.walk(ast.parse(script.read_text()))
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "write_results"
        ]
        assert calls, f"{script.name} writes no results file"
        for call in calls:
            assert "figures" in {k.arg for k in call.keywords}, f"{script.name}:{call.lineno}"
