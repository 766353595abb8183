"""One rank of test_node_tiers.py: tiers on node-local directories (gloo, CPU).

RANK=r WORLD_SIZE=n INIT=file://... GPUMEM_NODE=k python node_tiers_worker.py MODE BASE URL ENDPOINT

Each simulated node k has its own directory BASE/node<k>; the remote is URL at ENDPOINT (the
test's moto server, or its fault proxy). Modes: ``save`` trains and saves steps 2 and 4, each
waited for in both tiers (rank 0 writes the state of each step to BASE/ref-<step>.pt and prints
the remote's committed steps); ``kill``: the same, but rank CRASH_RANK SIGKILLs itself in step
4's upload, after its first data file went up, and the others then close the Checkpointer;
``stop``: the same with SIGSTOP (a rank that hangs, or whose node vanished: gloo sees no closed
connection), the others close without waiting for the tiers first; ``restore`` restores and
writes what it restored to BASE/got-<world>.pt. The model is FSDP2 (``fully_shard``, each rank
prints how many parameters are DTensors and its rows of the first weight). REPLICAS (default 1)
is ``replicas=``, COLLECTIVE_TIMEOUT (default 60) ``collective_timeout_s``. Every rank prints
each step's ``SaveStats.remote`` and its warnings.
"""

import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from sharded_lib import build, full_state, init_rank, train

import gpumem
from gpumem.checkpoint.storage.s3.object_root import ObjectRoot


def _die_in_step_4_upload(sig: int) -> None:
    upload = ObjectRoot._upload_file

    def upload_then_die(self, src, name, size, key):
        sent = upload(self, src, name, size, key)
        if "step-000000004" in key:  # one file of this rank's is up, the commit is not
            os.kill(os.getpid(), sig)
        return sent

    ObjectRoot._upload_file = upload_then_die


def main() -> None:
    mode, base, url, endpoint = sys.argv[1:5]
    rank, world = init_rank()
    node_dir = os.path.join(base, f"node{os.environ['GPUMEM_NODE']}")
    model, opt = build("fsdp", seed=0)
    params = list(model.parameters())
    dtensors = sum(hasattr(p, "to_local") for p in params)
    rows = model[0].weight.to_local().shape[0]
    print(f"rank {rank} fsdp2 dtensors {dtensors}/{len(params)} rows {rows}", flush=True)
    if mode in ("kill", "stop") and rank == int(os.environ["CRASH_RANK"]):
        _die_in_step_4_upload(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    ck = gpumem.Checkpointer(
        local=node_dir,
        remote=url,
        endpoint_url=endpoint,
        keep=3,
        chunk_bytes=4096,
        replicas=int(os.environ.get("REPLICAS", "1")),
        collective_timeout_s=float(os.environ.get("COLLECTIVE_TIMEOUT", "60")),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode in ("save", "kill", "stop"):
            for step in (2, 4):
                train(model, opt, 2, start=step - 2)
                ref = full_state(model, opt)
                if rank == 0:
                    torch.save(ref, os.path.join(base, f"ref-{step}.pt"))
                stats = ck.save(step, model=model, optimizer=opt)
                ck.wait()
                idle = ck.tiers.wait(120) if mode != "stop" else None
                print(f"rank {rank} step {step} idle={idle} remote: {stats.remote}", flush=True)
        else:
            step = ck.restore(model=model, optimizer=opt)
            got = full_state(model, opt)
            if rank == 0:
                torch.save({"step": step, "state": got}, os.path.join(base, f"got-{world}.pt"))
            print(f"rank {rank} restored {step} from {ck.tiers.restored_from}", flush=True)
        if rank == 0 and mode != "restore":
            print(f"rank 0 remote steps {ck.tiers.root.steps()}", flush=True)
        if mode in ("kill", "stop"):  # a peer is gone: close() must still return
            ck.close()
            print(f"rank {rank} closed", flush=True)
    for w in caught:
        print(f"rank {rank} warned: {w.message}", flush=True)
    if mode in ("kill", "stop"):  # the job ends here, as torchrun would end it
        os._exit(0)
    ck.close()
    dist.barrier()
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    main()
