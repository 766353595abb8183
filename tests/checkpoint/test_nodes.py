"""Node-local checkpoint directories and peer replicas: 4 gloo ranks on one machine in simulated
nodes of 2 (``GPUMEM_NODE``), each node its own directory. Losing a node deletes its directory
(its ranks are gone with the job); the restarted job restores from what the others hold."""

import os
import shutil

import pytest
import torch
from sharded_lib import differences, start_ranks

from gpumem.checkpoint.restore.peers import complete_steps, plan
from gpumem.checkpoint.storage.nodes.topology import Nodes

HERE = os.path.dirname(__file__)


def launch(tmp_path, mode, world, layout="fsdp", replicas=2, per_node=2, env=None, timeout=300):
    """Run nodes_worker.py on ``world`` ranks, ``per_node`` ranks a node; their outputs."""
    base = tmp_path / "run"
    base.mkdir(exist_ok=True)
    args = [mode, str(base), layout, str(replicas)]
    procs = start_ranks("nodes_worker.py", args, tmp_path, mode, world, per_node, env)
    return [p.communicate(timeout=timeout)[0] for p in procs], [p.returncode for p in procs]


def load(path):
    return torch.load(path, weights_only=True)


def test_fsdp_replicas_survive_a_lost_node_on_4_and_2_ranks(tmp_path):
    outs, codes = launch(tmp_path, "save", 4)
    assert codes == [0] * 4, outs
    base = tmp_path / "run"
    node0 = sorted(os.listdir(base / "node0" / "step-000000004"))
    node1 = sorted(os.listdir(base / "node1" / "step-000000004"))
    manifests = ["MANIFEST"] + [f"manifest-r{r:05d}" for r in range(4)]
    data = [f"data-r{r:05d}-0000.bin" for r in range(4)]
    # every node: every manifest, its own ranks' data and (replicas=2, two nodes) the others'
    assert node0 == node1 == sorted(manifests + data)
    main0 = (base / "node0" / "step-000000004" / "MANIFEST").read_bytes()
    assert main0 == (base / "node1" / "step-000000004" / "MANIFEST").read_bytes()

    shutil.rmtree(base / "node1")  # node 1 is lost; a replacement node starts with an empty disk
    outs, codes = launch(tmp_path, "restore", 4)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 4 OK" in outs[r] for r in range(4)), outs
    got = load(base / "got-4.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []
    # the replacement holds step 4 again: its ranks' files, fetched from node 0
    again = sorted(os.listdir(base / "node1" / "step-000000004"))
    assert set(manifests + data[2:]) <= set(again)

    # another world size: 2 ranks, one a node, the second on a fresh node (NODE_DIR node9)
    shutil.rmtree(base / "node1")
    outs, codes = launch(tmp_path, "restore", 2, per_node=1, env={"NODE_DIR": ""})
    assert codes == [0, 0], outs
    got = load(base / "got-2.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []


def test_a_damaged_replica_is_found_and_the_older_step_restored(tmp_path):
    """The survivor's copy of a lost rank's data is damaged: the fetched step fails the restore's
    CRC checks on every rank, and the next step held whole is fetched and restored."""
    outs, codes = launch(tmp_path, "save", 4)
    assert codes == [0] * 4, outs
    base = tmp_path / "run"
    shutil.rmtree(base / "node1")
    data = base / "node0" / "step-000000004" / "data-r00003-0000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    outs, codes = launch(tmp_path, "restore", 4)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 2 OK" in outs[r] for r in range(4)), outs
    assert "skipping damaged checkpoint step-000000004" in outs[0]
    got = load(base / "got-4.pt")
    assert got["step"] == 2 and differences(load(base / "ref-2.pt"), got["state"]) == []


def test_a_damaged_or_missing_primary_is_repaired_from_a_replica_not_fallen_back(tmp_path):
    """Node 0's own copy of rank 0's data is damaged (a flipped byte) and node 1's of rank 2's
    is gone, while each node holds a good replica of the other's (replicas=2). Before: the
    flipped byte passed the inventory (sizes only), failed the restore's CRC checks, and every
    rank fell back to step 2. Now each node fetches what it lacks or what fails its CRC32C from
    the other, CRC-checked, rewrites its copy, and step 4 restores."""
    outs, codes = launch(tmp_path, "save", 4)
    assert codes == [0] * 4, outs
    base = tmp_path / "run"
    node0, node1 = base / "node0" / "step-000000004", base / "node1" / "step-000000004"
    flipped, gone = node0 / "data-r00000-0000.bin", node1 / "data-r00002-0000.bin"
    good = {
        f.name: (node1 if f is flipped else node0).joinpath(f.name).read_bytes()
        for f in (flipped, gone)
    }
    assert flipped.read_bytes() == good[flipped.name]  # the replica is the same file
    raw = bytearray(good[flipped.name])
    raw[100] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    gone.unlink()
    outs, codes = launch(tmp_path, "restore", 4)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 4 OK" in outs[r] for r in range(4)), outs
    assert "skipping" not in "".join(outs), outs
    assert "the files of saved rank(s) [0] on node 0 fail their CRC32C" in outs[0], outs
    got = load(base / "got-4.pt")
    assert got["step"] == 4 and differences(load(base / "ref-4.pt"), got["state"]) == []
    for f in (flipped, gone):  # rewritten locally from the replica
        assert f.read_bytes() == good[f.name]


def test_a_commit_that_fails_on_one_node_is_taken_back_on_the_others(tmp_path):
    """Node 1's leader gets EIO syncing its directory after step 4's commit rename, node 0's
    commit goes through. Before: save() failed on every rank while node 0 kept step 4 (and,
    before issue 39 item 8, node 1 too), so the next restore took the step the save reported
    failed. Now every node takes it back: the save fails everywhere, no node holds step 4, and
    the restore takes step 2 bit-identical."""
    outs, codes = launch(tmp_path, "save", 4, env={"EIO_NODE": "1"})
    assert codes == [3] * 4, outs
    assert all(f"rank {r} step 4 failed: CheckpointIOError" in outs[r] for r in range(4)), outs
    base = tmp_path / "run"
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (base / node).iterdir() if "step-" in p.name) == [
            "step-000000002"
        ], node
    outs, codes = launch(tmp_path, "restore", 4)
    assert codes == [0] * 4, outs
    assert all(f"rank {r} restored 2 OK" in outs[r] for r in range(4)), outs
    got = load(base / "got-4.pt")
    assert got["step"] == 2 and differences(load(base / "ref-2.pt"), got["state"]) == []


def test_kill_9_of_a_rank_mid_save_leaves_the_previous_step(tmp_path):
    outs, codes = launch(tmp_path, "crash", 4, env={"CRASH_RANK": "3"})
    assert codes[3] == -9, outs
    base = tmp_path / "run"
    outs, codes = launch(tmp_path, "restore", 4)
    assert codes == [0] * 4, outs
    got = load(base / "got-4.pt")
    assert got["step"] == 2 and differences(load(base / "ref-2.pt"), got["state"]) == []


def test_replicas_1_and_a_lost_node_is_a_clear_error(tmp_path):
    outs, codes = launch(tmp_path, "save", 4, replicas=1)
    assert codes == [0] * 4, outs
    base = tmp_path / "run"
    held = sorted(os.listdir(base / "node0" / "step-000000004"))
    assert [n for n in held if n.startswith("data")] == [
        "data-r00000-0000.bin",
        "data-r00001-0000.bin",
    ]
    shutil.rmtree(base / "node1")
    outs, codes = launch(tmp_path, "restore", 4, replicas=1)
    assert codes == [0] * 4, outs
    for r in range(4):
        assert f"rank {r} restore failed: CheckpointCorruptError" in outs[r], outs
        assert "no step is held whole" in outs[r] and "saved rank(s) [2, 3]" in outs[r]


def test_replicas_beyond_the_nodes_and_on_a_shared_directory_are_refused(tmp_path):
    outs, codes = launch(tmp_path, "refuse", 4, replicas=3)
    assert codes == [0] * 4, outs
    for r in range(4):
        assert "replicas=3" in outs[r] and "the job has 2 node(s)" in outs[r], outs
        assert "use replicas <= 2" in outs[r]
    outs, codes = launch(tmp_path, "refuse", 2, replicas=2, env={"NODE_DIR": "shared"})
    assert codes == [0, 0], outs
    assert all("a shared file system" in o and "use replicas=1" in o for o in outs), outs
    assert not os.listdir(tmp_path / "run" / "shared")  # the probe left nothing behind
    # two ranks of one node (GPUMEM_NODE) that do not see each other's files
    outs, codes = launch(tmp_path, "refuse", 2, replicas=1, env={"DIR_PER_RANK": "1"})
    assert codes == [0, 0], outs
    for o in outs:
        assert "neither shared by every rank nor node-local: ranks [0, 1] are one node" in o, o
        assert "rank(s) [0, 1] see the files of ranks [[0], [1]]" in o


def held(*pairs):
    """A node's inventory: step -> (CRC 7, world size 4, not replicated, ranks)."""
    return {step: (7, 4, False, set(ranks)) for step, ranks in pairs}


def test_plan_takes_the_newest_step_held_whole_and_fetches_only_what_is_missing():
    nodes = Nodes(True, ((0, 1), (2, 3)), 0, replicas=2)
    assert nodes.holders(0) == [2] and nodes.holders(3) == [1]
    # node 1 replaced (empty); node 0 holds step 4 whole (its replicas) and step 6 in part
    per_node = [held((4, [0, 1, 2, 3]), (6, [0, 1])), {}]
    whole, partial = complete_steps(per_node)
    assert whole == [(4, [0])] and partial == [(6, [2, 3])]
    moves = plan(nodes, per_node, 4, [0], world_size=4)
    # the manifests, then ranks 2 and 3's files, each from node 0's leader to node 1's
    assert [(t.src, t.dst, t.names) for t in moves] == [
        (0, 2, ["MANIFEST"] + [f"manifest-r{r:05d}" for r in range(4)]),
        (0, 2, ["rank:2"]),
        (0, 2, ["rank:3"]),
    ]
    # another world size (2 ranks): every saved rank's files to every node lacking them
    small = Nodes(True, ((0,), (1,)), 0)
    moves = plan(small, [held((4, [0, 1, 2, 3])), held((4, [2]))], 4, [0, 1], world_size=2)
    assert [(t.src, t.dst, t.names) for t in moves] == [
        (0, 1, ["rank:0"]),
        (0, 1, ["rank:1"]),
        (0, 1, ["rank:3"]),
    ]
    # a node whose main manifest of the step differs (another save) is not one of its holders
    other = {4: (9, 4, False, {0, 1, 2, 3})}
    assert complete_steps([held((4, [0, 1])), other]) == ([], [(4, [2, 3])])


class _TwoRanks:
    """Rank 1 of a 2-rank group whose all-gathers are recorded (rank 0 reports success)."""

    rank, world_size = 1, 2

    def __init__(self):
        self.gathered = []

    def all_gather(self, values):
        self.gathered.append(values)
        return [[1] * len(values), values]


def test_a_fetched_step_that_fails_to_commit_still_joins_the_all_gather(tmp_path, monkeypatch):
    """Node 1 receives step 4 (the transfers succeed) but its main manifest does not load.
    Before: load_info raised on that rank before the all-gather every rank takes part in, so
    the others waited there (or disagreed). Now the failure travels through the all-gather and
    every rank raises the same error naming rank 1."""
    from gpumem.checkpoint.errors import CheckpointCorruptError
    from gpumem.checkpoint.restore import peers
    from gpumem.checkpoint.storage.safe_fs import Dir

    monkeypatch.setattr(peers.peer_files, "run", lambda *args, **kwargs: None)
    nodes = Nodes(True, ((0,), (1,)), 1)
    group = _TwoRanks()
    restorer = peers.Restore(nodes, None, tmp_path)
    with Dir.open(tmp_path) as root, pytest.raises(CheckpointCorruptError) as err:
        restorer._fetch(group, [held((4, [0, 1, 2, 3])), {}], 4, [0], root)
    assert group.gathered == [[0]]
    assert "failed on rank(s) [1]" in str(err.value) and "MANIFEST" in str(err.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_replicas_must_be_a_positive_int(tmp_path, bad):
    import gpumem
    from gpumem.checkpoint import CheckpointStateError

    with pytest.raises(CheckpointStateError, match="replicas"):
        gpumem.Checkpointer(tmp_path / "c", replicas=bad)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"read_only": True}, "read_only=True"),
        ({}, r"the job has 1 node\(s\).*use replicas <= 1"),
    ],
)
def test_replicas_where_they_cannot_apply_are_refused(tmp_path, kw, why):
    import gpumem
    from gpumem.checkpoint import CheckpointStateError

    with pytest.raises(CheckpointStateError, match=why):
        gpumem.Checkpointer(tmp_path / "c", replicas=2, **kw)
    assert not (tmp_path / "c").exists()
