"""The object-store client (gpumem.checkpoint.storage.s3.object_store) against a real S3-protocol
server in its own process (moto's server mode, s3_lib.S3Server), with faults injected at the
HTTP level (s3_lib.FaultProxy). Skipped where boto3 or moto is not installed (``.[test]``
installs both)."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest
from s3_lib import (
    CREDENTIALS,
    S3Server,
    env,
    is_conditional_put,
    is_part,
    is_ranged_get,
    open_store,
)

from gpumem.checkpoint import CheckpointCorruptError, CheckpointIOError, CheckpointStateError
from gpumem.checkpoint.storage.location import ObjectURL
from gpumem.checkpoint.storage.s3.object_body import Budget, crc32c_header

boto3 = pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")

from gpumem.checkpoint.storage.s3.object_store import S3Store  # noqa: E402

MiB = 1 << 20


def _store(endpoint: str, bucket: str, prefix: str = "run", **kw) -> S3Store:
    return open_store(endpoint, bucket, prefix, **kw)


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _raw(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


# ---------------------------------------------------------------------- round trips


def test_multipart_round_trip_is_bit_identical_and_carries_crc32c(s3_server, s3_bucket):
    from google_crc32c import value as ref_crc  # an independent CRC32C

    store = _store(s3_server.url, s3_bucket)
    a, b = _data(12 * MiB, 1), _data(5 * MiB + 123, 2)  # 2 + 1 parts (of 6 MiB, one of 5 MiB + 123)
    up = store.upload("run/shard-0", [a, b], part_bytes=6 * MiB, budget_bytes=7 * MiB)
    whole = np.concatenate([a, b])
    assert up.size == whole.nbytes
    assert up.crc32c == ref_crc(whole.tobytes())
    assert len(up.part_crcs) == 3 and up.part_crcs[0] == ref_crc(a[: 6 * MiB].tobytes())
    # the store kept the object's full CRC32C (the one gpumem sent) and checks it
    info = store.head("run/shard-0")
    assert info.size == whole.nbytes and info.crc32c == up.crc32c
    out = np.zeros_like(whole)
    store.read_into("run/shard-0", 0, out, object_size=whole.nbytes, etag=up.etag, crc=up.crc32c)
    assert np.array_equal(out, whole)
    # a range in the middle, into a slice of a larger buffer
    part = np.zeros(3 * MiB + 7, dtype=np.uint8)
    store.read_into("run/shard-0", 11 * MiB, part, object_size=whole.nbytes)
    assert np.array_equal(part, whole[11 * MiB : 14 * MiB + 7])
    # what an independent client reads is the same bytes
    body = _raw(s3_server.url).get_object(Bucket=s3_bucket, Key="run/shard-0")["Body"].read()
    assert body == whole.tobytes()


def test_a_small_object_is_one_put_and_a_tensor_uploads_as_it_is(s3_server, s3_bucket):
    import torch

    store = _store(s3_server.url, s3_bucket)
    t = torch.arange(1000, dtype=torch.float32)
    up = store.upload("run/t", [t])
    assert up.size == 4000 and len(up.part_crcs) == 1
    back = torch.empty_like(t)
    store.read_into("run/t", 0, back, object_size=4000, crc=up.crc32c)
    assert torch.equal(back, t)
    assert store.get("run/t")[0] == t.numpy().tobytes()


def test_list_and_delete(s3_server, s3_bucket):
    store = _store(s3_server.url, s3_bucket)
    for name in ("run/a", "run/b/c", "other/x"):
        store.put(name, name.encode())
    assert [o.key for o in store.list()] == ["run/a", "run/b/c"]
    assert [o.key for o in store.list("b/")] == ["run/b/c"]
    store.delete(["run/a", "run/missing"])
    assert [o.key for o in store.list()] == ["run/b/c"]
    assert store.get("run/a") is None and store.head("run/a") is None


# ---------------------------------------------------------------------- integrity


def test_parts_carry_their_crc32c_and_a_damaged_one_fails_the_upload(
    s3_server, s3_proxy, s3_bucket
):
    from google_crc32c import value as ref_crc

    store = _store(s3_proxy.url, s3_bucket)
    first = len(s3_proxy.puts)
    store.upload("run/ok", [_data(12 * MiB, 5)], part_bytes=6 * MiB)
    sent = s3_proxy.puts[first:]
    assert len(sent) == 2  # each part's header is the CRC32C of the bytes that went out
    assert all(h == crc32c_header(ref_crc(body)) for h, body in sent)
    # a byte changed on the wire after gpumem checksummed it. moto (unlike S3) does not check
    # the part's header, but it computes the object's CRC32C from what it assembled, and gpumem
    # compares that with its own: the object is deleted, the save fails
    s3_proxy.add("flip_request", is_part, times=1)
    with pytest.raises(
        CheckpointIOError, match=r"CRC32C \(.*\) differs from the one gpumem"
    ) as info:
        store.upload("run/s", [_data(12 * MiB)], part_bytes=6 * MiB)
    assert info.value.errno == errno.EIO
    assert store.head("run/s") is None and store.uploads() == []


def test_a_store_refusing_a_damaged_body_is_one_clear_error(s3_server, s3_proxy, s3_bucket):
    # S3 answers 400 BadDigest to a body that fails its x-amz-checksum-crc32c (moto does not
    # check it, so the proxy answers as S3 does)
    store = _store(s3_proxy.url, s3_bucket)
    s3_proxy.add("bad_digest", lambda m, p, q, h: m == "PUT", times=None)
    with pytest.raises(CheckpointIOError, match="CRC32C differs from the one gpumem computed"):
        store.put("run/m", b"manifest bytes")
    with pytest.raises(CheckpointIOError, match="BadDigest"):
        store.upload("run/s", [_data(12 * MiB)], part_bytes=6 * MiB)
    assert store.head("run/m") is None and store.head("run/s") is None
    assert store.uploads() == []


def test_a_changed_object_is_detected_by_crc_and_by_etag(s3_server, s3_proxy, s3_bucket):
    store = _store(s3_proxy.url, s3_bucket)
    data = _data(MiB)
    up = store.upload("run/s", [data])
    out = np.zeros_like(data)
    s3_proxy.add("flip_response", is_ranged_get)  # damaged on the way out, once: read again
    store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)
    assert np.array_equal(out, data) and s3_proxy.count("GET") == 2
    s3_proxy.add("flip_response", is_ranged_get, times=None)  # every time: damaged
    with pytest.raises(CheckpointCorruptError, match=r"fail their CRC32C.*read 3 times"):
        store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)
    s3_proxy.rules.clear()
    # replaced behind gpumem's back (same size): the ETag no longer matches
    _raw(s3_server.url).put_object(Bucket=s3_bucket, Key="run/s", Body=_data(MiB, 9).tobytes())
    with pytest.raises(CheckpointCorruptError, match="changed after it was written"):
        store.read_into("run/s", 0, out, object_size=data.nbytes, etag=up.etag)
    with pytest.raises(CheckpointCorruptError, match="fail their CRC32C"):
        store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)


def test_sizes_are_checked_against_the_manifest_before_reading(s3_server, s3_bucket):
    store = _store(s3_server.url, s3_bucket)
    store.put("run/s", b"x" * 100)
    out = bytearray(10)
    with pytest.raises(CheckpointCorruptError, match="not the 200 its manifest records"):
        store.read_into("run/s", 0, out, object_size=200)  # truncated (or not what was written)
    with pytest.raises(CheckpointCorruptError, match="lie outside"):
        store.read_into("run/s", 95, out, object_size=100)  # refused before any request
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        store.read_into("run/none", 0, out, object_size=100)
    with pytest.raises(CheckpointCorruptError, match="more than the 50"):
        store.get("run/s", max_bytes=50)


# ---------------------------------------------------------------------- conditional writes


def test_put_new_creates_once(s3_server, s3_bucket):
    store = _store(s3_server.url, s3_bucket)
    assert store.put_new("run/manifest", b"one")
    assert not store.put_new("run/manifest", b"two")
    assert store.get("run/manifest")[0] == b"one"


def test_two_writers_race_for_one_commit_and_exactly_one_wins(s3_server, s3_bucket):
    stores = [_store(s3_server.url, s3_bucket) for _ in range(8)]
    results: dict[int, bool] = {}
    barrier = threading.Barrier(len(stores))

    def commit(i: int) -> None:
        barrier.wait()
        results[i] = stores[i].put_new("run/step-7/manifest", f"writer {i}".encode())

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1
    assert stores[0].get("run/step-7/manifest")[0] == f"writer {winners[0]}".encode()


def test_a_commit_whose_response_was_lost_is_still_its_win(s3_server, s3_proxy, s3_bucket):
    # the server stores the object, the client never hears it, botocore retries, and the retry
    # fails the precondition: the writer tag says it was this writer's own write
    store = _store(s3_proxy.url, s3_bucket)
    before = s3_proxy.count("PUT")
    rule = s3_proxy.add("drop_response", is_conditional_put)
    assert store.put_new("run/latest", b"7")
    assert rule.hits == 1 and s3_proxy.count("PUT") - before == 2
    other = _store(s3_server.url, s3_bucket)
    assert not other.put_new("run/latest", b"8")


def test_put_over_moves_a_pointer_only_from_the_version_read(s3_server, s3_bucket):
    store = _store(s3_server.url, s3_bucket)
    assert store.put_new("run/latest", b"1")
    _, etag = store.get("run/latest")
    new = store.put_over("run/latest", b"2", etag)
    assert new is not None and store.get("run/latest") == (b"2", new)
    assert store.put_over("run/latest", b"3", etag) is None  # someone moved it since
    assert store.get("run/latest")[0] == b"2"


# ---------------------------------------------------------------------- faults and retries


def test_a_reset_mid_part_and_slowdowns_are_retried(s3_server, s3_proxy, s3_bucket):
    store = _store(s3_proxy.url, s3_bucket)
    data = _data(18 * MiB, 3)
    s3_proxy.add("reset_request", is_part, times=2)
    s3_proxy.add("slowdown", is_part, times=2)
    up = store.upload("run/s", [data], part_bytes=6 * MiB)
    assert s3_proxy.count("PUT", "partNumber") == 3 + 4  # three parts, four failed attempts
    out = np.zeros_like(data)
    store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)
    assert np.array_equal(out, data)


def test_a_read_whose_body_breaks_off_resumes(s3_server, s3_proxy, s3_bucket):
    store = _store(s3_proxy.url, s3_bucket)
    data = _data(9 * MiB, 4)
    up = store.upload("run/s", [data])
    s3_proxy.add("reset_response", is_ranged_get, times=2)
    out = np.zeros_like(data)
    store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)
    assert np.array_equal(out, data)
    gets = [q for m, _, q, s in s3_proxy.seen if m == "GET" and s == 206]
    assert len(gets) == 3


def test_a_part_that_keeps_failing_aborts_the_upload(s3_server, s3_proxy, s3_bucket):
    store = _store(s3_proxy.url, s3_bucket, max_attempts=3)
    s3_proxy.add(
        "slowdown", lambda m, p, q, h: is_part(m, p, q, h) and q["partNumber"] == ["2"], None
    )
    with pytest.raises(CheckpointIOError, match="SlowDown"):
        store.upload("run/s", [_data(18 * MiB)], part_bytes=6 * MiB)
    assert store.head("run/s") is None
    assert store.uploads() == []  # aborted: no parts left billed or listed
    assert s3_proxy.count("PUT", "partNumber=2") == 3


def test_a_killed_uploader_leaves_an_upload_listed_and_abortable(s3_server, s3_bucket):
    store = _store(s3_server.url, s3_bucket)
    # what a writer killed between parts leaves behind: an upload, no object
    raw = _raw(s3_server.url)
    uid = raw.create_multipart_upload(Bucket=s3_bucket, Key="run/s", ChecksumAlgorithm="CRC32C")[
        "UploadId"
    ]
    raw.upload_part(Bucket=s3_bucket, Key="run/s", UploadId=uid, PartNumber=1, Body=b"x" * MiB)
    left = store.uploads()
    assert [(u.key, u.upload_id) for u in left] == [("run/s", uid)]
    assert store.head("run/s") is None and list(store.list()) == []
    store.abort(left[0])
    assert store.uploads() == []
    store.abort(left[0])  # twice is no error


def test_the_budget_bounds_the_bytes_in_flight():
    budget = Budget(10)
    assert budget.take(6) == 6
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(budget.take(6)))
    t.start()
    t.join(0.2)
    assert got == []  # 6 + 6 > 10: waits
    budget.give(6)
    t.join(5)
    assert got == [6]
    assert budget.take(0) == 0
    budget.give(6)
    assert budget.take(100) == 10  # a part larger than the whole budget goes alone


# ---------------------------------------------------------------------- bad roots: one error


@pytest.mark.parametrize(
    "url",
    [
        "s3://",
        "s3:///run",
        "s3://UPPER/run",
        "s3://a/run",
        "s3://bucket_name/x",
        "s3://b..b/x",
        "s3://192.168.0.1/x",
        "s3://s3_bucket/a//b",
        "s3://s3_bucket/a/../b",
        "s3://s3_bucket/x?versionId=1",
        "s3://s3_bucket/x#frag",
        "gs://s3_bucket/x",
        "/local/path",
    ],
)
def test_a_malformed_url_is_one_clear_error(url):
    with pytest.raises(CheckpointStateError) as info:
        ObjectURL.parse(url)
    msg = str(info.value)
    assert repr(url) in msg and "s3://BUCKET" in msg and "\n" not in msg


def test_urls_parse():
    assert ObjectURL.parse("s3://my-bucket") == ObjectURL("my-bucket", "")
    assert ObjectURL.parse("s3://my.bucket/runs/llama/") == ObjectURL("my.bucket", "runs/llama")
    assert ObjectURL.parse("s3://b12/x").key("step-3/manifest") == "x/step-3/manifest"
    assert str(ObjectURL.parse("s3://b12/x/")) == "s3://b12/x"


def test_a_missing_bucket_is_one_clear_error(s3_server):
    with pytest.raises(CheckpointIOError, match="'no-such-bucket' does not exist") as info:
        _store(s3_server.url, "no-such-bucket")
    assert info.value.errno == errno.ENOENT


def test_an_unreachable_endpoint_is_one_clear_error():
    port = __import__("s3_lib")._free_port()
    with pytest.raises(CheckpointIOError, match="cannot reach the store") as info:
        _store(f"http://127.0.0.1:{port}", "bucket", max_attempts=1)
    assert info.value.errno == errno.ECONNREFUSED


def test_denied_credentials_are_one_clear_error(tmp_path):
    srv = S3Server(tmp_path, auth=True)  # checks keys: "testing" is not one it knows
    try:
        with pytest.raises(CheckpointIOError, match="access denied") as info:
            _store(srv.url, "bucket")
        assert info.value.errno == errno.EACCES
        assert "AWS_ACCESS_KEY_ID" in str(info.value)
    finally:
        srv.stop()


def test_missing_credentials_are_one_clear_error(s3_server, s3_bucket, tmp_path):
    nothing = {k: None for k in CREDENTIALS if k != "AWS_REGION"}
    none = str(tmp_path / "none")
    with (
        env({**nothing, "AWS_SHARED_CREDENTIALS_FILE": none, "AWS_CONFIG_FILE": none}),
        env({"AWS_EC2_METADATA_DISABLED": "true", "AWS_PROFILE": None}),
        pytest.raises(CheckpointIOError, match="no AWS credentials found"),
    ):
        S3Store(f"s3://{s3_bucket}/run", endpoint_url=s3_server.url)


def test_a_store_without_conditional_writes_is_refused_at_open(s3_server, s3_proxy, s3_bucket):
    s3_proxy.add("strip_conditions", is_conditional_put, times=None)
    with pytest.raises(CheckpointIOError, match="ignores conditional writes") as info:
        _store(s3_proxy.url, s3_bucket)
    assert info.value.errno == errno.EOPNOTSUPP
    assert list(_store(s3_server.url, s3_bucket).list("")) == []  # the probe left nothing


def test_the_endpoint_and_region_come_from_the_environment(s3_server, s3_bucket):
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        store = S3Store(f"s3://{s3_bucket}/run")
    assert store.endpoint == s3_server.url
    store.put("run/x", b"1")
    assert store.get("run/x")[0] == b"1"


def test_an_upload_sends_the_callers_memory_without_a_host_copy(s3_server, s3_bucket):
    import tracemalloc

    store = _store(s3_server.url, s3_bucket)
    data = _data(24 * MiB, 6)
    store.upload("run/warm", [data[: 12 * MiB]], part_bytes=6 * MiB)  # imports, pools, caches
    tracemalloc.start()  # numpy's and Python's allocations are both traced
    try:
        up = store.upload("run/s", [data], part_bytes=6 * MiB, budget_bytes=24 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # four 6 MiB parts in flight at once: a copy of any one of them would show as >= 6 MiB
    assert peak < 2 * MiB, peak
    out = np.zeros_like(data)
    store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c)
    assert np.array_equal(out, data)


def test_a_large_read_goes_in_parallel_ranges_of_one_version(s3_server, s3_proxy, s3_bucket):
    store = _store(s3_proxy.url, s3_bucket, max_concurrency=4)
    data = _data(40 * MiB, 7)
    up = store.upload("run/s", [data], part_bytes=8 * MiB)
    s3_proxy.add("reset_response", is_ranged_get, times=1)
    first = len(s3_proxy.seen)
    out = np.zeros_like(data)
    store.read_into("run/s", 0, out, object_size=data.nbytes, crc=up.crc32c, range_bytes=8 * MiB)
    assert np.array_equal(out, data)
    seen = s3_proxy.seen[first:]
    assert [m for m, *_ in seen].count("HEAD") == 1  # the version every range is pinned to
    assert [m for m, *_ in seen].count("GET") == 5 + 1  # five ranges, one resumed


def test_pieces_with_padding_make_the_same_bytes_as_the_local_writer(
    s3_server, s3_bucket, tmp_path
):
    from gpumem.checkpoint.storage.safe_fs import Dir

    store = _store(s3_server.url, s3_bucket)
    # extents of an arena as a data file holds them: aligned, zero gaps, a tail of padding,
    # small and large ones, so that parts span several extents and gaps
    rng = np.random.default_rng(8)
    pieces, at = [], 0
    for n in (100, 7 * MiB + 3, 4096, 1, 6 * MiB, 12345):
        at = -(-at // 4096) * 4096
        pieces.append((at, rng.integers(0, 256, n, dtype=np.uint8)))
        at += n
    size = -(-at // 4096) * 4096 + 4096
    with Dir.open(tmp_path) as d:  # the reference: the directory backend's own writer
        d.write_pieces("ref.bin", pieces, size, False)
    ref = (tmp_path / "ref.bin").read_bytes()
    up = store.upload_pieces("run/data", pieces[::-1], size, part_bytes=5 * MiB)
    assert up.size == size == len(ref) and len(up.part_crcs) == 3
    out = bytearray(size)
    store.read_into("run/data", 0, out, object_size=size, crc=up.crc32c)
    assert bytes(out) == ref
    with pytest.raises(ValueError, match="overlaps"):
        store.upload_pieces("run/x", [(0, b"abc"), (2, b"d")], 10)
    with pytest.raises(ValueError, match="past the file"):
        store.upload_pieces("run/x", [(8, b"abc")], 10)


def test_read_pieces_keeps_the_native_readers_contract(s3_server, s3_bucket, tmp_path):
    from gpumem.checkpoint.storage.safe_fs import Dir
    from gpumem.reader import read_file

    store = _store(s3_server.url, s3_bucket)
    rng = np.random.default_rng(9)
    extents, at = [], 0
    for n in (5000, 3 * MiB + 17, 8192, 1):
        at = -(-at // 4096) * 4096
        extents.append((at, n))
        at += n
    size = -(-at // 4096) * 4096
    pieces = [(off, rng.integers(0, 256, n, dtype=np.uint8)) for off, n in extents]
    with Dir.open(tmp_path) as d:
        d.write_pieces("f.bin", pieces, size, False)
    store.upload_pieces("run/f.bin", pieces, size, part_bytes=5 * MiB)
    chunk = 4096
    slots, total = [], 0
    for _, n in extents:
        slots.append(total if n != 8192 else -1)  # one piece without checksums
        total += -(-n // chunk)

    def fresh():
        return [(off, np.zeros(n, dtype=np.uint8)) for off, n in extents], np.full(total, -7)

    ref_pieces, ref_crcs = fresh()  # the reference: the native reader on the local file
    read_file(tmp_path / "f.bin", ref_pieces, chunk_bytes=chunk, crc_index=slots, crc_out=ref_crcs)
    got_pieces, got_crcs = fresh()
    n = store.read_pieces(
        "run/f.bin",
        got_pieces,
        expect_size=size,
        chunk_bytes=chunk,
        crc_index=slots,
        crc_out=got_crcs,
    )
    assert n == sum(b.nbytes for _, b in got_pieces)
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(ref_pieces, got_pieces, strict=True))
    assert np.array_equal(ref_crcs, got_crcs) and (got_crcs != -7).sum() == total - 2
    with pytest.raises(CheckpointCorruptError, match="not the 999 its manifest records"):
        store.read_pieces("run/f.bin", got_pieces, expect_size=999)
