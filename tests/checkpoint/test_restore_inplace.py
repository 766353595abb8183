"""A plain restore hands the model its verified bytes in one native copy into the live storage
(issue #20): the parameters keep their storage and get the saved values exactly; tied and
non-contiguous tensors go through the model's own load_state_dict as before; a failure before
the commit leaves the model bit-identical."""

from __future__ import annotations

import pytest
import torch
from hostile_lib import snapshot
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointCorruptError
from gpumem.checkpoint.restore import plain


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # one storage behind two keys
        self.norm = nn.LayerNorm(8)
        self.register_buffer("strided", torch.arange(12.0).reshape(3, 4).t())  # not contiguous


def _objects(seed: int):
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.head(model.norm(model.emb(torch.arange(4)))).sum().backward()
    opt.step()
    return model, opt


def test_restore_copies_into_the_live_storage_once(tmp_path, monkeypatch):
    saved_model, saved_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(1, model=saved_model, optimizer=saved_opt, blocking=True)
        ck.wait()
    copies = []
    real = plain.copy_many

    def counting(srcs, dsts, threads=None):
        copies.append(len(srcs))
        return real(srcs, dsts, threads)

    monkeypatch.setattr(plain, "copy_many", counting)
    model, opt = _objects(2)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        assert ck.restore(model=model, optimizer=opt) == 1
    assert snapshot(model, opt) == snapshot(saved_model, saved_opt)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert model.head.weight is model.emb.weight
    # one native copy of the norm's weight and bias; the tied weight and the strided buffer were
    # left to load_state_dict
    assert copies == [2]


def test_a_failure_before_the_commit_leaves_the_model_bit_identical(tmp_path, monkeypatch):
    saved_model, saved_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(1, model=saved_model, optimizer=saved_opt, blocking=True)
        ck.wait()
    model, opt = _objects(2)
    before = snapshot(model, opt)

    real = torch.optim.AdamW.load_state_dict
    calls = []

    def refuse_once(self, state):  # the saved state is refused, the rollback taken
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("no")
        return real(self, state)

    monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", refuse_once)
    with (
        gpumem.Checkpointer(tmp_path, keep=None) as ck,
        pytest.raises(CheckpointCorruptError, match="refused"),
    ):
        ck.restore(model=model, optimizer=opt, path=tmp_path / "step-000000001")
    assert snapshot(model, opt) == before
