"""Two gloo ranks on CPU: per-rank shards, commit only when every rank is durable, agreed
restore."""

import os
import subprocess
import sys

import pytest
import torch

import gpumem
from gpumem.checkpoint import CheckpointStateError

HERE = os.path.dirname(__file__)


def test_two_ranks_gloo(tmp_path):
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        INIT=f"file://{tmp_path.parent / (tmp_path.name + '.rendezvous')}",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dist_worker.py"), str(tmp_path)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out
        assert f"rank {r} OK" in out and "rank(s) [1] failed" in outs[0]
    names = sorted(os.listdir(tmp_path / "step-000000007"))
    assert names == [
        "MANIFEST",
        "data-r00000-0000.bin",
        "data-r00001-0000.bin",
        "manifest-r00000",
        "manifest-r00001",
    ]
    # a single process cannot take a 2-rank checkpoint: said clearly, nothing touched
    model = torch.nn.Linear(2, 2)
    with (
        gpumem.Checkpointer(tmp_path) as ck,
        pytest.raises(CheckpointStateError, match="saved by 2 ranks, this job has 1"),
    ):
        ck.restore(model=model)


def test_a_directory_rank_0_cannot_open_fails_every_rank_at_once(tmp_path):
    """Rank 0 refuses a hostile ``.lock``; the other rank is told so instead of waiting for rank 0
    in a collective (issue #14)."""
    _open_a_hostile_directory_on_two_ranks(tmp_path)


@pytest.mark.slow
def test_ranks_that_exit_right_after_a_collective_exit_cleanly(tmp_path):
    """Each rank exits right after the failed open (a gloo collective just done): gloo's worker
    still had to drop the collective's tensors, which needs the GIL, and without the exit hook
    of ``group.py`` Python's finalization killed it mid-unwind: SIGABRT in 1 run of 4 here."""
    for i in range(8):
        _open_a_hostile_directory_on_two_ranks(tmp_path / str(i))


def _open_a_hostile_directory_on_two_ranks(tmp_path):
    root, canary = tmp_path / "ck", tmp_path / "canary"
    root.mkdir(parents=True)
    canary.write_text("someone's file")
    (root / ".lock").symlink_to(canary)
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        INIT=f"file://{tmp_path / 'rendezvous'}",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dist_open_worker.py"), str(root)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {r} OK" in out, out
    assert canary.read_text() == "someone's file"
