"""benchmarks/bench_published.py's ``--rows`` merge: the rerun rows replace theirs in the
recorded torchtitan section, the others stay, and the errors are read back from the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))  # its own imports (_report) and the path it adds, undone
    try:
        spec = importlib.util.spec_from_file_location("bench_pub", BENCH / "bench_published.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod


def _row(name: str, err: str, res: str) -> list[object]:
    return [name, "1.00", "1.00", err, "1.10 / 1.20", "1.30", 1.2, res, "how"]


def test_merge_replaces_named_rows_and_reads_errors_back() -> None:
    bp = _bench()
    old = [
        _row("A", "-0.5000 %", "+1.0 %"),
        _row("B", "+2.0000 %", "-"),
        _row("C", "0 %", "-3.0 %"),
    ]
    section = bp.titan_section(old, [0.005, 0.02, 0.0], [("A", 0.01), ("C", -0.03)])
    rows, errors, res = bp._merge_rows(section, [_row("C", "+1.0000 %", "+9.3 %")])
    assert [r[0] for r in rows] == ["A", "B", "C"]
    assert rows[2][7] == "+9.3 %" and rows[0] == [str(c) for c in old[0]]
    assert errors == pytest.approx([0.005, 0.02, 0.01])
    assert [n for n, _ in res] == ["A", "C"]
    assert [e for _, e in res] == pytest.approx([0.01, 0.093])
    with pytest.raises(SystemExit, match="no recorded row named"):
        bp._merge_rows(section, [_row("D", "0 %", "-")])
