"""One rank of the Lightning Trainer test (DDP, gloo, CPU). Launched per rank by
test_integrations.py:

RANK=r WORLD_SIZE=2 INIT=file:///tmp/rdzv \
    python lightning_train.py [--straight CK OUT N] CK OUT N [STOP_AT]

Trains a tiny regressor with dropout (0.1) with Lightning's DDP strategy and gpumem's
CheckpointCallback (saves every 2 steps, PreemptionGuard installed), from torchdata's
StatefulDataLoader (shuffled: Lightning's DistributedSampler; 6 batches per rank and epoch, so
the stop at step 4 falls mid-epoch), resuming from CKPT_DIR. With STOP_AT, rank 0 sends itself
SIGTERM after that step. Writes the final weights and what each step saw and its loss (rank 0)
and exits with the callback's exit code.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

for key, value in (("LOCAL_RANK", os.environ["RANK"]), ("NODE_RANK", "0")):
    os.environ.setdefault(key, value)
# Lightning's environment reads these; the process group below exists before it looks, so the
# port is never opened (the rendezvous is a file: a TCP port can be taken by another process)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "1")
dist.init_process_group(
    "gloo",
    init_method=os.environ["INIT"],
    rank=int(os.environ["RANK"]),
    world_size=int(os.environ["WORLD_SIZE"]),
)

import lightning.pytorch as pl  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from gpumem.integrations.lightning import CheckpointCallback  # noqa: E402


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.trace = []
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        # what each step saw and computed: the resumed run's tail must equal the reference's
        self.trace.append([self.trainer.global_step, x.sum().item(), loss.item()])
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 8, generator=g)
        ds = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
        # a plain DataLoader restarts an interrupted epoch from its start (not resumable); torch's
        # RandomSampler, not shuffle=True: under DDP Lightning swaps it for its DistributedSampler
        # (shuffled by seed and epoch), but wraps torchdata's own RandomSampler, whose order is
        # then drawn afresh each epoch and is not resumable
        sampler = torch.utils.data.RandomSampler(ds)
        return StatefulDataLoader(ds, batch_size=4, sampler=sampler)


class StopAt(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the guard at the next batch end


def run(ckdir: str, out: str, max_steps: int, stop_at: int | None) -> int:
    """One training run with the callback; returns the callback's exit code."""
    pl.seed_everything(0)
    cb = CheckpointCallback(ckdir, every_n_train_steps=2, preemption=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),  # Lightning drops WORLD_SIZE from the env at teardown
        strategy="ddp",
        max_steps=max_steps,
        callbacks=[cb] + ([StopAt(stop_at)] if stop_at else []),
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model)
    if trainer.global_rank == 0:
        weights = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
        with open(out, "w") as f:
            json.dump({"step": trainer.global_step, "restored": cb.restored_step,
                       "trace": model.trace,
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
