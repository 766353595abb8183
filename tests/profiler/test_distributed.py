"""torch.distributed (gloo, 2 processes): each rank profiles itself, rank 0 gathers summaries."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gpumem


def _worker(rank, world, store, out):
    # a file rendezvous: a TCP one on a "free" port can lose a race for that port to another process
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from gpumem.profiler.distributed import gather_summaries

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = 4 * (rank + 1)  # ranks differ on purpose: rank 1 holds twice the activations
        with gpumem.profile(model, opt) as prof:
            model(torch.randn(batch, 16)).sum().backward()
            for p in model.parameters():  # a real collective inside the region
                dist.all_reduce(p.grad)
            opt.step()
        rep = prof.report()
        got = gather_summaries(rep)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"gathered": got}, f)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rep.summary(), f)
        # no rank tears its gloo pairs down while a peer may still have the last all_gather in
        # flight: CI once saw rank 1 abort ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_gloo_two_ranks_gather(tmp_path):
    out = str(tmp_path / "gathered.json")
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    gathered = json.loads((tmp_path / "gathered.json").read_text())["gathered"]
    own = [json.loads((tmp_path / f"gathered.json.{r}").read_text()) for r in range(2)]
    assert [g["rank"] for g in gathered] == [0, 1]
    assert [g["peak_bytes"] for g in gathered] == [o["peak_bytes"] for o in own]
    assert own[0]["rank"] == 0 and own[1]["rank"] == 1
    # rank 1's batch is twice rank 0's: its input is 4·16·4 bytes larger
    assert gathered[1]["at_peak"]["inputs"] - gathered[0]["at_peak"]["inputs"] == 4 * 16 * 4
    assert gathered[1]["peak_bytes"] > gathered[0]["peak_bytes"]


def test_gather_without_process_group():
    from gpumem.profiler.distributed import gather_summaries

    rep = gpumem.profile(nn.Linear(2, 2)).__enter__()
    rep.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="init_process_group"):
        gather_summaries(rep.report())
