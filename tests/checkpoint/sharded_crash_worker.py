"""One of four FSDP ranks of the crash test (gloo, CPU), launched by test_crash.py:

RANK=r WORLD_SIZE=4 INIT=file:///tmp/rdzv python sharded_crash_worker.py CKPT_DIR

Commits step 1 (the full state goes to CKPT_DIR/step1.pt for the test), then saves step 2 with
every shard manifest's write held back 3 s, printing "saving 2" once its data files are written:
the test kills one rank with SIGKILL there. The others must fail that save (a peer gone from the
collectives) and exit 3 without committing anything.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from sharded_lib import build, full_state, init_rank, train

import gpumem
import gpumem.checkpoint.storage.directory as persist
from gpumem.checkpoint import CheckpointError


def main() -> None:
    root = sys.argv[1]
    init_rank()
    model, opt = build("fsdp")
    train(model, opt, 2)
    ck = gpumem.Checkpointer(root, collective_timeout_s=20)
    ck.save(1, model=model, optimizer=opt)
    ck.wait()
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(root, "step1.pt"))
    dist.barrier()
    train(model, opt, 1, start=2)
    real = persist.write_manifest

    def slow(d, name, manifest):  # data files of step 2 written, its shard manifest held back:
        if manifest.body.get("step") == 2:  # the test kills a rank now
            print("saving 2", flush=True)
            time.sleep(3)
        return real(d, name, manifest)

    persist.write_manifest = slow
    ck.save(2, model=model, optimizer=opt)
    try:
        ck.wait()
        print("step 2 COMMITTED", flush=True)
        code = 0
    except CheckpointError as exc:
        print(f"step 2 failed: {type(exc).__name__}: {exc}", flush=True)
        code = 3
    os._exit(code)  # a peer is gone: tearing the process group down could wait on it


if __name__ == "__main__":
    main()
