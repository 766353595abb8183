"""docs/architecture.md's module map is the house: every module, package and native source file
is on it, and everything on it exists.

The map is the fenced block under "## The module map": one entry a line, a folder's entries
indented two spaces under it (``gpumem/`` and ``csrc/`` are the two roots), the description after
the name; ``a.py / b.py`` names several modules on one line. A description goes on in lines
indented to its first line's column (or deeper), which are never read as entries. Each
package's ``__init__.py`` docstring lists the same modules (tests/test_import_graph.py), so a
module added or moved is written in both places, or one of the two tests names it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
_ENTRY = re.compile(r"^( *)(\S+\.py|\S+/|\S+\.cpp|\S+\.h)(?=\s|$)")
_MORE = re.compile(r"\s+/\s+(\S+\.(?:py|cpp|h))(?=\s|$)")  # ``a.py / b.py``


def the_map(text: str) -> str:
    """The fenced block under the map's heading."""
    after = text.split("## The module map", 1)[1]
    return after.split("```", 2)[1]


def map_entries(block: str) -> list[str]:
    """Each entry's path from the repository root: folders end in ``/``. A line indented to
    the column where the last entry's description starts (or deeper) continues it."""
    entries: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, folder) of the folders the line is inside
    column = 10**9  # where the descriptions of the last entry start
    for line in block.splitlines():
        m = _ENTRY.match(line)
        if m is None or len(m.group(1)) >= column:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        names = [m.group(2)]
        end = m.end()
        while (more := _MORE.match(line, end)) is not None:
            names.append(more.group(1))
            end = more.end()
        entries.extend(parent + name for name in names)
        if names[0].endswith("/"):
            stack.append((indent, parent + names[0]))
        described = re.compile(r"\s+(?=\S)").match(line, end)
        if described is not None and described.end() < len(line):
            column = described.end()
    return entries


def house() -> set[str]:
    """What the map must name: every module and package of gpumem/ (a package as its folder,
    its ``__init__.py`` not required) and every C++ source and header of csrc/."""
    out: set[str] = set()
    for path in (ROOT / "gpumem").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            out.add(rel[: -len("__init__.py")])
        else:
            out.add(rel)
    for path in (ROOT / "csrc").iterdir():
        if path.suffix in (".cpp", ".h"):
            out.add(path.relative_to(ROOT).as_posix())
    return out


def differences(entries: list[str], wanted: set[str]) -> tuple[list[str], list[str], list[str]]:
    """(missing from the map, on the map but not in the tree, named twice)."""
    named = set(entries)
    missing = sorted(wanted - named)
    extra = sorted(e for e in named if not (ROOT / e).exists())
    twice = sorted({e for e in entries if entries.count(e) > 1})
    return missing, extra, twice


def test_the_map_names_every_module_and_nothing_else():
    entries = map_entries(the_map(MAP.read_text()))
    assert "gpumem/profiler/session.py" in entries  # the parse sees nested entries
    missing, extra, twice = differences(entries, house())
    problems = []
    if missing:
        problems.append(
            "not on the map (add one line each under its folder): " + ", ".join(missing)
        )
    if extra:
        problems.append("on the map but not in the tree (remove or rename): " + ", ".join(extra))
    if twice:
        problems.append("on the map twice: " + ", ".join(twice))
    assert not problems, "docs/architecture.md, ## The module map: " + "; ".join(problems)


def test_the_map_parse_follows_indents_and_groups():
    block = """
gpumem/
  units.py             bytes <-> text
  profiler/            measure
    session.py         Profile, the context manager: hooks + tracker -> records;
                       profiler/ words that go on a description are not entries
    a.py / b.py        two on one line
    c.py / d.py
                       x.py a description under a line of names
  dcp.py               back at the top
csrc/
  arena.cpp            host memory
"""
    assert map_entries(block) == [
        "gpumem/",
        "gpumem/units.py",
        "gpumem/profiler/",
        "gpumem/profiler/session.py",
        "gpumem/profiler/a.py",
        "gpumem/profiler/b.py",
        "gpumem/profiler/c.py",
        "gpumem/profiler/d.py",
        "gpumem/dcp.py",
        "csrc/",
        "csrc/arena.cpp",
    ]


def test_the_differences_name_each_module():
    entries = ["gpumem/", "gpumem/units.py", "gpumem/gone.py", "gpumem/units.py"]
    wanted = {"gpumem/", "gpumem/units.py", "gpumem/new.py"}
    assert differences(entries, wanted) == (
        ["gpumem/new.py"],
        ["gpumem/gone.py"],
        ["gpumem/units.py"],
    )
