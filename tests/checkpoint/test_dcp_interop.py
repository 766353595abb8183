"""``gpumem.dcp`` checked the way DCP checks its own file-system storage, through ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` (scenarios in dcp_interop_lib.py).

One spawn of four gloo ranks runs every scenario: DTensor state saved on a 1-D mesh of 4 and a
2 x 2 mesh in six placements, each loaded into all six (Shard(0) <-> Shard(1) <-> Replicate,
1-D <-> 2-D); every FileSystemWriter / FileSystemReader argument, by keyword and by position;
overwrite=False refusing an existing checkpoint exactly where FileSystemWriter does;
``async_save`` twice through one writer that caches its staged state. A spawn of two ranks then
loads the four-rank checkpoints into its own meshes (4 -> 2) and this process loads them as
one (4 -> 1, ``no_dist``). Single-process tests cover the signatures, the refusal of a plain
DCP directory (naming ``gpumem ckpt import``) and the ``format_utils`` equivalents.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import gpumem.dcp
from gpumem.checkpoint.capture.dtensor import sharding_supported

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not sharding_supported(),
    reason="needs torch.distributed and torch >= 2.6 (public DTensor)",
)


def _worker(rank: int, world: int, root: str, names: list[str]) -> None:
    import dcp_interop_lib as lib  # the spawned process imports the tests' directory

    torch.set_num_threads(1)
    os.environ["GPUMEM_THREADS"] = "2"
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv-{world}", rank=rank, world_size=world
    )
    found = {name: lib.SCENARIOS[name](Path(root), world) for name in names}
    Path(root, f"result-{world}-{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(root: Path, world: int, names: list[str]) -> dict[str, list[str]]:
    here = str(Path(__file__).parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here + (os.pathsep + old if old else "")
    try:
        mp.spawn(_worker, args=(world, str(root), names), nprocs=world, join=True)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    merged: dict[str, list[str]] = {n: [] for n in names}
    for r in range(world):
        for name, bad in json.loads((root / f"result-{world}-{r}.json").read_text()).items():
            merged[name] += [f"rank {r}: {b}" for b in bad]
    return merged


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-interop")
    names = ["reshard", "writer_arguments", "overwrite", "async_save"]
    return root, _spawn(root, 4, names)


@pytest.mark.parametrize("scenario", ["reshard", "writer_arguments", "overwrite", "async_save"])
def test_four_ranks_behave_as_dcp_storage(four, scenario):
    assert four[1][scenario] == []


def test_four_rank_checkpoints_load_on_two_ranks_and_on_one(four):
    import dcp_interop_lib as lib

    root = four[0]
    assert _spawn(root, 2, ["reshard"])["reshard"] == []  # 2-rank saves, loaded on 2
    # the 4-rank saves (1-D and 2-D meshes), loaded by one process into plain tensors
    for i in range(6):
        state = {
            "model": {n: torch.zeros_like(lib.full(n)) for n in ("w", "b")},
            "plain": torch.zeros(3),
            "step": -1,
            "cfg": {"lr": 0.0, "name": ""},
        }
        reader = gpumem.dcp.StorageReader(root / "reshard-4" / f"step-{i}")
        dcp.load(state, storage_reader=reader, no_dist=True)
        assert lib.compare(f"step {i}", state, 1.0 + i) == []


def test_constructors_take_every_filesystem_argument_in_order():
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    for ours, theirs in (
        (gpumem.dcp.StorageWriter, FileSystemWriter),
        (gpumem.dcp.StorageReader, FileSystemReader),
    ):
        mine, given = (inspect.signature(c.__init__).parameters for c in (ours, theirs))
        names = [n for n, p in given.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert set(names) <= set(mine), f"{ours.__name__} lacks {set(names) - set(mine)}"
        # the same order, so positional calls mean the same
        positional = [n for n, p in given.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert list(mine)[: len(positional)] == positional


def test_overwrite_false_refuses_a_committed_step_in_one_process(tmp_path):
    state = {"w": torch.arange(4.0)}
    dcp.save(state, storage_writer=gpumem.dcp.StorageWriter(tmp_path / "step-5", overwrite=False))
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save(
            state, storage_writer=gpumem.dcp.StorageWriter(tmp_path / "step-5", overwrite=False)
        )
    # a new step named in the same directory is written
    dcp.save(state, storage_writer=gpumem.dcp.StorageWriter(tmp_path / "step-6", overwrite=False))
    assert json.loads((tmp_path / "latest").read_text())["step"] == 6


def test_overwrite_as_dcps_own_e2e_test_checks_it(tmp_path):
    """torch's test_e2e_save_and_load.py::test_overwrite with gpumem's storage swapped in: the
    directory alone, no step named, refused once it holds a checkpoint."""
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=gpumem.dcp.StorageWriter(tmp_path, overwrite=False))
    dcp.save({"random": t2}, storage_writer=gpumem.dcp.StorageWriter(tmp_path, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=gpumem.dcp.StorageReader(tmp_path))
    assert torch.equal(sd["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t2}, storage_writer=gpumem.dcp.StorageWriter(tmp_path, overwrite=False))
    # the refused save wrote nothing: the newest is still t2's
    assert json.loads((tmp_path / "latest").read_text())["step"] == 1


def test_the_writer_stages_as_filesystem_writer_does(tmp_path):
    from torch.distributed.checkpoint.staging import AsyncStager

    state = {"w": torch.arange(4.0), "n": 3}
    ours = gpumem.dcp.StorageWriter(tmp_path / "g")
    theirs = dcp.FileSystemWriter(tmp_path / "p")
    assert isinstance(ours, AsyncStager)
    for writer in (ours, theirs):
        staged = writer.stage(state)
        assert torch.equal(staged["w"], state["w"]) and staged["n"] == 3
        assert staged["w"].data_ptr() != state["w"].data_ptr()  # a copy, safe from training
    assert ours.should_synchronize_after_execute == theirs.should_synchronize_after_execute


def test_extensions_are_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="no stream extensions"):
        gpumem.dcp.StorageWriter(tmp_path, _extensions=[object()])


def test_a_plain_dcp_directory_names_the_import_command(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    with pytest.raises(CheckpointException, match="gpumem ckpt import"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=gpumem.dcp.StorageReader(tmp_path / "plain"))


def test_format_utils_equivalents_round_trip(tmp_path):
    """What docs/checkpoint.md gives for format_utils' dcp_to_torch_save / torch_save_to_dcp
    (which open FileSystemReader / FileSystemWriter themselves)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    original = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4}
    torch.save(original, tmp_path / "full.pt")
    # torch_save_to_dcp: a torch.save file into a gpumem checkpoint
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    dcp.save(loaded, storage_writer=gpumem.dcp.StorageWriter(tmp_path / "ck"), no_dist=True)
    # dcp_to_torch_save: every item of a gpumem checkpoint, no state dict given
    back: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(  # what dcp_to_torch_save calls (dcp.load keeps to the keys given)
            back,
            storage_reader=gpumem.dcp.StorageReader(tmp_path / "ck"),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    torch.save(back, tmp_path / "back.pt")
    again = torch.load(tmp_path / "back.pt", weights_only=True)
    assert torch.equal(again["model"]["w"], original["model"]["w"])
    assert again["step"] == 4
