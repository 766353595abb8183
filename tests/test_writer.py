"""gpumem.writer: parallel pwrite round trips, O_DIRECT, and errors surfacing as OSError."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gpumem._native import load
from gpumem.arena import HostArena
from gpumem.writer import fsync_dir, write_file

C = load()


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 104729 + n).randbytes(n)


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def mixed_pieces(seed: int, count: int) -> tuple[list[tuple[int, object]], bytearray]:
    """Pieces of several buffer kinds at random offsets with gaps, and the file they must
    produce."""
    rng = random.Random(seed)
    pieces, expected, offset = [], bytearray(), 0
    for i in range(count):
        offset += rng.choice([0, 0, 1, 7, 4096, rng.randrange(10_000)])  # gaps read back as zeros
        n = rng.choice([0, 1, 9, 4095, 4097, rng.randrange(1, 300_000)])
        raw = rand_bytes(n, seed * 1000 + i)
        kind = i % 5
        if kind == 0:
            buf: object = raw
        elif kind == 1:
            buf = bytearray(raw)
        elif kind == 2:
            buf = np.frombuffer(raw, np.uint8)
        elif kind == 3 and n % 2 == 0:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.int16) if n else torch.empty(0)
        else:
            buf = memoryview(bytearray(b"\0" * 3 + raw))[3:]  # unaligned start
        pieces.append((offset, buf))
        expected[len(expected) :] = b"\0" * (offset + n - len(expected))
        expected[offset : offset + n] = raw
        offset += n
    rng.shuffle(pieces)
    return pieces, expected


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_round_trip_many_pieces(tmp_path, threads):
    pieces, expected = mixed_pieces(1, 60)
    path = tmp_path / "shard.bin"
    n = write_file(path, pieces, size=len(expected) + 100, threads=threads)
    assert n == sum(
        b.nbytes if isinstance(b, torch.Tensor) else memoryview(b).nbytes for _, b in pieces
    )
    assert path.read_bytes() == bytes(expected) + b"\0" * 100


def test_big_piece_is_split_and_continued(tmp_path):
    raw = rand_bytes((20 << 20) + 5, 2)
    path = tmp_path / "big.bin"
    assert write_file(path, [(3, raw)], threads=4) == len(raw)
    assert path.read_bytes() == b"\0" * 3 + raw


def test_size_truncates_and_existing_file_is_replaced(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_000)
    write_file(path, [(0, b"abcdef")], size=4, fsync=False)
    assert path.read_bytes() == b"abcd"
    write_file(str(path), [])
    assert path.read_bytes() == b""


def test_tensor_pieces_of_any_dtype(tmp_path):
    tensors = [
        torch.randn(100, 3).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(5, dtype=torch.complex64),
    ]
    pieces, offset, expected = [], 0, b""
    for t in tensors:
        pieces.append((offset, t))
        expected += bytes(t.untyped_storage())
        offset += t.nbytes
    write_file(tmp_path / "t.bin", pieces)
    assert (tmp_path / "t.bin").read_bytes() == expected


@pytest.mark.parametrize("tail", [0, 123])
def test_direct_io_round_trip(tmp_path, tail):
    # Aligned arena buffers at aligned offsets go through O_DIRECT, unaligned pieces buffered.
    size = (9 << 20) + tail
    with HostArena(size + 8192, pinned=False) as arena:
        src = np.frombuffer(rand_bytes(size, 3), np.uint8)
        arena.copy_in([src], [0])
        aligned = arena.view(0, size)
        odd = rand_bytes(5000, 4)
        path = tmp_path / "direct.bin"
        written, direct_bytes = C.write_file(
            os.fsencode(path),
            [0, size + 4096],
            [aligned.numpy(), np.frombuffer(odd, np.uint8)],
            -1,
            0,
            True,
            True,
        )
        assert written == size + len(odd)
        assert path.read_bytes() == src.tobytes() + b"\0" * 4096 + odd
        if direct_bytes == 0:
            pytest.skip(f"{tmp_path} refuses O_DIRECT (written buffered instead, content verified)")
        assert (
            direct_bytes == (size // 4096) * 4096
        )  # exactly the aligned middle; tail + odd buffered


def test_direct_with_unaligned_buffers_falls_back(tmp_path):
    pieces, expected = mixed_pieces(5, 30)
    path = tmp_path / "mixed.bin"
    write_file(path, pieces, direct=True, size=len(expected))
    assert path.read_bytes() == bytes(expected)


def test_fsync_dir(tmp_path):
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        fsync_dir(tmp_path / "missing")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as info:
        fsync_dir(tmp_path / "file")
    assert info.value.errno == errno.ENOTDIR


def test_bad_arguments(tmp_path):
    path = tmp_path / "x"
    with pytest.raises(TypeError, match=r"pieces\[0\] must be a \(file_offset, buffer\) pair"):
        write_file(path, [b"abc"])
    with pytest.raises(ValueError, match=r"pieces\[1\] file offset must be >= 0"):
        write_file(path, [(0, b"a"), (-5, b"b")])
    with pytest.raises(ValueError, match="not contiguous"):
        write_file(path, [(0, torch.ones(4, 4).t())])
    with pytest.raises(ValueError, match="size must be >= 0"):
        write_file(path, [], size=-1)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        write_file(path, [], threads=0)


# ---- error paths: each runs where the failure can be provoked for real ----


def test_read_only_directory_is_eacces():
    # Root ignores permission bits, so a root run drops to uid 65534 (nobody) in a child process.
    # The child loads everything it needs (gpumem._C included) *before* it drops: the checkout
    # may sit where only root can read (a private clone), and nobody could not import it there.
    parent = Path(tempfile.mkdtemp(prefix="gpumem-ro-", dir="/tmp"))
    try:
        parent.chmod(0o555)
        target = parent / "shard.bin"
        code = f"""
import json, os
from gpumem import _native
from gpumem.writer import write_file
_native.load()
if os.geteuid() == 0:
    os.chdir("/")
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    write_file({str(target)!r}, [(0, b"data")])
    print(json.dumps({{"ok": True}}))
except OSError as e:
    print(json.dumps({{"type": type(e).__name__, "errno": e.errno, "filename": e.filename,
                      "msg": str(e)}}))
"""
        proc = run_py(code)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result.get("errno") == errno.EACCES, result
        assert result["type"] == "PermissionError" and result["filename"] == str(target)
        assert "open for writing" in result["msg"]
    finally:
        parent.chmod(0o755)
        shutil.rmtree(parent, ignore_errors=True)


def test_file_size_limit_is_efbig(tmp_path):
    target = tmp_path / "big.bin"
    code = f"""
import json, resource, signal
from gpumem.writer import write_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then write() returns EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    write_file({str(target)!r}, [(0, bytes(4 << 20))], threads=2)
    print(json.dumps({{"ok": True}}))
except OSError as e:
    print(json.dumps({{"errno": e.errno, "filename": e.filename, "msg": str(e)}}))
"""
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result.get("errno") == errno.EFBIG, result
    assert result["filename"] == str(target) and "pwrite" in result["msg"]


@contextlib.contextmanager
def tiny_tmpfs(size: str):
    mnt = Path(tempfile.mkdtemp(prefix="gpumem-tmpfs-"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def test_full_tmpfs_is_enospc():
    with tiny_tmpfs("1m") as mnt:
        target = mnt / "shard.bin"
        with pytest.raises(OSError) as info:
            write_file(target, [(0, bytes(1 << 20)), (1 << 20, bytes(3 << 20))], threads=2)
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)


def test_direct_on_tmpfs():
    # tmpfs refuses O_DIRECT with EINVAL before Linux 6.6 (the writer then writes buffered) and
    # accepts it since; either way the call succeeds with the right content.
    with tiny_tmpfs("64m") as mnt, HostArena(1 << 20, pinned=False) as arena:
        arena.copy_in([rand_bytes(1 << 20, 7)], [0])
        target = mnt / "d.bin"
        written, direct_bytes = C.write_file(
            os.fsencode(target), [0], [arena.view(0, 1 << 20).numpy()], -1, 0, True, True
        )
        assert written == 1 << 20 and direct_bytes in (0, 1 << 20)
        assert target.read_bytes() == rand_bytes(1 << 20, 7)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_dev_full_is_enospc():
    with pytest.raises(OSError) as info:
        write_file("/dev/full", [(0, b"x" * 10_000)], fsync=False)
    assert info.value.errno == errno.ENOSPC and info.value.filename == "/dev/full"


def test_exclusive_creates_only_a_new_file_never_through_a_link(tmp_path):
    canary = tmp_path / "canary"
    canary.write_bytes(b"someone's")
    (tmp_path / "link").symlink_to(canary)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("canary", "link", "dangling"):
        with pytest.raises(FileExistsError):
            write_file(tmp_path / name, [(0, b"new")], exclusive=True)
    assert canary.read_bytes() == b"someone's" and not (tmp_path / "nowhere").exists()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert write_file("new", [(0, b"abc")], dir_fd=fd, exclusive=True, direct=True) == 3
    finally:
        os.close(fd)
    assert (tmp_path / "new").read_bytes() == b"abc"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_no_descriptor_leaks_when_planning_throws_after_the_open(tmp_path):
    """A piece that ends past the largest file offset is refused while planning, which runs
    after the file was opened (descriptors are owned by a guard, not closed by hand)."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        with pytest.raises(ValueError, match="ends past the largest file offset"):
            write_file(tmp_path / "x", [(2**63 - 4, b"0123456789")], direct=True)
    assert len(os.listdir("/proc/self/fd")) == before


def test_non_utf8_paths(tmp_path):
    path = os.path.join(os.fsencode(tmp_path), b"w-\xff.bin")
    assert write_file(path, [(0, b"abc")]) == 3
    assert write_file(os.fsdecode(path) + "2", [(0, b"de")]) == 2
    with open(path, "rb") as f:
        assert f.read() == b"abc"
    fsync_dir(os.fsencode(tmp_path))
