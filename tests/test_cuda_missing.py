"""Without a usable CUDA runtime only the CUDA paths turn off, with one clear message.

Each case runs in a fresh interpreter: the runtime is loaded once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json
from gpumem._native import cuda_runtime
from gpumem.arena import HostArena
rt = cuda_runtime()
out = {"available": rt.available, "message": rt.message}
try:
    HostArena(4096, pinned=True)
    out["pinned_error"] = None
except RuntimeError as e:
    out["pinned_error"] = str(e)
with HostArena(1 << 20) as arena:          # the default still works, unpinned
    arena.copy_in([b"abc"], [10])
    out["default_pinned"] = arena.pinned
    out["bytes"] = arena.view(10, 3).tolist()
print(json.dumps(out))
"""


def probe(**env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**full_env, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check_disabled(result: dict, reason: str) -> None:
    assert result["available"] is False
    assert result["message"].startswith(f"CUDA runtime not loaded: {reason}")
    assert result["message"].endswith("CUDA paths (pinned host memory) are disabled")
    assert result["pinned_error"].startswith("HostArena(pinned=True) needs the CUDA runtime, but ")
    assert result["message"] in result["pinned_error"]
    assert result["default_pinned"] is False and result["bytes"] == [97, 98, 99]


def test_missing_library():
    result = probe(GPUMEM_CUDA_LIBRARY="/nonexistent/libcudart.so.12")
    check_disabled(result, "GPUMEM_CUDA_LIBRARY=/nonexistent/libcudart.so.12 could not be loaded (")
    assert "No such file or directory" in result["message"]


def test_disabled_by_environment():
    check_disabled(probe(GPUMEM_DISABLE_CUDA="1"), "disabled by GPUMEM_DISABLE_CUDA=1")


def test_this_machine_reports_one_line():
    import torch

    from gpumem._native import cuda_runtime

    rt = cuda_runtime()
    if torch.cuda.is_available():
        assert rt.available and rt.device_count == torch.cuda.device_count() and rt.message == ""
        assert "libcudart" in rt.library
    else:
        assert not rt.available and rt.message.startswith("CUDA runtime not loaded: ")
        assert "\n" not in rt.message


def test_missing_extension_says_how_to_build():
    code = """
import sys
sys.modules["gpumem._C"] = None   # what an unbuilt source tree looks like to the import system
from gpumem._native import load
try:
    load()
except ImportError as e:
    print(e)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "gpumem._C is not built" in proc.stdout and "pip install -e ." in proc.stdout
    assert "C++17 compiler" in proc.stdout


@pytest.mark.gpu
def test_reuses_the_runtime_torch_loaded():
    code = """
import json, torch
torch.cuda.init()
from gpumem._native import cuda_runtime
rt = cuda_runtime()
maps = open("/proc/self/maps").read()
copies = {line.split()[-1] for line in maps.splitlines() if "libcudart" in line}
print(json.dumps({"available": rt.available, "library": rt.library, "copies": sorted(copies)}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["available"] and len(result["copies"]) == 1  # no second libcudart was loaded
