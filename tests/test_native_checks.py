"""The native thread pool, pin flag and reader, checked in C++ (tests/native/native_checks.cpp).

The serial path of ``parallel_for`` is unreachable from Python with a throwing item (no function
the bindings hand it throws), and a data race needs ThreadSanitizer to be seen reliably, so the
checks link csrc/{parallel,arena,cuda_api,reader,fileio,crc32c}.cpp into a small program: once
plainly, once with ``-fsanitize=thread`` where the compiler supports it (else that part skips,
saying so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "native" / "native_checks.cpp"] + [
    ROOT / "csrc" / f"{name}.cpp"
    for name in ("parallel", "arena", "cuda_api", "reader", "fileio", "crc32c")
]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build tests/native/native_checks.cpp")
    return cxx


def _build(out: Path, *flags: str) -> Path:
    subprocess.run(
        [_compiler(), "-std=c++17", "-O1", "-g", "-pthread", *flags, f"-I{ROOT / 'csrc'}"]
        + [str(s) for s in SOURCES]
        + ["-ldl", "-o", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("native") / "native_checks")


@pytest.fixture(scope="module")
def tsan(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("native_tsan")
    probe = d / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    try:
        subprocess.run(
            [_compiler(), "-fsanitize=thread", str(probe), "-o", str(d / "probe")],
            check=True,
            capture_output=True,
        )
        subprocess.run([str(d / "probe")], check=True, capture_output=True, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"this compiler or kernel cannot run ThreadSanitizer programs ({exc})")
    return _build(d / "native_checks_tsan", "-fsanitize=thread")


def test_parallel_for_runs_every_item_and_rethrows_the_first_error(plain):
    out = _run(plain, "parallel_for")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # the serial path (threads=1, a single item, or GPUMEM_THREADS=1 as the default) included
    assert "ok   n=64 threads=1: all 64 items ran (ran 64)" in lines
    assert "ok   n=64 threads=1: the first error, 'item 1', rethrown (got 'item 1')" in lines
    assert "ok   n=5 threads=0: all 5 items ran (ran 5)" in lines
    assert len(lines) == 26 and all(line.startswith("ok ") for line in lines)


def _disk_dir() -> Path:
    """A directory on a disk (the temporary directory may be tmpfs, which refuses O_DIRECT and so
    never starts the reader's prefault thread)."""
    d = ROOT / "build" / "native_checks"
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_read_file_prefaults_ahead_of_the_readers(plain):
    out = _run(plain, "read_file", str(_disk_dir()))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("ok ") for line in lines), out.stdout
    # O_DIRECT took the middles (this directory's file system allows it), so the prefaulter ran
    assert "(0 bytes through O_DIRECT)" not in out.stdout


def test_pin_flag_and_pool_are_race_free_under_thread_sanitizer(tsan, fake_cudart):
    for args in (
        ("pin_flag", str(fake_cudart)),
        ("parallel_for",),
        ("read_file", str(_disk_dir())),
    ):
        out = _run(tsan, *args)
        assert out.returncode == 0 and "ThreadSanitizer" not in out.stderr, (
            out.stdout + out.stderr[-6000:]
        )
        assert out.stdout and all(line.startswith("ok ") for line in out.stdout.splitlines())


def test_pin_flag_stress_without_sanitizer(plain, fake_cudart):
    out = _run(plain, "pin_flag", str(fake_cudart))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok   20 rounds: one pin thread per buffer, every poller saw pinning finish" in (
        out.stdout.splitlines()
    )
