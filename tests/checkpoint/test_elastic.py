"""Restore on another world size (always on; ``elastic=`` is a deprecated no-op): replicated (DDP)
state saved by N ranks resumes on M ranks; plain state that differs between ranks is refused.

One spawn of two gloo ranks does three things: save a replicated checkpoint (both ranks hold the
same model and optimizer, as DDP keeps them), save one whose rank 1 differs (what sharded state
looks like), and restore elastically a checkpoint the single test process saved (1 -> 2 ranks).
The test process then restores the 2-rank checkpoints as a 1-rank job (2 -> 1).
"""

import json
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointStateError


def _setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(100)  # the same batch everywhere: replicas stay identical, like DDP's
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    return model, opt


def _flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _worker(rank: int, world: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        with gpumem.Checkpointer(f"{root}/replicated") as ck:
            model, opt = _setup(0)
            random.seed(10 + rank)  # each rank's own RNG state
            ck.save(3, model=model, optimizer=opt, extra={"rank": rank})
        with gpumem.Checkpointer(f"{root}/sharded") as ck:
            model, opt = _setup(rank)  # rank 1's weights differ
            ck.save(3, model=model, optimizer=opt)
        with gpumem.Checkpointer(f"{root}/single") as ck:  # saved by 1 rank, restored by 2
            model, opt = _setup(7)
            got: dict = {}
            step = ck.restore(model=model, optimizer=opt, extra=got)
            with open(f"{root}/grown.{rank}.json", "w") as f:
                json.dump(
                    {
                        "step": step,
                        "params": _flat(model),
                        "extra": got,
                        "opt_step": float(opt.state_dict()["state"][0]["step"]),
                    },
                    f,
                )
        dist.barrier()  # no rank tears its gloo pairs down while a peer still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_elastic_restore_across_world_sizes(tmp_path):
    single_model, single_opt = _setup(5)
    with gpumem.Checkpointer(tmp_path / "single") as ck:
        ck.save(9, model=single_model, optimizer=single_opt, extra={"rank": 0})
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)

    # 1 -> 2: both ranks got the single rank's state
    for r in range(2):
        grown = json.loads((tmp_path / f"grown.{r}.json").read_text())
        assert grown["step"] == 9 and grown["extra"] == {"rank": 0} and grown["opt_step"] == 1.0
        assert grown["params"] == _flat(single_model)

    # 2 -> 1: the default; elastic=True still works, with a DeprecationWarning
    model, opt = _setup(42)
    with gpumem.Checkpointer(tmp_path / "replicated") as ck:
        got: dict = {}
        with pytest.warns(DeprecationWarning, match="elastic=.* no effect"):
            assert ck.restore(model=model, optimizer=opt, extra=got, elastic=True) == 3
        got = {}
        assert ck.restore(model=model, optimizer=opt, extra=got) == 3
    ref_model, ref_opt = _setup(0)
    assert _flat(model) == _flat(ref_model) and got == {"rank": 0}  # saved rank 0 seeds rank 0
    for a, b in zip(
        opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values(), strict=True
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)

    # sharded (rank 1 differs): refused before anything is loaded, naming the first difference
    with (
        gpumem.Checkpointer(tmp_path / "sharded") as ck,
        pytest.raises(
            CheckpointStateError,
            match=r"saved by 2 ranks, this job has 1, and rank 1 saved another tensor "
            r"'model\.0\.bias'",
        ),
    ):
        ck.restore(model=model, optimizer=opt)
    assert _flat(model) == _flat(ref_model)
