"""One rank of test_distributed.py's hostile-directory case: rank 0 cannot open the directory
(its ``.lock`` is a symbolic link), and every rank must raise at once rather than wait in a
collective for rank 0.

RANK=r WORLD_SIZE=2 INIT=file:///tmp/rendezvous python dist_open_worker.py CKPT_DIR
"""

import os
import sys

import torch.distributed as dist

import gpumem
from gpumem.checkpoint import CheckpointCorruptError, CheckpointError


def main() -> None:
    dist.init_process_group(
        "gloo",
        init_method=os.environ["INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank = dist.get_rank()
    try:
        gpumem.Checkpointer(sys.argv[1])
        raise AssertionError("the Checkpointer opened a directory whose .lock is a symlink")
    except CheckpointCorruptError as exc:
        assert rank == 0 and "symbolic link" in str(exc), (rank, exc)
    except CheckpointError as exc:
        assert rank == 1 and "rank 0 could not open" in str(exc), (rank, exc)
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    main()
