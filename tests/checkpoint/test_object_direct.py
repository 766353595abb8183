"""Checkpointer("s3://bucket/prefix") (issue 21): saved to and restored from moto's S3 server (a
child process) directly, each rank uploading its own shards, with faults from the HTTP proxy:
resets mid-part and 503s retried, a killed uploader leaving the older step, a racing second job
losing its commit, a changed or truncated object falling back to the older step; 4 FSDP ranks
over gloo restored by 2 and by 1; bad input refused at construction with nothing written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from s3_lib import (
    CREDENTIALS,
    S3Server,
    env,
    is_conditional_put,
    is_part,
    is_ranged_get,
)
from s3_lib import open_checkpointer as _ck
from s3_lib import restore_from as _restored
from s3_lib import same as _same
from s3_lib import save_steps as _save_steps
from s3_lib import snapshot as _snapshot
from s3_lib import train_state as _state

import gpumem
from gpumem.checkpoint import (
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointStateError,
)

pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")

MiB = 1 << 20
HERE = Path(__file__).parent


def _raw(endpoint: str):
    import boto3

    with env(CREDENTIALS):
        return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    got = _raw(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


# ------------------------------------------------------------------------------ one rank


def test_saved_to_the_store_and_restored_bit_identical_nothing_local(
    s3_server, s3_bucket, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/run"
    states = _save_steps(url, s3_server.url, [1, 2, 3], keep=2)
    assert list(tmp_path.iterdir()) == []  # no local "s3:" directory
    keys = _keys(s3_server.url, s3_bucket, "run/")
    # retention: step 1 is gone (its COMMIT and its files), steps 2 and 3 are committed
    assert [k for k in keys if k.endswith("/COMMIT")] == [
        "run/step-000000002/COMMIT",
        "run/step-000000003/COMMIT",
    ]
    assert not any(k.startswith("run/step-000000001/") for k in keys)
    commit = "run/step-000000003/COMMIT"
    record = json.loads(_raw(s3_server.url).get_object(Bucket=s3_bucket, Key=commit)["Body"].read())
    files = [k for k in keys if k.startswith(f"run/step-000000003/{record['save']}/")]
    names = sorted(k.rsplit("/", 1)[1] for k in files)
    assert names[0] == "MANIFEST" and "manifest-r00000" in names[1:]
    data = [k for k in files if "/data-" in k]
    heads = [_raw(s3_server.url).head_object(Bucket=s3_bucket, Key=k) for k in data]
    # the data went up as multipart uploads of 5 MiB parts ("-N" ETags), 18 MiB in all
    assert any(h["ETag"].strip('"').endswith(tuple(f"-{n}" for n in range(2, 9))) for h in heads)
    total = sum(h["ContentLength"] for h in heads)
    assert 18 * MiB < total < 19 * MiB
    latest = json.loads(
        _raw(s3_server.url).get_object(Bucket=s3_bucket, Key="run/latest")["Body"].read()
    )
    assert latest["step"] == 3
    with _ck(url, s3_server.url) as ck:
        assert [i.step for i in ck.list()] == [2, 3]
    step, got = _restored(url, s3_server.url)
    assert step == 3 and _same(got, states[3])
    assert list(tmp_path.iterdir()) == []


def test_resets_mid_part_and_503s_are_retried_on_save_and_restore(s3_server, s3_proxy, s3_bucket):
    url = f"s3://{s3_bucket}/faults"
    s3_proxy.add("reset_request", is_part, times=1)
    s3_proxy.add("slowdown", is_part, times=2)
    states = _save_steps(url, s3_proxy.url, [1])
    parts = s3_proxy.count("PUT", "partNumber")
    completed = s3_proxy.count("POST", "uploadId")
    assert completed >= 1 and parts >= 3 + 4  # 4 parts of the 18 MiB file, 3 sent again
    s3_proxy.add("reset_response", is_ranged_get, times=1)
    s3_proxy.add("slowdown", is_ranged_get, times=2)
    step, got = _restored(url, s3_proxy.url)
    assert step == 1 and _same(got, states[1])


def test_a_changed_object_falls_back_to_the_older_step(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/changed"
    states = _save_steps(url, s3_server.url, [1, 2])
    raw = _raw(s3_server.url)
    key = next(
        k for k in _keys(s3_server.url, s3_bucket, "changed/step-000000002/") if "/data-" in k
    )
    body = bytearray(raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x40  # one bit, same size: only the chunk CRCs can tell
    raw.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    with pytest.warns(CheckpointFallbackWarning, match="fail their CRC32C"):
        step, got = _restored(url, s3_server.url)
    assert step == 1 and _same(got, states[1])
    raw.put_object(Bucket=s3_bucket, Key=key, Body=b"short")  # truncated: refused unread
    with pytest.warns(CheckpointFallbackWarning, match=r"not the \d+ its manifest records"):
        step, got = _restored(url, s3_server.url)
    assert step == 1 and _same(got, states[1])


def test_a_racing_second_job_loses_the_commit_and_leaves_nothing(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/race"
    a, b = _ck(url, s3_server.url), _ck(url, s3_server.url)
    (ma, oa), (mb, ob) = _state(1), _state(2)
    try:  # both persist at once; the conditional put of COMMIT lets exactly one win
        a.save(5, model=ma, optimizer=oa)
        b.save(5, model=mb, optimizer=ob)
        errors = []
        for ck in (a, b):
            try:
                ck.wait()
            except CheckpointStateError as exc:
                errors.append(str(exc))
    finally:
        for ck in (a, b):
            with contextlib.suppress(CheckpointStateError):
                ck.close()
    assert len(errors) == 1 and "already committed" in errors[0], errors
    assert a.history[-1].committed != b.history[-1].committed
    step, got = _restored(url, s3_server.url)
    expected = _snapshot(ma, oa) if a.history[-1].committed else _snapshot(mb, ob)
    assert step == 5 and _same(got, expected)
    saves = {k.split("/")[2] for k in _keys(s3_server.url, s3_bucket, "race/step-000000005/")}
    assert len(saves) == 2  # COMMIT and the winner's save id: the loser's objects are deleted


def test_a_killed_uploader_leaves_the_previous_step_to_restore(
    s3_server, s3_proxy, s3_bucket, capsys
):
    url = f"s3://{s3_bucket}/killed"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "object_direct_worker.py"), url, s3_proxy.url],
        env={**os.environ, **CREDENTIALS},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        s3_proxy.add("hang", is_part, times=None)  # step 2's upload gets stuck on a part
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 120
        while not any(status == -1 for *_, status in s3_proxy.seen):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    keys = _keys(s3_server.url, s3_bucket, "killed/")
    assert [k for k in keys if k.endswith("/COMMIT")] == ["killed/step-000000001/COMMIT"]
    from gpumem.cli import main

    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        assert main(["ckpt", "ls", url, "--all"]) == 0
    out = capsys.readouterr().out
    assert "step-000000001" in out and "incomplete upload killed/step-000000002/" in out
    torch.manual_seed(1)
    want = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.Linear(1536, 8))
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.Linear(1536, 8))
    with _ck(url, s3_server.url) as ck:
        assert ck.restore(model=model) == 1
    assert all(
        torch.equal(a, b) for a, b in zip(want.parameters(), model.parameters(), strict=False)
    )
    # opening the root for saving aborted the upload: clean_stale takes uploads older than a
    # day, and moto dates every upload's Initiated in 2010
    ups = _raw(s3_server.url).list_multipart_uploads(Bucket=s3_bucket, Prefix="killed/")
    assert ups.get("Uploads", []) == []


def test_preemption_guard_final_save_to_the_store(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/guard"
    model, opt = _state(7)
    with _ck(url, s3_server.url) as ck:
        guard = gpumem.PreemptionGuard(ck, grace_s=60, exit_code=42)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.should_stop(9, model=model, optimizer=opt)
            assert guard.durable and guard.exit_code == 42
        finally:
            guard.close()
    step, got = _restored(url, s3_server.url)
    assert step == 9 and _same(got, _snapshot(model, opt))


# ------------------------------------------------------------------------------ bad input


def test_bad_input_is_one_error_at_construction_nothing_written(
    s3_server, s3_proxy, s3_bucket, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointStateError, match="'s3://Bad_Bucket/x' is not an object-store"):
        gpumem.Checkpointer("s3://Bad_Bucket/x")
    with pytest.raises(CheckpointStateError, match="an object store already"):
        gpumem.Checkpointer(f"s3://{s3_bucket}/x", remote=f"s3://{s3_bucket}/y")
    with pytest.raises(CheckpointStateError, match="endpoint_url"):
        gpumem.Checkpointer(tmp_path / "d", endpoint_url=s3_server.url)
    with pytest.raises(CheckpointIOError, match="s3://no-such-bucket-x/run") as info:
        _ck("s3://no-such-bucket-x/run", s3_server.url)
    assert "\n" not in str(info.value)
    s3_proxy.add("strip_conditions", is_conditional_put, times=None)
    with pytest.raises(CheckpointIOError, match="ignores conditional writes"):
        _ck(f"s3://{s3_bucket}/nocond", s3_proxy.url)
    assert _keys(s3_server.url, s3_bucket, "nocond/") == []
    assert list(tmp_path.iterdir()) == []


def test_denied_credentials_are_one_error_at_construction(tmp_path):
    srv = S3Server(tmp_path, auth=True)  # checks keys: "testing" is not one it knows
    try:
        with pytest.raises(CheckpointIOError, match="access denied") as info:
            _ck("s3://bucket/run", srv.url)
        assert "s3://bucket/run" in str(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ several ranks

CHUNK = 4096


def _ranks(rank: int, world: int, root: str, url: str, endpoint: str, tag: str) -> None:
    import torch.distributed as dist
    from sharded_lib import build, differences, full_state, train

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv-{tag}", rank=rank, world_size=world
    )
    out: dict = {}
    kw = {"endpoint_url": endpoint, "chunk_bytes": CHUNK, "staging_bytes": 64 * MiB}
    if tag == "save":  # FSDP(4): each rank uploads its own shards
        model, opt = build("fsdp")
        train(model, opt, 2)
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, f"{root}/f4.pt")
        with gpumem.Checkpointer(url, **kw) as ck:
            stats = ck.save(2, model=model, optimizer=opt)
            ck.wait()
            out["committed"] = stats.committed
    else:  # FSDP(2) restores FSDP(4)'s step from the store, reading only its ranges
        model, opt = build("fsdp", seed=99)
        train(model, opt, 1, start=50)
        with gpumem.Checkpointer(url, **kw) as ck:
            out["step"] = ck.restore(model=model, optimizer=opt)
            out["read"] = ck.last_restore.bytes_read
            out["needed"] = ck.last_restore.bytes_needed
        out["diff"] = differences(torch.load(f"{root}/f4.pt"), full_state(model, opt))
    Path(root, f"{tag}.{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def test_four_fsdp_ranks_save_to_the_store_two_and_one_restore(s3_server, s3_bucket, tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from gpumem.checkpoint.capture.dtensor import sharding_supported

    if not dist.is_available() or not sharding_supported():
        pytest.skip("needs torch.distributed and torch >= 2.6 (public fully_shard)")
    from sharded_lib import build, differences, full_state

    url = f"s3://{s3_bucket}/fsdp"
    with env(CREDENTIALS):
        for tag, world in (("save", 4), ("restore", 2)):
            mp.spawn(
                _ranks,
                args=(world, str(tmp_path), url, s3_server.url, tag),
                nprocs=world,
                join=True,
            )
    saved = [json.loads((tmp_path / f"save.{r}.json").read_text()) for r in range(4)]
    assert all(s["committed"] for s in saved)
    keys = _keys(s3_server.url, s3_bucket, "fsdp/step-000000002/")
    assert {k.rsplit("/", 1)[1] for k in keys if "/manifest-r" in k} == {
        f"manifest-r{r:05d}" for r in range(4)
    }  # every rank's shard manifest, uploaded by that rank
    for r in range(2):  # 4 -> 2: each rank read its overlaps, at most a partial chunk more
        got = json.loads((tmp_path / f"restore.{r}.json").read_text())
        assert got["step"] == 2 and got["diff"] == [], got
        assert got["needed"] <= got["read"] <= got["needed"] + 18 * 2 * 2 * CHUNK
    model, opt = build("plain", seed=5)  # 4 -> 1, into the plain model
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointFallbackWarning)
        with _ck(url, s3_server.url, chunk_bytes=CHUNK) as ck:
            assert ck.restore(model=model, optimizer=opt) == 2
    assert differences(torch.load(tmp_path / "f4.pt"), full_state(model, opt)) == []


# ------------------------------------------------------------------------------ the cli


def test_inspect_and_export_read_an_s3_root(s3_server, s3_bucket, tmp_path, capsys):
    from safetensors.torch import load_file

    from gpumem.cli import main

    url = f"s3://{s3_bucket}/cli"
    states = _save_steps(url, s3_server.url, [4, 6])
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        assert main(["ckpt", "inspect", url, "--json"]) == 0
        newest = json.loads(capsys.readouterr().out)
        assert main(["ckpt", "inspect", url, "--step", "4", "--json"]) == 0
        older = json.loads(capsys.readouterr().out)
        assert main(["ckpt", "export", url, "--step", "4", "--out", str(tmp_path / "w")]) == 0
        capsys.readouterr()
        assert main(["ckpt", "inspect", url, "--step", "5"]) == 2
        assert "no committed step 5" in capsys.readouterr().err
    assert newest["step"] == 6 and older["step"] == 4 and older["world_size"] == 1
    assert newest["path"].startswith(f"s3://{s3_bucket}/cli/step-000000006/")
    names = {t["name"] for t in older["ranks"][0]["tensor_list"]}
    assert "model.0.weight" in names and older["nbytes"] == newest["nbytes"]
    weights = load_file(str(tmp_path / "w" / "model-00001-of-00001.safetensors"))
    want = {k[len("m.") :]: v for k, v in states[4].items() if k.startswith("m.")}
    assert weights.keys() == want.keys()
    assert all(torch.equal(weights[k], want[k]) for k in want)


def test_going_back_sets_the_newer_steps_aside(s3_server, s3_bucket):
    from gpumem.checkpoint import CheckpointBranchWarning

    url = f"s3://{s3_bucket}/back"
    _save_steps(url, s3_server.url, [1, 3])
    with pytest.warns(CheckpointBranchWarning, match="back-abandoned|abandoned"):
        states = _save_steps(url, s3_server.url, [2])
    keys = _keys(s3_server.url, s3_bucket, "back/")
    assert [k for k in keys if k.endswith("/COMMIT")][-2:] == [
        "back/step-000000001/COMMIT",
        "back/step-000000002/COMMIT",
    ]
    aside = [k for k in keys if k.startswith("back/abandoned/")]
    assert len(aside) == 1 and aside[0].startswith("back/abandoned/step-000000003-")
    latest = _raw(s3_server.url).get_object(Bucket=s3_bucket, Key="back/latest")["Body"].read()
    assert json.loads(latest)["step"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointFallbackWarning)  # latest agrees: no warning
        step, got = _restored(url, s3_server.url)
    assert step == 2 and _same(got, states[2])
    with _ck(url, s3_server.url) as ck:  # the abandoned branch's files are kept by clean_stale
        ck._root.objects.clean_stale(older_than_s=0)
    save = aside[0].split("-")[-1].split("/")[0]
    assert any(f"/step-000000003/{save}/" in k for k in _keys(s3_server.url, s3_bucket, "back/"))


def test_going_back_with_tiers_sets_the_remotes_newer_steps_aside(s3_server, s3_bucket, tmp_path):
    from gpumem.checkpoint import CheckpointBranchWarning

    url = f"s3://{s3_bucket}/tiers-back"
    kw = {"remote": url, "endpoint_url": s3_server.url, "staging_bytes": 64 * MiB}

    def save(steps) -> dict[int, dict[str, torch.Tensor]]:
        states = {}
        with env(CREDENTIALS), gpumem.Checkpointer(tmp_path / "local", overlap=False, **kw) as ck:
            for step in steps:
                model, opt = _state(step)
                ck.save(step, model=model, optimizer=opt, blocking=True)
                ck.wait()
                assert ck.tiers.wait(120)
                states[step] = _snapshot(model, opt)
        return states

    save([1, 3])
    with pytest.warns(CheckpointBranchWarning):
        states = save([2])
    keys = _keys(s3_server.url, s3_bucket, "tiers-back/")
    commits = [k.split("/", 1)[1] for k in keys if k.endswith("/COMMIT")]
    assert commits[0].startswith("abandoned/step-000000003-")
    assert commits[1:] == ["step-000000001/COMMIT", "step-000000002/COMMIT"]
    model, opt = _state(999)  # a node that lost its disk: restored from the remote's branch
    with env(CREDENTIALS), gpumem.Checkpointer(tmp_path / "fresh", **kw) as ck:
        assert ck.restore(model=model, optimizer=opt) == 2
    assert _same(_snapshot(model, opt), states[2])
