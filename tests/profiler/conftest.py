"""Shared helpers for the profiler tests: a training step, and MemTracker as the reference."""

import pytest
import torch
import torch.nn.functional as F


def train_steps(model, opt, x, y, steps=1, loss="ce"):
    for _ in range(steps):
        out = model(x)
        if loss == "ce":
            lossv = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        else:
            lossv = out.float().square().mean()
        lossv.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


def memtracker_peak(model, opt, x, y, steps=1, loss="ce"):
    """Peak of PyTorch's own MemTracker over the same steps (its 'Total' at its peak)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt, x)
    with mt:
        for _ in range(steps):
            train_steps(model, opt, x, y, 1, loss)
            mt.reset_mod_stats()
    (snap,) = mt.get_tracker_snapshot("peak").values()
    return snap["Total"], snap


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
