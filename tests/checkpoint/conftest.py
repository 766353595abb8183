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


# the object-store tests: a local S3 server in a child process and a fault proxy (see s3_lib)
@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    from s3_lib import serve

    yield from serve(tmp_path_factory)


@pytest.fixture
def s3_proxy(s3_server):
    from s3_lib import proxy_for

    yield from proxy_for(s3_server)


@pytest.fixture
def s3_bucket(s3_server):
    from s3_lib import CREDENTIALS, env, new_bucket

    with env(CREDENTIALS):
        return new_bucket(s3_server.url)


def pytest_terminal_summary(terminalreporter):
    """How many fault-sweep cases ran (test_fault_sweep.py), in the output CI keeps."""
    sweep = sys.modules.get("fault_sweep")
    for line in getattr(sweep, "RAN", []):
        terminalreporter.write_line(line)
