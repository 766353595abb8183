"""Tiers on node-local directories (gpumem.checkpoint.node_uploads): 4 gloo ranks in 2 simulated
nodes (``GPUMEM_NODE``), each node its own directory, the remote a moto server behind the fault
proxy. Each rank uploads its own shards; rank 0 commits the remote step only once all did. A lost
node (its directory deleted) restores bit-identically from the remote on 4 and on 2 ranks; a
reset mid-upload is retried; a permanent failure of one rank's upload, or a rank killed in its
upload, leaves the step uncommitted remotely and the previous remote step intact; the survivors'
close() returns after a peer was killed or stopped (hung) mid-upload. The model is FSDP2
(``fully_shard`` over gloo on CPU, sharded_lib's ``fsdp`` layout), so torch >= 2.6."""

import os
import shutil

import pytest
import torch
from s3_lib import CREDENTIALS, open_store
from sharded_lib import differences, start_ranks

from gpumem.checkpoint.storage.s3.object_root import ObjectRoot

pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")


def _fsdp2() -> bool:
    import torch.distributed as dist

    from gpumem.checkpoint.capture.dtensor import sharding_supported

    return dist.is_available() and sharding_supported()


pytestmark = pytest.mark.skipif(
    not _fsdp2(), reason="needs torch.distributed and torch >= 2.6 (public fully_shard)"
)

HERE = os.path.dirname(__file__)
DATA = [f"data-r{r:05d}-0000.bin" for r in range(4)]


def launch(tmp_path, mode, url, endpoint, world=4, per_node=2, env=None, timeout=300):
    """Run node_tiers_worker.py on ``world`` ranks, ``per_node`` a node: outputs, exit codes."""
    procs = start(tmp_path, mode, url, endpoint, world, per_node, env)
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs], [p.returncode for p in procs]
    finally:
        for p in procs:
            p.kill()


def start(tmp_path, mode, url, endpoint, world, per_node, env):
    """The ``world`` worker processes, started."""
    base = tmp_path / "run"
    base.mkdir(exist_ok=True)
    env = {**CREDENTIALS, **(env or {})}
    args = [mode, str(base), url, endpoint]
    return start_ranks("node_tiers_worker.py", args, tmp_path, mode, world, per_node, env)


def load(path):
    return torch.load(path, weights_only=True)


def remote(endpoint, bucket, prefix):
    return ObjectRoot(open_store(endpoint, bucket, prefix))


def data_of(rank, step):
    def match(method, path, query, headers):
        return method == "PUT" and f"step-{step:09d}/" in path and f"data-r{rank:05d}-" in path

    return match


def test_fsdp2_a_lost_node_restores_from_the_remote_on_4_and_2_ranks(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    url, base = f"s3://{s3_bucket}/run", tmp_path / "run"
    reset = s3_proxy.add("reset_request", data_of(2, 4), times=1)  # retried by the client
    outs, codes = launch(tmp_path, "save", url, s3_proxy.url)
    assert codes == [0] * 4, outs
    assert reset.hits == 1
    # FSDP2: every parameter a DTensor, the first weight's 96 rows 24 a rank
    assert all(f"rank {r} fsdp2 dtensors 6/6 rows 24" in outs[r] for r in range(4)), outs
    for r in range(4):
        assert f"rank {r} step 4 idle=True" in outs[r], outs[r]
    assert "remote: uploaded" in outs[0] and "rank 0 remote steps [4, 2]" in outs[0], outs[0]
    # node-local: each node's step holds its own ranks' data files only (replicas=1)
    assert sorted(f for f in os.listdir(base / "node1" / "step-000000004") if "data" in f) == [
        DATA[2],
        DATA[3],
    ]
    root = remote(s3_server.url, s3_bucket, "run")
    files, info = root.open_step(4)
    assert info.world_size == 4
    keys = {o.key.rsplit("/", 1)[1] for o in root.store.list("step-000000004/")}
    assert set(DATA) <= keys  # every rank's shards, from both nodes
    main = (base / "node0" / "step-000000004" / "MANIFEST").read_bytes()
    assert files.read_small("MANIFEST", 1 << 20, "manifest") == main

    shutil.rmtree(base / "node1")  # node 1 is lost, with its disk; replicas=1: no peer copy
    outs, codes = launch(tmp_path, "restore", url, s3_server.url)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 4 from remote" in outs[r] for r in range(4)), outs
    got = load(base / "got-4.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []

    shutil.rmtree(base / "node1")  # again, and the job comes back on 2 ranks, one a node
    outs, codes = launch(tmp_path, "restore", url, s3_server.url, world=2, per_node=1)
    assert codes == [0] * 2, outs
    assert all(f"rank {r} fsdp2 dtensors 6/6 rows 48" in outs[r] for r in range(2)), outs
    assert all(f"rank {r} restored 4 from remote" in outs[r] for r in range(2)), outs
    got = load(base / "got-2.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []


def test_a_permanent_failure_of_one_ranks_upload_keeps_the_previous_remote_step(
    s3_server, s3_proxy, s3_bucket, tmp_path
):
    url, base = f"s3://{s3_bucket}/fail", tmp_path / "run"
    s3_proxy.add("bad_digest", data_of(2, 4), times=None)
    outs, codes = launch(tmp_path, "save", url, s3_proxy.url)
    assert codes == [0] * 4, outs
    assert "rank 0 remote steps [2]" in outs[0], outs[0]
    assert "step 4 idle=True remote: upload failed" in outs[0], outs[0]
    assert "rank(s) [2] could not upload their shards" in outs[0], outs[0]
    assert "rank 2's upload failed" in outs[2], outs[2]
    assert "rank 2 warned: step 4 is committed in" in outs[2], outs[2]
    root = remote(s3_server.url, s3_bucket, "fail")
    assert root.steps() == [2] and root.open_step(2)[1].world_size == 4
    assert list(root.store.list("step-000000004/")) == []  # the failed save's objects deleted
    for node in ("node0", "node1"):  # the local step is as it was
        assert (base / node / "step-000000004" / "MANIFEST").is_file()
    # the previous remote step restores, bit-identical, once both nodes are gone
    shutil.rmtree(base / "node0")
    shutil.rmtree(base / "node1")
    outs, codes = launch(tmp_path, "restore", url, s3_server.url)
    assert codes == [0] * 4, outs
    got = load(base / "got-4.pt")
    assert got["step"] == 2 and differences(load(base / "ref-2.pt"), got["state"]) == []


def test_a_rank_killed_mid_upload_never_commits_the_step_remotely(s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/kill"
    outs, codes = launch(tmp_path, "kill", url, s3_server.url, env={"CRASH_RANK": "3"})
    assert codes == [0, 0, 0, -9], outs
    assert "rank 0 remote steps [2]" in outs[0], outs[0]
    assert "step 4 idle=True remote: upload failed" in outs[0], outs[0]
    assert all(f"rank {r} closed" in outs[r] for r in range(3)), outs  # close() returned
    root = remote(s3_server.url, s3_bucket, "kill")
    assert root.steps() == [2]
    assert root.store.head(root.store.url.key("step-000000004/COMMIT")) is None


def test_survivors_close_returns_when_a_peer_hangs_mid_upload(s3_server, s3_bucket, tmp_path):
    """SIGSTOP: gloo sees no closed connection, so without the bound the survivors' close()
    would wait in the uploaders' collective for UPLOAD_TIMEOUT_S (2 h); with it, at most
    collective_timeout_s (5 s here) once they wait for the stopped rank only."""
    url = f"s3://{s3_bucket}/stop"
    env = {"CRASH_RANK": "3", "COLLECTIVE_TIMEOUT": "5"}
    procs = start(tmp_path, "stop", url, s3_server.url, 4, 2, env)
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs[:3]]  # generous; 2 h without it
        codes = [p.returncode for p in procs[:3]]
    finally:
        for p in procs:
            p.kill()
    procs[3].wait()
    assert codes == [0, 0, 0], outs
    for r in range(3):
        gave_up = f"rank {r} stopped waiting for the other ranks' upload of step 4 after 5 s"
        assert f"rank {r} closed" in outs[r] and gave_up in outs[r], outs[r]
    root = remote(s3_server.url, s3_bucket, "stop")
    assert root.steps() == [2]  # step 4 never committed remotely; step 2 intact
    assert root.store.head(root.store.url.key("step-000000004/COMMIT")) is None


def test_with_replicas_a_lost_node_restores_from_its_peers_not_the_store(
    s3_server, s3_bucket, tmp_path
):
    url, base = f"s3://{s3_bucket}/replicas", tmp_path / "run"
    two = {"REPLICAS": "2"}
    outs, codes = launch(tmp_path, "save", url, s3_server.url, env=two)
    assert codes == [0] * 4, outs
    assert "rank 0 remote steps [4, 2]" in outs[0], outs[0]
    # replicas=2 on 2 nodes: each node's step holds every rank's data; the remote one copy
    assert sorted(f for f in os.listdir(base / "node1" / "step-000000004") if "data" in f) == DATA
    root = remote(s3_server.url, s3_bucket, "replicas")
    keys = [o.key.rsplit("/", 1)[1] for o in root.store.list("step-000000004/")]
    assert sorted(k for k in keys if k.startswith("data")) == DATA

    shutil.rmtree(base / "node1")
    outs, codes = launch(tmp_path, "restore", url, s3_server.url, env=two)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 4 from local" in outs[r] for r in range(4)), outs
    got = load(base / "got-4.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []
