"""Per-chunk CRC32C of a byte tensor on the device, in Triton.

CRC32C (Castagnoli; reflected polynomial 0x82F63B78, init and xorout 0xFFFFFFFF) as computed by
the SSE4.2 ``crc32`` instruction, google-crc32c and ``gpumem._C``. Triton has neither a
carry-less multiply nor a CRC instruction, so the kernels use table lookups and the linearity of
the CRC over GF(2):

* ``Z`` = "feed one zero byte" is a linear map on the 32-bit register; ``Z^d`` shifts a register
  by ``d`` bytes. The raw CRC (init 0, no xorout) of a message of bytes ``b_0..b_{n-1}`` is
  ``XOR_i Z^(n-i)(b_i)``, so raw CRCs of pieces combine as
  ``raw(A || B) = Z^|B|(raw(A)) ^ raw(B)``, and ``crc(M) = ~(Z^|M|(0xFFFFFFFF) ^ raw(M))``.
  Leading zero bytes do not change a raw CRC, which is how partial pieces are padded.
* Any linear map ``M`` of a 32-bit register is applied with four 256-entry byte tables
  (``M(v) = T0[v & 255] ^ T1[v >> 8 & 255] ^ T2[v >> 16 & 255] ^ T3[v >> 24]``), the slicing-by-4
  idea of Intel's "slicing-by-8" CRC, or with eight 16-entry nibble tables. The host
  precomputes both for ``Z^(2^b)``, b = 0..63 (288 KiB in all); a shift by any ``d`` is then a
  product over the set bits of ``d``.

Large chunks (``_crc32c_tiles_kernel``): a chunk is cut into tiles; a program owns one tile and
``LANES`` lanes that walk it in interleaved 4-byte words (lane ``l`` takes words ``l, l+LANES,
...``), so each step is one coalesced load of ``4*LANES`` contiguous bytes. A lane keeps
``r = Z^(4*LANES)(r) ^ w`` (8 nibble or 4 byte lookups per word); the lane registers form an
``LANES``-word message whose raw CRC is combined in a log2(LANES)-level tree, the tile's raw CRC
is shifted by the bytes that follow it in its chunk, and the program XORs it (with the init term,
for the chunk's first tile) into the chunk's output word with one atomic. XOR is exact and
commutative, so the result does not depend on the order the programs run in.

Small chunks (``_crc32c_small_kernel``, chunk <= 256 bytes): one lane per chunk, byte at a time.

Expected limits on an H100/H200 (estimated from the sm_90 SASS, not yet measured; see
benchmarks/bench_triton_crc32c.py): HBM is not the limit, the inner loop is. With byte tables a
warp-wide lookup touches up to 8 cache lines (8 L1 wavefronts), so 4 lookups per word bound the
loop near 1 TB/s; with nibble tables (the default) each lookup stays in one line, ~13 SASS
instructions per byte bound it near 2.5 TB/s peak issue, realistically 1.2-2 TB/s. A D2D copy
moves 1.5-2.2 TB/s of payload (3.35-4.8 TB/s of HBM traffic) on an H100/H200.
"""

# No `from __future__ import annotations`: Triton 3.1 recognises `tl.constexpr` parameters only
# from evaluated annotations.
import functools
import math
import numbers
from contextlib import nullcontext
from typing import TYPE_CHECKING

import numpy as np
import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

POLY = 0x82F63B78  # CRC32C, reflected
_MASK32 = 0xFFFFFFFF
_NUM_POWERS = 64  # tables for Z^(2^b), b < 64: shifts of any length a tensor can have
SMALL_CHUNK_MAX = 256  # chunks up to this many bytes take the one-lane-per-chunk kernel
_SMALL_BLOCK = 256  # chunks per program of the small-chunk kernel
_MAX_LANES = 1024
_STEPS_PER_TILE = 32  # a full tile is 4 * LANES * 32 bytes (128 KiB at 1024 lanes)
# Inner-loop tables of the large-chunk kernel. Nibble tables cost twice the lookups of byte
# tables but each warp-wide lookup stays in one L1 cache line; on Hopper the byte tables' scattered
# L1 wavefronts, not instruction issue, are expected to bound the loop (see the module docstring).
# benchmarks/bench_triton_crc32c.py measures both.
STEP_TABLES = "nibble"


# --------------------------------------------------------------------------------------------
# Host side: GF(2) operators and their byte tables
# --------------------------------------------------------------------------------------------


def _zero_byte(v: int) -> int:
    """Z(v): the register after feeding one zero byte (bitwise, the definition)."""
    for _ in range(8):
        v = (v >> 1) ^ (POLY if v & 1 else 0)
    return v


def _apply(cols: list[int], v: int) -> int:
    """Apply a 32x32 GF(2) matrix given by its columns (images of 1 << i) to v."""
    out = 0
    i = 0
    while v:
        if v & 1:
            out ^= cols[i]
        v >>= 1
        i += 1
    return out


@functools.cache
def _power_matrices() -> tuple[tuple[int, ...], ...]:
    """Columns of Z^(2^b) for b < _NUM_POWERS, by repeated squaring."""
    mats = [[_zero_byte(1 << i) for i in range(32)]]
    for _ in range(_NUM_POWERS - 1):
        prev = mats[-1]
        mats.append([_apply(prev, c) for c in prev])
    return tuple(tuple(m) for m in mats)


def shift_bytes(value: int, nbytes: int) -> int:
    """Z^nbytes(value): a raw CRC register shifted by ``nbytes`` zero bytes (host reference)."""
    mats = _power_matrices()
    b = 0
    while nbytes:
        if nbytes & 1:
            value = _apply(list(mats[b]), value)
        nbytes >>= 1
        b += 1
    return value


def init_term(length: int) -> int:
    """What init and xorout add to the raw CRC of a ``length``-byte message."""
    return shift_bytes(_MASK32, length) ^ _MASK32


@functools.cache
def operator_tables() -> np.ndarray:
    """int32 array [_NUM_POWERS, 4, 256]: byte tables of Z^(2^b); [0, 0] is the classic table."""
    cols = np.array(_power_matrices(), dtype=np.uint32).reshape(_NUM_POWERS, 4, 8)
    bits = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(bool)  # [256, 8]
    picked = np.where(bits[None, None], cols[:, :, None, :], np.uint32(0))  # [P, 4, 256, 8]
    return np.bitwise_xor.reduce(picked, axis=-1).astype(np.uint32).view(np.int32)


@functools.cache
def nibble_tables() -> np.ndarray:
    """int32 array [_NUM_POWERS, 8, 16]: the same operators as eight 16-entry nibble tables.

    A 16-entry table is 64 bytes, inside one 128-byte cache line, so a warp's 32 scattered
    lookups into it are served by one L1 wavefront instead of up to eight for a byte table.
    """
    cols = np.array(_power_matrices(), dtype=np.uint32).reshape(_NUM_POWERS, 8, 4)
    bits = ((np.arange(16)[:, None] >> np.arange(4)[None, :]) & 1).astype(bool)  # [16, 4]
    picked = np.where(bits[None, None], cols[:, :, None, :], np.uint32(0))  # [P, 8, 16, 4]
    return np.bitwise_xor.reduce(picked, axis=-1).astype(np.uint32).view(np.int32)


_device_tables: dict[str, "torch.Tensor"] = {}


def _tables_on(device: "torch.device") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(byte tables, nibble tables) on ``device``, built once per device.

    Both live in one allocation; the nibble tables start 256 KiB in, so each 64-byte table is
    64-byte aligned (allocations are at least 256-byte aligned).
    """
    import torch

    key = str(device)
    tab = _device_tables.get(key)
    if tab is None:
        host = np.concatenate([operator_tables().reshape(-1), nibble_tables().reshape(-1)])
        tab = torch.from_numpy(host).to(device)
        _device_tables[key] = tab
    split = operator_tables().size
    return tab[:split], tab[split:]


def _as_i32(v: int) -> int:
    """A uint32 as the int32 with the same bits (kernel scalar arguments are signed)."""
    return v - (1 << 32) if v >= 1 << 31 else v


# --------------------------------------------------------------------------------------------
# Device side
# --------------------------------------------------------------------------------------------


@triton.jit
def _apply_op(TAB_ptr, v):
    """M(v) for the operator whose four byte tables start at TAB_ptr (v: int32, any shape).

    Operator b (Z^(2^b)) starts at TAB_ptr + b * 1024; its nibble tables at NIB_ptr + b * 128.
    """
    t = tl.load(TAB_ptr + (v & 0xFF))
    t ^= tl.load(TAB_ptr + 256 + ((v >> 8) & 0xFF))
    t ^= tl.load(TAB_ptr + 512 + ((v >> 16) & 0xFF))
    t ^= tl.load(TAB_ptr + 768 + ((v >> 24) & 0xFF))
    return t


@triton.jit
def _apply_op_nibbles(NIB_ptr, v):
    """M(v) from the operator's eight 16-entry nibble tables at NIB_ptr (v: int32, any shape)."""
    t = tl.load(NIB_ptr + (v & 0xF))
    for j in tl.static_range(1, 8):
        t ^= tl.load(NIB_ptr + j * 16 + ((v >> (4 * j)) & 0xF))
    return t


@triton.jit
def _shift(TAB_ptr, v, nbytes, nbits):
    """Z^nbytes(v) for a scalar v: one table-driven operator per set bit of nbytes < 2^nbits."""
    for b in range(nbits):
        if ((nbytes >> b) & 1) != 0:
            v = _apply_op(TAB_ptr + b * 1024, v)
    return v


@triton.jit
def _crc32c_tiles_kernel(
    X_ptr,
    OUT_ptr,
    TAB_ptr,
    NIB_ptr,
    n_bytes,
    chunk_bytes,
    tile_bytes,
    tiles_per_chunk,
    init_full,
    init_last,
    nbits,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    WORDS: tl.constexpr,
    NIBBLES: tl.constexpr,
):
    """XOR one tile's contribution into OUT[chunk] (int32 bits of the chunk's CRC32C); see
    ``_tile_crc``. X_ptr points to int32 words (WORDS: 4-aligned start, chunk and length) or to
    uint8 bytes."""
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid // tiles_per_chunk
    tile = pid - chunk * tiles_per_chunk
    _tile_crc(
        X_ptr,
        OUT_ptr,
        TAB_ptr,
        NIB_ptr,
        0,
        n_bytes,
        chunk,
        tile,
        chunk_bytes,
        tile_bytes,
        init_full,
        init_last,
        nbits,
        LANES,
        LOG2_LANES,
        WORDS,
        NIBBLES,
    )


@triton.jit
def _crc32c_multi_kernel(
    X_ptr,
    OUT_ptr,
    TAB_ptr,
    NIB_ptr,
    PROG_ptr,
    chunk_bytes,
    tile_bytes,
    tiles_per_chunk,
    init_full,
    nbits,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    WORDS: tl.constexpr,
    NIBBLES: tl.constexpr,
):
    """The tiles kernel over many tensors in one launch. Program p reads row p of PROG (int64:
    the tensor's byte offset from X_ptr, its length, the OUT index of its first chunk, the
    tile's index within the tensor) and XORs that tile's contribution into OUT. A short last
    chunk's init term is computed here (it differs per tensor)."""
    row = PROG_ptr + tl.program_id(0).to(tl.int64) * 4
    x_off = tl.load(row)
    n_bytes = tl.load(row + 1)
    out0 = tl.load(row + 2)
    t = tl.load(row + 3)
    chunk = t // tiles_per_chunk
    tile = t - chunk * tiles_per_chunk
    chunk_len = tl.minimum(n_bytes - chunk * chunk_bytes, chunk_bytes)
    init_last = _shift(TAB_ptr, tl.full((), -1, tl.int32), chunk_len, nbits) ^ -1
    _tile_crc(
        X_ptr,
        OUT_ptr + out0,
        TAB_ptr,
        NIB_ptr,
        x_off,
        n_bytes,
        chunk,
        tile,
        chunk_bytes,
        tile_bytes,
        init_full,
        init_last,
        nbits,
        LANES,
        LOG2_LANES,
        WORDS,
        NIBBLES,
    )


@triton.jit
def _tile_crc(
    X_ptr,
    OUT_ptr,
    TAB_ptr,
    NIB_ptr,
    x_off,
    n_bytes,
    chunk,
    tile,
    chunk_bytes,
    tile_bytes,
    init_full,
    init_last,
    nbits,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    WORDS: tl.constexpr,
    NIBBLES: tl.constexpr,
):
    """XOR tile ``tile`` of chunk ``chunk``'s contribution into OUT[chunk]; the message starts
    ``x_off`` bytes (a multiple of 4 with WORDS) after X_ptr's first byte.

    The tile is front-padded with zero bytes to K steps of 4*LANES bytes (leading zeros leave a
    raw CRC unchanged). Lane l sees words w_{k*LANES+l}, k < K, and ends with
    r_l = XOR_k Z^(4*LANES*(K-1-k))(w_{k*LANES+l}), so
    raw(tile) = Z^4(XOR_l Z^(4*(LANES-1-l))(r_l)), the inner XOR being the tree below.
    NIBBLES: the per-step operator uses nibble tables (8 lookups/word, each in one cache line)
    instead of byte tables (4 lookups/word, each spread over up to 8 lines).
    """
    chunk_start = chunk * chunk_bytes
    chunk_len = tl.minimum(n_bytes - chunk_start, chunk_bytes)
    tile_start = tile * tile_bytes
    tile_len = tl.minimum(chunk_len - tile_start, tile_bytes)
    steps = tl.cdiv(tile_len, 4 * LANES)
    pad = steps * (4 * LANES) - tile_len  # zero bytes in front of the tile
    base = x_off + chunk_start + tile_start - pad  # byte offset of the padded tile's first byte
    lane = tl.arange(0, LANES)
    r = tl.zeros([LANES], dtype=tl.int32)
    for k in range(steps):
        vpos = k * (4 * LANES) + lane * 4  # byte offset of each lane's word in the padded tile
        if WORDS:
            w = tl.load(
                X_ptr + ((base + vpos) >> 2), mask=vpos >= pad, other=0, cache_modifier=".cg"
            )
        else:
            byte = tl.arange(0, 4)
            pos = vpos[:, None] + byte[None, :]
            b = tl.load(X_ptr + base + pos, mask=pos >= pad, other=0, cache_modifier=".cg")
            # the four bytes occupy disjoint bits, so their sum is the little-endian word
            w = tl.sum(b.to(tl.int32) << (byte[None, :] * 8), axis=1)
        if NIBBLES:  # r = Z^(4*LANES)(r) ^ w
            r = _apply_op_nibbles(NIB_ptr + (LOG2_LANES + 2) * 128, r) ^ w
        else:
            r = _apply_op(TAB_ptr + (LOG2_LANES + 2) * 1024, r) ^ w
    # Combine the lanes as an LANES-word message: pairs (left, right) -> Z^(4*2^b)(left) ^ right.
    x = r
    for b in tl.static_range(LOG2_LANES):
        left, right = tl.split(tl.reshape(x, (LANES >> (b + 1), 2)))
        x = _apply_op(TAB_ptr + (b + 2) * 1024, left) ^ right
    raw = tl.sum(x, axis=0)  # x has one element: this only makes it a scalar
    # Z^4 finishes the tile's last word; then shift past the rest of the chunk.
    raw = _shift(TAB_ptr, raw, chunk_len - tile_start - tile_len + 4, nbits)
    init = tl.where(chunk_len == chunk_bytes, init_full, init_last)
    raw ^= tl.where(tile == 0, init, 0)
    tl.atomic_xor(OUT_ptr + chunk, raw)


@triton.jit
def _crc32c_small_kernel(
    X_ptr, OUT_ptr, TAB_ptr, n_bytes, chunk_bytes, n_chunks, BLOCK: tl.constexpr
):
    """OUT[c] = CRC32C of chunk c for BLOCK chunks, one lane each, one byte per step."""
    chunk = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = chunk < n_chunks
    start = chunk * chunk_bytes
    length = tl.minimum(n_bytes - start, chunk_bytes)
    r = tl.full([BLOCK], -1, dtype=tl.int32)
    for i in range(chunk_bytes):
        live = valid & (i < length)
        b = tl.load(X_ptr + start + i, mask=live, other=0).to(tl.int32)
        nxt = ((r >> 8) & 0xFFFFFF) ^ tl.load(TAB_ptr + ((r ^ b) & 0xFF))
        r = tl.where(live, nxt, r)
    tl.store(OUT_ptr + chunk, ~r, mask=valid)


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------


def interpreted() -> bool:
    """True when these kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_crc32c_tiles_kernel, InterpretedFunction)


def _check(data: object, chunk_bytes: object) -> None:
    import torch

    if not isinstance(data, torch.Tensor):
        raise TypeError(f"chunk_crc32c_triton: expected a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"chunk_crc32c_triton: expected a 1-D uint8 tensor, got {data.dim()}-D {data.dtype}; "
            "view the tensor's bytes with t.contiguous().view(-1).view(torch.uint8)"
        )
    if not data.is_contiguous():
        raise ValueError(
            "chunk_crc32c_triton: the tensor is not contiguous (stride "
            f"{tuple(data.stride())}); call .contiguous() first"
        )
    integral = isinstance(chunk_bytes, numbers.Integral) and not isinstance(chunk_bytes, bool)
    if not integral or chunk_bytes <= 0:
        raise ValueError(
            f"chunk_crc32c_triton: chunk_bytes must be a positive int, got {chunk_bytes!r}"
        )
    if data.device.type == "cuda":
        return
    if data.device.type == "cpu" and interpreted():
        return
    if data.device.type == "cpu":
        raise ValueError(
            "chunk_crc32c_triton: the tensor is on the CPU and Triton is not in interpreter mode; "
            "use backend='native' for CPU tensors, or set TRITON_INTERPRET=1 before "
            "gpumem.kernels.crc32c is first imported"
        )
    raise ValueError(
        f"chunk_crc32c_triton: tensors on {data.device} are not supported; "
        "use a CUDA tensor, or a CPU tensor with backend='native'"
    )


def tile_lanes(chunk_bytes: int) -> int:
    """Lanes per program for large chunks: enough words per lane, at most _MAX_LANES."""
    lanes = 1 << max(5, (chunk_bytes // 16).bit_length() - 1)
    return min(lanes, _MAX_LANES)


def chunk_crc32c_triton(
    data: "torch.Tensor", chunk_bytes: int, *, step_tables: str = STEP_TABLES
) -> "torch.Tensor":
    """CRC32C of each ``chunk_bytes`` piece of a byte tensor, computed by Triton kernels.

    Args:
        data: contiguous 1-D uint8 tensor on a CUDA device (or on the CPU when Triton runs in
            its interpreter, ``TRITON_INTERPRET=1``).
        chunk_bytes: bytes per chunk (> 0); the last chunk may be shorter.
        step_tables: ``"nibble"`` or ``"byte"``, the lookup tables of the large-chunk kernel's
            inner loop (same results; for benchmarks, see STEP_TABLES).

    Returns:
        int64 tensor of ``ceil(len(data) / chunk_bytes)`` CRC32C values on ``data.device``, each
        bit-identical to ``google_crc32c.value`` of that chunk's bytes.

    Raises:
        TypeError, ValueError: wrong type, dtype, shape, layout, chunk size or device.

    Example:
        >>> x = torch.arange(10, dtype=torch.uint8, device="cuda")
        >>> chunk_crc32c_triton(x, 4).tolist()  # CRCs of bytes 0-3, 4-7, 8-9
    """
    import torch

    _check(data, chunk_bytes)
    chunk_bytes = int(chunk_bytes)  # numpy integers too
    if step_tables not in ("nibble", "byte"):
        raise ValueError(f"step_tables must be 'nibble' or 'byte', got {step_tables!r}")
    n = data.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    out = torch.zeros(-(-n // chunk_bytes), dtype=torch.int32, device=data.device)
    guard = torch.cuda.device(data.device) if data.device.type == "cuda" else nullcontext()
    with guard:
        crc32c_into(data, out, chunk_bytes, step_tables=step_tables)
    return out.to(torch.int64) & _MASK32


def crc32c_into(
    data: "torch.Tensor", out: "torch.Tensor", chunk_bytes: int, *, step_tables: str = STEP_TABLES
) -> None:
    """Enqueue the chunk CRC32Cs of ``data`` into ``out`` on the current stream: the raw bits as
    int32 (``& 0xFFFFFFFF`` gives the value), one per ``chunk_bytes`` chunk.

    The lean form of :func:`chunk_crc32c_triton` for callers that checksum many tensors: no
    checks, no allocation, no conversion, one kernel launch. ``data`` is a non-empty contiguous
    uint8 tensor on the current CUDA device; ``out`` an int32 tensor of exactly
    ``ceil(len(data) / chunk_bytes)`` elements on the same device, **zeroed** (tiles XOR into it).
    """
    n = data.numel()
    chunk_bytes = min(int(chunk_bytes), n)  # one chunk either way; keeps kernel arguments in int64
    n_chunks = -(-n // chunk_bytes)
    tables, nibbles = _tables_on(data.device)
    if chunk_bytes <= SMALL_CHUNK_MAX:
        grid = (triton.cdiv(n_chunks, _SMALL_BLOCK),)
        _crc32c_small_kernel[grid](
            data, out, tables, n, chunk_bytes, n_chunks, BLOCK=_SMALL_BLOCK, num_warps=8
        )
    else:
        _launch_tiles(data, out, tables, nibbles, chunk_bytes, step_tables == "nibble")


_MULTI_TABLES: dict[tuple, "torch.Tensor"] = {}  # (device, chunk, addresses, lengths) -> PROG


def crc32c_many_into(
    sources: "list[torch.Tensor]",
    out: "torch.Tensor",
    starts: list[int],
    chunk_bytes: int,
    *,
    step_tables: str = STEP_TABLES,
) -> list[int]:
    """Enqueue the chunk CRC32Cs of many tensors in ONE kernel launch on the current stream.

    Source ``i`` (a contiguous uint8 tensor on the current CUDA device) gets its CRCs at
    ``out[starts[i]:]`` (int32 bits, ``out`` zeroed, as in :func:`crc32c_into`). One launch
    replaces one per tensor: with hundreds of tensors (a model and its optimizer state) the
    per-launch host cost, not the GPU, bounds the per-tensor path. The kernel reaches every
    source through byte offsets from the lowest-addressed one, from a table of
    (offset, length, first CRC slot, tile) per program, cached per set of addresses (a
    training job's tensors stay where they are from one checkpoint to the next).

    Only word-aligned sources go in (address and length multiples of 4, ``chunk_bytes`` a
    multiple of 4 above ``SMALL_CHUNK_MAX``); returns the indices of those left out, for
    :func:`crc32c_into`.
    """
    import torch

    chunk = int(chunk_bytes)
    if chunk <= SMALL_CHUNK_MAX or chunk % 4:
        return list(range(len(sources)))
    take = [
        i
        for i, s in enumerate(sources)
        if s.numel() and s.numel() % 4 == 0 and s.data_ptr() % 4 == 0
    ]
    left = sorted(set(range(len(sources))) - set(take))
    if not take:
        return left
    lanes = tile_lanes(chunk)
    step = 4 * lanes
    tile = min(step * _STEPS_PER_TILE, -(-chunk // step) * step)
    tiles_per_chunk = -(-chunk // tile)
    ptrs = [sources[i].data_ptr() for i in take]
    lens = [sources[i].numel() for i in take]
    device = sources[take[0]].device
    key = (str(device), chunk, tuple(ptrs), tuple(lens), tuple(starts[i] for i in take))
    prog = _MULTI_TABLES.get(key)
    if prog is None:
        n = np.asarray(lens, dtype=np.int64)
        n_chunks = -(-n // chunk)
        last = n - (n_chunks - 1) * chunk
        counts = (n_chunks - 1) * tiles_per_chunk + -(-last // tile)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.empty((int(counts.sum()), 4), dtype=np.int64)
        rows[:, 0] = np.repeat(np.asarray(ptrs, dtype=np.int64) - min(ptrs), counts)
        rows[:, 1] = np.repeat(n, counts)
        rows[:, 2] = np.repeat(np.asarray([starts[i] for i in take], dtype=np.int64), counts)
        rows[:, 3] = np.arange(len(rows), dtype=np.int64) - first
        prog = torch.from_numpy(rows).to(device)
        if len(_MULTI_TABLES) >= 8:
            _MULTI_TABLES.pop(next(iter(_MULTI_TABLES)))
        _MULTI_TABLES[key] = prog
    base = sources[take[ptrs.index(min(ptrs))]]
    tables, nibbles = _tables_on(device)
    _crc32c_multi_kernel[(prog.shape[0],)](
        base.view(torch.int32),
        out,
        tables,
        nibbles,
        prog,
        chunk,
        tile,
        tiles_per_chunk,
        _as_i32(init_term(chunk)),
        (chunk + 4).bit_length(),
        LANES=lanes,
        LOG2_LANES=int(math.log2(lanes)),
        WORDS=True,
        NIBBLES=step_tables == "nibble",
        num_warps=max(1, min(8, lanes // 128)),
    )
    return left


def _launch_tiles(
    data: "torch.Tensor",
    out: "torch.Tensor",
    tables: "torch.Tensor",
    nibbles: "torch.Tensor",
    chunk: int,
    use_nibbles: bool,
) -> None:
    import torch

    n = data.numel()
    lanes = tile_lanes(chunk)
    step = 4 * lanes
    tile = min(step * _STEPS_PER_TILE, -(-chunk // step) * step)
    tiles_per_chunk = -(-chunk // tile)
    last_len = n - (-(-n // chunk) - 1) * chunk
    n_tiles = (-(-n // chunk) - 1) * tiles_per_chunk + -(-last_len // tile)
    words = data.data_ptr() % 4 == 0 and data.storage_offset() % 4 == 0
    words = words and chunk % 4 == 0 and n % 4 == 0
    x = data.view(torch.int32) if words else data
    _crc32c_tiles_kernel[(n_tiles,)](
        x,
        out,
        tables,
        nibbles,
        n,
        chunk,
        tile,
        tiles_per_chunk,
        _as_i32(init_term(chunk)),
        _as_i32(init_term(last_len)),
        (chunk + 4).bit_length(),
        LANES=lanes,
        LOG2_LANES=int(math.log2(lanes)),
        WORDS=words,
        NIBBLES=use_nibbles,
        num_warps=max(1, min(8, lanes // 128)),
    )
