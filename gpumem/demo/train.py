"""The demo's trainer: a small language model trained for real on the CPU, checkpointed with
``gpumem.Checkpointer`` and stopped by SIGTERM through ``gpumem.PreemptionGuard``.

    python -m gpumem.demo.train CKPT_DIR STEPS LOSSES [--sigterm-at N] [--save-every K]

It resumes from the newest checkpoint in CKPT_DIR if there is one, appends ``<step> <loss as
float.hex()>`` lines to LOSSES (exact bits, so two runs can be compared bit for bit), and with
``--sigterm-at N`` sends itself SIGTERM after step N, as a scheduler would: the guard then saves
the final checkpoint within its grace period and the process exits with the guard's code.
Everything that decides the next loss is in the checkpoint: model, AdamW state, the learning
rate schedule, the data position and the RNG states (dropout draws from torch's generator).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch
import torch.nn.functional as F

import gpumem
from gpumem.models import build_model

GRACE_S = 30.0


class Batches:
    """Token batches from a seeded generator, resumable by position: each sequence counts up
    from a random start (mod vocab), a rule the model can learn, so the loss falls."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 1234):
        self.vocab, self.batch, self.seq, self.seed, self.pos = vocab, batch, seq, seed, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + self.pos)
        self.pos += 1
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=g)
        ids = (start + torch.arange(self.seq + 1)) % self.vocab
        return ids[:, :-1], ids[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos, self.seed = int(sd["pos"]), int(sd["seed"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumem.demo.train")
    p.add_argument("ckpt_dir")
    p.add_argument("steps", type=int)
    p.add_argument("losses")
    p.add_argument("--sigterm-at", type=int, default=None)
    p.add_argument("--save-every", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the same reductions in every run: bit-identical losses
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny", dropout=0.1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data = Batches(model.config.vocab_size, batch=4, seq=64)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "stateful": {"data": data}}
    ckpt = gpumem.Checkpointer(args.ckpt_dir, keep=2)
    with gpumem.PreemptionGuard(ckpt, grace_s=GRACE_S, state=state) as guard:
        return _train(args, ckpt, guard, state)


def _train(args: argparse.Namespace, ckpt: Any, guard: Any, state: dict[str, Any]) -> int:
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    data = state["stateful"]["data"]
    done = ckpt.restore(**state) or 0
    print(f"start {done}", flush=True)
    with open(args.losses, "a") as out:
        for step in range(done, args.steps):
            x, y = data.next()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            out.write(f"{step + 1} {loss.item().hex()}\n")
            out.flush()
            done = step + 1
            if done % args.save_every == 0:
                ckpt.save(done, **state)
            if args.sigterm_at == done:
                os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before it preempts
            if guard.should_stop(done):
                print(f"stopped {done} {guard.exit_code} {guard.outcome}", flush=True)
                ckpt.close()
                return guard.exit_code
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
