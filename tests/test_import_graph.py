"""No import circles in gpumem/: the modules form layers, each importing only those below.

An edge is an ``import`` statement. ``from package import name`` is an edge to
``package.name`` when that is a module, otherwise to the package itself (its ``__init__``). The
graph is read from the source with ``ast``, so the test imports nothing of gpumem and sees every
module, whether or not it is used.

Three graphs must be acyclic: the module-level imports (what runs at import time); the same
with the imports inside functions added; and with the ``if TYPE_CHECKING:`` imports added too.
A function-level import is there to defer a heavy dependency (torch for a preset estimate,
matplotlib for a plot), never to dodge a circle, and a type-only import is still a dependency
a reader has to follow. The subpackages, collapsed to one node each, must form layers too.

Names are part of the layering a reader follows: no two modules or packages share a name (a
``cli/`` subcommand module may mirror the top-level module or package it runs), and every
package's docstring lists what is in it, one line each.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[1] / "gpumem"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG_ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.Module, functions: bool, type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (top level, also inside if/try/with), with
    ``functions`` those inside function and class bodies too, and with ``type_checking`` those
    under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if functions or isinstance(node, ast.ClassDef):
                stack.extend(node.body)
        elif isinstance(node, ast.If):
            if type_checking or not _is_type_checking(node.test):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                stack.extend(block)
            for handler in node.handlers:
                stack.extend(handler.body)
        elif isinstance(node, ast.With | ast.For | ast.While):
            stack.extend(node.body)
            stack.extend(getattr(node, "orelse", []))
    return found


def import_graph(functions: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree, functions, type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = []
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    targets.append(sub if sub in files else mod)
            for target in targets:
                # `import a.b.c` imports a, a.b and a.b.c; the innermost known module is the edge
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def full_graph() -> dict[str, set[str]]:
    """Every import, wherever it is: module level, in functions, under ``TYPE_CHECKING``."""
    return import_graph(functions=True, type_checking=True)


def _package_of(module: str) -> str:
    """The top-level part of gpumem a module belongs to: ``gpumem.profiler.session`` ->
    ``gpumem.profiler``; a root module (``gpumem.device``) and the root (``gpumem``) stay."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with every module collapsed into its top-level part; edges inside one drop."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        node = _package_of(module)
        out.setdefault(node, set()).update(_package_of(t) for t in targets)
        out[node].discard(node)
    return out


def test_the_graph_is_read():
    graph = import_graph()
    # a known edge of each kind, so an empty graph cannot pass the cycle tests below
    assert "gpumem._native" in graph["gpumem.checksum"]  # absolute
    assert "gpumem.checkpoint.errors" in graph["gpumem.checkpoint.storage.format"]  # relative
    assert "gpumem.estimator.module_estimate" not in graph["gpumem.estimator.api"]
    assert "gpumem.estimator.module_estimate" in import_graph(True)["gpumem.estimator.api"]


def test_type_checking_imports_are_read():
    # the root package names the planner for type checkers only
    assert "gpumem.planner" not in import_graph(functions=True)["gpumem"]
    assert "gpumem.planner" in import_graph(functions=True, type_checking=True)["gpumem"]
    full = full_graph()
    assert "gpumem.planner" in full["gpumem"]
    assert "gpumem.estimator.module_estimate" in full["gpumem.estimator.api"]  # function level


def test_the_package_graph_is_read():
    packages = package_graph(full_graph())
    assert {"gpumem", "gpumem.profiler", "gpumem.device", "gpumem.checkpoint"} <= set(packages)
    assert "gpumem.profiler.session" not in packages
    assert "gpumem.profiler" in packages["gpumem.estimator"]  # the accuracy check profiles
    assert "gpumem.estimator" in packages["gpumem"]  # a TYPE_CHECKING import
    assert all(node not in targets for node, targets in packages.items())


def _describe(cycles: list[list[str]]) -> str:
    return "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles in gpumem/: " + _describe(cycles)


def test_no_cycles_hidden_in_function_level_imports():
    cycles = find_cycles(import_graph(functions=True))
    assert cycles == [], "import cycles through function-level imports: " + _describe(cycles)


def test_no_cycles_counting_every_import():
    cycles = find_cycles(full_graph())
    assert cycles == [], (
        "import cycles counting TYPE_CHECKING and function-level imports: " + _describe(cycles)
    )


def test_no_cycles_between_subpackages():
    cycles = find_cycles(package_graph(full_graph()))
    assert cycles == [], "import cycles between gpumem's subpackages: " + _describe(cycles)


# gpumem/checkpoint/'s stages, in the order a save and a restore pass through them: a stage
# imports only earlier ones (and the shared modules beside the façade: errors, group, stats,
# workers), never a later stage nor the façade (checkpointer, save, config, preemption)
CHECKPOINT_STAGES = ("capture", "stage", "storage", "restore", "interop")
CHECKPOINT_SHARED = ("errors", "group", "stats", "workers")


def checkpoint_order_violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges out of a checkpoint stage to a later stage or to the façade."""
    prefix = "gpumem.checkpoint."

    def part(module: str) -> str | None:
        return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None

    def allowed(src: str, target: str) -> bool:
        dst = part(target)
        if target != "gpumem.checkpoint" and (dst is None or dst in CHECKPOINT_SHARED):
            return True  # outside checkpoint/, or one of the shared modules
        return dst in CHECKPOINT_STAGES and (
            CHECKPOINT_STAGES.index(dst) <= CHECKPOINT_STAGES.index(src)
        )

    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if (src := part(source)) in CHECKPOINT_STAGES
        for target in targets
        if not allowed(src, target)
    )


def test_checkpoint_stages_import_only_earlier_stages():
    graph = full_graph()
    assert "gpumem.checkpoint.capture.codec" in graph["gpumem.checkpoint.storage.format"]
    assert checkpoint_order_violations(graph) == []


def test_the_stage_order_check_finds_a_backward_edge():
    graph = {
        "gpumem.checkpoint.stage.x": {"gpumem.checkpoint.storage.y", "gpumem.checkpoint.errors"},
        "gpumem.checkpoint.restore.z": {"gpumem.checkpoint.capture.w", "gpumem.checkpoint.save"},
        "gpumem.checkpoint.capture.w": {"gpumem.checkpoint"},
        "gpumem.checkpoint.checkpointer": {"gpumem.checkpoint.interop.v"},
    }
    assert checkpoint_order_violations(graph) == [
        "gpumem.checkpoint.capture.w -> gpumem.checkpoint",
        "gpumem.checkpoint.restore.z -> gpumem.checkpoint.save",
        "gpumem.checkpoint.stage.x -> gpumem.checkpoint.storage.y",
    ]


def test_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_package_graph_collapses_modules():
    graph = {"gpumem.a.x": {"gpumem.a.y", "gpumem.b"}, "gpumem.a.y": set(), "gpumem.b": {"gpumem"}}
    assert package_graph(graph) == {"gpumem.a": {"gpumem.b"}, "gpumem.b": {"gpumem"}}


def module_names() -> dict[str, list[str]]:
    """Each module or package name (the last part of its dotted name) -> the files (``.py``)
    and packages (``/``) that have it, relative to the repository."""
    names: dict[str, list[str]] = {}
    for path in sorted(PKG_ROOT.rglob("*.py")):
        rel = path.relative_to(PKG_ROOT.parent)
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(rel.as_posix())
        elif path.parent != PKG_ROOT:
            names.setdefault(path.parent.name, []).append(rel.parent.as_posix() + "/")
    return names


def name_clashes(names: dict[str, list[str]]) -> dict[str, list[str]]:
    """The names that more than one module or package has, not counting ``cli/<name>.py``
    beside a top-level ``<name>.py`` or ``<name>/`` (the subcommand that runs it)."""
    clashes = {}
    for name, paths in names.items():
        top_level = {f"gpumem/{name}.py", f"gpumem/{name}/"} & set(paths)
        rest = [p for p in paths if not (top_level and p == f"gpumem/cli/{name}.py")]
        if len(rest) > 1:
            clashes[name] = paths
    return clashes


def test_module_names_are_distinct():
    names = module_names()
    assert names["doctor"] == ["gpumem/cli/doctor.py", "gpumem/doctor.py"]  # the walk sees both
    assert "gpumem/profiler/" in names["profiler"]
    clashes = name_clashes(names)
    assert clashes == {}, f"module names used twice in gpumem/ (rename one): {clashes}"


# the same role in each trainer library's integration module (integrations/hf.py, lightning.py)
SAME_ROLE_CLASSES = {"CheckpointCallback"}


def class_names() -> dict[str, list[str]]:
    """Each class name defined in gpumem/ -> the modules that define one."""
    out: dict[str, list[str]] = {}
    for path in sorted(PKG_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(_module_name(path))
    return out


def test_class_names_are_distinct():
    """Two classes of one name (three ``Layout``s, two ``Snapshot``s once) make a cold reader
    guess which one a name means."""
    names = class_names()
    assert names["Checkpointer"] == ["gpumem.checkpoint.checkpointer"]  # the walk sees classes
    twice = {n: m for n, m in names.items() if len(m) > 1 and n not in SAME_ROLE_CLASSES}
    assert twice == {}, f"class names defined twice in gpumem/ (rename one): {twice}"


def test_name_clashes_are_found():
    assert name_clashes(
        {
            "state": ["gpumem/checkpoint/state.py", "gpumem/profiler/state.py"],
            "doctor": ["gpumem/cli/doctor.py", "gpumem/doctor.py"],
            "demo": ["gpumem/cli/demo.py", "gpumem/demo/"],
            "estimate": ["gpumem/cli/estimate.py", "gpumem/estimator/estimate.py"],
            "plan": ["gpumem/cli/plan.py"],
        }
    ) == {
        "state": ["gpumem/checkpoint/state.py", "gpumem/profiler/state.py"],
        "estimate": ["gpumem/cli/estimate.py", "gpumem/estimator/estimate.py"],
    }


def package_contents(init: Path) -> list[str]:
    """The modules and subpackages directly inside the package of ``init``."""
    here = init.parent
    modules = [p.stem for p in here.glob("*.py") if p.name != "__init__.py"]
    packages = [p.parent.name for p in here.glob("*/__init__.py")]
    return sorted(modules + packages)


def unlisted(doc: str, names: list[str]) -> list[str]:
    """The names no line of ``doc`` starts with (after its indent), followed by what it is:
    ``    session   the context manager`` (``session.py`` and ``session/`` count too)."""
    return [
        n for n in names if not re.search(rf"^[ \t]*{re.escape(n)}(\.py|/)?[ \t]+\S", doc, re.M)
    ]


def test_every_package_docstring_lists_its_modules():
    missing = {}
    inits = sorted(PKG_ROOT.rglob("__init__.py"))
    assert PKG_ROOT / "profiler" / "__init__.py" in inits
    for init in inits:
        rel = init.parent.relative_to(PKG_ROOT.parent).as_posix()
        doc = ast.get_docstring(ast.parse(init.read_text()), clean=True) or ""
        names = package_contents(init)
        assert names, rel
        if unlisted(doc, names):
            missing[rel] = unlisted(doc, names)
    assert missing == {}, f"__init__.py docstrings that do not list these, one line each: {missing}"


def test_unlisted_reads_one_line_per_name():
    doc = "Modules:\n\n    session   the context manager\n    report.py what it says\nhooks\n"
    assert unlisted(doc, ["session", "report", "hooks", "tracker"]) == ["hooks", "tracker"]
    assert package_contents(PKG_ROOT / "__init__.py")[:3] == ["__main__", "_assumptions", "_env"]
    assert "profiler" in package_contents(PKG_ROOT / "__init__.py")
