"""Training that goes back (a rollback, or a new run in an old run's directory): the new branch
wins.

Before: restore() took the highest step and retention kept the highest steps, so after a rollback
from step 5 to step 3 the abandoned step 5 won every restore and retention deleted the new
branch's saves as they came.
"""

import os
import warnings

import pytest
import torch
from ckpt_files import step_dirs
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointBranchWarning, verify
from gpumem.checkpoint.storage.directory import ABANDONED, set_aside_newer
from gpumem.checkpoint.storage.safe_fs import Dir


def _model(value: float) -> nn.Linear:
    m = nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def _steps(root) -> list[int]:
    return sorted(s for s, _ in step_dirs(root))


def test_rollback_then_save_sets_the_abandoned_branch_aside(tmp_path):
    with gpumem.Checkpointer(tmp_path, keep=3) as ck:
        for step in range(1, 6):
            ck.save(step, model=_model(step))
        ck.wait()
        assert _steps(tmp_path) == [3, 4, 5]
        back = _model(0)
        assert ck.restore(model=back, path=tmp_path / "step-000000003") == 3  # the rollback
        with pytest.warns(CheckpointBranchWarning, match=r"step-000000004, step-000000005"):
            stats = ck.save(4, model=_model(40.0))  # the new branch's step 4
            ck.wait()
        assert [p.rsplit("/", 1)[-1] for p in stats.set_aside] == [
            "step-000000004",
            "step-000000005",
        ]
        got = _model(0)
        assert ck.restore(model=got) == 4  # before: the abandoned step 5
        assert torch.equal(got.weight, torch.full((2, 3), 40.0))
        with warnings.catch_warnings():
            warnings.simplefilter(
                "error", CheckpointBranchWarning
            )  # going forward again: no warning
            ck.save(5, model=_model(50.0))
            ck.save(6, model=_model(60.0))
            ck.wait()
        # retention counted the new branch: before, it deleted the new 4 and 5 and kept the old ones
        assert _steps(tmp_path) == [4, 5, 6]
        got = _model(0)
        assert ck.restore(model=got) == 6
        assert torch.equal(got.weight, torch.full((2, 3), 60.0))
        assert [i.step for i in ck.list()] == [4, 5, 6]

    # nothing of the old branch was deleted: it sits, intact and verifiable, under abandoned/
    (held,) = (tmp_path / ABANDONED).iterdir()
    assert held.name.endswith("-before-step-4")
    assert sorted(p.name for p in held.iterdir()) == ["step-000000004", "step-000000005"]
    assert verify(held / "step-000000005").step == 5


def test_new_run_in_an_old_runs_directory(tmp_path):
    with gpumem.Checkpointer(tmp_path, keep=2) as ck:
        for step in (100, 200):
            ck.save(step, model=_model(step))
        ck.wait()
    with gpumem.Checkpointer(tmp_path, keep=2) as ck:  # a fresh run that does not resume
        with pytest.warns(CheckpointBranchWarning):
            ck.save(10, model=_model(1.0))
            ck.wait()
        ck.save(20, model=_model(2.0))
        ck.wait()
        assert _steps(tmp_path) == [10, 20]
        got = _model(0)
        assert ck.restore(model=got) == 20  # before: the old run's 200
        assert torch.equal(got.bias, torch.full((2,), 2.0))


def test_same_step_again_is_replaced_not_set_aside(tmp_path):
    with gpumem.Checkpointer(tmp_path, keep=3) as ck:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointBranchWarning)
            ck.save(1, model=_model(1.0))
            ck.save(2, model=_model(2.0))
            ck.save(2, model=_model(22.0))  # e.g. a final save at an already saved step
            ck.wait()
        assert _steps(tmp_path) == [1, 2]
        assert not (tmp_path / ABANDONED).exists()
        got = _model(0)
        assert ck.restore(model=got) == 2 and torch.equal(got.bias, torch.full((2,), 22.0))


def test_crash_after_setting_aside_resumes_on_the_new_branch(tmp_path):
    """commit() sets the old branch aside before the new step's rename: a crash in between
    leaves the branch point as the newest checkpoint, never the abandoned steps."""
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        for step in range(1, 6):
            ck.save(step, model=_model(step))
        ck.wait()
    with Dir.open(tmp_path) as root:
        moved = set_aside_newer(root, 4)  # what a save of step 4 does first; then the "crash"
    assert [os.path.basename(p) for p in moved] == ["step-000000004", "step-000000005"]
    with gpumem.Checkpointer(tmp_path) as ck:
        got = _model(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `latest` still names the moved step 5: stale
            assert ck.restore(model=got) == 3
        assert torch.equal(got.bias, torch.full((2,), 3.0))


def test_nothing_newer_moves_nothing(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(7, model=_model(7.0))
        ck.wait()
    with Dir.open(tmp_path) as root:
        assert set_aside_newer(root, 7) == [] and set_aside_newer(root, 8) == []
    assert _steps(tmp_path) == [7] and not (tmp_path / ABANDONED).exists()


def test_ckpt_ls_mentions_abandoned_branches(tmp_path, capsys):
    from gpumem.cli import main

    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(5, model=_model(5.0))
        with pytest.warns(CheckpointBranchWarning):
            ck.save(2, model=_model(2.0))
            ck.wait()
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-000000002  <- latest" in out
    assert "1 checkpoint(s) of abandoned branches" in out and "step-000000005" not in out
