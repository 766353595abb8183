"""Test tiers: the CPU tier runs everywhere (Triton under its interpreter); the `gpu` marker runs
on a real CUDA device and skips cleanly without one; `slow` runs with --runslow."""

import os

# Must be set before any Triton kernel module is imported: on a CPU machine Triton kernels run in
# the interpreter. On a CUDA machine they compile for the device.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        _cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        _cuda = False
    os.environ["TRITON_INTERPRET"] = "0" if _cuda else "1"

# the step simulations' on-disk cache (gpumem/estimator/sim_cache.py) stays off in tests, and
# in the CLI processes they start: each test simulates afresh and writes nothing to the home
# folder; tests/estimator/test_reserved.py turns it on in a temporary folder
os.environ.setdefault("GPUMEM_CACHE_DIR", "off")

import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_CUDART = Path(__file__).parent / "native" / "fake_cudart.c"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    has_gpu = _cuda_available()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


@pytest.fixture
def in_child():
    """``in_child(fn, timeout=20)`` runs ``fn()`` in a forked child and fails the test if it
    raises there (with its traceback) or hangs past ``timeout`` seconds: a read blocked on a FIFO
    inside native code is interrupted by no signal handler, but a child can be killed."""
    import os
    import signal
    import sys
    import time
    import traceback

    def run(fn, timeout: float = 20.0) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            os.close(r)
            code = 0
            try:
                torch = sys.modules.get("torch")
                if torch is not None:  # the parent's OpenMP pool does not survive a fork
                    torch.set_num_threads(1)
                fn()
            except BaseException:
                code = 1
                os.write(w, traceback.format_exc().encode()[-16000:])  # below a pipe's buffer
            finally:
                os._exit(code)
        os.close(w)
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail(f"hung: no result within {timeout:g} s (killed)")
                time.sleep(0.01)
            with os.fdopen(r, "rb") as f:
                report = f.read().decode(errors="replace")
            r = -1
        finally:
            if r != -1:
                os.close(r)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            pytest.fail(f"failed in the child (exit {code}):\n{report}", pytrace=False)

    return run


@pytest.fixture(scope="session")
def fake_cudart(tmp_path_factory) -> Path:
    """tests/native/fake_cudart.c built as a shared library: a libcudart stand-in for CPU runs."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcudart")
    lib = tmp_path_factory.mktemp("fakecudart") / "libfakecudart.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(FAKE_CUDART), "-lpthread"], check=True
    )
    return lib
