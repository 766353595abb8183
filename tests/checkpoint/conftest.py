import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    # the machine is shared: keep the native pools small in tests
    monkeypatch.setenv("GPUMEM_THREADS", "2")
