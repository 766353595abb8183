import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The machine is shared: the checkpoint tests keep the native thread pool this small.
NATIVE_THREADS = 2


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    # The variable reaches the processes these tests start. This process loaded gpumem._C during
    # collection, before any fixture ran, and reads GPUMEM_THREADS only then: set its pool too.
    from gpumem._native import load

    monkeypatch.setenv("GPUMEM_THREADS", str(NATIVE_THREADS))
    native = load()
    before = native.num_threads()
    native.set_num_threads(NATIVE_THREADS)
    yield
    native.set_num_threads(before)
