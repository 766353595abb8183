"""Tiers (gpumem.checkpoint.tiers): Checkpointer(local, remote="s3://...") against moto's S3 server
in a child process: a save committed locally, then uploaded in the background; ``ls`` and
SaveStats name the tiers holding each step; a lost local directory restored from the remote
bit-identical; an upload fault leaves the local step and the next save catches up; a SIGTERM with
an upload in flight exits within the grace period saying which tier holds what; bad input fails
at construction with nothing written; several ranks: a shared directory (rank 0 uploads) or
node-local ones (each rank uploads its own shards)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from s3_lib import CREDENTIALS, env

import gpumem
from gpumem.checkpoint import CheckpointIOError, CheckpointStateError

pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")

MiB = 1 << 20
HERE = Path(__file__).parent


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.Linear(768, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def _tiered(local: Path, url: str, endpoint: str, **kw) -> gpumem.Checkpointer:
    with env(CREDENTIALS):
        return gpumem.Checkpointer(
            local=local,
            remote=url,
            endpoint_url=endpoint,
            staging_bytes=64 * MiB,
            overlap=False,
            **kw,
        )


def _equal_state(a: torch.nn.Module, b: torch.nn.Module, oa, ob) -> None:
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_a_tiered_save_is_in_both_tiers_and_ls_says_so(s3_server, s3_bucket, tmp_path, capsys):
    from gpumem.cli import main

    url = f"s3://{s3_bucket}/run"
    with _tiered(tmp_path / "local", url, s3_server.url, keep=2) as ck:
        stats = []
        for step in (1, 2, 3):
            model, opt = _state(step)
            stats.append(ck.save(step, model=model, optimizer=opt, blocking=True))
            assert ck.tiers.wait(120)  # each upload before the next
        assert [s.tiers for s in stats] == [("local", "remote")] * 3
        assert all(s.remote == "uploaded" for s in stats)
        # keep=2 on both tiers: the remote dropped step 1 only after committing step 3
        assert [(r.step, r.tiers) for r in ck.tiers.holding()] == [
            (2, ("local", "remote")),
            (3, ("local", "remote")),
        ]
        assert ck.tiers.root.steps() == [3, 2]
    # a local-only step (saved without the remote) is listed as such
    model, opt = _state(4)
    with gpumem.Checkpointer(tmp_path / "local", keep=None, staging_bytes=64 * MiB) as ck:
        local_only = ck.save(4, model=model, optimizer=opt, blocking=True)
        assert ck.tiers.url is None and ck.tiers.wait(0)
    assert local_only.tiers == ("local",) and local_only.remote == ""
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.url}):
        assert main(["ckpt", "ls", "--json", str(tmp_path / "local"), "--remote", url]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["step"], r["tiers"], r["latest"]) for r in rows] == [
            (2, ["local", "remote"], False),
            (3, ["local", "remote"], False),
            (4, ["local"], True),
        ]
        shutil.rmtree(tmp_path / "local" / "step-000000002")
        assert main(["ckpt", "ls", str(tmp_path / "local"), "--remote", url]) == 0
        out = capsys.readouterr().out
        assert "step-000000002  [remote]" in out and "step-000000004  <- latest  [local]" in out


def test_a_lost_local_directory_restores_from_the_remote_bit_identical(
    s3_server, s3_bucket, tmp_path
):
    url = f"s3://{s3_bucket}/run"
    model, opt = _state(5)
    extra = {"epoch": 3, "tokens": torch.arange(10, dtype=torch.int64), "name": "run-a"}
    with _tiered(tmp_path / "local", url, s3_server.url) as ck:
        ck.save(5, model=model, optimizer=opt, extra=extra, blocking=True)
    # closing waited for the upload
    shutil.rmtree(tmp_path / "local")  # the node and its NVMe are gone
    fresh, fresh_opt = _state(77)
    got: dict = {}
    with _tiered(tmp_path / "local", url, s3_server.url) as ck:
        assert ck.restore(model=fresh, optimizer=fresh_opt, extra=got) == 5
        assert ck.tiers.restored_from == "remote"
        # the fetched step is in the local tier now, and restores from there next time
        assert [(r.step, r.tiers) for r in ck.tiers.holding()] == [(5, ("local", "remote"))]
    _equal_state(model, fresh, opt, fresh_opt)
    assert (
        got["epoch"] == 3 and got["name"] == "run-a" and torch.equal(got["tokens"], extra["tokens"])
    )
    again, again_opt = _state(78)
    with _tiered(tmp_path / "local", url, s3_server.url) as ck:
        assert ck.restore(model=again, optimizer=again_opt) == 5
        assert ck.tiers.restored_from == "local"
    _equal_state(model, again, opt, again_opt)


def test_a_newer_remote_step_wins_over_an_older_local_one(s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/run"
    with _tiered(tmp_path / "a", url, s3_server.url, keep=None) as ck:
        for step in (1, 2):
            model, opt = _state(step)
            ck.save(step, model=model, optimizer=opt, blocking=True)
    shutil.rmtree(tmp_path / "a" / "step-000000002")  # this node missed step 2
    fresh, fresh_opt = _state(50)
    with _tiered(tmp_path / "a", url, s3_server.url, keep=None) as ck:
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 2
        assert ck.tiers.restored_from == "remote"
    _equal_state(model, fresh, opt, fresh_opt)


def _data_put(method: str, path: str, query: dict, headers: dict) -> bool:
    return method == "PUT" and "/data-r" in path


def test_an_upload_fault_keeps_the_local_step_and_the_next_save_catches_up(
    s3_server, s3_proxy, s3_bucket, tmp_path, monkeypatch
):
    from gpumem.checkpoint import verify
    from gpumem.checkpoint.tiers import remote as tiers

    # two attempts per request: the persistent fault below exhausts them quickly
    real = tiers.open_remote

    def few_attempts(url, endpoint_url, writable=True):
        from gpumem.checkpoint.storage.s3.object_root import ObjectRoot
        from gpumem.checkpoint.storage.s3.object_store import S3Store

        assert real is not None
        return ObjectRoot(S3Store(url, endpoint_url=endpoint_url, max_attempts=2))

    monkeypatch.setattr(tiers, "open_remote", few_attempts)
    url = f"s3://{s3_bucket}/run"
    ck = _tiered(tmp_path / "local", url, s3_proxy.url)
    try:
        rule = s3_proxy.add("slowdown", _data_put, times=None)  # every data upload: 503
        model, opt = _state(1)
        with pytest.warns(RuntimeWarning, match="its upload to .* failed"):
            first = ck.save(1, model=model, optimizer=opt, blocking=True)
            assert ck.tiers.wait(120)
        assert first.tiers == ("local",) and first.remote.startswith("upload failed")
        assert "SlowDown" in first.remote or "503" in first.remote
        assert verify(tmp_path / "local" / "step-000000001").step == 1
        assert ck.tiers.root.steps() == [] and ck.tiers.root.store.uploads() == []
        rule.times = 0  # the store recovers
        model, opt = _state(2)
        second = ck.save(2, model=model, optimizer=opt, blocking=True)
        assert ck.tiers.wait(120)
        assert second.tiers == ("local", "remote") and ck.tiers.root.steps() == [2]
        s3_proxy.add("reset_request", _data_put, times=1)  # one reset: retried, committed
        model, opt = _state(3)
        third = ck.save(3, model=model, optimizer=opt, blocking=True)
        assert ck.tiers.wait(120) and third.tiers == ("local", "remote")
        assert any(status == 0 for *_, status in s3_proxy.seen)  # the reset happened
    finally:
        ck.close()
    fresh, fresh_opt = _state(9)
    shutil.rmtree(tmp_path / "local")
    with _tiered(tmp_path / "local", url, s3_server.url) as ck2:
        assert ck2.restore(model=fresh, optimizer=fresh_opt) == 3
    _equal_state(model, fresh, opt, fresh_opt)


def _few_attempts(monkeypatch) -> None:
    """Two attempts per request: a store that does not answer fails fast."""
    from gpumem.checkpoint.storage.s3.object_root import ObjectRoot
    from gpumem.checkpoint.storage.s3.object_store import S3Store
    from gpumem.checkpoint.tiers import remote as tiers

    def few(url, endpoint_url, writable=True):
        return ObjectRoot(S3Store(url, endpoint_url=endpoint_url, max_attempts=2))

    monkeypatch.setattr(tiers, "open_remote", few)


def _anything(method: str, path: str, query: dict, headers: dict) -> bool:
    return True


def test_a_store_outage_at_restart_starts_from_a_whole_local_tier_and_uploads_resume(
    s3_server, s3_proxy, s3_bucket, tmp_path, monkeypatch
):
    """Before: an unreachable store made Checkpointer(...) raise CheckpointIOError although the
    local directory held committed steps. Now: one RuntimeWarning, a restore from the local tier
    (not asking the store again), a save whose upload fails while the store is down, and the
    next save's upload once it answers again. With no local step the outage stays an error."""
    import warnings

    _few_attempts(monkeypatch)
    url = f"s3://{s3_bucket}/run"
    model, opt = _state(1)
    with _tiered(tmp_path / "local", url, s3_proxy.url) as ck:
        ck.save(1, model=model, optimizer=opt, blocking=True)
    outage = s3_proxy.add("reset_request", _anything, times=None)  # every request: reset
    with pytest.raises(CheckpointIOError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _tiered(tmp_path / "empty", url, s3_proxy.url)
    assert not (tmp_path / "empty").exists()
    fresh, fresh_opt = _state(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = _tiered(tmp_path / "local", url, s3_proxy.url)
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 1
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "does not answer" in said[0] and "uploads resume" in said[0], said
    assert ck.tiers.restored_from == "local"
    _equal_state(model, fresh, opt, fresh_opt)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            down = ck.save(2, model=fresh, optimizer=fresh_opt, blocking=True)
            assert ck.tiers.wait(120)
        assert down.remote.startswith("upload failed") and down.tiers == ("local",)
        outage.times = 0  # the store answers again
        back = ck.save(3, model=fresh, optimizer=fresh_opt, blocking=True)
        assert ck.tiers.wait(120)
        assert back.remote == "uploaded" and back.tiers == ("local", "remote"), back.remote
        assert [(r.step, r.tiers) for r in ck.tiers.holding()][-1] == (3, ("local", "remote"))
    finally:
        ck.close()


def test_a_newer_save_while_an_upload_runs_queues_only_the_newest(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    url = f"s3://{s3_bucket}/run"
    ck = _tiered(tmp_path / "local", url, s3_proxy.url, keep=None)
    try:
        hold = s3_proxy.add("hang", _data_put, times=1)  # step 1's upload stalls once
        stats = []
        model, opt = _state(1)
        stats.append(ck.save(1, model=model, optimizer=opt, blocking=True))
        deadline = time.monotonic() + 60
        while not hold.hits:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for step in (2, 3, 4):  # committed locally while step 1 uploads
            model, opt = _state(step)
            stats.append(ck.save(step, model=model, optimizer=opt, blocking=True))
        assert ck.wait(60)  # the local commits; the upload of step 1 still hangs
        assert [s.committed for s in stats] == [True] * 4
        assert stats[1].remote.startswith("not uploaded: superseded by step 3")
        assert stats[2].remote.startswith("not uploaded: superseded by step 4")
        assert stats[3].remote == "queued"
        s3_proxy._release.set()  # the held request is reset: botocore retries it
        assert ck.tiers.wait(180)
        assert [s.tiers for s in stats] == [
            ("local", "remote"),
            ("local",),
            ("local",),
            ("local", "remote"),
        ]
        assert ck.tiers.root.steps() == [4, 1]
    finally:
        ck.close()


def test_sigterm_with_an_upload_in_flight_exits_within_the_grace_and_says_where(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    url = f"s3://{s3_bucket}/run"
    child = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "tiers_worker.py"),
            "sigterm",
            str(tmp_path / "local"),
            url,
            s3_proxy.url,
            "3",
        ],
        env={**os.environ, **CREDENTIALS},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        hold = s3_proxy.add("hang", _data_put, times=None)  # step 2's upload never finishes
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "saved 2"
        deadline = time.monotonic() + 60
        while not hold.hits:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)  # a hang check, not a timing assertion
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 42, err
    assert "durable=True uploaded=False" in out
    line = next(ln for ln in err.splitlines() if ln.startswith("gpumem: SIGTERM"))
    assert "reused the save of this step; committed" in line
    assert f"step 2 durable in {tmp_path / 'local'} (local) only: NOT in {url} in time" in line
    assert "step 2 was still uploading" in line and "(it holds step 1)" in line
    from s3_lib import open_store

    from gpumem.checkpoint.storage.s3.object_root import ObjectRoot

    root = ObjectRoot(open_store(s3_server.url, s3_bucket))
    assert root.steps() == [1]  # the abandoned upload committed nothing
    assert gpumem.checkpoint.verify(tmp_path / "local" / "step-000000002").step == 2


@pytest.mark.parametrize(
    "remote, endpoint, problem",
    [
        ("s3://Bad_Bucket/run", None, "is not a bucket name"),
        ("gs://bucket/run", None, "not s3://"),
        ("s3://bucket/a//b", None, "empty, '.' or '..' segment"),
        (42, None, "must be an s3://BUCKET/PREFIX text"),
        (None, "http://127.0.0.1:1", "is for an s3:// directory or remote=, neither is given"),
        ("s3://bucket/run", "ftp://host", "must be an http:// or https:// URL"),
    ],
)
def test_a_malformed_remote_is_refused_at_construction_nothing_written(
    tmp_path, remote, endpoint, problem
):
    with pytest.raises(CheckpointStateError) as info:
        gpumem.Checkpointer(tmp_path / "local", remote=remote, endpoint_url=endpoint)
    msg = str(info.value)
    assert problem in msg and "\n" not in msg
    assert not (tmp_path / "local").exists()


def test_a_missing_bucket_is_one_error_at_construction_nothing_written(s3_server, tmp_path):
    with pytest.raises(CheckpointIOError) as info:
        _tiered(tmp_path / "local", "s3://no-such-bucket-here/run", s3_server.url)
    msg = str(info.value)
    assert "no-such-bucket-here" in msg and "does not exist" in msg and "\n" not in msg
    assert not (tmp_path / "local").exists()
    with pytest.raises(CheckpointStateError, match="read_only=True"):
        gpumem.Checkpointer(tmp_path / "local", remote="s3://b-ok/run", read_only=True)
    with pytest.raises(CheckpointStateError, match="not both"):
        gpumem.Checkpointer(tmp_path / "x", local=tmp_path / "y")
    assert not (tmp_path / "local").exists()


@pytest.mark.parametrize("layout", ["shared", "node"])
def test_two_ranks_upload_a_shared_or_node_local_directory_and_restore_from_the_remote(
    s3_server, s3_bucket, tmp_path, layout
):
    env_ = dict(
        os.environ,
        **CREDENTIALS,
        WORLD_SIZE="2",
        INIT=f"file://{tmp_path / 'rendezvous'}",
    )
    url = f"s3://{s3_bucket}/{layout}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "tiers_worker.py"),
                "ranks",
                str(tmp_path / "local"),
                url,
                s3_server.url,
                layout,
            ],
            env={**env_, "RANK": str(r), "GPUMEM_NODE": str(r) if layout == "node" else "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {r} restored" in out, out


def _next(proc: subprocess.Popen, mark: str) -> str:
    """What ``proc`` printed up to the line ``mark`` (or its end)."""
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline()) and line.strip() != mark:
        lines.append(line)
    return "".join(lines)


def _go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def test_node_local_ranks_outlive_a_store_outage_at_restart(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    """Node-local directories, two ranks (two nodes): each uploads its shards of step 3. The
    store then resets every request: before, Checkpointer(...) raised CheckpointIOError on every
    rank although each node held step 3 whole. Now the job starts with one warning (rank 0),
    restores step 3 from its nodes, step 4's upload fails, and once the store answers again
    step 5 is committed remotely."""
    env_ = dict(os.environ, **CREDENTIALS, WORLD_SIZE="2", INIT=f"file://{tmp_path / 'rdv'}")
    args = [sys.executable, str(HERE / "tiers_worker.py"), "outage", str(tmp_path / "local")]
    procs = [
        subprocess.Popen(
            [*args, f"s3://{s3_bucket}/nodes", s3_proxy.url],
            env={**env_, "RANK": str(r), "GPUMEM_NODE": str(r)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        heads = [_next(p, "saved") for p in procs]
        outage = s3_proxy.add("reset_request", _anything, times=None)
        _go(procs)
        heads = [h + _next(p, "down") for h, p in zip(heads, procs, strict=True)]
        outage.times = 0  # the store answers again
        _go(procs)
        outs = [h + p.communicate(timeout=240)[0] for h, p in zip(heads, procs, strict=True)]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    warned = [line for line in outs[0].splitlines() if "rank 0 warned" in line]
    # one warning of the outage (the restore does not add "could not be read"); one of step 4
    assert [w for w in warned if "does not answer" in w and "uploads resume" in w] == warned[:1]
    assert len(warned) == 2 and "step 4 is committed" in warned[1], outs[0]
    assert "does not answer" not in outs[1], outs[1]
    for r in range(2):
        assert f"rank {r} restored from local; step 4: upload failed" in outs[r], outs[r]
    assert "rank 0 step 5: uploaded ('local', 'remote')" in outs[0], outs[0]
