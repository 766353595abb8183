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
