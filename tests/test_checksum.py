"""gpumem.checksum against the independent references google-crc32c and crc32c (ICRAR)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import crc32c as icrar
import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem._native import load
from gpumem.checksum import chunk_crc32c, cpu_features, crc32c, crc32c_combine

C = load()
HAS_HW = cpu_features()["crc32c"] != "table"
IMPLS = ["auto", "table"] + (["hardware"] if HAS_HW else [])

# Block edges of the hardware path (8-byte words, 3 x 256 and 3 x 8192 byte stripes; the
# folding path's 512-byte floor, 16-byte blocks, 128- and 256-byte groups) +-1,
# and odd MiB sizes that cross the 1 MiB per-thread split.
SIZES = [
    0,
    1,
    7,
    8,
    9,
    63,
    64,
    65,
    511,
    512,
    513,
    527,
    528,
    640,
    1023,
    1024,
    1025,
    767,
    768,
    769,
    4095,
    4096,
    4097,
    24575,
    24576,
    24577,
    49152 + 775,
    (1 << 20) - 1,
    (1 << 20) + 3,
    (3 << 20) + 1,
    (5 << 20) + 12345,
]


def ref(data: bytes) -> int:
    return google_crc32c.value(bytes(data))


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


def test_check_value():
    # The CRC-32C check value of "123456789" (Castagnoli; RFC 3720 appendix B.4).
    assert crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", SIZES)
def test_sizes_match_references(n, impl):
    data = rand_bytes(n)
    expected = ref(data)
    assert expected == icrar.crc32c(data)
    assert C.crc32c(memoryview(data), 0, impl) == expected
    assert C.crc32c(memoryview(data), 0, impl, threads=1) == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("start", range(1, 8))
def test_unaligned_starts(start, impl):
    buf = bytearray(rand_bytes(70_000 + start, start))
    for n in (0, 1, 7, 9, 100, 24_577, 70_000):
        view = memoryview(buf)[start : start + n]
        assert C.crc32c(view, 0, impl) == ref(buf[start : start + n]), n
    assert crc32c(memoryview(buf)[start:]) == ref(buf[start:])


@pytest.mark.parametrize("impl", IMPLS)
def test_running_crc_extends(impl):
    data = rand_bytes(300_000, 3)
    rng = random.Random(5)
    for _ in range(40):
        cut = rng.randrange(len(data) + 1)
        a, b = data[:cut], data[cut:]
        first = C.crc32c(memoryview(a), 0, impl)
        assert C.crc32c(memoryview(b), first, impl) == ref(data)
        assert crc32c(b, crc32c(a)) == icrar.crc32c(b, icrar.crc32c(a))


def test_combine_matches_reference():
    rng = random.Random(11)
    for la, lb in [(0, 0), (0, 5), (5, 0), (1, 1), (7, 4097), (100, 24_577), (3, 1 << 20)] + [
        (rng.randrange(10_000), rng.randrange(70_000)) for _ in range(30)
    ]:
        a, b = rand_bytes(la, 1), rand_bytes(lb, 2)
        assert crc32c_combine(ref(a), ref(b), lb) == ref(a + b), (la, lb)


def test_combine_is_associative_for_huge_lengths():
    # Beyond what a reference can hash: (a+b)+c == a+(b+c) for lengths up to 2**50 bytes.
    rng = random.Random(2)
    for _ in range(50):
        a, b, c = (rng.randrange(2**32) for _ in range(3))
        lb, lc = rng.randrange(2**50), rng.randrange(2**50)
        left = crc32c_combine(crc32c_combine(a, b, lb), c, lc)
        right = crc32c_combine(a, crc32c_combine(b, c, lc), lb + lc)
        assert left == right


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_threads_give_identical_results(threads):
    data = rand_bytes((6 << 20) + 4099, 9)
    expected = ref(data)
    for impl in IMPLS:
        assert C.crc32c(memoryview(data), 0, impl, threads) == expected
        assert C.crc32c(memoryview(data)[3:], 12345, impl, threads) == icrar.crc32c(data[3:], 12345)


def test_table_and_hardware_agree():
    if not HAS_HW:
        with pytest.raises(ValueError, match="no CRC32C instructions"):
            C.crc32c(b"x", 0, "hardware")
        pytest.skip("no CRC32C instructions on this CPU: only the table path exists")
    rng = random.Random(1)
    for _ in range(200):
        data = rand_bytes(rng.randrange(100_000), rng.randrange(1000))
        start = rng.randrange(8)
        view = memoryview(data)[start:]
        assert C.crc32c(view, 0, "table") == C.crc32c(view, 0, "hardware")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_property_vs_crc32c_package(data, value):
    assert crc32c(data, value) == icrar.crc32c(data, value)


def test_accepts_numpy_and_memoryview_formats():
    arr = np.arange(1000, dtype=np.float32)
    assert crc32c(arr) == ref(arr.tobytes())
    big_endian = np.arange(100, dtype=">f8").reshape(10, 10)
    assert crc32c(big_endian) == ref(big_endian.tobytes())
    assert crc32c(memoryview(np.ones((4, 5), np.int16))) == ref(np.ones((4, 5), np.int16).tobytes())
    assert crc32c(bytearray(b"abc")) == ref(b"abc")
    assert crc32c(np.zeros(0, np.float64)) == 0


def test_tensor_any_dtype_crc32c():
    t = torch.randn(33, 17).to(torch.bfloat16)
    assert crc32c(t) == ref(bytes(t.untyped_storage()))
    assert crc32c(torch.tensor(3.5)) == ref(bytes(torch.tensor(3.5).untyped_storage()))


def _dtypes() -> list[torch.dtype]:
    names = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(
        0,
        256,
        (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(3),
    )
    if dtype == torch.bool:
        raw = raw % 2  # bool bytes must be 0/1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 20])
def test_chunk_crc32c_native_every_dtype(dtype, chunk):
    t = _random_tensor(dtype, (37, 5, 3))
    data = bytes(t.untyped_storage())
    got = chunk_crc32c(t, chunk, backend="native")
    expected = [ref(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.tolist() == expected
    assert chunk_crc32c(t, chunk).tolist() == expected  # auto on a CPU tensor is native


def test_chunk_crc32c_of_a_view_with_storage_offset():
    base = torch.arange(10_000, dtype=torch.int32)
    t = base[1234:5678]  # contiguous, storage offset 4936 bytes
    data = t.numpy().tobytes()
    assert chunk_crc32c(t, 1000).tolist() == [
        ref(data[i : i + 1000]) for i in range(0, len(data), 1000)
    ]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunk_paths_and_threads(threads):
    data = rand_bytes((9 << 20) + 5, 4)
    arr = np.frombuffer(data, np.uint8)
    # many small chunks (grouped per task) and few big chunks (split inside each chunk)
    for chunk in (4096, 100_003, 4 << 20, 16 << 20):
        out = np.empty(-(-len(data) // chunk), np.int64)
        C.chunk_crc32c(arr, chunk, out, "auto", threads)
        assert out.tolist() == [ref(data[i : i + chunk]) for i in range(0, len(data), chunk)]


def test_empty_tensor_gives_empty_result():
    for t in (torch.empty(0), torch.empty(0, 5, dtype=torch.float16)):
        out = chunk_crc32c(t, 16)
        assert out.shape == (0,) and out.dtype == torch.int64


def test_non_contiguous_is_a_clear_error():
    t = torch.arange(100, dtype=torch.float32).reshape(10, 10).t()
    with pytest.raises(ValueError, match=r"not contiguous.*contiguous\(\)"):
        chunk_crc32c(t, 16)
    with pytest.raises(ValueError, match="not contiguous"):
        crc32c(t)
    with pytest.raises(ValueError, match="not C-contiguous"):
        crc32c(np.arange(20).reshape(4, 5)[:, 1])


@pytest.mark.parametrize("bad", [0, -1, -4096, 1.5, True, None])
def test_chunk_bytes_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        chunk_crc32c(torch.ones(10), bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(ValueError, match="chunk_bytes must be positive"):
            C.chunk_crc32c(np.ones(10, np.uint8), bad, np.empty(1, np.int64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_crc32c(torch.ones(4), 4, backend="cuda")
    with pytest.raises(TypeError, match=r"takes a torch.Tensor"):
        chunk_crc32c(b"abc", 4)
    with pytest.raises(ValueError, match=r"value must be a CRC32C value in \[0, 2\*\*32\)"):
        crc32c(b"x", 2**32)
    with pytest.raises(ValueError, match="value must be"):
        crc32c(b"x", -1)
    with pytest.raises(ValueError, match="len_b must be"):
        crc32c_combine(1, 2, -3)
    with pytest.raises(TypeError, match="must be bytes-like"):
        crc32c(12345)
    with pytest.raises(ValueError, match="impl must be"):
        C.crc32c(b"x", 0, "fast")
    out = np.empty(3, np.int64)
    with pytest.raises(ValueError, match="out has 3 entries, need 2"):
        C.chunk_crc32c(np.ones(10, np.uint8), 5, out)


def test_numpy_integer_arguments_are_accepted():
    a = chunk_crc32c(torch.arange(8, dtype=torch.uint8), 4)
    assert crc32c(bytes(range(4, 8)), int(a[0])) == ref(bytes(range(8)))
    assert crc32c_combine(np.int64(a[0]), np.uint32(a[1]), np.int64(4)) == ref(bytes(range(8)))


def test_concurrent_callers_share_the_pool():
    blobs = [rand_bytes((2 << 20) + i, i) for i in range(6)]
    expected = [ref(b) for b in blobs]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        results[i] = [C.crc32c(memoryview(blobs[i]), 0, "auto", 3) for _ in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == [expected[i]] * 5 for i in range(6))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_works_in_a_forked_child():
    data = rand_bytes(4 << 20, 8)
    assert C.crc32c(memoryview(data), 0, "auto", 2) == ref(data)  # the pool now has workers
    pid = os.fork()
    if pid == 0:  # child: the parent's workers do not exist here
        ok = C.crc32c(memoryview(data), 0, "auto", 2) == ref(data)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


_FOLD_CHECK = """
import random, sys
import google_crc32c
from gpumem._native import load
from gpumem.checksum import cpu_features
C = load()
rng = random.Random(7)
for n in [511, 512, 513, 767, 768, 1024, 1535, 4096 + 15, 70001, (1 << 20) + 3]:
    for start in (0, 1, 5, 8):
        data = rng.randbytes(n + start)
        for value in (0, 0xDEADBEEF):
            got = C.crc32c(memoryview(data)[start:], value, "auto", 1)
            want = google_crc32c.extend(value, data[start:])
            assert got == want, (n, start, value, got, want)
print(cpu_features()["crc32c_fold"])
"""


@pytest.mark.parametrize("cap", [None, "pclmulqdq", "none"])
def test_every_folding_path_matches_the_reference(cap):
    # each path this CPU has (VPCLMULQDQ, PCLMULQDQ, the crc32 instruction alone), capped by
    # GPUMEM_CRC32C_FOLD in a fresh process (the choice is made when the module loads)
    env = {k: v for k, v in os.environ.items() if k != "GPUMEM_CRC32C_FOLD"}
    if cap is not None:
        env["GPUMEM_CRC32C_FOLD"] = cap
    out = subprocess.run(
        [sys.executable, "-c", _FOLD_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    fold = out.stdout.strip()
    assert fold in ("vpclmulqdq", "pclmulqdq", "none")
    if cap == "none":
        assert fold == "none"
    elif cap == "pclmulqdq":
        assert fold in ("pclmulqdq", "none")


def test_cpu_features_and_gpumem_threads():
    feats = cpu_features()
    assert feats["crc32c"] in ("sse4.2", "armv8-crc", "table")
    assert feats["crc32c_fold"] in ("vpclmulqdq", "pclmulqdq", "none")
    assert feats["threads"] >= 1
    code = "from gpumem.checksum import cpu_features; print(cpu_features()['threads'])"
    env = {**os.environ, "GPUMEM_THREADS": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "3"
    env["GPUMEM_THREADS"] = "many"
    bad = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "GPUMEM_THREADS='many' is not an integer" in bad.stderr


@pytest.mark.slow
def test_multi_gib_buffer():
    n = (5 << 29) + 13  # 2.5 GiB + 13 bytes: combine across threads on a buffer > 2**31
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    expected = icrar.crc32c(data)  # google-crc32c wants read-only bytes, a 2.5 GiB copy
    assert crc32c(data) == expected
    assert C.crc32c(data, 0, "auto", 1) == expected
    out = chunk_crc32c(torch.from_numpy(data), 1 << 30)
    whole = crc32c_combine(
        crc32c_combine(int(out[0]), int(out[1]), 1 << 30), int(out[2]), n - (2 << 30)
    )
    assert whole == expected


@pytest.mark.gpu
def test_cuda_tensors():
    t = _random_tensor(torch.float32, (1 << 18,))
    cpu = chunk_crc32c(t, 4096, backend="native")
    dev = chunk_crc32c(t.cuda(), 4096)
    assert dev.device.type == "cuda" and dev.cpu().tolist() == cpu.tolist()
    with pytest.raises(ValueError, match="backend='native' needs a CPU tensor"):
        chunk_crc32c(t.cuda(), 4096, backend="native")
    with pytest.raises(ValueError, match="on cuda"):
        crc32c(t.cuda())


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_multi_gib_matches_native():
    t = torch.randint(0, 256, ((3 << 30) + 7,), dtype=torch.uint8)
    cpu = chunk_crc32c(t, 64 << 20, backend="native")
    assert chunk_crc32c(t.cuda(), 64 << 20).cpu().tolist() == cpu.tolist()


def test_triton_backend_matches_native():
    # CPU tier: the Triton kernel runs under TRITON_INTERPRET=1 (set by conftest); small sizes only.
    t = _random_tensor(torch.float16, (3, 333))
    for chunk in (5, 256, 700, 4096):
        native = chunk_crc32c(t, chunk, backend="native")
        triton_out = chunk_crc32c(t, chunk, backend="triton")
        assert triton_out.dtype == torch.int64 and triton_out.tolist() == native.tolist()
