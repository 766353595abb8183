"""The native CUDA runtime loader and the pinning thread, against a fake libcudart on the CPU.

The fake (tests/native/fake_cudart.c, built by the fake_cudart fixture in tests/conftest.py)
implements the seven entry points csrc/cuda_api.cpp resolves and logs every call with the calling
thread's current device, so the real dlopen path, the chunked registration, its error path and the
device the pinning thread works on are all checked without a GPU. Each case runs in a fresh
interpreter: the runtime is loaded once per process.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_probe(code: str, lib: Path | str, tmp_path: Path, **env: str) -> tuple[dict, list[tuple]]:
    """Run ``code`` (which prints one JSON line) against ``lib``; its output and the fake's log."""
    log = tmp_path / "cudart.log"
    log.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMEM_", "FAKE_CUDART_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={
            **base,
            "GPUMEM_CUDA_LIBRARY": str(lib),
            "FAKE_CUDART_LOG": str(log),
            "GPUMEM_THREADS": "2",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = []
    if log.exists():
        for line in log.read_text().splitlines():
            what, *nums = line.split()
            entries.append((what, *map(int, nums)))
    return json.loads(proc.stdout.strip().splitlines()[-1]), entries


PIN = """
import ctypes, gc, json, os
from gpumem._native import cuda_runtime
from gpumem.arena import HostArena, current_cuda_device
lib = ctypes.CDLL(os.environ["GPUMEM_CUDA_LIBRARY"])  # the copy the native core loaded
rt = cuda_runtime()
lib.cudaSetDevice(2)  # what torch.cuda.set_device(2) does in this thread
out = {"available": rt.available, "count": rt.device_count, "library": rt.library,
       "current": current_cuda_device()}
arena = HostArena((2 << 30) + 12345, pinned=None)  # 2 GiB of address space, never touched
out["pinned"] = arena.pinned
try:
    out["done"] = arena.wait_pinned(60)
except RuntimeError as e:
    out["error"] = str(e)
out.update(pinned_bytes=arena.pinned_bytes, ptr=arena.data_ptr, n=arena.nbytes)
other = HostArena(4096, pinned=True, device=1)  # explicit device, whatever this thread's is
other.wait_pinned(60)
out["other"] = other.data_ptr
arena.close(); other.close(); del arena, other; gc.collect()
print(json.dumps(out))
"""


def test_pinning_registers_in_chunks_on_the_callers_device(fake_cudart, tmp_path):
    out, log = run_probe(PIN, fake_cudart, tmp_path)
    assert out["available"] and out["count"] == 4 and out["library"] == str(fake_cudart)
    assert out["current"] == 2 and out["pinned"] and out["done"] is True
    ptr, n, gib = out["ptr"], out["n"], 1 << 30
    assert out["pinned_bytes"] == n
    regs = [e[1:] for e in log if e[0] == "register"]
    # (address, bytes, flags, device of the registering thread): 1 GiB pieces tiling the arena,
    # cudaHostRegisterPortable, on device 2 (the caller's), never on the pin thread's default 0
    assert regs == [
        (ptr, gib, 1, 2),
        (ptr + gib, gib, 1, 2),
        (ptr + 2 * gib, 12345, 1, 2),
        (out["other"], 4096, 1, 1),
    ]
    assert sorted(e[1] for e in log if e[0] == "unregister") == sorted(r[0] for r in regs)
    assert ("set_device", 0, 0, 0, 0) not in log  # no context was made on GPU 0


def test_a_failed_registration_is_reported_and_only_the_registered_part_released(
    fake_cudart, tmp_path
):
    out, log = run_probe(PIN, fake_cudart, tmp_path, FAKE_CUDART_FAIL_REGISTER="2")
    gib = 1 << 30
    assert out["error"] == (
        f"cudaHostRegister of {gib} bytes at arena offset {gib} failed: "
        "fake: out of memory (cudaError 2)"
    )
    assert out["pinned_bytes"] == gib  # the first chunk stays pinned; copies split per chunk
    names = [e[0] for e in log]
    assert names.index("get_last_error") == names.index("register_failed") + 1  # error slot cleared
    assert (
        "register" not in names[names.index("register_failed") : names.index("get_last_error") + 1]
    )
    unreg = sorted(e[1] for e in log if e[0] == "unregister")
    assert unreg == sorted([out["ptr"], out["other"]])  # never the chunk that failed


PREPARE = """
import ctypes, json, os
import gpumem
lib = ctypes.CDLL(os.environ["GPUMEM_CUDA_LIBRARY"])
lib.cudaSetDevice(3)  # this rank trains on GPU 3
ck = gpumem.Checkpointer(os.environ["CKPT_DIR"], staging_bytes=64 << 20)
ck.prepare(nbytes=1 << 20)  # allocates and pins on a worker thread
ck.wait()
arena = ck._staging.arena
print(json.dumps({"pinned": arena.pinned, "ptr": arena.data_ptr, "done": arena.wait_pinned(60)}))
ck.close()
"""


def test_prepare_pins_on_the_trainers_device_not_the_worker_threads(fake_cudart, tmp_path):
    out, log = run_probe(PREPARE, fake_cudart, tmp_path, CKPT_DIR=str(tmp_path / "ck"))
    assert out["pinned"] and out["done"]
    regs = [e[1:] for e in log if e[0] == "register"]
    assert regs == [(out["ptr"], 1 << 20, 1, 3)]  # registered from a thread on device 3
    assert [e[1] for e in log if e[0] == "set_device"] == [
        3,
        3,
    ]  # the trainer's, then the pin thread's


LOAD = """
import json
from gpumem._native import cuda_runtime
from gpumem.arena import HostArena, current_cuda_device
rt = cuda_runtime()
with HostArena(4096) as arena:
    pinned = arena.pinned
print(json.dumps({"available": rt.available, "message": rt.message, "pinned": pinned,
                  "device": current_cuda_device()}))
"""


@pytest.mark.parametrize(
    "lib,env,reason",
    [
        ("fake", {"FAKE_CUDART_DEVICES": "0"}, "no CUDA device is visible"),
        (
            "fake",
            {"FAKE_CUDART_DEVICES": "-1"},
            "cudaGetDeviceCount failed: fake: no device (cudaError 100)",
        ),
        (
            ctypes.util.find_library("m") or "libm.so.6",
            {},
            "libcudart lacks the symbol cudaHostRegister",
        ),
    ],
)
def test_an_unusable_runtime_turns_only_the_cuda_paths_off(fake_cudart, tmp_path, lib, env, reason):
    out, log = run_probe(LOAD, fake_cudart if lib == "fake" else lib, tmp_path, **env)
    assert out["available"] is False and out["pinned"] is False and out["device"] is None
    assert out["message"].startswith(f"CUDA runtime not loaded: {reason}")
    assert not [e for e in log if e[0] in ("register", "set_device")]


TEARDOWN = """
import ctypes, json, os, threading, time
from gpumem._native import cuda_runtime, load
lib = ctypes.CDLL(os.environ["GPUMEM_CUDA_LIBRARY"])
assert cuda_runtime().available
buf = load().HostBuffer(3 * 4096, 4096)
buf.start_pinning(0)
while not lib.fake_blocked():  # the pin thread is inside cudaHostRegister, which waits for us
    time.sleep(0.001)
deleting = threading.Event()

def release():
    deleting.wait()
    time.sleep(0.2)  # main is inside `del buf` by now, joining the pin thread
    lib.fake_release()  # needs the GIL to get here

helper = threading.Thread(target=release)
helper.start()
deleting.set()
del buf
helper.join()
print(json.dumps({}))
"""


def test_destroying_a_buffer_while_it_pins_lets_other_python_threads_run(fake_cudart, tmp_path):
    # The destructor joins the pin thread, whose registration only ends when another Python
    # thread calls fake_release(). With the GIL held through the join, that thread could not run
    # and the fake would give up after 20 s ("register_timeout").
    _, log = run_probe(TEARDOWN, fake_cudart, tmp_path, FAKE_CUDART_BLOCK_REGISTER="1")
    names = [e[0] for e in log]
    assert "register_released" in names and "register_timeout" not in names
    assert names.count("register") == 1 and names.count("unregister") == 1


ENQUEUE = """
import ctypes, json, os, threading, time
import numpy as np
import torch
from gpumem.arena import HostArena
lib = ctypes.CDLL(os.environ["GPUMEM_CUDA_LIBRARY"])
gib = 1 << 30
arena = HostArena(gib + 8192, pinned=True)  # address space only: pages are touched where copied
arena.wait_pinned(60)
g = torch.Generator().manual_seed(0)
a = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g)  # "device" tensors: host here
b = torch.randn(100, generator=g)
rows = [(a.data_ptr(), 8192, gib - 4096), (b.data_ptr() + 40, 360, 4096)]  # a spans the boundary
copies = np.array(rows, dtype=np.uint64)
out = {"ptr": arena.data_ptr, "a": a.data_ptr(), "b": b.data_ptr()}
mode = os.environ["MODE"]
if mode == "copy":
    out["calls"] = arena.enqueue_d2h(copies, 0x5EED)
    out["a_ok"] = bool(torch.equal(arena.view(gib - 4096, 8192), a))
    out["b_ok"] = bool(torch.equal(arena.view(4096, 360), b.view(torch.uint8)[40:]))
elif mode == "bounds":
    bad = np.array([*rows, (b.data_ptr(), 400, gib + 8000)], dtype=np.uint64)
    try:
        arena.enqueue_d2h(bad, 1)
    except ValueError as e:
        out["error"] = str(e)
elif mode == "fail":
    try:
        arena.enqueue_d2h(copies, 1)
    except RuntimeError as e:
        out["error"] = str(e)
elif mode == "gil":
    t = threading.Thread(target=arena.enqueue_d2h, args=(copies, 7))
    t.start()
    while not lib.fake_blocked():  # the native call is inside cudaMemcpyAsync, waiting for us
        time.sleep(0.001)
    lib.fake_release()  # this thread runs Python meanwhile: the call let go of the GIL
    t.join()
print(json.dumps(out))
"""


def test_one_native_call_enqueues_every_copy_cut_at_the_registration_chunks(fake_cudart, tmp_path):
    """The snapshot's copies: one call, each row a cudaMemcpyAsync device-to-host on the given
    stream, a row that crosses a 1 GiB registration boundary cut there, the bytes where the
    offsets say."""
    out, log = run_probe(ENQUEUE, fake_cudart, tmp_path, MODE="copy")
    ptr, gib = out["ptr"], 1 << 30
    assert out["calls"] == 3 and out["a_ok"] and out["b_ok"]
    assert [e[1:4] for e in log if e[0] == "memcpy"] == [
        (ptr + gib - 4096, 4096, 0x5EED),
        (ptr + gib, 4096, 0x5EED),
        (ptr + 4096, 360, 0x5EED),
    ]


def test_a_copy_that_does_not_fit_is_refused_before_any_is_enqueued(fake_cudart, tmp_path):
    out, log = run_probe(ENQUEUE, fake_cudart, tmp_path, MODE="bounds")
    gib = 1 << 30
    assert out["error"] == (
        f"enqueue_d2h: copy 2 (400 bytes at offset {gib + 8000}) does not fit in the arena of "
        f"{gib + 8192} bytes"
    )
    assert not [e for e in log if e[0].startswith("memcpy")]


def test_a_cuda_error_names_the_copy_and_clears_the_error_slot(fake_cudart, tmp_path):
    out, log = run_probe(ENQUEUE, fake_cudart, tmp_path, MODE="fail", FAKE_CUDART_FAIL_MEMCPY="2")
    gib = 1 << 30
    assert out["error"] == (
        f"cudaMemcpyAsync of copy 0 (4096 bytes from device address {out['a'] + 4096} to arena "
        f"offset {gib}) failed: fake: invalid value (cudaError 1)"
    )
    names = [e[0] for e in log]
    assert names.count("memcpy") == 1 and names.count("memcpy_failed") == 1  # then it stopped
    assert names.index("get_last_error", names.index("memcpy_failed")) == (
        names.index("memcpy_failed") + 1
    )


def test_the_enqueue_releases_the_gil(fake_cudart, tmp_path):
    _, log = run_probe(ENQUEUE, fake_cudart, tmp_path, MODE="gil", FAKE_CUDART_BLOCK_MEMCPY="1")
    names = [e[0] for e in log]
    assert "memcpy_released" in names and "memcpy_timeout" not in names
    assert names.count("memcpy") == 3
