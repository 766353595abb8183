"""The house rules run with the tests: lint, format and the public API's type check.

The README's test command (and so CI) runs them through pytest; ruff and mypy are test
dependencies. Configuration lives in pyproject.toml.
"""

from __future__ import annotations

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
