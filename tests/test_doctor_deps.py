"""Issue 23 (7): `gpumem doctor` keeps the build tools apart from the runtime dependencies, and
says "no NVIDIA driver" where libcudart's answer is "driver version is insufficient" only
because there is no driver at all."""

from __future__ import annotations

import pytest

from gpumem import _native
from gpumem.doctor import run_doctor

INSUFFICIENT = {
    "available": False,
    "library": "libcudart.so.12",
    "device_count": 0,
    "reason": "cudaGetDeviceCount failed: CUDA driver version is insufficient for CUDA runtime "
    "version",
}


def test_build_tools_are_not_runtime_versions():
    report = run_doctor(measure=False)
    assert "nanobind" not in report.versions
    assert {"torch", "numpy", "numba", "nvidia-ml-py"} <= set(report.versions)
    assert set(report.build) == {"nanobind", "cmake", "ninja"}
    text = report.text()
    runtime = text.split("build tools")[0]
    assert "nanobind" not in runtime and "build tools (only to rebuild gpumem._C)" in text
    assert "build" in report.to_dict()


class _FakeCore:
    def cuda_load(self, disabled, library):
        return dict(INSUFFICIENT)


@pytest.fixture
def insufficient(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: _FakeCore())
    _native.cuda_runtime.cache_clear()
    yield
    _native.cuda_runtime.cache_clear()


def test_no_driver_is_said_so(insufficient, monkeypatch):
    monkeypatch.setattr(_native, "nvidia_driver_present", lambda: False)
    msg = _native.cuda_runtime().message
    assert "no NVIDIA driver on this machine" in msg and "insufficient" not in msg


def test_an_old_driver_is_still_insufficient(insufficient, monkeypatch):
    monkeypatch.setattr(_native, "nvidia_driver_present", lambda: True)
    assert "driver version is insufficient" in _native.cuda_runtime().message


def test_a_missing_extra_says_how_to_install_it(monkeypatch):
    import importlib.metadata

    from gpumem import doctor

    real = importlib.metadata.version

    def version(pkg):
        if pkg == "numba":
            raise importlib.metadata.PackageNotFoundError(pkg)
        return real(pkg)

    monkeypatch.setattr(importlib.metadata, "version", version)
    out = doctor._installed(("numba", "numpy"))
    assert out["numba"].startswith("not installed (optional: pip install 'gpumem[plan]'")
    assert out["numpy"] == real("numpy")
