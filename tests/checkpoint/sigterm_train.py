"""Training script for the SIGTERM test: resumes if it can, saves every 5 steps, stops on SIGTERM.

    python sigterm_train.py CKPT_DIR TOTAL_STEPS
Prints ``loss <step> <float.hex>`` per step; exits with the guard's exit code when preempted.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from trainlib import Setup, seed_all

import gpumem


def main() -> int:
    root, total = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    seed_all(0)
    s = Setup(init_seed=0)
    ck = gpumem.Checkpointer(root, keep=2)
    # state=: a SIGTERM before the first periodic save is saved too (as docs/checkpoint.md says)
    guard = gpumem.PreemptionGuard(ck, grace_s=60, exit_code=42, state=s.objects())
    start = ck.restore(**s.objects()) or 0
    print(f"start {start}", flush=True)
    for step in range(start, total):
        loss = s.step()
        print(f"loss {step} {loss.hex()}", flush=True)
        done = step + 1
        if done % 5 == 0:
            ck.save(done, **s.objects())
        if guard.should_stop(done):
            return guard.exit_code
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
