"""Checkpoints in an object store (checkpoint.storage.s3.object_root) against moto's S3 server
in a child process: a step saved by the real Checkpointer, uploaded and committed by conditional
put, listed, fetched back, verified and restored bit-identical; racing commits, retention,
damaged and truncated objects, what killed saves leave."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from s3_lib import CREDENTIALS, env, open_store

import gpumem
from gpumem.checkpoint import (
    CheckpointCorruptError,
    CheckpointFallbackWarning,
    CheckpointStateError,
)

pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")

from gpumem.checkpoint.restore.fetch import fetch
from gpumem.checkpoint.storage.s3.object_root import ObjectRoot

MiB = 1 << 20


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.Linear(1536, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def _save(local, steps, keep=None) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` with the real Checkpointer into ``local``; each step's model state."""
    states = {}
    with gpumem.Checkpointer(local, keep=keep, staging_bytes=64 * MiB, overlap=False) as ck:
        for step in steps:
            model, opt = _model(step)
            ck.save(step, model=model, optimizer=opt, blocking=True)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def _root(s3_server, s3_bucket, prefix="run") -> ObjectRoot:
    # parts of 5 MiB: the ~18 MiB data file goes up in four parts
    return ObjectRoot(open_store(s3_server.url, s3_bucket, prefix), part_bytes=5 * MiB)


def _raw(endpoint):
    import boto3

    with env(CREDENTIALS):
        return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def test_upload_commit_list_fetch_restore_bit_identical(s3_server, s3_bucket, tmp_path):
    states = _save(tmp_path / "local", [3, 7])
    root = _root(s3_server, s3_bucket)
    assert root.steps() == [] and fetch(root, tmp_path / "none") is None
    for step in (3, 7):
        up = root.upload_step(tmp_path / "local" / f"step-{step:09d}")
        assert up.step == step and up.nbytes > 15 * MiB and up.pointer_error is None
    assert root.steps() == [7, 3]
    infos = root.list_checkpoints()
    assert [i.step for i in infos] == [3, 7]
    local_info = gpumem.checkpoint.verify(tmp_path / "local" / "step-000000007")
    assert infos[1].manifest_crc32c == local_info.manifest_crc32c
    latest = json.loads(root.store.get("run/latest")[0])
    assert latest == {
        "step": 7,
        "path": "step-000000007",
        "manifest_crc32c": infos[1].manifest_crc32c,
    }
    # fetch the newest back into an empty local directory and restore from it there
    fetched = fetch(root, tmp_path / "cache")
    assert fetched == tmp_path / "cache" / "step-000000007"
    model, opt = _model(99)
    with gpumem.Checkpointer(tmp_path / "cache", read_only=True) as ck:
        assert ck.restore(model=model, optimizer=opt) == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, states[7][k]), k


def test_two_jobs_committing_one_step_one_wins_the_other_leaves_nothing(
    s3_server, s3_bucket, tmp_path
):
    _save(tmp_path / "a", [5])
    _save(tmp_path / "b", [5])
    ra, rb = _root(s3_server, s3_bucket), _root(s3_server, s3_bucket)
    won = ra.upload_step(tmp_path / "a" / "step-000000005")
    with pytest.raises(CheckpointStateError, match="step 5 is already committed"):
        rb.upload_step(tmp_path / "b" / "step-000000005")
    keys = [o.key for o in ra.store.list()]
    assert all(
        won.save in k for k in keys if k.startswith("run/step-000000005/") and "COMMIT" not in k
    )
    assert root_verifies(ra, 5, tmp_path / "check")


def root_verifies(root: ObjectRoot, step: int, dest) -> bool:
    return root.download_step(step, dest).is_dir()


def test_retention_deletes_old_steps_only_after_a_newer_commit(s3_server, s3_bucket, tmp_path):
    _save(tmp_path / "local", [1, 2, 3])
    root = _root(s3_server, s3_bucket)
    assert root.upload_step(tmp_path / "local" / "step-000000001", keep=2).removed == []
    assert root.upload_step(tmp_path / "local" / "step-000000002", keep=2).removed == []
    assert root.upload_step(tmp_path / "local" / "step-000000003", keep=2).removed == [1]
    assert root.steps() == [3, 2]
    assert not list(root.store.list("step-000000001/"))  # its files went with it


def test_latest_never_moves_back(s3_server, s3_bucket, tmp_path):
    _save(tmp_path / "local", [4, 9])
    root = _root(s3_server, s3_bucket)
    root.upload_step(tmp_path / "local" / "step-000000009")
    root.upload_step(tmp_path / "local" / "step-000000004")
    assert json.loads(root.store.get("run/latest")[0])["step"] == 9


def test_a_damaged_newest_step_falls_back_to_the_older(s3_server, s3_bucket, tmp_path):
    _save(tmp_path / "local", [1, 2])
    root = _root(s3_server, s3_bucket)
    for step in (1, 2):
        root.upload_step(tmp_path / "local" / f"step-{step:09d}")
    raw = _raw(s3_server.url)
    data = next(o for o in root.store.list("step-000000002/") if "/data-" in o.key)
    body = bytearray(raw.get_object(Bucket=s3_bucket, Key=data.key)["Body"].read())
    body[len(body) // 3] ^= 0x40  # one bit, same size: only the chunk CRCs can tell
    raw.put_object(Bucket=s3_bucket, Key=data.key, Body=bytes(body))
    with pytest.warns(CheckpointFallbackWarning, match="skipped step 2"):
        fetched = fetch(root, tmp_path / "cache")
    assert fetched is not None and fetched.name == "step-000000001"
    assert not (tmp_path / "cache" / "step-000000002").exists()  # the damaged copy was removed


def test_a_truncated_object_is_refused_before_it_is_read(s3_server, s3_bucket, tmp_path):
    _save(tmp_path / "local", [1])
    root = _root(s3_server, s3_bucket)
    root.upload_step(tmp_path / "local" / "step-000000001")
    raw = _raw(s3_server.url)
    data = next(o for o in root.store.list("step-000000001/") if "/data-" in o.key)
    raw.put_object(Bucket=s3_bucket, Key=data.key, Body=b"short")
    with pytest.raises(CheckpointCorruptError, match=r"not the \d+ its manifest records"):
        root.download_step(1, tmp_path / "cache")


@pytest.mark.parametrize(
    "damage",
    [
        b"not json",
        b'{"save": "../../x", "manifest_crc32c": 1}',
        b'{"save": "%s", "manifest_crc32c": 7}',
    ],
)
def test_a_hostile_commit_record_hides_the_step(s3_server, s3_bucket, tmp_path, damage):
    _save(tmp_path / "local", [1, 2])
    root = _root(s3_server, s3_bucket)
    for step in (1, 2):
        save = root.upload_step(tmp_path / "local" / f"step-{step:09d}").save
    if b"%s" in damage:  # the right save, the wrong manifest CRC: a manifest from another save
        damage = damage.replace(b"%s", save.encode())
    _raw(s3_server.url).put_object(Bucket=s3_bucket, Key="run/step-000000002/COMMIT", Body=damage)
    assert [i.step for i in root.list_checkpoints()] == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fetch(root, tmp_path / "cache").name == "step-000000001"
    assert any(issubclass(w.category, CheckpointFallbackWarning) for w in caught)


def test_what_a_killed_save_leaves_is_never_read_and_is_cleaned(s3_server, s3_bucket, tmp_path):
    _save(tmp_path / "local", [1])
    root = _root(s3_server, s3_bucket)
    up = root.upload_step(tmp_path / "local" / "step-000000001")
    raw = _raw(s3_server.url)
    # a killed save of step 2: some files, no COMMIT; and an upload it never completed
    orphan = "run/step-000000002/" + "ab" * 16 + "/data-r00000-0000.bin"
    raw.put_object(Bucket=s3_bucket, Key=orphan, Body=b"x" * 100)
    raw.create_multipart_upload(Bucket=s3_bucket, Key="run/step-000000002/x/data")
    assert root.steps() == [1] and [i.step for i in root.list_checkpoints()] == [1]
    # moto reports every upload as initiated in 2010, so only the objects' age is seen here:
    # a young orphan may be a live job's save in progress and stays
    assert root.clean_stale(older_than_s=3600) == ["upload:run/step-000000002/x/data"]
    assert root.store.head(orphan) is not None
    assert root.clean_stale(older_than_s=0) == [orphan]
    assert root.store.uploads() == [] and root.store.head(orphan) is None
    assert all(up.save in o.key or o.key.endswith(("COMMIT", "latest")) for o in root.store.list())
    assert root.download_step(1, tmp_path / "cache").is_dir()


def test_the_cli_lists_and_verifies_an_s3_root(s3_server, s3_bucket, tmp_path, capsys):
    from gpumem.cli import main

    _save(tmp_path / "local", [1, 2])
    root = _root(s3_server, s3_bucket)
    for step in (1, 2):
        root.upload_step(tmp_path / "local" / f"step-{step:09d}")
    raw = _raw(s3_server.url)
    raw.create_multipart_upload(Bucket=s3_bucket, Key="run/step-000000003/x/data")
    url = f"s3://{s3_bucket}/run"
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        assert main(["ckpt", "ls", "--json", url]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["step"], r["ok"], r["latest"]) for r in rows] == [
            (1, True, False),
            (2, True, True),
        ]
        assert main(["ckpt", "ls", "--all", url]) == 0
        out = capsys.readouterr().out
        assert (
            "step-000000002  <- latest" in out
            and "incomplete upload run/step-000000003/x/data" in out
        )
        assert main(["ckpt", "verify", url]) == 0
        out = capsys.readouterr().out
        assert out.count("every byte checked") == 2
        data = next(o for o in root.store.list("step-000000001/") if "/data-" in o.key)
        body = bytearray(raw.get_object(Bucket=s3_bucket, Key=data.key)["Body"].read())
        body[100] ^= 1
        raw.put_object(Bucket=s3_bucket, Key=data.key, Body=bytes(body))
        assert main(["ckpt", "verify", url]) == 1
        out = capsys.readouterr().out
        assert "CORRUPT  step 1:" in out and "OK       step 2:" in out
        # a store error is an error as the README says: one line, exit 2 (1 is for CORRUPT)
        assert main(["ckpt", "ls", "s3://no-such-bucket/run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'no-such-bucket' does not exist" in err[0]
        assert err[0].startswith("gpumem ckpt ls: error: ")


def test_the_cli_inspects_and_verifies_one_step_of_an_s3_root(
    s3_server, s3_bucket, tmp_path, capsys
):
    """The path ``ckpt ls --json`` prints for a step is what ``inspect`` and ``verify`` take."""
    from gpumem.cli import main

    _save(tmp_path / "local", [1, 2])
    root = _root(s3_server, s3_bucket)
    for step in (1, 2):
        root.upload_step(tmp_path / "local" / f"step-{step:09d}")
    url = f"s3://{s3_bucket}/run"
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        assert main(["ckpt", "ls", "--json", url]) == 0
        first = json.loads(capsys.readouterr().out)[0]["path"]
        assert first == f"{url}/step-000000001"
        assert main(["ckpt", "inspect", "--json", first]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 1
        assert main(["ckpt", "inspect", "--json", first + "/", "--step", "1"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 1
        assert main(["ckpt", "verify", first]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and out[0].startswith("OK       step 1:"), out
        # a step the root lacks, or a --step that contradicts the URL: one line, exit 2
        for argv in (
            ["verify", f"{url}/step-000000005"],
            ["inspect", f"{url}/step-5"],
            ["inspect", first, "--step", "2"],
        ):
            assert main(["ckpt", *argv]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "error: " in err[0], err
            assert "step 5" in err[0] or "--step 2" in err[0], err
        raw = _raw(s3_server.url)
        data = next(o for o in root.store.list("step-000000001/") if "/data-" in o.key)
        body = bytearray(raw.get_object(Bucket=s3_bucket, Key=data.key)["Body"].read())
        body[100] ^= 1
        raw.put_object(Bucket=s3_bucket, Key=data.key, Body=bytes(body))
        assert main(["ckpt", "verify", first]) == 1
        assert "CORRUPT  step 1:" in capsys.readouterr().out


def test_a_killed_uploader_commits_nothing_and_the_older_step_restores(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from s3_lib import is_part

    _save(tmp_path / "local", [1, 2])
    root = _root(s3_server, s3_bucket)
    root.upload_step(tmp_path / "local" / "step-000000001")
    # the uploader of step 2 gets stuck on a part (the proxy holds it) and is killed there
    s3_proxy.add("hang", is_part, times=None)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from s3_lib import open_store\n"
        "from gpumem.checkpoint.storage.s3.object_root import ObjectRoot\n"
        "root = ObjectRoot(open_store(sys.argv[2], sys.argv[3]), part_bytes=5 << 20)\n"
        "root.upload_step(sys.argv[4])\n"
    )
    here = str(Path(__file__).parent)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            here,
            s3_proxy.url,
            s3_bucket,
            str(tmp_path / "local" / "step-000000002"),
        ],
        env={**os.environ, **CREDENTIALS},
    )
    try:
        deadline = time.monotonic() + 60
        while not any(status == -1 for *_, status in s3_proxy.seen):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert root.steps() == [1]  # nothing of step 2 is visible
    assert [u.key.rsplit("/", 1)[-1] for u in root.store.uploads()] == ["data-r00000-0000.bin"]
    assert json.loads(root.store.get("run/latest")[0])["step"] == 1
    assert fetch(root, tmp_path / "cache").name == "step-000000001"
    removed = root.clean_stale(older_than_s=0)
    assert any(r.startswith("upload:") for r in removed) and root.store.uploads() == []
