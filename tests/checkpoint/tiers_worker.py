"""Processes of test_tiers.py.

python tiers_worker.py sigterm LOCAL URL ENDPOINT GRACE_S
    one process: saves step 1 (uploaded), prints "ready", reads a line from stdin (the test
    makes the store hang meanwhile), saves step 2 and polls a PreemptionGuard until the
    test's SIGTERM stops it; exits with the guard's exit code.
RANK=r WORLD_SIZE=2 INIT=file://... python tiers_worker.py ranks LOCAL URL ENDPOINT shared|node
    two gloo ranks: a save uploaded with both ranks' shards ("shared": by rank 0; "node": each
    rank its own directory and node (GPUMEM_NODE), each rank uploads its own shards), rank 0's
    directory deleted, restored from the remote bit-identical on every rank.
RANK=r WORLD_SIZE=2 INIT=file://... python tiers_worker.py outage LOCAL URL ENDPOINT
    two gloo ranks, each its own directory and node: step 3 saved and uploaded, the Checkpointer
    closed; "saved", then a line read from stdin (the test makes the store reset every request
    meanwhile); a new Checkpointer opens (rank 0 prints its RuntimeWarnings), restores step 3
    bit-identical, saves step 4 (its upload fails); "down", a line read (the test lets the store
    answer again); step 5 saved, and whether it went up printed.
"""

import os
import shutil
import sys

import torch

import gpumem


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def sigterm(local: str, url: str, endpoint: str, grace_s: float) -> int:
    ck = gpumem.Checkpointer(
        local, staging_bytes=64 << 20, overlap=False, remote=url, endpoint_url=endpoint
    )
    model, opt = _state(1)
    guard = gpumem.PreemptionGuard(ck, grace_s=grace_s, exit_code=42)
    ck.save(1, model=model, optimizer=opt, blocking=True)
    assert ck.tiers.wait(120) and ck.tiers.uploaded == 1
    print("ready", flush=True)
    sys.stdin.readline()
    model, opt = _state(2)
    ck.save(2, model=model, optimizer=opt, blocking=True)
    print("saved 2", flush=True)
    while not guard.should_stop(2):
        torch.randn(64, 64).sum()  # "training" until the signal
    print(f"durable={guard.durable} uploaded={guard.uploaded}", flush=True)
    return guard.exit_code  # atexit closes the Checkpointer: it must not wait past the grace


def ranks(local: str, url: str, endpoint: str, layout: str) -> int:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=os.environ["INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank = dist.get_rank()
    directory = local if layout == "shared" else f"{local}-node{rank}"
    kw = {"staging_bytes": 64 << 20, "overlap": False, "remote": url, "endpoint_url": endpoint}
    model, opt = _state(10 + rank)  # each rank its own state: its own shards
    with gpumem.Checkpointer(directory, **kw) as ck:
        stats = ck.save(3, model=model, optimizer=opt, blocking=True)
        assert ck.tiers.wait(120)
        if rank == 0:
            assert stats.tiers == ("local", "remote"), stats
            infos = ck.tiers.root.list_checkpoints()
            assert [(i.step, i.world_size) for i in infos] == [(3, 2)], infos
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory)  # the node's disk is gone
    dist.barrier()
    fresh, fresh_opt = _state(99)
    with gpumem.Checkpointer(directory, **kw) as ck:
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 3
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        for group in opt.state_dict()["state"]:
            for k, v in opt.state_dict()["state"][group].items():
                assert torch.equal(v, fresh_opt.state_dict()["state"][group][k]), k
    print(f"rank {rank} restored", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def outage(local: str, url: str, endpoint: str) -> int:
    import warnings

    import torch.distributed as dist

    from gpumem.checkpoint.storage.s3.object_root import ObjectRoot
    from gpumem.checkpoint.storage.s3.object_store import S3Store
    from gpumem.checkpoint.tiers import remote

    def few_attempts(url, endpoint_url, writable=True):  # a store that does not answer: fast
        return ObjectRoot(S3Store(url, endpoint_url=endpoint_url, max_attempts=2))

    remote.open_remote = few_attempts
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
    kw = {"staging_bytes": 64 << 20, "overlap": False, "remote": url, "endpoint_url": endpoint}
    directory = f"{local}-node{rank}"
    model, opt = _state(10 + rank)
    with gpumem.Checkpointer(directory, **kw) as ck:
        ck.save(3, model=model, optimizer=opt, blocking=True)
        assert ck.tiers.wait(120)
    print("saved", flush=True)
    sys.stdin.readline()
    fresh, fresh_opt = _state(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = gpumem.Checkpointer(directory, **kw)
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 3
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        down = ck.save(4, model=fresh, optimizer=fresh_opt, blocking=True)
        assert ck.tiers.wait(120)
    for w in caught:
        if issubclass(w.category, RuntimeWarning):
            print(f"rank {rank} warned: {w.message}", flush=True)
    print(f"rank {rank} restored from {ck.tiers.restored_from}; step 4: {down.remote}", flush=True)
    print("down", flush=True)
    sys.stdin.readline()
    back = ck.save(5, model=fresh, optimizer=fresh_opt, blocking=True)
    assert ck.tiers.wait(120)
    print(f"rank {rank} step 5: {back.remote} {back.tiers}", flush=True)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "sigterm":
        sys.exit(sigterm(args[0], args[1], args[2], float(args[3])))
    if mode == "outage":
        sys.exit(outage(*args))
    sys.exit(ranks(*args))
