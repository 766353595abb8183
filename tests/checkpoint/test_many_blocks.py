"""A directory of a hundred thousand blocks (issue #25): it verifies, and a damaged block or a
nonzero padding byte in it is still found and named. How long it takes is a benchmark
(``benchmarks/bench_verify_blocks.py``), not a test. The manifest's fast decode
(``format._fast_tensor``) accepts exactly what the full check accepts, with the same entry."""

from __future__ import annotations

import copy
import os

import pytest
from blocks_lib import BLOCKS_FILE, forge_blocks, save_small
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.checkpoint import CheckpointCorruptError
from gpumem.checkpoint.capture.boxes import Mesh
from gpumem.checkpoint.errors import CheckpointError
from gpumem.checkpoint.storage import format

N = 100_000


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    step = save_small(tmp_path_factory.mktemp("blocks"))
    values = forge_blocks(step, N)
    return step, values


def _poke(path, offset: int, value: int) -> int:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([value]), offset)
    finally:
        os.close(fd)
    return old


def test_a_hundred_thousand_blocks_verify(blocks):
    step, _ = blocks
    info = gpumem.checkpoint.verify(step)
    assert info.step == 1 and info.sharded


@pytest.mark.parametrize("j", [0, 54_321, N - 1])
def test_a_damaged_block_among_them_is_found(blocks, j):
    step, values = blocks
    align = 4096
    old = _poke(step / BLOCKS_FILE, j * align, values[j] ^ 0x5A)
    try:
        with pytest.raises(CheckpointCorruptError, match=rf"'extra\.t\.{j}'.*CRC32C"):
            gpumem.checkpoint.verify(step)
    finally:
        _poke(step / BLOCKS_FILE, j * align, old)


def test_a_nonzero_padding_byte_among_them_is_found(blocks):
    step, _ = blocks
    at = 77_777 * 4096 + 100
    old = _poke(step / BLOCKS_FILE, at, 1)
    try:
        with pytest.raises(CheckpointCorruptError, match=rf"padding at byte {at} is not zero"):
            gpumem.checkpoint.verify(step)
    finally:
        _poke(step / BLOCKS_FILE, at, old)


# ------------------------------------------------------------------ fast decode == full check

FILES = {"d.bin": 1 << 20}
MESHES = (Mesh((2,), None, (0, 1)),)
GOOD = {
    "name": "w",
    "dtype": "float32",
    "shape": [2, 3],
    "nbytes": 24,
    "crc32c": [5],
    "extents": [["d.bin", 4096, 24]],
    "global": {"shape": [4, 3], "offsets": [2, 0], "mesh": 0, "placements": ["S(0)"]},
}
VALUES = st.one_of(
    st.integers(-3, 5),
    st.sampled_from([True, None, 2**32, 2**63, 4096, 1 << 20, 1.0, "", "x", "a/b", "S(0)", "R"]),
    st.sampled_from(["float32", "uint8", "complex", "d.bin", "e.bin"]),
    st.lists(st.integers(-1, 4), max_size=3),
    st.just([["d.bin", 0, 24]]),
    st.just({}),
)


def _paths(node, at=()):
    yield at
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*at, i))


PATHS = [p for p in _paths(GOOD) if p]


@settings(max_examples=400, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(PATHS), st.one_of(VALUES, st.just("__drop__"))), max_size=3
    ),
    sharded=st.booleans(),
)
def test_the_fast_decode_accepts_what_the_full_check_accepts(edits, sharded):
    t = copy.deepcopy(GOOD)
    for path, value in edits:
        node = t
        try:
            for k in path[:-1]:
                node = node[k]
            if value == "__drop__":
                del node[path[-1]]
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    c = format._Checker("m")
    try:
        full = format._parse_tensor(c, t, 0, 4096, 64, FILES, MESHES, sharded)
    except CheckpointError:
        full = None
    fast = format._fast_tensor(t, 4096, 64, FILES, MESHES, sharded)
    assert fast == full or fast is None, (t, fast, full)
    if full is not None and fast is not None:
        assert vars(fast) == vars(full)


def test_the_fast_decode_takes_the_good_entry():
    c = format._Checker("m")
    full = format._parse_tensor(c, GOOD, 0, 4096, 64, FILES, MESHES, True)
    assert format._fast_tensor(GOOD, 4096, 64, FILES, MESHES, True) == full
    plain = {k: v for k, v in GOOD.items() if k != "global"}
    assert format._fast_tensor(plain, 4096, 64, FILES, MESHES, False) == format._parse_tensor(
        c, plain, 0, 4096, 64, FILES, MESHES, False
    )
