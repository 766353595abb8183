"""The profiler stays in small pieces (issue #40): no class over 350 lines, no function over 80,
and the session holds no branch on the mode (``modes.py`` is what differs)."""

from __future__ import annotations

import ast
from pathlib import Path

PROFILER = Path(__file__).resolve().parents[2] / "gpumem" / "profiler"
# older than the rule, each named so that it can only shrink off this list
KNOWN = {"fake.py:_fake_mode_class"}


def oversized(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        limit = {ast.ClassDef: 350, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}.get(type(node))
        if limit is not None and lines > limit and f"{name}:{node.name}" not in KNOWN:
            out.append(f"{name}:{node.name} ({lines} lines, at most {limit})")
    return out


def test_no_class_or_function_over_the_limits():
    found = [x for p in sorted(PROFILER.glob("*.py")) for x in oversized(p.read_text(), p.name)]
    assert found == []


def test_the_session_does_not_branch_on_the_mode():
    tree = ast.parse((PROFILER / "session.py").read_text())
    reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    compared = {
        c.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        for c in [n.left, *n.comparators]
        if isinstance(c, ast.Constant)
    }
    assert "strategy" in reads  # the walk sees attributes
    assert "light" not in reads and "light" not in compared


def test_the_limits_are_read():
    source = "class A:\n" + "    x = 1\n" * 350 + "def f():\n" + "    pass\n" * 80
    assert oversized(source, "m.py") == [
        "m.py:A (351 lines, at most 350)",
        "m.py:f (81 lines, at most 80)",
    ]
