"""gpumem.arena.HostArena: aligned allocation, aliasing views, threaded copies, lifetime,
pinning."""

from __future__ import annotations

import gc
import itertools
import random

import numpy as np
import pytest
import torch

from gpumem._native import cuda_runtime, load
from gpumem.arena import HostArena


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 31 + n).randbytes(n)


@pytest.mark.parametrize("alignment", [64, 4096, 2 << 20])
def test_allocation_is_aligned(alignment):
    with HostArena(12345, pinned=False, alignment=alignment) as arena:
        assert arena.nbytes == 12345 and arena.pinned is False
        assert arena.data_ptr % max(alignment, 4096) == 0
        assert arena.view(0, 12345).data_ptr() == arena.data_ptr


def test_views_alias_the_arena():
    with HostArena(1 << 16, pinned=False) as arena:
        a = arena.view(100, 50)
        a.copy_(torch.arange(50, dtype=torch.uint8))
        b = arena.view(120, 10)
        assert b.tolist() == list(range(20, 30))
        assert a.data_ptr() == arena.data_ptr + 100
        f = arena.tensor(4096, torch.float32, (4, 8))
        f.fill_(1.5)
        assert arena.view(4096, 4).tolist() == list(np.float32(1.5).tobytes())
        assert arena.tensor(4096, torch.float32, 32).shape == (32,)
        assert arena.tensor(4096, torch.bfloat16, (0,)).numel() == 0


def test_tensor_offset_and_bounds_errors():
    with HostArena(4096, pinned=False) as arena:
        with pytest.raises(
            ValueError, match=r"offset 2 is not a multiple of the torch.float32 item size 4"
        ):
            arena.tensor(2, torch.float32, (4,))
        with pytest.raises(ValueError, match="outside the arena of 4096 bytes"):
            arena.tensor(4000, torch.float64, (13,))
        with pytest.raises(ValueError, match="outside the arena"):
            arena.view(-1, 10)
        with pytest.raises(TypeError, match="offset must be an int"):
            arena.view(1.5, 10)


def test_copy_in_many_dtypes_and_buffer_kinds():
    sources = [
        torch.randn(100, 7).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randn(9, dtype=torch.complex128),
        np.arange(1000, dtype=np.int32),
        rand_bytes(777, 1),
        bytearray(rand_bytes(5, 2)),
        torch.empty(0),
    ]
    offsets, expected, offset = [], bytearray(), 0
    for s in sources:
        raw = (
            bytes(s.untyped_storage())
            if isinstance(s, torch.Tensor)
            else bytes(memoryview(s).cast("B"))
        )
        offset += (-offset) % 64  # 64-byte slots, as a stager would lay them out
        offsets.append(offset)
        expected[len(expected) :] = b"\0" * (offset - len(expected)) + raw
        offset += len(raw)
    with HostArena(len(expected), pinned=False) as arena:
        arena.view(0, len(expected)).zero_()
        arena.copy_in(sources, offsets)
        assert arena.view(0, len(expected)).numpy().tobytes() == bytes(expected)


@pytest.mark.parametrize("threads", [None, 1, 2, 5])
def test_copy_in_large_sources(threads):
    big = torch.from_numpy(np.frombuffer(rand_bytes((11 << 20) + 3, 3), np.uint8).copy())
    small = torch.arange(1000, dtype=torch.int64)
    with HostArena((12 << 20) + 8192, pinned=False) as arena:
        arena.copy_in([big, small], [5, (11 << 20) + 4096], threads=threads)
        assert torch.equal(arena.view(5, big.numel()), big)
        assert torch.equal(arena.tensor((11 << 20) + 4096, torch.int64, 1000), small)


@pytest.mark.parametrize("chunk", [4096, 1 << 20, 8 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_in_with_crcs_matches_the_reference(chunk, threads):
    # the CRCs the copy computes (block by block, from the bytes it stored) equal google-crc32c's
    # of each source's chunks; pieces of odd sizes, one with no CRC slots (-1), one larger than a
    # copy task (4 MiB) and than the chunk
    import google_crc32c

    sizes = [(9 << 20) + 12345, 77, 3 * chunk + 1, 5000]
    srcs = [np.frombuffer(rand_bytes(n, i), np.uint8).copy() for i, n in enumerate(sizes)]
    offsets = list(itertools.accumulate([0] + [n + 100 for n in sizes[:-1]]))
    counts = [-(-n // chunk) for n in sizes]
    index = [0, -1, counts[0], counts[0] + counts[2]]
    out = np.full(counts[0] + counts[2] + counts[3] + 2, 7, dtype=np.int64)
    with HostArena(offsets[-1] + sizes[-1], pinned=False) as arena:
        arena.copy_in(
            srcs, offsets, threads=threads, chunk_bytes=chunk, crc_index=index, crc_out=out
        )
        for src, off in zip(srcs, offsets, strict=True):
            assert np.array_equal(arena.view(off, src.size).numpy(), src)
    for src, first in zip(srcs, index, strict=True):
        if first < 0:
            continue
        want = [
            google_crc32c.value(src[k : k + chunk].tobytes()) for k in range(0, len(src), chunk)
        ]
        assert out[first : first + len(want)].tolist() == want
    assert out[-2:].tolist() == [7, 7]  # nothing written past the last slot


def test_copy_in_with_crcs_rejects_bad_slots():
    with HostArena(1 << 16, pinned=False) as arena:
        out = np.zeros(2, dtype=np.int64)
        with pytest.raises(ValueError, match=r"piece 0 needs CRC slots up to 3 but crc_out has 2"):
            arena.copy_in([b"x" * 9000], [0], chunk_bytes=4096, crc_index=[0], crc_out=out)
        with pytest.raises(ValueError, match="chunk_bytes > 0 go together"):
            arena.copy_in([b"x"], [0], chunk_bytes=0, crc_index=[0], crc_out=out)
        with pytest.raises(ValueError, match="1 sources but 2 CRC indices"):
            arena.copy_in([b"x"], [0], chunk_bytes=4096, crc_index=[0, 1], crc_out=out)
        with pytest.raises(ValueError, match="for reads only"):
            arena.copy_in([b"x"], [0], chunk_bytes=4096, crc_index=[-2], crc_out=out)
        with pytest.raises(ValueError, match="CRC index -3"):
            arena.copy_in([b"x"], [0], chunk_bytes=4096, crc_index=[-3], crc_out=out)


def test_copy_in_errors():
    with HostArena(1000, pinned=False) as arena:
        with pytest.raises(
            ValueError,
            match=r"source 1 \(100 bytes at offset 950\) does not fit in the arena of 1000 bytes",
        ):
            arena.copy_in([b"x" * 10, b"y" * 100], [0, 950])
        with pytest.raises(ValueError, match="2 sources but 1 offsets"):
            arena.copy_in([b"a", b"b"], [0])
        with pytest.raises(ValueError, match=r"sources\[0\] is not contiguous"):
            arena.copy_in([torch.ones(4, 4).t()], [0])
        with pytest.raises(ValueError, match="negative offset"):
            arena.copy_in([b"a"], [-1])


def test_close_and_view_lifetime():
    arena = HostArena(1 << 20, pinned=False)
    keep = arena.tensor(8, torch.int32, (5,))
    keep.copy_(torch.arange(5, dtype=torch.int32))
    arena.close()
    arena.close()  # idempotent
    assert arena.closed
    with pytest.raises(RuntimeError, match="closed"):
        arena.view(0, 1)
    with pytest.raises(RuntimeError, match="closed"):
        arena.copy_in([b"a"], [0])
    gc.collect()
    assert keep.tolist() == [0, 1, 2, 3, 4]  # a live view keeps the memory valid
    with HostArena(64, pinned=False) as other:
        pass
    assert other.closed


def test_bad_construction():
    with pytest.raises(ValueError, match="nbytes must be positive"):
        HostArena(0)
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        HostArena(100, alignment=100)
    with pytest.raises(MemoryError):
        HostArena(1 << 62, pinned=False)


def test_sizes_that_overflow_the_address_space_are_refused():
    # Rounding 2**64 - 1 bytes up to a page wraps to 0; with an 8 KiB alignment that once mapped
    # 8 KiB and reported an arena of 2**64 - 1 bytes, so copy_in's bounds check passed any offset.
    C = load()
    for nbytes, alignment in [
        (2**64 - 1, 8192),
        (2**64 - 4095, 8192),
        (2**63 - 1, 2**63),  # fits alone, but not with the alignment's padding
        (2**63, 4096),  # over PTRDIFF_MAX: no object may be that large
    ]:
        with pytest.raises(ValueError, match=rf"arena size {nbytes} bytes .* cannot be mapped"):
            C.HostBuffer(nbytes, alignment)
        with pytest.raises(
            ValueError, match=r"more than this process can address|cannot be mapped"
        ):
            HostArena(nbytes, pinned=False, alignment=alignment)
    with pytest.raises(ValueError, match=r"nbytes 2361183241434822606848 is more than"):
        HostArena(2**71, pinned=False)
    with pytest.raises(MemoryError):  # fits the arithmetic, not the machine
        C.HostBuffer(1 << 62, 8192)


def test_default_pinning_follows_cuda_runtime():
    with HostArena(4096) as arena:
        assert arena.pinned == cuda_runtime().available
        if not arena.pinned:
            assert arena.wait_pinned() is False and arena.pinned_bytes == 0


def test_pinned_true_without_cuda_is_a_clear_error():
    if cuda_runtime().available:
        pytest.skip("the CUDA runtime is available here")
    with pytest.raises(
        RuntimeError,
        match=r"HostArena\(pinned=True\) needs the CUDA runtime, but CUDA runtime not loaded",
    ):
        HostArena(4096, pinned=True)


def test_copy_from_device_never_crosses_a_pinning_chunk(monkeypatch):
    """One copy per registration chunk it touches, bytes intact (CPU source, small chunks)."""
    with HostArena(5 * 4096, pinned=False) as arena:
        assert arena.pin_chunk == 1 << 30  # the native core's registration granularity
        arena.pinned, arena._pin_chunk = True, 4096  # as if pinned in 4 KiB registrations
        seen = []
        real_view = arena.view
        monkeypatch.setattr(arena, "view", lambda o, n: seen.append((o, n)) or real_view(o, n))
        src = torch.arange(3000, dtype=torch.int32)  # 12000 bytes at 4000: touches chunks 0-3
        arena.copy_from_device(src, 4000)
        assert seen == [(4000, 96), (4096, 4096), (8192, 4096), (12288, 3712)]
        assert torch.equal(real_view(4000, 12000).view(torch.int32), src)
        seen.clear()
        arena.copy_from_device(src[:1024], 8192)  # exactly one chunk: one copy
        assert seen == [(8192, 4096)]
        arena.pinned = False  # plain memory has no registrations: one copy
        seen.clear()
        arena.copy_from_device(src, 4000)
        assert seen == [(4000, 12000)]
        with pytest.raises(ValueError, match="outside the arena"):
            arena.copy_from_device(src, 5 * 4096 - 100)
        with pytest.raises(ValueError, match="not contiguous"):
            arena.copy_from_device(src[::2], 0)


@pytest.mark.gpu
def test_pinned_arena_on_gpu():
    n = (2 << 30) + (8 << 20)  # three registration chunks, the last one long enough for src
    with HostArena(n, pinned=True) as arena:
        assert arena.pinned and arena.pin_chunk == 1 << 30
        src = torch.randn(1 << 20, device="cuda")
        # While pinning runs, a copy across a chunk boundary may meet one registered and one
        # unregistered chunk, which the driver rejects unless the copy is split (copy_from_device).
        # Results are compared on the host: a host-to-device read of the same span would be such
        # a spanning copy itself.
        for at in ((1 << 30) - 4096, (2 << 30) - 8192):
            arena.copy_from_device(src, at)
            torch.cuda.synchronize()
            assert torch.equal(arena.tensor(at, torch.float32, src.shape), src.cpu())
        assert arena.wait_pinned(timeout=120) is True
        assert arena.pinned_bytes == n
        dst = arena.tensor((1 << 30) - 4096, torch.float32, src.shape)  # spans chunks 0 and 1
        # torch 2.11's is_pinned() says False here (seen on an H200: it asks its own pinned
        # allocator), yet the copy runs asynchronously at the pinned rate (benchmarks/gpu_session.sh
        # probe): is_pinned() is no test of the registration, so it is not asserted
        src2 = src * 2
        arena.copy_from_device(src2, (1 << 30) - 4096)
        torch.cuda.synchronize()
        assert torch.equal(dst, src2.cpu())
