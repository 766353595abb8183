"""The checkpoint package keeps the shape a reader can follow (issue "The house, step 2"): a thin
façade, no class or function too long to hold in one's head. (Its stage order, its import
circles and its package docstrings are checked with the rest in tests/test_import_graph.py.)

Read from the source with ``ast``: nothing here imports gpumem.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gpumem" / "checkpoint"
MAX_FACADE_LINES = 450  # checkpointer.py: save / restore / prepare / wait / close, nothing else
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 80


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), filename=str(p)) for p in sorted(PKG.rglob("*.py"))}


def test_the_facade_stays_thin():
    lines = len((PKG / "checkpointer.py").read_text().splitlines())
    assert lines <= MAX_FACADE_LINES, f"checkpointer.py has {lines} lines"


def test_no_class_or_function_is_too_long_to_read():
    too_long = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = (node.end_lineno or 0) - node.lineno + 1
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if n > limit:
                too_long.append(f"{path.relative_to(PKG)}:{node.name} ({n} lines > {limit})")
    assert too_long == []


def test_the_limits_are_measured():
    """The measure sees the real sizes: the façade class is the longest class, and it is long."""
    sizes = [
        (node.end_lineno or 0) - node.lineno + 1
        for tree in _sources().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "Checkpointer"
    ]
    assert len(sizes) == 1 and 200 < sizes[0] <= MAX_CLASS_LINES
