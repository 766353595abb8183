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
  idea of Intel's "slicing-by-8" CRC. The host precomputes them for ``Z^(2^b)``, b = 0..63
  (256 KiB); a shift by any ``d`` is then a product over the set bits of ``d``.

Large chunks (``_crc32c_tiles_kernel``): a chunk is cut into tiles; a program owns one tile and
``LANES`` lanes that walk it in interleaved 4-byte words (lane ``l`` takes words ``l, l+LANES,
...``), so each step is one coalesced load of ``4*LANES`` contiguous bytes. A lane keeps
``r = Z^(4*LANES)(r) ^ w`` (4 byte-table lookups per word); the lane registers form an
``LANES``-word message whose raw CRC is combined in a log2(LANES)-level tree, the tile's raw CRC
is shifted by the bytes that follow it in its chunk, and the program XORs it (with the init term,
for the chunk's first tile) into the chunk's output word with one atomic. XOR is exact and
commutative, so the result does not depend on the order the programs run in.

Many tensors (``_crc32c_multi_kernel``, what a checkpoint snapshot uses): the same tiles over
every tensor of a save in one launch, each program reading its tensor's offset, length, first
output slot and init terms from a table built once per set of addresses (``plan_many``).

Small chunks (``_crc32c_small_kernel``, chunk <= 256 bytes): one lane per chunk, byte at a time.

Measured on an H200 (benchmarks/results/triton_crc32c.md): 370-680 GB/s, HBM is not the limit,
the inner loop is. An earlier variant looked the step operator up in eight 16-entry nibble
tables (each warp-wide lookup in one cache line, twice the lookups); the byte tables were faster
at every chunk size, so the nibble variant was removed. A D2D copy moves 1.5-2.2 TB/s of payload
on an H100/H200.
"""

# No `from __future__ import annotations`: Triton 3.1 recognises `tl.constexpr` parameters only
# from evaluated annotations.
import functools
import math
import numbers
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
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


@functools.lru_cache(maxsize=4096)
def init_term(length: int) -> int:
    """What init and xorout add to the raw CRC of a ``length``-byte message (cached per length:
    a training job checksums the same tensor lengths at every save)."""
    return shift_bytes(_MASK32, length) ^ _MASK32


@functools.cache
def operator_tables() -> np.ndarray:
    """int32 array [_NUM_POWERS, 4, 256]: byte tables of Z^(2^b); [0, 0] is the classic table."""
    cols = np.array(_power_matrices(), dtype=np.uint32).reshape(_NUM_POWERS, 4, 8)
    bits = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(bool)  # [256, 8]
    picked = np.where(bits[None, None], cols[:, :, None, :], np.uint32(0))  # [P, 4, 256, 8]
    return np.bitwise_xor.reduce(picked, axis=-1).astype(np.uint32).view(np.int32)


_device_tables: dict[str, "torch.Tensor"] = {}


def _tables_on(device: "torch.device") -> "torch.Tensor":
    """The byte tables on ``device``, copied there once per device."""
    import torch

    key = str(device)
    tab = _device_tables.get(key)
    if tab is None:
        tab = torch.from_numpy(operator_tables().reshape(-1).copy()).to(device)
        _device_tables[key] = tab
    return tab


def _as_i32(v: int) -> int:
    """A uint32 as the int32 with the same bits (kernel scalar arguments are signed)."""
    return v - (1 << 32) if v >= 1 << 31 else v


# --------------------------------------------------------------------------------------------
# Device side
# --------------------------------------------------------------------------------------------


@triton.jit
def _apply_op(TAB_ptr, v):
    """M(v) for the operator whose four byte tables start at TAB_ptr (v: int32, any shape);
    operator b (Z^(2^b)) starts at TAB_ptr + b * 1024."""
    t = tl.load(TAB_ptr + (v & 0xFF))
    t ^= tl.load(TAB_ptr + 256 + ((v >> 8) & 0xFF))
    t ^= tl.load(TAB_ptr + 512 + ((v >> 16) & 0xFF))
    t ^= tl.load(TAB_ptr + 768 + ((v >> 24) & 0xFF))
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
    )


@triton.jit
def _crc32c_multi_kernel(
    X_ptr,
    OUT_ptr,
    TAB_ptr,
    PROG_ptr,
    chunk_bytes,
    tile_bytes,
    tiles_per_chunk,
    init_full,
    nbits,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    WORDS: tl.constexpr,
):
    """The tiles kernel over many tensors in one launch. Program p reads row p of PROG (int64:
    the tensor's byte offset from X_ptr, its length, the OUT index of its first chunk, the
    tile's index within the tensor, the init term of its short last chunk, computed and cached
    on the host) and XORs that tile's contribution into OUT."""
    row = PROG_ptr + tl.program_id(0).to(tl.int64) * 5
    x_off = tl.load(row)
    n_bytes = tl.load(row + 1)
    out0 = tl.load(row + 2)
    t = tl.load(row + 3)
    init_last = tl.load(row + 4).to(tl.int32)
    chunk = t // tiles_per_chunk
    tile = t - chunk * tiles_per_chunk
    _tile_crc(
        X_ptr,
        OUT_ptr + out0,
        TAB_ptr,
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
    )


@triton.jit
def _tile_crc(
    X_ptr,
    OUT_ptr,
    TAB_ptr,
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
):
    """XOR tile ``tile`` of chunk ``chunk``'s contribution into OUT[chunk]; the message starts
    ``x_off`` bytes (a multiple of 4 with WORDS) after X_ptr's first byte.

    The tile is front-padded with zero bytes to K steps of 4*LANES bytes (leading zeros leave a
    raw CRC unchanged). Lane l sees words w_{k*LANES+l}, k < K, and ends with
    r_l = XOR_k Z^(4*LANES*(K-1-k))(w_{k*LANES+l}), so
    raw(tile) = Z^4(XOR_l Z^(4*(LANES-1-l))(r_l)), the inner XOR being the tree below.
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
        r = _apply_op(TAB_ptr + (LOG2_LANES + 2) * 1024, r) ^ w  # r = Z^(4*LANES)(r) ^ w
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


def chunk_crc32c_triton(data: "torch.Tensor", chunk_bytes: int) -> "torch.Tensor":
    """CRC32C of each ``chunk_bytes`` piece of a byte tensor, computed by Triton kernels.

    Args:
        data: contiguous 1-D uint8 tensor on a CUDA device (or on the CPU when Triton runs in
            its interpreter, ``TRITON_INTERPRET=1``).
        chunk_bytes: bytes per chunk (> 0); the last chunk may be shorter.

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
    n = data.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    out = torch.zeros(-(-n // chunk_bytes), dtype=torch.int32, device=data.device)
    guard = torch.cuda.device(data.device) if data.device.type == "cuda" else nullcontext()
    with guard:
        crc32c_into(data, out, chunk_bytes)
    return out.to(torch.int64) & _MASK32


def crc32c_into(data: "torch.Tensor", out: "torch.Tensor", chunk_bytes: int) -> None:
    """Enqueue the chunk CRC32Cs of ``data`` into ``out`` on the current stream: the raw bits as
    int32 (``& 0xFFFFFFFF`` gives the value), one per ``chunk_bytes`` chunk.

    The lean form of :func:`chunk_crc32c_triton`: no checks, no allocation, no conversion, one
    kernel launch. ``data`` is a non-empty contiguous uint8 tensor on the current CUDA device;
    ``out`` an int32 tensor of exactly ``ceil(len(data) / chunk_bytes)`` elements on the same
    device, **zeroed** (tiles XOR into it).
    """
    n = data.numel()
    chunk_bytes = min(int(chunk_bytes), n)  # one chunk either way; keeps kernel arguments in int64
    n_chunks = -(-n // chunk_bytes)
    tables = _tables_on(data.device)
    if chunk_bytes <= SMALL_CHUNK_MAX:
        grid = (triton.cdiv(n_chunks, _SMALL_BLOCK),)
        _crc32c_small_kernel[grid](
            data, out, tables, n, chunk_bytes, n_chunks, BLOCK=_SMALL_BLOCK, num_warps=8
        )
    else:
        _launch_tiles(data, out, tables, chunk_bytes)


def _tiling(chunk: int) -> tuple[int, int, int]:
    """(lanes, tile bytes, tiles per chunk) of the tiled kernels for ``chunk``-byte chunks."""
    lanes = tile_lanes(chunk)
    step = 4 * lanes
    tile = min(step * _STEPS_PER_TILE, -(-chunk // step) * step)
    return lanes, tile, -(-chunk // tile)


@dataclass(frozen=True)
class _Launch:
    """One launch of the multi-tensor kernel: its program table (on the device) and which
    source is its base (the lowest address; every other one is reached by a byte offset)."""

    base: int
    prog: "torch.Tensor"
    words: bool


@dataclass(frozen=True)
class ManyPlan:
    """The launches that checksum a fixed set of device byte ranges (``plan_many``): one for the
    word-aligned ones (address and length multiples of 4: word loads), one more only if some
    are not (byte loads). Built once per set of addresses; launching costs no per-tensor work."""

    chunk: int
    launches: tuple[_Launch, ...]


def plan_many(
    ptrs: "Sequence[int]",
    lens: "Sequence[int]",
    starts: "Sequence[int]",
    chunk_bytes: int,
    device: "torch.device",
) -> ManyPlan:
    """The program tables for ranges ``ptrs[i]``, ``lens[i]`` bytes (> 0), range i's CRCs going
    to ``out[starts[i]:]``, at ``chunk_bytes`` (> SMALL_CHUNK_MAX) per chunk, on ``device``.
    Each row holds the per-length init term of the range's last chunk (``init_term``, cached)."""
    import torch

    chunk = int(chunk_bytes)
    if chunk <= SMALL_CHUNK_MAX:
        raise ValueError(
            f"plan_many needs chunks above {SMALL_CHUNK_MAX} bytes (the tiled kernel), got {chunk}"
        )
    _, tile, tiles_per_chunk = _tiling(chunk)
    words_ok = chunk % 4 == 0
    classes: dict[bool, list[int]] = {True: [], False: []}
    for i, (p, n) in enumerate(zip(ptrs, lens, strict=True)):
        if n <= 0:
            raise ValueError(f"plan_many: range {i} is empty ({n} bytes)")
        classes[words_ok and p % 4 == 0 and n % 4 == 0].append(i)
    launches = []
    for words, take in classes.items():
        if not take:
            continue
        p = np.asarray([ptrs[i] for i in take], dtype=np.int64)
        n = np.asarray([lens[i] for i in take], dtype=np.int64)
        n_chunks = -(-n // chunk)
        last = n - (n_chunks - 1) * chunk
        counts = (n_chunks - 1) * tiles_per_chunk + -(-last // tile)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.empty((int(counts.sum()), 5), dtype=np.int64)
        rows[:, 0] = np.repeat(p - p.min(), counts)
        rows[:, 1] = np.repeat(n, counts)
        rows[:, 2] = np.repeat(np.asarray([starts[i] for i in take], dtype=np.int64), counts)
        rows[:, 3] = np.arange(len(rows), dtype=np.int64) - first
        rows[:, 4] = np.repeat(
            np.asarray([_as_i32(init_term(int(x))) for x in last.tolist()], dtype=np.int64), counts
        )
        base = take[int(np.argmin(p))]
        launches.append(_Launch(base, torch.from_numpy(rows).to(device), words))
    return ManyPlan(chunk, tuple(launches))


def launch_many(plan: ManyPlan, bases: "Sequence[torch.Tensor]", out: "torch.Tensor") -> None:
    """Enqueue ``plan``'s launches on the current stream: ``bases[k]`` is the uint8 tensor of
    launch k's base range (``plan.launches[k].base``), ``out`` the zeroed int32 CRC buffer."""
    import torch

    chunk = plan.chunk
    lanes, tile, tiles_per_chunk = _tiling(chunk)
    for launch, base in zip(plan.launches, bases, strict=True):
        _crc32c_multi_kernel[(launch.prog.shape[0],)](
            base.view(torch.int32) if launch.words else base,
            out,
            _tables_on(out.device),
            launch.prog,
            chunk,
            tile,
            tiles_per_chunk,
            _as_i32(init_term(chunk)),
            (chunk + 4).bit_length(),
            LANES=lanes,
            LOG2_LANES=int(math.log2(lanes)),
            WORDS=launch.words,
            num_warps=max(1, min(8, lanes // 128)),
        )


_MANY_PLANS: dict[tuple, ManyPlan] = {}  # (device, chunk, addresses, lengths, starts) -> plan


def crc32c_many_into(
    sources: "list[torch.Tensor]", out: "torch.Tensor", starts: list[int], chunk_bytes: int
) -> int:
    """Enqueue the chunk CRC32Cs of many tensors on the current stream in one kernel launch
    (two when some are not word-aligned); returns the number of launches.

    Source ``i`` (a contiguous uint8 tensor on the current CUDA device) gets its CRCs at
    ``out[starts[i]:]`` (int32 bits, ``out`` zeroed, as in :func:`crc32c_into`). One launch
    replaces one per tensor: with hundreds of tensors (a model and its optimizer state) the
    per-launch host cost, not the GPU, bounds a per-tensor path. The program tables are cached
    per set of addresses (a training job's tensors stay where they are from one checkpoint to
    the next). Empty sources get no CRC; chunks up to SMALL_CHUNK_MAX take the one-lane kernel,
    one launch per source.
    """
    chunk = int(chunk_bytes)
    live = [i for i, s in enumerate(sources) if s.numel()]
    if not live:
        return 0
    if chunk <= SMALL_CHUNK_MAX:
        for i in live:
            n = -(-sources[i].numel() // chunk)
            crc32c_into(sources[i], out[starts[i] : starts[i] + n], chunk)
        return len(live)
    ptrs = [sources[i].data_ptr() for i in live]
    lens = [sources[i].numel() for i in live]
    device = sources[live[0]].device
    key = (str(device), chunk, tuple(ptrs), tuple(lens), tuple(starts[i] for i in live))
    plan = _MANY_PLANS.get(key)
    if plan is None:
        plan = plan_many(ptrs, lens, [starts[i] for i in live], chunk, device)
        if len(_MANY_PLANS) >= 8:
            _MANY_PLANS.pop(next(iter(_MANY_PLANS)))
        _MANY_PLANS[key] = plan
    launch_many(plan, [sources[live[x.base]] for x in plan.launches], out)
    return len(plan.launches)


def _launch_tiles(data: "torch.Tensor", out: "torch.Tensor", tables: "torch.Tensor", chunk: int):
    import torch

    n = data.numel()
    lanes, tile, tiles_per_chunk = _tiling(chunk)
    last_len = n - (-(-n // chunk) - 1) * chunk
    n_tiles = (-(-n // chunk) - 1) * tiles_per_chunk + -(-last_len // tile)
    words = data.data_ptr() % 4 == 0 and data.storage_offset() % 4 == 0
    words = words and chunk % 4 == 0 and n % 4 == 0
    x = data.view(torch.int32) if words else data
    _crc32c_tiles_kernel[(n_tiles,)](
        x,
        out,
        tables,
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
        num_warps=max(1, min(8, lanes // 128)),
    )
