"""One rank of the node-local checkpoint tests (gloo, CPU), launched by test_nodes.py.

RANK=r WORLD_SIZE=n INIT=file://... GPUMEM_NODE=k python nodes_worker.py MODE BASE LAYOUT REPLICAS

Each simulated node k has its own directory BASE/node<k> (NODE_DIR overrides the name). Modes:
``save`` trains and saves steps 2 and 4 (the state at each step written to BASE/ref-<step>.pt by
rank 0 for the test to compare with); ``crash`` saves step 2, then rank CRASH_RANK kills itself
(SIGKILL) in the middle of step 4's save (its shard written, its replicas not sent yet);
``restore`` restores and writes what it restored to BASE/got-<world>.pt; ``refuse`` constructs a
Checkpointer and prints the error it raises. With EIO_NODE=k, node k's leader gets EIO syncing its
directory after step 4's commit rename (the other nodes' commits succeed).
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
from gpumem.checkpoint import CheckpointError
from gpumem.checkpoint.storage import commit as commit_module


def main() -> None:
    mode, base, layout, replicas = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rank, world = init_rank()
    node_dir = os.path.join(base, os.environ.get("NODE_DIR") or f"node{os.environ['GPUMEM_NODE']}")
    if os.environ.get("DIR_PER_RANK"):  # neither shared nor one a node: refused
        node_dir = os.path.join(base, f"rank{rank}")
    if mode == "refuse":
        try:
            gpumem.Checkpointer(node_dir, replicas=replicas)
            print(f"rank {rank} NOT REFUSED", flush=True)
        except CheckpointError as exc:
            print(f"rank {rank} refused: {exc}", flush=True)
        dist.barrier()
        return
    model, opt = build(layout, seed=0)
    if os.environ.get("EIO_NODE") == os.environ["GPUMEM_NODE"]:
        _eio_after_step_4s_rename()
    if mode == "crash" and rank == int(os.environ["CRASH_RANK"]):
        spread = commit_module.spread

        def die_mid_save(nodes, group, tmp, files, main):
            if "step-000000004" in str(tmp.path):  # its shard written, nothing sent yet
                os.kill(os.getpid(), signal.SIGKILL)
            return spread(nodes, group, tmp, files, main)

        commit_module.spread = die_mid_save
    ck = gpumem.Checkpointer(node_dir, keep=3, replicas=replicas, chunk_bytes=4096)
    if mode in ("save", "crash"):
        for step in (2, 4):
            train(model, opt, 2, start=step - 2)
            ref = full_state(model, opt)
            if rank == 0 and mode == "save":
                torch.save(ref, os.path.join(base, f"ref-{step}.pt"))
            ck.save(step, model=model, optimizer=opt)
            try:
                ck.wait()
            except CheckpointError as exc:
                print(f"rank {rank} step {step} failed: {type(exc).__name__}", flush=True)
                os._exit(3)  # its peer is gone: the job ends here, as a real one would
            if rank == 0 and mode == "crash":
                torch.save(ref, os.path.join(base, f"ref-{step}.pt"))
        ck.close()
        print(f"rank {rank} saved OK", flush=True)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = ck.restore(model=model, optimizer=opt)
        except CheckpointError as exc:
            print(f"rank {rank} restore failed: {type(exc).__name__}: {exc}", flush=True)
            dist.barrier()
            return
    for w in caught:
        print(f"rank {rank} warned: {w.message}", flush=True)
    got = full_state(model, opt)
    if rank == 0:
        torch.save({"step": step, "state": got}, os.path.join(base, f"got-{world}.pt"))
    ck.close()
    print(f"rank {rank} restored {step} OK", flush=True)


def _eio_after_step_4s_rename() -> None:
    import errno

    from gpumem.checkpoint.storage.safe_fs import Dir

    real = Dir.fsync

    def fsync(self: Dir) -> None:
        if self.path.name != "step-000000004" and (self.path / "step-000000004").is_dir():
            raise OSError(errno.EIO, "Input/output error")
        real(self)

    Dir.fsync = fsync


if __name__ == "__main__":
    main()
