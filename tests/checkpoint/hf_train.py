"""One rank of the transformers Trainer test (DDP, gloo, CPU). Launched per rank by
test_integrations.py:

RANK=r WORLD_SIZE=2 INIT=file:///tmp/rdzv \
    python hf_train.py [--straight CK OUT N] CK OUT N [STOP_AT]

Trains a tiny regressor with dropout (0.1) on the Trainer's shuffled sampler (12 steps an
epoch: the stop at step 4 falls mid-epoch) with the real Trainer and gpumem's
CheckpointCallback (saves every 2 steps, PreemptionGuard installed), resuming from CKPT_DIR when
it holds a checkpoint. With STOP_AT, rank 0 sends itself SIGTERM after that step. Writes the
final weights (rank 0) and exits with the callback's exit code. With --straight, an
uninterrupted run to N in another directory comes first (the reference the test compares with).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
# accelerate insists on these; the process group below exists before it looks, so it never
# opens the port (the rendezvous is a file: a TCP port can be taken by another process)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "1")
dist.init_process_group(
    "gloo",
    init_method=os.environ["INIT"],
    rank=int(os.environ["RANK"]),
    world_size=int(os.environ["WORLD_SIZE"]),
)

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gpumem.integrations.hf import CheckpointCallback  # noqa: E402


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the guard at the next boundary


def run(ckdir: str, out: str, max_steps: int, stop_at: int | None) -> int:
    """One training run with the callback; returns the callback's exit code."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=os.path.join(ckdir, "hf"),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        learning_rate=0.05,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    cb = CheckpointCallback(ckdir, every_n_train_steps=2, preemption=True)
    callbacks = [cb] + ([StopAt(stop_at)] if stop_at else [])
    trainer = Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=callbacks)
    resume = cb.resume_from(trainer)
    trainer.train(resume_from_checkpoint=resume)
    cb.close()
    if dist.get_rank() == 0:
        weights = {k: v.flatten().tolist() for k, v in trainer.model.state_dict().items()}
        with open(out, "w") as f:
            json.dump({"step": trainer.state.global_step, "resumed": resume is not None,
                       "weights": weights}, f)  # fmt: skip
    dist.barrier()
    return cb.exit_code


def main():
    argv = sys.argv[1:]
    if argv[0] == "--straight":  # an uninterrupted run first, in the same processes
        run(argv[1], argv[2], int(argv[3]), None)
        argv = argv[4:]
    code = run(argv[0], argv[1], int(argv[2]), int(argv[3]) if len(argv) > 3 else None)
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
