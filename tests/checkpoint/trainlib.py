"""A tiny deterministic CPU training setup shared by the checkpoint tests and their subprocesses.

It uses every kind of state a resume must bring back: parameters and BatchNorm buffers, AdamW
state, an LR scheduler, a GradScaler-like object, a shuffling sampler with a position, and the
Python / NumPy / torch RNGs (dropout and input noise draw from all three).
"""

from __future__ import annotations

import random

import numpy as np
import torch


class ResumableSampler(torch.utils.data.Sampler):
    """Shuffles each epoch with a seeded generator; remembers how far into the epoch it is."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        while self.pos < self.n:
            self.pos += 1
            yield perm[self.pos - 1]
        self.epoch, self.pos = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd):
        self.epoch, self.pos, self.seed = sd["epoch"], sd["pos"], sd["seed"]


class ScalerLike:
    """GradScaler-shaped state: a float scale and an int growth tracker."""

    def __init__(self):
        self.scale, self.tracker = 1024.0, 0

    def update(self):
        self.tracker += 1
        if self.tracker % 3 == 0:
            self.scale *= 2.0

    def state_dict(self):
        return {"scale": self.scale, "_growth_tracker": self.tracker}

    def load_state_dict(self, sd):
        self.scale, self.tracker = sd["scale"], sd["_growth_tracker"]


class Setup:
    def __init__(
        self,
        init_seed: int = 0,
        data_seed: int = 1234,
        n: int = 96,
        dim: int = 16,
        hidden: int = 32,
    ):
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden),
            torch.nn.BatchNorm1d(hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(hidden, 1),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=50)
        self.scaler = ScalerLike()
        g = torch.Generator().manual_seed(data_seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.sampler = ResumableSampler(n, seed=data_seed)
        self.loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.x, self.y),
            batch_size=8,
            sampler=self.sampler,
            # each new iterator draws a base seed; from its own generator it leaves the global
            # RNG alone
            generator=torch.Generator().manual_seed(0),
        )
        self._it = None

    def objects(self):
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "scaler": self.scaler,
            "stateful": {"data": self.sampler},
        }

    def step(self) -> float:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            x, y = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            x, y = next(self._it)
        x = x + 0.01 * float(np.random.randn()) + 0.01 * random.random()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.scaler.update()
        return loss.item()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
