"""One rank of the distributed checkpoint test (gloo, CPU). Launched twice by test_distributed.py.

RANK=r WORLD_SIZE=2 INIT=file:///tmp/rendezvous python dist_worker.py CKPT_DIR
"""

import os
import resource
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from sharded_lib import init_rank
from trainlib import Setup, seed_all

import gpumem
from gpumem.checkpoint import CheckpointFallbackWarning, CheckpointIOError


def snapshot(s: Setup) -> dict:
    return {k: v.clone() for k, v in s.model.state_dict().items()}


def main() -> None:
    root = sys.argv[1]
    rank, _ = init_rank()
    seed_all(rank)
    s = Setup(init_seed=rank, data_seed=100 + rank)
    ck = gpumem.Checkpointer(root, keep=3)
    guard = gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), exit_code=42)
    for _ in range(3):
        s.step()
    ck.save(3, **s.objects())
    ck.wait()
    saved3 = snapshot(s)

    # rank 1 cannot write its data file (121 KB): nobody commits step 5, every rank's wait()
    # raises. The limit stays above the file store's size (a few KB): the rendezvous file also
    # carries the save's roll call.
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))
    s.step()
    ck.save(5, **s.objects())
    try:
        ck.wait()
        raise AssertionError("wait() did not raise")
    except CheckpointIOError as exc:
        print(f"rank {rank} step 5 failed as expected: {exc}", flush=True)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "step-000000005"))

    # a committed step 6, then rank 1's shard of it is damaged: both ranks agree to fall back to 3
    s.step()
    ck.save(6, **s.objects())
    ck.wait()
    if rank == 1:
        path = os.path.join(root, "step-000000006", "data-r00001-0000.bin")
        with open(path, "r+b") as f:
            first = f.read(6)
            f.seek(5)
            f.write(bytes([first[5] ^ 0xFF]))
    dist.barrier()
    fresh = Setup(init_seed=50 + rank, data_seed=100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.restore(**fresh.objects()) == 3
    assert any(issubclass(w.category, CheckpointFallbackWarning) for w in caught)
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, saved3[k]), k

    # preemption on rank 0 only: the all-reduced flag stops both ranks at the same step
    if rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    dist.barrier()
    assert guard.should_stop(7)
    assert guard.exit_code == 42, guard.outcome
    dist.barrier()
    info = gpumem.checkpoint.verify(os.path.join(root, "step-000000007"))
    assert info.world_size == 2
    ck.close()
    guard.close()
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
