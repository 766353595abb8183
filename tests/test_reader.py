"""gpumem.reader: parallel pread into pieces with chunk CRCs, O_DIRECT, errors as OSError, and
the strict mode that opens only a regular file of the expected size."""

from __future__ import annotations

import errno
import os
import random
import stat

import numpy as np
import pytest
import torch

from gpumem._native import load
from gpumem.arena import HostArena
from gpumem.reader import drop_page_cache, read_file, read_into

C = load()


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 104729 + n).randbytes(n)


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


@pytest.mark.parametrize("threads", [1, 4])
def test_read_into_fresh_memory(tmp_path, threads):
    """Never-touched, page-aligned buffers of many tasks (each reader maps its pages in before
    its O_DIRECT read, as a restore's fresh tensors) land byte-exact with google-crc32c's chunk
    CRCs; a file that ends early inside a piece is an EIO error."""
    import google_crc32c

    chunk = 1 << 20
    raw = rand_bytes((41 << 20) + 4096 * 2, 13)
    path = tmp_path / "f.bin"
    path.write_bytes(raw)
    sizes = [25 << 20, (16 << 20) + 4096, 4096]
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    outs = []
    for n in sizes:
        base = torch.empty(n + 4096, dtype=torch.uint8)
        skip = -base.data_ptr() % 4096
        outs.append(base[skip : skip + n])
    counts = [-(-n // chunk) for n in sizes]
    index = [0, counts[0], counts[0] + counts[1]]
    crcs = np.full(sum(counts), -1, dtype=np.int64)
    pieces = list(zip(offsets, outs, strict=True))

    def read() -> int:
        return read_file(
            path,
            pieces,
            threads=threads,
            direct=True,
            chunk_bytes=chunk,
            crc_index=index,
            crc_out=crcs,
        )

    assert read() == sum(sizes)
    for off, out, n, first in zip(offsets, outs, sizes, index, strict=True):
        data = raw[off : off + n]
        assert out.numpy().tobytes() == data
        want = [google_crc32c.value(data[k : k + chunk]) for k in range(0, n, chunk)]
        assert crcs[first : first + len(want)].tolist() == want
    with open(path, "r+b") as f:
        f.truncate(30 << 20)  # inside the second piece
    with pytest.raises(OSError) as info:
        read()
    assert info.value.errno == errno.EIO


def test_read_file_uses_o_direct_for_aligned_middles(tmp_path):
    raw = rand_bytes((8 << 20) + 100, 12)
    path = tmp_path / "d.bin"
    path.write_bytes(raw)
    drop_page_cache([path])  # from the disk, as after a reboot: the middles through O_DIRECT
    with HostArena(len(raw) + 4096, pinned=False) as arena:
        out = arena.view(0, len(raw))

        def read() -> tuple[int, int, int, int]:
            out.zero_()
            got = C.read_file(
                os.fsencode(path), [0], [out.numpy()], [-1], 0, np.empty(0, np.int64), 0, True
            )
            assert out.numpy().tobytes() == raw
            return got

        nbytes, direct_bytes, nonzero, cached = read()
        assert nbytes == len(raw)
        assert nonzero == -1  # no must-be-zero piece was asked for
        if direct_bytes == 0 and cached == 0:
            pytest.skip(f"{tmp_path} refuses O_DIRECT (read buffered instead, content verified)")
        if cached:
            pytest.skip("the page cache kept the file (fadvise DONTNEED ignored): nothing to test")
        assert (
            direct_bytes == len(raw) // 4096 * 4096
        )  # the unaligned tail came through the page cache
        # A file the page cache holds whole is copied from it, not read from the disk again
        # (where the kernel answers cachestat(2), 6.5+; else O_DIRECT as before).
        with open(path, "rb") as f:
            f.read()
        nbytes, direct_bytes, nonzero, cached = read()
        assert nbytes == len(raw) and direct_bytes + cached == len(raw) // 4096 * 4096
        if _cachestat():
            assert cached == len(raw) // 4096 * 4096 and direct_bytes == 0


def _cachestat() -> bool:
    """Whether this kernel has cachestat(2) (Linux 6.5+)."""
    import platform

    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    return platform.system() == "Linux" and release >= (6, 5)


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


def test_drop_page_cache_walks_directories_and_keeps_the_bytes(tmp_path):
    (tmp_path / "d").mkdir()
    files = {tmp_path / "a.bin": b"x" * 10000, tmp_path / "d" / "b.bin": b"y" * 5000}
    for f, data in files.items():
        f.write_bytes(data)
    drop_page_cache([tmp_path / "a.bin", tmp_path / "d"])  # a file, and a directory walked
    assert all(f.read_bytes() == data for f, data in files.items())
    with pytest.raises(FileNotFoundError):
        drop_page_cache([tmp_path / "missing.bin"])


def test_read_only_buffer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="out is read-only"):
        read_into(tmp_path / "x", 0, b"abc")


# ---- strict mode: only the regular file of the size asked for (issue #14) ----


def _strict(path, size, **kw):
    buf = bytearray(max(size, 0))
    return read_file(path, [(0, buf)] if size else [], expect_size=size, **kw), bytes(buf)


def test_strict_read_of_the_expected_file(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    assert _strict(tmp_path / "f", 10) == (10, b"0123456789")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # relative to a directory descriptor, as the checkpoint reader uses it
        assert _strict("f", 10, dir_fd=fd) == (10, b"0123456789")
    finally:
        os.close(fd)


def test_strict_read_refuses_what_is_not_the_expected_file(tmp_path, in_child):
    """A symlink (even to the right bytes), a FIFO, a device, a directory or another size: an
    UnexpectedFileError (an OSError) naming the file, and nothing read. The FIFO would block
    an open for reading forever, so the cases run in a child with a time limit."""
    from gpumem.reader import UnexpectedFileError

    (tmp_path / "f").write_bytes(b"0123456789")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    cases = {
        "link": (10, "symbolic link"),
        "fifo": (0, "a FIFO"),
        "dir": (0, "a directory"),
        "f": (11, "is 10 bytes, expected 11"),
    }
    try:
        os.mknod(tmp_path / "dev", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # as /dev/zero
        cases["dev"] = (0, "a character device")
    except OSError:
        pass  # no CAP_MKNOD here: the other cases still run

    def case():
        for name, (size, match) in cases.items():
            with pytest.raises(UnexpectedFileError, match=match) as info:
                _strict(tmp_path / name, size)
            assert info.value.filename == str(tmp_path / name), name
        # without expect_size the reader reads what the caller points it at
        assert read_file(tmp_path / "link", [(0, bytearray(10))]) == 10

    in_child(case)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_no_descriptor_leaks_when_a_read_fails_after_opening(tmp_path):
    """Descriptors are owned by a guard in the native core: the failures after the open (a file
    shorter than its pieces, read through both descriptors with direct=True) close them."""
    (tmp_path / "short").write_bytes(b"x" * 100)
    before = _open_fds()
    for _ in range(200):
        with pytest.raises(OSError, match="shorter than expected"):
            read_file(tmp_path / "short", [(0, bytearray(4096 * 3))], direct=True, expect_size=100)
    assert _open_fds() == before


def test_non_utf8_paths(tmp_path):
    path = os.path.join(os.fsencode(tmp_path), b"r-\xff.bin")
    with open(path, "wb") as f:
        f.write(b"abcdef")
    assert _strict(path, 6) == (6, b"abcdef")
    out = bytearray(3)
    assert read_into(os.fsdecode(path), 2, out) == 3 and bytes(out) == b"cde"
    with pytest.raises(FileNotFoundError) as info:
        read_into(path + b"-missing", 0, bytearray(1))
    assert os.fsencode(info.value.filename) == path + b"-missing"
