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
from gpumem.writer import fsync_dir, read_file, read_into, write_file

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
            str(path),
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


def test_read_into_round_trip(tmp_path):
    raw = rand_bytes((17 << 20) + 9, 6)
    path = tmp_path / "r.bin"
    path.write_bytes(raw)
    out = torch.empty((17 << 20) // 4, dtype=torch.float32)
    assert read_into(path, 9, out, threads=3) == out.nbytes
    assert out.numpy().tobytes() == raw[9 : 9 + out.nbytes]
    buf = bytearray(100)
    read_into(path, 1000, buf)
    assert bytes(buf) == raw[1000:1100]
    arr = np.empty((3, 5), np.int32)
    read_into(path, 0, arr)
    assert arr.tobytes() == raw[:60]
    assert read_into(path, len(raw), bytearray()) == 0


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("chunk", [4096, 1 << 20, 16 << 20])
def test_read_file_pieces_and_chunk_crcs(tmp_path, threads, chunk):
    """Pieces land byte-exact (aligned arena views through O_DIRECT, odd buffers buffered) and
    every chunk CRC equals google-crc32c's over the same bytes."""
    import google_crc32c

    raw = rand_bytes((19 << 20) + 4096 * 3 + 77, 11)
    path = tmp_path / "r.bin"
    path.write_bytes(raw)
    sizes = [(17 << 20) + 5, 4096, 3000]  # a big one split over tasks, one page, an odd tail
    second = (sizes[0] + 4095) // 4096 * 4096  # same alignment phase in the file and the arena
    offsets = [0, second, second + 8192 + 1]
    with HostArena(sum(sizes) + 3 * 4096, pinned=False) as arena:
        outs = [
            arena.view(0, sizes[0]),
            arena.view(second, sizes[1]),
            torch.empty(sizes[2], dtype=torch.uint8),
        ]
        counts = [(n + chunk - 1) // chunk for n in sizes]
        index = [0, counts[0], counts[0] + counts[1]]
        crcs = np.full(sum(counts) + 2, -1, dtype=np.int64)
        got = read_file(
            path,
            list(zip(offsets, outs, strict=True)),
            threads=threads,
            direct=True,
            chunk_bytes=chunk,
            crc_index=index,
            crc_out=crcs,
        )
        assert got == sum(sizes)
        for off, out, n, first in zip(offsets, outs, sizes, index, strict=True):
            data = raw[off : off + n]
            assert out.numpy().tobytes() == data
            want = [google_crc32c.value(data[k : k + chunk]) for k in range(0, n, chunk)]
            assert crcs[first : first + len(want)].tolist() == want
        assert crcs[-2:].tolist() == [-1, -1]  # slots past the last piece untouched


def test_read_file_uses_o_direct_for_aligned_middles(tmp_path):
    raw = rand_bytes((8 << 20) + 100, 12)
    path = tmp_path / "d.bin"
    path.write_bytes(raw)
    with HostArena(len(raw) + 4096, pinned=False) as arena:
        out = arena.view(0, len(raw))
        nbytes, direct_bytes = C.read_file(
            str(path), [0], [out.numpy()], [-1], 0, np.empty(0, np.int64), 0, True
        )
        assert nbytes == len(raw) and out.numpy().tobytes() == raw
        if direct_bytes == 0:
            pytest.skip(f"{tmp_path} refuses O_DIRECT (read buffered instead, content verified)")
        assert (
            direct_bytes == len(raw) // 4096 * 4096
        )  # the unaligned tail came through the page cache


def test_read_file_errors(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError) as info:
        read_file(path, [(0, bytearray(10)), (50, bytearray(60))], direct=True)
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert "shorter than expected" in str(info.value)
    with pytest.raises(ValueError, match="needs CRC slots up to 2 but crc_out has 1"):
        read_file(
            path,
            [(0, bytearray(100))],
            chunk_bytes=64,
            crc_index=[0],
            crc_out=np.zeros(1, np.int64),
        )
    with pytest.raises(ValueError, match="needs crc_out"):
        read_file(path, [(0, bytearray(10))], chunk_bytes=64)
    with pytest.raises(ValueError, match="read-only"):
        read_file(path, [(0, b"abc")])
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "nope", [(0, bytearray(1))])


def test_read_past_eof_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError) as info:
        read_into(path, 50, bytearray(60))
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert "unexpected end of file" in str(info.value)
    with pytest.raises(FileNotFoundError):
        read_into(tmp_path / "nope", 0, bytearray(1))


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
    with pytest.raises(ValueError, match="out is read-only"):
        read_into(path, 0, b"abc")
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
            str(target), [0], [arena.view(0, 1 << 20).numpy()], -1, 0, True, True
        )
        assert written == 1 << 20 and direct_bytes in (0, 1 << 20)
        assert target.read_bytes() == rand_bytes(1 << 20, 7)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_dev_full_is_enospc():
    with pytest.raises(OSError) as info:
        write_file("/dev/full", [(0, b"x" * 10_000)], fsync=False)
    assert info.value.errno == errno.ENOSPC and info.value.filename == "/dev/full"


def test_drop_page_cache_walks_directories_and_keeps_the_bytes(tmp_path):
    from gpumem.writer import drop_page_cache

    (tmp_path / "d").mkdir()
    files = {tmp_path / "a.bin": b"x" * 10000, tmp_path / "d" / "b.bin": b"y" * 5000}
    for f, data in files.items():
        f.write_bytes(data)
    drop_page_cache([tmp_path / "a.bin", tmp_path / "d"])  # a file, and a directory walked
    assert all(f.read_bytes() == data for f, data in files.items())
    with pytest.raises(FileNotFoundError):
        drop_page_cache([tmp_path / "missing.bin"])
