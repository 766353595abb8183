"""Which data loaders resume exactly in Lightning with gpumem's callback (the docs' loader table,
docs/checkpoint.md). Launched by test_integrations.py, once on one device and once per rank of a
2-rank DDP job (gloo, CPU):

[RANK=r WORLD_SIZE=2 INIT=file:///tmp/rdzv] python lightning_loaders.py ROOT OUT LOADER...

For each loader: an uninterrupted run of N steps, then for each stop (in epoch 0, at the end
of epoch 0, in epoch 1) a run that saves at the stop and ends there and a run that resumes from
it to N steps, in a fresh directory. Writes (rank 0) per loader and stop whether the resumed
run's final weights and the steps it ran (the batch each saw, its loss: dropout 0.1) equal the
uninterrupted run's.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD > 1:
    for key, value in (("LOCAL_RANK", os.environ["RANK"]), ("NODE_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # never opened: see lightning_train.py
    os.environ.setdefault("MASTER_PORT", "1")
    dist.init_process_group(
        "gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]), world_size=WORLD
    )

import lightning.pytorch as pl  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from gpumem.integrations.lightning import CheckpointCallback  # noqa: E402

SAMPLES, BATCH = 48, 4
PER_EPOCH = SAMPLES // BATCH // WORLD  # batches per rank and epoch: 12 on one device, 6 on 2
# a stop in epoch 0, at its end, and in epoch 1
STOPS = {"epoch 0": PER_EPOCH // 2, "epoch end": PER_EPOCH, "epoch 1": PER_EPOCH + PER_EPOCH // 2}
STEPS = 2 * PER_EPOCH + 2


def loader(kind: str, ds):
    if kind == "stateful-sampler":
        return StatefulDataLoader(ds, batch_size=BATCH, sampler=torch.utils.data.RandomSampler(ds))
    if kind == "stateful-shuffle":
        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True)
    if kind == "stateful-ordered":
        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=False)
    if kind == "plain-shuffle":
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)
    if kind == "plain-ordered":
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)
    raise ValueError(kind)


class Regressor(pl.LightningModule):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.trace = kind, []
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.trace.append([self.trainer.global_step, x.sum().item(), loss.item()])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(0))
        return loader(self.kind, torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)))


def fit(kind: str, ckdir: str, steps: int, every: int | None) -> tuple[list, list]:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp" if WORLD > 1 else "auto",
        max_steps=steps,
        callbacks=[CheckpointCallback(ckdir, every_n_train_steps=every)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(kind)
    trainer.fit(model)
    return model.trace, [v.flatten().tolist() for v in model.state_dict().values()]


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Lightning's advice on workers and resumable loaders
    root, out, kinds = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = {}
    for kind in kinds:
        trace, weights = fit(kind, f"{root}/{kind}-straight", STEPS, None)
        for name, stop in STOPS.items():
            ckdir = f"{root}/{kind}-{stop}"
            fit(kind, ckdir, stop, stop)
            got_trace, got_weights = fit(kind, ckdir, STEPS, None)
            same = sum(a == b for a, b in zip(got_weights, weights, strict=True))
            results[f"{kind}/{name}"] = {
                "exact": got_trace == trace[stop:] and same == len(weights),
                "tensors_equal": f"{same}/{len(weights)}",
                "steps_run": len(got_trace),
                "steps_left": STEPS - stop,
            }
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
