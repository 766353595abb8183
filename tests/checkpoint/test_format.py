"""Manifest framing, layout planning, byte-flip detection and hostile manifests (hypothesis)."""

import base64
import contextlib
import json
import os
import pickle
import random
import tempfile
from pathlib import Path

import google_crc32c
import pytest
import torch
from ckpt_files import encode_manifest, read_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.checkpoint import CheckpointCorruptError, CheckpointError, verify
from gpumem.checkpoint.capture.codec import decode
from gpumem.checkpoint.stage.pieces import plan_staging
from gpumem.checkpoint.storage import format
from gpumem.checkpoint.storage.format import decode_manifest, parse_main, parse_shard


def test_manifest_framing_matches_an_independent_crc32c():
    data, crc = format.encode_manifest({"a": [1, 2.5, "x"]}, 1)
    header, payload = data.split(b"\n", 1)
    assert header.startswith(b"gpumem-checkpoint 1 000000000017 ")
    prefix = header[: header.rindex(b" ") + 1]
    assert crc == google_crc32c.value(prefix + payload) == int(header[-8:], 16)
    assert decode_manifest(data, "m") == ({"a": [1, 2.5, "x"]}, crc, 1)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "bad header"),
        (b"gpumem-checkpoint 1 000000000002 00000000\n{}", "CRC32C mismatch"),
        (b"gpumem-checkpoint 1 000000000009 00000000\n{}", "truncated"),
    ],
)
def test_manifest_framing_errors(data, match):
    with pytest.raises(CheckpointCorruptError, match=match):
        decode_manifest(data, "m")


def _framed(payload: bytes, version: int = 1) -> bytes:
    prefix = f"gpumem-checkpoint {version} {len(payload):012d} ".encode()
    return prefix + f"{google_crc32c.value(prefix + payload):08x}\n".encode() + payload


@pytest.mark.parametrize(
    "payload, match",
    [
        (b'{"a": NaN}', "non-finite"),
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b"[1]", "not a JSON object"),
        (b"[" * 100000 + b"]" * 100000, "invalid"),
    ],
)
def test_hostile_json_bodies(payload, match):
    with pytest.raises(CheckpointCorruptError, match=match):
        decode_manifest(_framed(payload), "m")
    with pytest.raises(CheckpointCorruptError, match="version 7"):
        decode_manifest(_framed(b"{}", version=7), "m")


def test_plan_layout_by_hand():
    ts = [
        torch.empty(10, dtype=torch.uint8),
        torch.empty(1250),
        torch.empty(0),
        torch.empty(3, dtype=torch.uint8),
    ]
    plan = plan_staging(ts, ["a", "b", "c", "d"], budget=1 << 20, alignment=4096, chunk=4096)
    assert plan.slots == 1 and plan.batch_sizes == [12291]
    assert [(p.index, p.offset, p.nbytes) for p in plan.pieces] == [
        (0, 0, 10),
        (1, 4096, 5000),
        (3, 12288, 3),
    ]
    # fits, in 8 KiB segments (one data file each, written while the next is copied)
    plan = plan_staging(
        ts, ["a", "b", "c", "d"], budget=1 << 20, alignment=4096, chunk=4096, segment=8192
    )
    assert not plan.streaming and plan.batch_sizes == [8192, 4099] and plan.bases == [0, 8192]
    assert [(p.index, p.batch, p.offset, p.src_offset, p.nbytes) for p in plan.pieces] == [
        (0, 0, 0, 0, 10),
        (1, 0, 4096, 0, 4096),
        (1, 1, 0, 4096, 904),
        (3, 1, 4096, 0, 3),
    ]
    # over budget (12291 > 12000): two slots of 6000 // 4096 * 4096 = 4096 bytes; the 5000-byte
    # tensor is cut at a chunk boundary and each piece starts a fresh slot
    plan = plan_staging(ts, ["a", "b", "c", "d"], budget=12000, alignment=4096, chunk=4096)
    assert plan.slots == 2 and plan.capacity == 4096 and plan.batch_sizes == [10, 4096, 904, 3]
    assert plan.bases == [0, 4096, 0, 4096]
    assert [(p.index, p.batch, p.offset, p.src_offset, p.nbytes) for p in plan.pieces] == [
        (0, 0, 0, 0, 10),
        (1, 1, 0, 0, 4096),
        (1, 2, 0, 4096, 904),
        (3, 3, 0, 0, 3),
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("flip")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(root, chunk_bytes=4096) as ck:
        ck.save(1, model=model, optimizer=opt, extra={"e": 1})
    return root / "step-000000001"


def test_the_reader_checks_the_version_against_the_fields(saved):
    """The writer states a manifest's version from what the checkpoint holds (a plain save is
    version 1); the reader refuses a field its version does not have, and a version 2 / 3
    manifest without its marker."""
    assert (saved / "manifest-r00000").read_bytes().startswith(b"gpumem-checkpoint 1 ")
    assert (saved / "MANIFEST").read_bytes().startswith(b"gpumem-checkpoint 1 ")
    body, _ = read_manifest(saved / "manifest-r00000")
    parse_shard(body, "m", 0, 1)
    with pytest.raises(CheckpointCorruptError, match=r"version 3 \(sharded\) but lacks .*'meshes'"):
        parse_shard(body, "m", 0, 3)
    with pytest.raises(CheckpointCorruptError, match=r"version 2 \(replicated\) but not marked"):
        parse_shard(body, "m", 0, 2)
    for key, value in (("replicated", True), ("meshes", [])):
        with pytest.raises(CheckpointCorruptError, match=f"field '{key}', which version 1"):
            parse_shard({**body, key: value}, "m", 0, 1)
    main, _ = read_manifest(saved / "MANIFEST")
    with pytest.raises(CheckpointCorruptError, match="field 'sharded', which version 2"):
        parse_main({**main, "replicated": True, "sharded": True}, "m", 0, 2)
    # a block of a global tensor belongs in a sharded (version 3) shard manifest only
    first = dict(body["tensors"][0])
    first["global"] = {"shape": first["shape"], "offsets": [0] * len(first["shape"])}
    forged = {**body, "tensors": [first, *body["tensors"][1:]]}
    with pytest.raises(CheckpointCorruptError, match="'global' needs a version 3"):
        parse_shard(forged, "m", 0, 1)
    assert parse_shard({**forged, "meshes": []}, "m", 0, 3).tensors[0].box is not None
    with pytest.raises(ValueError, match="version 4"):
        format.encode_manifest({}, 4)


def test_every_byte_flip_is_detected(saved):
    files = sorted(p for p in saved.iterdir())
    assert {p.name for p in files} == {"MANIFEST", "manifest-r00000", "data-r00000-0000.bin"}
    verify(saved)
    rng = random.Random(5)
    flips = 0
    for path in files:
        original = path.read_bytes()
        # every byte of the small main manifest; random positions (data, padding, JSON) elsewhere
        positions = (
            range(len(original))
            if path.name == "MANIFEST"
            else rng.sample(range(len(original)), 150)
        )
        for pos in positions:
            damaged = bytearray(original)
            damaged[pos] ^= rng.randrange(1, 256)
            path.write_bytes(bytes(damaged))
            with pytest.raises(CheckpointCorruptError):
                verify(saved)
            flips += 1
        path.write_bytes(original)
    assert flips > 500
    verify(saved)


def test_truncated_and_missing_files_are_detected(saved, tmp_path):
    import shutil

    copy = tmp_path / "step-000000001"
    shutil.copytree(saved, copy)
    data = copy / "data-r00000-0000.bin"
    raw = data.read_bytes()
    data.write_bytes(raw[:-1])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        verify(copy)
    data.unlink()
    with pytest.raises(CheckpointCorruptError, match="unreadable"):
        verify(copy)
    (copy / "manifest-r00000").unlink()
    with pytest.raises(CheckpointCorruptError, match="missing"):
        verify(copy)


# --------------------------------------------------------------------- nothing is unpickled

# A pickle that creates MARKER when it is loaded. test_the_planted_pickle_is_live shows that it
# does; the tests below plant it wherever a load path could meet it and check MARKER afterwards,
# so they fail if any path unpickles (or evals) what it reads.
MARKER = Path(tempfile.gettempdir()) / f"gpumem-test-pwned-{os.getpid()}"


class _Plant:
    def __reduce__(self):
        return (os.mkdir, (str(MARKER),))


PAYLOAD = pickle.dumps(_Plant(), protocol=2)


@pytest.fixture
def no_marker():
    def clear():
        if MARKER.exists():
            MARKER.rmdir()

    clear()
    yield
    clear()


def test_the_planted_pickle_is_live(no_marker):
    pickle.loads(PAYLOAD)
    assert MARKER.is_dir()


def test_no_load_path_unpickles_planted_bytes(tmp_path, no_marker):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    planted = {
        "bytes": PAYLOAD,
        "text": PAYLOAD.decode("latin-1"),
        "tensor": torch.frombuffer(bytearray(PAYLOAD), dtype=torch.uint8),
        "b64": base64.b64encode(PAYLOAD).decode(),
    }
    with gpumem.Checkpointer(tmp_path, chunk_bytes=4096) as ck:
        ck.save(1, model=model, optimizer=opt, extra=planted)
    (tmp_path / "step-000000001" / "data.pkl").write_bytes(PAYLOAD)  # a stray file beside them
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    extra: dict = {}
    with gpumem.Checkpointer(tmp_path) as ck:
        assert [info.step for info in ck.list()] == [1]
        assert ck.restore(model=fresh, optimizer=fresh_opt, extra=extra) == 1
    verify(tmp_path / "step-000000001")
    assert not MARKER.exists()
    # the bytes came back as data, exactly
    assert extra["bytes"] == PAYLOAD and extra["text"] == planted["text"]
    assert extra["b64"] == planted["b64"]
    assert torch.equal(extra["tensor"], planted["tensor"])
    assert torch.equal(fresh.weight, model.weight)


# ------------------------------------------------------------------------------------ fuzzing

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "__tensor__",
            "__tuple__",
            "__dict__",
            "__ndarray__",
            "float32",
            "data-r00000-0000.bin",
            "../etc/passwd",
            f"__import__('os').mkdir({str(MARKER)!r})",
            PAYLOAD.decode("latin-1"),
        ]
    )
    | st.just({"__bytes__": base64.b64encode(PAYLOAD).decode()}),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "__tensor__",
                    "__tuple__",
                    "__dict__",
                    "__float__",
                    "__bytes__",
                    "__ndarray__",
                    "name",
                    "dtype",
                    "shape",
                    "nbytes",
                    "crc32c",
                    "extents",
                    "files",
                    "tensors",
                    "state",
                    "rank",
                    "step",
                    "x",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replace(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_hostile_shard_manifests_fail_cleanly(saved, tmp_path_factory, data, no_marker):
    body, _ = read_manifest(saved / "manifest-r00000")
    paths = list(_paths(body))
    path = data.draw(st.sampled_from(paths))
    body = _replace(json.loads(json.dumps(body)), path, data.draw(json_values))
    try:
        shard = parse_shard(body, "m", 0, 1)
        decode(shard.state, {t.name: t for t in shard.tensors})
    except CheckpointError:
        pass
    assert not MARKER.exists()


@settings(max_examples=200, deadline=None)
@given(body=json_values)
def test_random_bodies_fail_cleanly(body):
    for parse in (parse_main, parse_shard):
        for version in format.READ_VERSIONS:
            with contextlib.suppress(CheckpointError):
                parse(body if isinstance(body, dict) else {"x": body}, "m", 0, version)
    with contextlib.suppress(CheckpointError):
        decode(body, {})
    assert not MARKER.exists()


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_as_manifest(raw):
    with pytest.raises(CheckpointCorruptError):
        decode_manifest(raw, "m")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_hostile_manifest_on_disk_through_verify(saved, tmp_path_factory, data, no_marker):
    """A forged shard manifest (valid framing and CRC, recorded in a forged main manifest) only
    ever produces CheckpointError from verify()."""
    import shutil

    root = tmp_path_factory.mktemp("forge") / "step-000000001"
    shutil.copytree(saved, root)
    body, _ = read_manifest(root / "manifest-r00000")
    path = data.draw(st.sampled_from(list(_paths(body))))
    body = _replace(body, path, data.draw(json_values))
    raw, crc = encode_manifest(body)
    (root / "manifest-r00000").write_bytes(raw)
    main, _ = read_manifest(root / "MANIFEST")
    main["shards"][0]["crc32c"] = crc
    (root / "MANIFEST").write_bytes(encode_manifest(main)[0])
    with contextlib.suppress(CheckpointError):
        verify(root)
    assert not MARKER.exists()
