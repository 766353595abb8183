"""The house rules run with the tests: lint, format and the public API's type check.

The README's test command (and so CI) runs them through pytest; ruff and mypy are test
dependencies. Configuration lives in pyproject.toml.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
