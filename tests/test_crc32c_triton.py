"""The Triton CRC32C kernels against independent implementations (google-crc32c, crc32c).

CPU tier: the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a
machine without CUDA) on tensors of at most 1 MiB. `gpu` tier: CUDA tensors of 64 MiB to 1 GiB,
checked against the hardware-accelerated ``crc32c`` package on a CPU copy.
"""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.kernels import crc32c as K

_CAN_RUN = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not _CAN_RUN, reason="needs CUDA or TRITON_INTERPRET=1 (set before Triton kernels import)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _reference(data: torch.Tensor, chunk: int) -> list[int]:
    """google-crc32c of each chunk of a CPU byte tensor."""
    raw = data.cpu().numpy().tobytes()
    return [google_crc32c.value(raw[i : i + chunk]) for i in range(0, len(raw), chunk)]


def _triton(data: torch.Tensor, chunk: int) -> list[int]:
    out = K.chunk_crc32c_triton(data.to(DEVICE), chunk)
    assert out.dtype == torch.int64
    assert out.device.type == DEVICE
    assert out.shape == (-(-data.numel() // chunk),)
    return out.cpu().tolist()


# ---- host-side GF(2) machinery (no Triton) ---------------------------------------------------


def test_byte_table_is_the_classic_crc32c_table():
    table = K.operator_tables()[0, 0].astype(np.int64) & 0xFFFFFFFF
    for i in (0, 1, 2, 128, 255):
        v = i
        for _ in range(8):
            v = (v >> 1) ^ (0x82F63B78 if v & 1 else 0)
        assert table[i] == v
    assert table[1] == 0xF26B8303 and table[128] == 0x82F63B78


@pytest.mark.parametrize("na,nb", [(0, 0), (0, 5), (1, 1), (7, 9), (1000, 4097), (65536, 3)])
def test_host_shift_combines_crcs_like_the_reference(na, nb):
    """crc(A||B) from crc(A), crc(B) and |B| alone: the identity the kernels build on."""
    a, b = bytes(_random_bytes(na, 1).numpy()), bytes(_random_bytes(nb, 2).numpy())
    ca, cb = google_crc32c.value(a), google_crc32c.value(b)
    combined = K.shift_bytes(ca ^ K.init_term(na), nb) ^ cb ^ K.init_term(nb) ^ K.init_term(na + nb)
    assert combined == google_crc32c.value(a + b)


def test_operator_tables_are_powers_of_the_zero_byte_shift():
    tabs = K.operator_tables().astype(np.int64) & 0xFFFFFFFF
    for b in (1, 5, 33, 63):
        v = 0xDEADBEEF
        via_tables = tabs[b, 0, v & 255] ^ tabs[b, 1, v >> 8 & 255]
        via_tables ^= tabs[b, 2, v >> 16 & 255] ^ tabs[b, 3, v >> 24]
        assert via_tables == K.shift_bytes(v, 1 << b)
    assert K.shift_bytes(0x12345678, 3) == K.shift_bytes(K.shift_bytes(0x12345678, 1), 2)


# ---- input validation (no kernel launch) ---------------------------------------------------


@pytest.mark.parametrize(
    "data,chunk,exc,words",
    [
        (b"abc", 4, TypeError, "torch.Tensor"),
        (torch.zeros(8, dtype=torch.float32), 4, ValueError, "uint8"),
        (torch.zeros(2, 4, dtype=torch.uint8), 4, ValueError, "1-D"),
        (torch.zeros(16, dtype=torch.uint8)[::2], 4, ValueError, "contiguous"),
        (torch.zeros(8, dtype=torch.uint8), 0, ValueError, "positive"),
        (torch.zeros(8, dtype=torch.uint8), -4, ValueError, "positive"),
        (torch.zeros(8, dtype=torch.uint8), True, ValueError, "positive"),
        (torch.zeros(8, dtype=torch.uint8), 4.0, ValueError, "positive"),
        (torch.zeros(8, dtype=torch.uint8, device="meta"), 4, ValueError, "backend='native'"),
    ],
)
def test_bad_input_is_a_clear_error(data, chunk, exc, words):
    with pytest.raises(exc, match=words):
        K.chunk_crc32c_triton(data, chunk)


def test_cpu_tensor_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setattr(K, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as info:
        K.chunk_crc32c_triton(torch.zeros(8, dtype=torch.uint8), 4)
    assert "backend='native'" in str(info.value)


# ---- kernels (interpreter on CPU, compiled on CUDA) ----------------------------------------


@needs_triton
def test_empty_input_gives_empty_int64():
    out = K.chunk_crc32c_triton(torch.empty(0, dtype=torch.uint8, device=DEVICE), 64)
    assert out.dtype == torch.int64 and out.numel() == 0 and out.device.type == DEVICE


@needs_triton
def test_known_vector():
    # The CRC-32C check value (RFC 3720 appendix B.4 lists more); "123456789" -> 0xE3069283.
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert _triton(data, 9) == [0xE3069283]
    assert _triton(data, 1000) == [0xE3069283]
    assert _triton(torch.zeros(32, dtype=torch.uint8), 32) == [0x8A9136AA]  # RFC 3720 B.4


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@needs_triton
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [64, 1000])  # the one-lane-per-chunk and the tiled kernel
def test_every_dtype_viewed_as_bytes(dtype, chunk):
    gen = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        t = torch.rand(1237, generator=gen) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(1237, generator=gen).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (1237,), generator=gen, dtype=torch.int64).to(dtype)
    data = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
    assert _triton(data, chunk) == _reference(data, chunk)


_SIZES = [0, 1, 7, 8, 9, 4095, 4097, 65537]
_CHUNKS = [1, 3, 4, 7, 64, 4096, 65536]


@needs_triton
@pytest.mark.parametrize("chunk", _CHUNKS)
@pytest.mark.parametrize("size", _SIZES)
def test_sizes_and_chunk_sizes(size, chunk):
    data = _random_bytes(size, size * 31 + chunk)
    assert _triton(data, chunk) == _reference(data, chunk)


@needs_triton
@pytest.mark.parametrize("offset", range(1, 8))
@pytest.mark.parametrize("chunk", [7, 64, 300, 1000])
def test_unaligned_starts(offset, chunk):
    big = _random_bytes(2051 + 8, offset)
    data = big[offset : offset + 2051]
    assert data.is_contiguous() and data.data_ptr() % 8 == (big.data_ptr() + offset) % 8
    assert _triton(data, chunk) == _reference(data, chunk)


@needs_triton
@pytest.mark.parametrize("chunk", [5000, 1 << 20, 1 << 40])
def test_chunk_larger_than_data(chunk):
    data = _random_bytes(4321, 7)
    assert _triton(data, chunk) == [google_crc32c.value(bytes(data.numpy()))]


@needs_triton
@pytest.mark.parametrize(
    "size,chunk,offset",
    [
        (300_000, 200_000, 0),  # word loads; a chunk of two tiles, the second partial
        (300_001, 200_000, 0),  # byte loads (length not a multiple of 4)
        (300_000, 200_000, 3),  # byte loads (unaligned start)
        (1 << 20, 1 << 20, 0),  # 1 MiB in one chunk of eight full tiles
        (600_001, 250_000, 5),  # unaligned, multi-tile chunks, a short last chunk
    ],
)
def test_chunks_spanning_several_tiles(size, chunk, offset):
    data = _random_bytes(size + offset, size)[offset:]
    assert _triton(data, chunk) == _reference(data, chunk)


@needs_triton
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(0, 3000),
    chunk=st.one_of(st.integers(1, 300), st.integers(301, 4000)),
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_sizes_chunks_and_offsets(size, chunk, offset, seed):
    data = _random_bytes(size + offset, seed)[offset:]
    assert _triton(data, chunk) == _reference(data, chunk)


def _many_sources(chunk: int) -> list[torch.Tensor]:
    """Byte tensors scattered in memory: short and multi-chunk, one not word aligned, one of odd
    length, one empty, one a bf16 tensor's bytes (2 bytes an element: 2 * 3001 bytes, not a
    multiple of 4); the lowest address need not come first."""
    sizes = [8, chunk, chunk + 4, 3 * chunk + 1024, 20, 7, 0, 2 * chunk]
    srcs = [_random_bytes(n + 4, seed)[4:] for seed, n in enumerate(sizes)]
    srcs.append(_random_bytes(4 * chunk + 9, 99)[1 : 4 * chunk + 1])  # address not word aligned
    srcs.append(_random_bytes(2 * 3001, 98).view(torch.bfloat16).view(torch.uint8))
    srcs.reverse()
    return [s.to(DEVICE) for s in srcs]


@needs_triton
@pytest.mark.parametrize("chunk", [1024, 4096, 12288, 4098])
def test_one_launch_for_many_tensors(chunk):
    """crc32c_many_into: every tensor of a save in one launch when all are word aligned, a
    second launch (byte loads) only for those that are not; each chunk equal to google-crc32c;
    an empty tensor gets no CRC; the cached program tables give the same result again."""
    srcs = _many_sources(chunk)
    counts = [-(-s.numel() // chunk) for s in srcs]
    starts = [sum(counts[:i]) for i in range(len(srcs))]
    out = torch.zeros(sum(counts), dtype=torch.int32, device=DEVICE)
    # words for the aligned ones, bytes for the rest (all of them when the chunk is not 4-aligned)
    assert K.crc32c_many_into(srcs, out, starts, chunk) == (2 if chunk % 4 == 0 else 1)
    got = (out.to(torch.int64) & 0xFFFFFFFF).cpu().tolist()
    for s, a, n in zip(srcs, starts, counts, strict=True):
        assert got[a : a + n] == _reference(s, chunk), s.numel()
    again = torch.zeros_like(out)
    K.crc32c_many_into(srcs, again, starts, chunk)
    assert torch.equal(again, out)
    aligned = [s for s in srcs if s.numel() and s.numel() % 4 == 0 and s.data_ptr() % 4 == 0]
    one = torch.zeros(
        sum(-(-s.numel() // chunk) for s in aligned), dtype=torch.int32, device=DEVICE
    )
    starts1 = [sum(-(-x.numel() // chunk) for x in aligned[:i]) for i in range(len(aligned))]
    assert K.crc32c_many_into(aligned, one, starts1, chunk) == 1  # a usual state: one launch
    assert (one.to(torch.int64) & 0xFFFFFFFF).tolist() == [
        c for x in aligned for c in _reference(x, chunk)
    ]


@needs_triton
def test_small_chunks_take_the_one_lane_kernel_per_tensor():
    srcs = [_random_bytes(100, 1), _random_bytes(0, 2), _random_bytes(33, 3)]
    out = torch.zeros(5, dtype=torch.int32)
    assert K.crc32c_many_into(srcs, out, [0, 2, 2], 64) == 2
    got = (out.to(torch.int64) & 0xFFFFFFFF).tolist()
    assert got == _reference(srcs[0], 64) + _reference(srcs[2], 64) + [0, 0]


def test_the_init_term_is_cached_per_length():
    K.init_term.cache_clear()
    K.init_term(4096)
    K.init_term(4096)
    K.init_term(12)
    info = K.init_term.cache_info()
    assert (info.hits, info.misses) == (1, 2)
    assert K.init_term(0) == 0 and K.init_term(1) == K.shift_bytes(0xFFFFFFFF, 1) ^ 0xFFFFFFFF


def test_plan_many_refuses_what_the_tiled_kernel_cannot_take():
    with pytest.raises(ValueError, match="chunks above 256 bytes"):
        K.plan_many([0], [64], [0], 256, torch.device("cpu"))
    with pytest.raises(ValueError, match="range 1 is empty"):
        K.plan_many([0, 64], [64, 0], [0, 1], 4096, torch.device("cpu"))


# ---- lowering for a Hopper GPU, without one ------------------------------------------------

_LOWER_SM90 = r"""
import inspect, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton._C.libtriton import ir
try:
    from triton.backends.nvidia.compiler import CUDABackend
    sig = inspect.signature
    assert list(sig(ASTSource.make_ir).parameters)[1:] == [
        "target", "options", "codegen_fns", "module_map", "context"]
    assert "language" in sig(CUDABackend.add_stages).parameters
except (ImportError, AssertionError):
    print("triton's compiler internals differ from 3.9; lowering not checked")
    sys.exit(3)
from gpumem.kernels import crc32c as K

target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)

def lower(fn, signature, constexprs, num_warps):
    opts = backend.parse_options({"num_warps": num_warps})
    ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
    src = ASTSource(fn, signature, constexprs)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts),
                      backend.get_module_map(), ctx)
    stages, metadata = {}, {}
    backend.add_stages(stages, opts, src.language)
    for name in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[name](mod, metadata)
    return mod

for words, lanes in ((True, 1024), (False, 32)):
    sig = {"X_ptr": "*i32" if words else "*u8", "OUT_ptr": "*i32", "TAB_ptr": "*i32",
           "n_bytes": "i64", "chunk_bytes": "i64", "tile_bytes": "i32",
           "tiles_per_chunk": "i32", "init_full": "i32", "init_last": "i32", "nbits": "i32",
           "LANES": "constexpr", "LOG2_LANES": "constexpr", "WORDS": "constexpr"}
    ce = {"LANES": lanes, "LOG2_LANES": lanes.bit_length() - 1, "WORDS": words}
    ptx = lower(K._crc32c_tiles_kernel, sig, ce, max(1, min(8, lanes // 128)))
    assert "atom.global" in ptx and ".xor.b32" in ptx
    assert ("ld.global.cg.b32" if words else "ld.global.cg.b8") in ptx
for words in (True, False):
    sig = {"X_ptr": "*i32" if words else "*u8", "OUT_ptr": "*i32", "TAB_ptr": "*i32",
           "PROG_ptr": "*i64", "chunk_bytes": "i64", "tile_bytes": "i32",
           "tiles_per_chunk": "i32", "init_full": "i32", "nbits": "i32", "LANES": "constexpr",
           "LOG2_LANES": "constexpr", "WORDS": "constexpr"}
    ptx = lower(K._crc32c_multi_kernel, sig, {"LANES": 1024, "LOG2_LANES": 10, "WORDS": words}, 8)
    assert "atom.global" in ptx and "ld.global.b64" in ptx
    assert ("ld.global.cg.b32" if words else "ld.global.cg.b8") in ptx
sig = {"X_ptr": "*u8", "OUT_ptr": "*i32", "TAB_ptr": "*i32", "n_bytes": "i64",
       "chunk_bytes": "i32", "n_chunks": "i32", "BLOCK": "constexpr"}
assert "st.global" in lower(K._crc32c_small_kernel, sig, {"BLOCK": 256}, 8)
print("lowered")
"""


def test_kernels_lower_to_ptx_for_sm90():
    """The real compiler path (not the interpreter) accepts the kernels: TTIR -> PTX for sm_90."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOWER_SM90],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("lowered")


# ---- real GPU tier --------------------------------------------------------------------------


def _crc_reference_big(cpu: torch.Tensor, chunk: int) -> list[int]:
    """The hardware-accelerated ``crc32c`` package (google-crc32c is slow on multi-GiB)."""
    import crc32c

    view = memoryview(cpu.numpy())
    return [crc32c.crc32c(view[i : i + chunk]) for i in range(0, len(view), chunk)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "size,chunk,offset",
    [
        (64 << 20, 1 << 20, 0),
        (64 << 20, 4 << 20, 3),
        ((256 << 20) + 5, 64 << 20, 0),
        ((256 << 20) + 1, 1_000_003, 1),
        (1 << 30, 256 << 20, 0),
        (1 << 30, 1 << 30, 0),
        (16 << 20, 64, 0),
        (16 << 20, 4096, 2),
        (1 << 20, 1, 0),
    ],
)
def test_gpu_large_buffers(size, chunk, offset):
    gen = torch.Generator(device="cuda").manual_seed(size + chunk)
    big = torch.randint(0, 256, (size + offset,), dtype=torch.uint8, device="cuda", generator=gen)
    data = big[offset:]
    got = K.chunk_crc32c_triton(data, chunk)
    assert got.device == data.device and got.dtype == torch.int64
    assert got.cpu().tolist() == _crc_reference_big(data.cpu(), chunk)


@pytest.mark.gpu
def test_gpu_bfloat16_tensor():
    t = torch.randn(3_000_001, device="cuda", dtype=torch.bfloat16)
    data = t.view(torch.uint8)
    assert K.chunk_crc32c_triton(data, 1 << 20).cpu().tolist() == _crc_reference_big(
        data.cpu(), 1 << 20
    )
