"""A tiny trainer for the real-Slurm tests, as README and docs/checkpoint.md show: resumes from
its latest checkpoint, saves every 10 steps, stops on SIGTERM with a durable final save.

    python slurm_train.py CKPT_DIR TOTAL_STEPS STEP_SECONDS
Prints ``start <step>`` and ``loss <step> <float.hex>`` per step (prefixed ``rank<N> `` for
rank N > 0: torchrun's RANK, else Slurm's task; each rank in its own directory), ``at
first-step <unix s>`` after a run's first step and ``at stop <unix s>`` when it leaves after its
final save (the figures: from the job leaving the node to the next run's first step); exits with
the guard's code.
"""

import os
import sys
import time

import torch

import gpumem


def say(line: str) -> None:
    """One write per line: torchrun's workers share the job's output file, and print() may
    split a line from its newline, interleaving ranks mid-line."""
    os.write(1, f"{line}\n".encode())


def main() -> int:
    root, total, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))  # torchrun's first
    root, tag = os.path.join(root, f"rank{rank}"), f"rank{rank} " if rank else ""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ck = gpumem.Checkpointer(root, keep=2)
    guard = gpumem.PreemptionGuard(ck, grace_s=20, state={"model": model, "optimizer": opt})
    start = ck.restore(model=model, optimizer=opt) or 0
    say(f"{tag}start {start}")
    for step in range(start, total):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"{tag}loss {step} {loss.item().hex()}")
        if step == start:
            say(f"{tag}at first-step {time.time():.3f}")
        done = step + 1
        if done % 10 == 0:
            ck.save(done, model=model, optimizer=opt)
        if guard.should_stop(done):
            say(f"{tag}at stop {time.time():.3f}")
            return guard.exit_code
        time.sleep(step_s)
    ck.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
