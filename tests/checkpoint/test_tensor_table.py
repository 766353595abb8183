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
from test_many_blocks import GOOD, MESHES, PATHS, VALUES

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
                node[path[-1]] = copy.deepcopy(value)  # a shared {} must not nest in itself
        except (KeyError, IndexError, TypeError):
            continue
    return t


ENTRY = {**GOOD, "extents": [["d.bin", 0, 24]]}  # GOOD, laid out canonically in a 24-byte file


def _body(tensors: list, sharded: bool) -> dict:
    body = {
        "format": "gpumem-checkpoint-shard",
        **{"rank": 0, "world_size": 1, "step": 3, "chunk_bytes": 4096, "alignment": 64},
        "files": {"d.bin": 24},
        "tensors": tensors,
        "state": {},
    }
    if sharded:
        body["meshes"] = [m.as_json() for m in MESHES]
    return body


def _both(body: dict, sharded: bool, spelling: dict) -> tuple:
    """(native outcome, Python outcome, whether the native decoder built the table)."""
    data = _framed(json.dumps(body, **spelling).encode(), 3 if sharded else 1)
    decoded, _, _ = format.decode_manifest(data, "m", native_tensors=True)
    built = type(decoded["tensors"]).__name__ == "Prebuilt"
    return _outcome(data, native=True), _outcome(data, native=False), built


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
def test_the_native_table_decides_as_the_full_check(edits, sharded, spelling, name):
    t = _edit(copy.deepcopy(ENTRY), edits)
    if isinstance(t, dict) and name:
        t["name"] = name
    native, python, _ = _both(_body([t], sharded), sharded, spelling)
    assert native == python
    if not isinstance(python, tuple):  # the same entries, field by field
        assert [vars(e) for e in native.tensors] == [vars(e) for e in python.tensors]


def test_the_native_table_takes_the_good_entries():
    plain = {k: v for k, v in ENTRY.items() if k != "global"}
    for t, sharded in ((ENTRY, True), (plain, False), (plain, True)):
        for spelling in ({}, {"indent": 1}, {"sort_keys": True}):
            native, python, built = _both(_body([t], sharded), sharded, spelling)
            assert built and not isinstance(python, tuple) and native == python
            assert vars(native.tensors[0]) == vars(python.tensors[0])
    empty = {**_body([], True), "files": {}}
    native, python, built = _both(empty, True, {})
    assert built and native == python and native.tensors == ()


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
        st.tuples(st.integers(0, len(PAYLOAD)), st.integers(0, 3), st.sampled_from([*PIECES, b""])),
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


def test_strings_with_quotes_backslashes_and_brackets_around_the_table_are_skipped_exactly():
    """find_tensors jumps over every value but the table (one scan for its closing bracket,
    strings by memchr): escaped quotes, backslash runs and brackets inside strings must not move
    the table's bounds, before the table or after it."""
    tricky = ['a\\"]}b', "c\\\\", '\\\\\\"', "[{", "}]", '"tensors":[]', "é"]
    for before in (True, False):
        body = json.loads(PAYLOAD)
        extra = {"x": tricky, "y": {"[": ["]", {"}": "{"}]}}
        state = {**extra, **body["state"]} if before else {**body["state"], **extra}
        rest = {k: v for k, v in body.items() if k != "state"}
        ordered = {"state": state, **rest} if before else {**rest, "state": state}
        data = _framed(json.dumps(ordered, separators=(",", ":")).encode())
        decoded, crc, version = format.decode_manifest(data, "m", native_tensors=True)
        assert type(decoded["tensors"]).__name__ == "Prebuilt", before
        assert decoded["state"] == state
        assert format.parse_shard(decoded, "m", crc, version) == _outcome(data, native=False)


def test_a_duplicate_tensors_key_is_refused_as_in_python():
    payload = PAYLOAD[:-1] + b',"tensors":[]}'
    got = _outcome(_framed(payload), native=True)
    assert got == _outcome(_framed(payload), native=False)
    assert "duplicate key 'tensors'" in got[1]


def _variant(replace: bytes, by: bytes) -> bytes:
    assert replace in PAYLOAD
    return _framed(PAYLOAD.replace(replace, by, 1))


def test_a_name_twice_or_a_misplaced_extent_gets_the_python_message():
    cases = {
        "appears twice": _variant(b'"name":"b"', b'"name":"a.w"'),
        "the layout puts it at": _framed(
            PAYLOAD.replace(b'"data-r00000-0000.bin",4096,24', b'"data-r00000-0000.bin",4160,24')
            .replace(b'"data-r00000-0000.bin":4120', b'"data-r00000-0000.bin":4184')
        ),
        "its extents end at": _variant(b'"data-r00000-0000.bin":4120', b'"data-r00000-0000.bin":4184'),  # noqa: E501
    }  # fmt: skip
    for what, data in cases.items():
        got = _outcome(data, native=True)
        assert got == _outcome(data, native=False)
        assert isinstance(got, tuple) and what in got[1], (what, got)
