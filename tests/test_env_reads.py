"""Every GPUMEM_* switch is read through gpumem/_env.py and stated in its table.

A name ``GPUMEM_...`` written as a string anywhere in gpumem/ must be the first argument of
``env_str``, ``env_int``, ``env_float`` or ``env_flag`` (never ``os.environ`` or ``os.getenv``
directly, which would skip the one parse and its one-line errors), and each name read so is a
row of the table in ``_env.py``'s docstring. Read with ``ast``: nothing of gpumem is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gpumem"
ENV = PKG / "_env.py"
READERS = {"env_str", "env_int", "env_float", "env_flag"}
_NAME = re.compile(r"^GPUMEM_[A-Z0-9_]+$")


def env_uses(source: str) -> tuple[set[str], list[str]]:
    """(names read through the _env helpers, other uses of a GPUMEM_* name as
    ``line: code``)."""
    tree = ast.parse(source)
    read: set[str] = set()
    through_helpers: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if name in READERS and isinstance(first, ast.Constant):
                through_helpers.add(id(first))
                if isinstance(first.value, str) and _NAME.match(first.value):
                    read.add(first.value)
    other = [
        f"{node.lineno}: {ast.get_source_segment(source, node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _NAME.match(node.value)
        and id(node) not in through_helpers
    ]
    return read, other


def table_names() -> set[str]:
    doc = ast.get_docstring(ast.parse(ENV.read_text())) or ""
    return set(re.findall(r"^\|\s*(GPUMEM_[A-Z0-9_]+)\s*\|", doc, re.M))


def test_gpumem_switches_are_read_only_through_env():
    read: dict[str, list[str]] = {}
    outside: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        if path == ENV:
            continue
        names, other = env_uses(path.read_text())
        rel = path.relative_to(PKG.parent).as_posix()
        outside += [f"{rel}:{o}" for o in other]
        for n in names:
            read.setdefault(n, []).append(rel)
    assert outside == [], "GPUMEM_* read outside gpumem/_env.py's helpers: " + "; ".join(outside)
    assert "GPUMEM_CACHE_DIR" in read  # the scan sees the helpers' reads
    unlisted = {n: where for n, where in read.items() if n not in table_names()}
    assert unlisted == {}, f"GPUMEM_* switches missing from gpumem/_env.py's table: {unlisted}"


def test_the_scan_finds_a_direct_read():
    source = (
        "import os\nfrom gpumem._env import env_flag\n"
        'a = os.environ.get("GPUMEM_X")\nb = env_flag("GPUMEM_Y")\n'
        'c = "GPUMEM_Z" in os.environ\nd = "set GPUMEM_Y=1 for more"\n'
    )
    read, other = env_uses(source)
    assert read == {"GPUMEM_Y"}
    assert other == ['3: "GPUMEM_X"', '5: "GPUMEM_Z"']
    assert {"GPUMEM_THREADS", "GPUMEM_CACHE_DIR"} <= table_names()
