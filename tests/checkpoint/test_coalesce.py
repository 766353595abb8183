"""Checkpointer(coalesce=True): save() never waits for the writer; a newer snapshot replaces the
one waiting to be written; wait(), close() and PreemptionGuard persist the last snapshot.

The writer is held on step 1 by a gate (the persist thread's ``_persist`` waits for it), so which
saves are written and which are superseded is decided by the code, not by timing: with step 1
being written, step 2 waits in the second slot, step 3 replaces it, step 4 replaces step 3. If
save() waited for the writer instead, the gate would never open from the test's thread: the
patched writer gives up after 30 s and the test fails on ``gate_timed_out``.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from ckpt_files import step_dirs

import gpumem
from gpumem.checkpoint import CheckpointError, CheckpointStateError
from gpumem.checkpoint.storage.commit import Commit


def _objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train(model, opt) -> None:
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


class Gate:
    """Holds the writer on ``step`` until opened; records what the persist thread wrote."""

    def __init__(self, monkeypatch, step: int = 1, fail: bool = False):
        self.open_ = threading.Event()
        self.held = threading.Event()
        self.timed_out = False
        self.persisted: list[int] = []
        real = Commit.run
        gate = self

        def persist(job):
            if job.step == step:
                gate.held.set()
                gate.timed_out = not gate.open_.wait(30)
                if fail:
                    raise OSError(28, "No space left on device (simulated)")
            gate.persisted.append(job.step)
            real(job)

        monkeypatch.setattr(Commit, "run", persist)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_newer_snapshots_replace_the_waiting_one_and_the_newest_is_written(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    model, opt = _objects(0)
    with gpumem.Checkpointer(tmp_path, keep=None, coalesce=True, overlap=False) as ck:
        stats = {}
        for step in (1, 2, 3, 4):
            _train(model, opt)
            stats[step] = ck.save(step, model=model, optimizer=opt)
            if step == 1:
                assert gate.held.wait(30)  # step 1 is being written from here on
        want = _params(model)
        # every save returned while step 1 was still being written
        assert not gate.open_.is_set()
        assert [stats[s].superseded_by for s in (1, 2, 3, 4)] == [None, 3, 4, None]
        assert [stats[s].supersedes for s in (1, 2, 3, 4)] == [None, None, 2, 3]
        assert stats[2].status == "superseded by step 3 (not written)"
        gate.open_.set()
        assert ck.wait() is True
    assert not gate.timed_out
    assert gate.persisted == [1, 4]  # 2 and 3 never reached the disk
    assert sorted(s for s, _ in step_dirs(tmp_path)) == [1, 4]
    assert stats[1].committed and stats[4].committed
    assert not stats[2].committed and not stats[3].committed
    assert [st.step for st in ck.history] == [1, 2, 3, 4]
    fresh, fresh_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, read_only=True) as ck:
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 4
    for a, b in zip(want, fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_without_a_writer_busy_every_save_is_written(tmp_path):
    """Each save is written when the writer is free: waiting for each shows no supersession."""
    model, opt = _objects(0)
    with gpumem.Checkpointer(tmp_path, keep=2, coalesce=True) as ck:
        for step in range(1, 5):
            _train(model, opt)
            st = ck.save(step, model=model, optimizer=opt)
            ck.wait()
            assert st.committed and st.superseded_by is None and st.supersedes is None
    assert sorted(s for s, _ in step_dirs(tmp_path)) == [3, 4]


def test_the_two_slots_alternate_and_a_superseded_slot_is_reused(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    model, opt = _objects(0)
    with gpumem.Checkpointer(tmp_path, coalesce=True, overlap=False) as ck:
        arenas = []
        for step in (1, 2, 3):
            ck.save(step, model=model, optimizer=opt)
            arenas.append(ck._job.snapshot.arena)
            if step == 1:
                assert gate.held.wait(30)
        assert arenas[0] is not arenas[1]  # step 2 waits beside the step being written
        assert arenas[2] is arenas[1]  # step 3 took the slot of the step it replaced
        gate.open_.set()
        ck.wait()
    assert not gate.timed_out


def test_a_failure_of_an_older_save_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, fail=True)
    model, opt = _objects(0)
    ck = gpumem.Checkpointer(tmp_path, coalesce=True, overlap=False)
    ck.save(1, model=model, optimizer=opt)
    assert gate.held.wait(30)
    st2 = ck.save(2, model=model, optimizer=opt)
    gate.open_.set()
    with pytest.raises(CheckpointError, match="No space left on device"):
        ck.wait()
    assert ck.wait() is True  # reported once; step 2 was written after it
    assert st2.committed
    ck.close()
    assert sorted(s for s, _ in step_dirs(tmp_path)) == [2]


def test_preemption_persists_the_last_snapshot(tmp_path, monkeypatch):
    """SIGTERM while step 1 is being written and step 4 waits: the guard reuses step 4's
    snapshot (it is this step's), waits until the writer has written it, and the job resumes
    from step 4 with its exact values."""
    gate = Gate(monkeypatch)
    model, opt = _objects(0)
    ck = gpumem.Checkpointer(tmp_path, coalesce=True, overlap=False)
    guard = gpumem.PreemptionGuard(ck, grace_s=60)
    try:
        for step in (1, 2, 3, 4):
            _train(model, opt)
            ck.save(step, model=model, optimizer=opt)
            if step == 1:
                assert gate.held.wait(30)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
                threading.Thread(target=gate.open_.set).start()  # the writer frees up later
            if guard.should_stop(step):
                break
        want = _params(model)
    finally:
        ck.close()
        guard.close()
    assert not gate.timed_out
    assert guard.saved_step == 4 and guard.durable and guard.exit_code == 143
    assert "reused the save of this step" in guard.outcome
    assert gate.persisted == [1, 4]
    assert sorted(s for s, _ in step_dirs(tmp_path)) == [1, 4]
    fresh, fresh_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, read_only=True) as ck:
        assert ck.restore(model=fresh, optimizer=fresh_opt) == 4
    for a, b in zip(want, fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_coalesce_and_spill_arguments_are_checked(tmp_path):
    with pytest.raises(CheckpointStateError, match="coalesce=1 must be True or False"):
        gpumem.Checkpointer(tmp_path, coalesce=1)
    with pytest.raises(CheckpointStateError, match="device_spill_bytes=-1 must be an int >= 0"):
        gpumem.Checkpointer(tmp_path, device_spill_bytes=-1)
    with pytest.raises(CheckpointStateError, match=r"device_spill_bytes=1\.5 must be an int"):
        gpumem.Checkpointer(tmp_path, device_spill_bytes=1.5)
