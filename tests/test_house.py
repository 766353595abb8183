"""The house rules run with the tests: lint, format and the public API's type check.

The README's test command (and so CI) runs them through pytest; ruff and mypy are test
dependencies. Configuration lives in pyproject.toml.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["gpumem", "tests", "benchmarks", "setup.py"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_check():
    out = _run("ruff", "check", "--no-cache", *TREES)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = _run("ruff", "format", "--check", "--no-cache", *TREES)
    assert out.returncode == 0, "run `ruff format` on:\n" + out.stdout + out.stderr


def test_public_api_type_check():
    out = _run("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_version_is_stated_once():
    # gpumem/_version.py is the version: pyproject.toml reads it, the native core repeats it
    from gpumem._version import __version__

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "gpumem._version.__version__" }' in pyproject
    assert f'm.attr("__version__") = "{__version__}";' in (ROOT / "csrc/module.cpp").read_text()
    native = pytest.importorskip("gpumem._C")
    assert native.__version__ == __version__


def private_imports(pkg: Path) -> list[str]:
    """``from gpumem... import _name`` where ``_name`` is not a module: a name one module
    keeps to itself, taken by another (make it public where it is shared)."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        package = parts if parts[-1] == "__init__" else parts[:-1]
        package = [p for p in package if p != "__init__"]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = [*base, *(node.module.split(".") if node.module else [])]
            elif (node.module or "").split(".")[0] == pkg.name:
                module = (node.module or "").split(".")
            else:
                continue  # outside gpumem
            where = pkg.parent.joinpath(*module)
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if (where / f"{name}.py").exists() or (where / name / "__init__.py").exists():
                    continue  # a private module of its package, imported inside it
                found.append(f"{path.relative_to(pkg.parent)}:{node.lineno} {name}")
    return found


def test_no_private_names_imported_across_modules():
    assert private_imports(ROOT / "gpumem") == []


def test_private_imports_are_found(tmp_path):
    pkg = tmp_path / "gpumem"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import _private_module\n")
    (pkg / "_private_module.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def _helper(): ...\n")
    (pkg / "sub" / "b.py").write_text(
        "from .a import _helper\nfrom gpumem.sub.a import _helper as h\nfrom os import _exit\n"
    )
    assert private_imports(pkg) == ["gpumem/sub/b.py:1 _helper", "gpumem/sub/b.py:2 _helper"]
