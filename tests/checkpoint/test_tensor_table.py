"""The native decode of a shard manifest's tensor table (``storage.tensor_table``, issue #25)
against the Python decoder as the reference: on generated and mutated entries it builds exactly
the entry ``format._parse_tensor`` builds or leaves the decision to it, and on hostile manifest
text (bytes inserted, removed, replaced) verify's decoder accepts and refuses exactly as the
Python path does, with the same message."""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from test_many_blocks import FILES, GOOD, MESHES, PATHS, VALUES

from gpumem._native import load
from gpumem.checkpoint.capture.boxes import Box
from gpumem.checkpoint.errors import CheckpointError
from gpumem.checkpoint.storage import format


def _edit(t, edits):
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
    return t


def _native(text: bytes, sharded: bool):
    ndims = [len(m.shape) for m in MESHES]
    return load().build_tensors(
        text, 0, len(text), 4096, 64, FILES, format.ITEMSIZE, ndims, sharded,
        format.TensorEntry, Box,
    )  # fmt: skip


SPELLINGS = st.sampled_from(
    [{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}, {"sort_keys": True}]
)


@settings(max_examples=600, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(PATHS), st.one_of(VALUES, st.just("__drop__"))), max_size=3
    ),
    sharded=st.booleans(),
    spelling=SPELLINGS,
    name=st.text(min_size=0, max_size=4),
)
def test_the_native_table_builds_what_the_full_check_builds(edits, sharded, spelling, name):
    t = _edit(copy.deepcopy(GOOD), edits)
    if isinstance(t, dict) and name:
        t["name"] = name
    try:
        full = format._parse_tensor(format._Checker("m"), t, 0, 4096, 64, FILES, MESHES, sharded)
    except CheckpointError:
        full = None
    built = _native(json.dumps([t], **spelling).encode(), sharded)
    assert built is None or (full is not None and built == [full]), (t, built, full)
    if built is not None:
        assert vars(built[0]) == vars(full) and vars(built[0].box or full) == vars(full.box or full)


def test_the_native_table_takes_the_good_entries():
    plain = {k: v for k, v in GOOD.items() if k != "global"}
    c = format._Checker("m")
    for t, sharded in ((GOOD, True), (plain, False), (plain, True)):
        want = format._parse_tensor(c, t, 0, 4096, 64, FILES, MESHES, sharded)
        assert _native(json.dumps([t, t]).encode(), sharded) == [want, want]
    assert _native(b" [ ] ", True) == []


# ------------------------------------------------------------------ whole manifests, hostile text


def _shard_text() -> bytes:
    body = format.shard_manifest(
        rank=0,
        world_size=1,
        step=3,
        chunk_bytes=4096,
        alignment=64,
        files={"data-r00000-0000.bin": 4096 + 24},
        tensors=[
            {
                "name": "a.w",
                "dtype": "float32",
                "shape": [2, 512],
                "nbytes": 4096,
                "crc32c": [11],
                "extents": [["data-r00000-0000.bin", 0, 4096]],
                "global": {"shape": [4, 512], "offsets": [2, 0], "mesh": 0, "placements": ["S(0)"]},
            },
            {
                "name": "b",
                "dtype": "int64",
                "shape": [3],
                "nbytes": 24,
                "crc32c": [4294967295],
                "extents": [["data-r00000-0000.bin", 4096, 24]],
            },
        ],
        state={"model": {"w": {"__dtensor__": "a.w"}, "b": {"__tensor__": "b"}}, "x": [1.5, "é"]},
        meshes=[MESHES[0]],
    )
    return format.encode_manifest(body.body, body.version)[0]


GOOD_TEXT = _shard_text()
PAYLOAD = GOOD_TEXT[GOOD_TEXT.index(b"\n") + 1 :]
PIECES = [b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b"0", b"7", b"-", b".", b"e", b"1e3"]
PIECES += [b"NaN", b"Infinity", b" ", b"\n", b"\x00", b"\xc3\xa9", b'"tensors":[]', b"\\u0073"]


def _framed(payload: bytes, version: int = 3) -> bytes:
    prefix = f"gpumem-checkpoint {version} {len(payload):012d} ".encode()
    crc = format.crc32c(payload, format.crc32c(prefix))
    return prefix + f"{crc:08x}\n".encode() + payload


def _outcome(data: bytes, native: bool):
    try:
        body, crc, version = format.decode_manifest(data, "m", native_tensors=native)
        return format.parse_shard(body, "m", crc, version)
    except CheckpointError as exc:
        return type(exc), str(exc)


@settings(max_examples=800, deadline=None)
@given(
    cuts=st.lists(
        st.tuples(
            st.integers(0, len(PAYLOAD)), st.integers(0, 3), st.sampled_from(PIECES + [b""])
        ),
        max_size=3,
    ),
    version=st.sampled_from([1, 2, 3]),
)
def test_hostile_manifest_text_gets_the_python_verdict(cuts, version):
    payload = PAYLOAD
    for at, drop, piece in cuts:
        payload = payload[:at] + piece + payload[at + drop :]
    data = _framed(payload, version)
    want = _outcome(data, native=False)
    assert _outcome(data, native=True) == want


def test_the_good_manifest_decodes_natively():
    body, crc, version = format.decode_manifest(GOOD_TEXT, "m", native_tensors=True)
    assert type(body["tensors"]).__name__ == "Prebuilt"
    assert format.parse_shard(body, "m", crc, version) == _outcome(GOOD_TEXT, native=False)


def test_a_duplicate_tensors_key_is_refused_as_in_python():
    payload = PAYLOAD[:-1] + b',"tensors":[]}'
    got = _outcome(_framed(payload), native=True)
    assert got == _outcome(_framed(payload), native=False)
    assert "duplicate key 'tensors'" in got[1]
