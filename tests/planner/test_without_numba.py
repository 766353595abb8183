"""numba is an extra (``gpumem[plan]``): without it a large sweep runs the same formula in
Python, says so in one warning, and gives the same plan."""

from __future__ import annotations

import pytest

import gpumem
from gpumem.planner import search


def _best(result) -> list[str]:
    return [c.describe() for c in result.candidates[:5]]


def test_a_large_sweep_without_numba_runs_in_python_and_says_so(monkeypatch):
    small = gpumem.plan("llama-2-7b", gpu="H100-80GB", n_gpus=8, seq_len=2048)
    monkeypatch.setattr(search, "NUMBA_FROM_ROWS", 1)  # every sweep counts as large
    monkeypatch.setattr(search, "_numba_installed", lambda: False)
    monkeypatch.setattr(search, "sweep", pytest.fail)  # the compiled kernel is never asked for
    with pytest.warns(search.PythonSweepNotice, match=r"pip install 'gpumem\[plan\]'"):
        large = gpumem.plan("llama-2-7b", gpu="H100-80GB", n_gpus=8, seq_len=2048)
    assert _best(large) == _best(small)
