"""The estimator stays readable in pieces: no function over 80 lines, no class over 350
(docstrings included), and ``estimate()`` takes at most 20 keywords (test_front_door.py)."""

import ast
from pathlib import Path

ESTIMATOR = Path(__file__).resolve().parents[2] / "gpumem" / "estimator"
MAX_FUNCTION, MAX_CLASS = 80, 350


def too_long(tree: ast.AST) -> list[str]:
    """``name (lines)`` of each function over MAX_FUNCTION and class over MAX_CLASS lines."""
    out = []
    for node in ast.walk(tree):
        limit = (
            MAX_CLASS
            if isinstance(node, ast.ClassDef)
            else MAX_FUNCTION
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            else None
        )
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            out.append(f"{node.name} ({node.end_lineno - node.lineno + 1})")
    return out


def test_no_function_over_80_lines_no_class_over_350():
    files = sorted(ESTIMATOR.rglob("*.py"))
    assert ESTIMATOR / "frameworks" / "torchtitan.py" in files
    found = {
        p.relative_to(ESTIMATOR).as_posix(): bad
        for p in files
        if (bad := too_long(ast.parse(p.read_text())))
    }
    assert found == {}, f"split these: {found}"


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    assert too_long(ast.parse(f"def f():\n{body}\n")) == [f"f ({MAX_FUNCTION + 1})"]
    assert too_long(ast.parse("def g():\n    pass\n")) == []
