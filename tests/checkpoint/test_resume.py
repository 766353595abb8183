"""Exact resume: bit-identical losses after a restore, in process and across a SIGTERM."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from trainlib import Setup, seed_all

import gpumem

HERE = os.path.dirname(__file__)


def test_resume_is_bit_identical(tmp_path):
    total, k = 30, 13  # 96 samples / batch 8 = 12 steps per epoch: k is mid-epoch
    seed_all(0)
    ref = Setup(init_seed=0)
    expected = [ref.step() for _ in range(total)]

    seed_all(0)
    a = Setup(init_seed=0)
    ck = gpumem.Checkpointer(tmp_path)
    first = [a.step() for _ in range(k)]
    stats = ck.save(k, **a.objects())
    assert stats.mode == "overlap"
    # training continues while parameters are copied in the background: the optimizer hook fences it
    rest = [a.step() for _ in range(total - k)]
    assert first + rest == expected
    ck.wait()

    seed_all(1234)
    b = Setup(init_seed=99)
    assert ck.restore(**b.objects()) == k
    resumed = [b.step() for _ in range(total - k)]
    assert resumed == expected[k:]
    ck.close()


def _run(root, total, **kw):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "sigterm_train.py"), str(root), str(total)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _losses(lines):
    return {int(p[1]): p[2] for p in (ln.split() for ln in lines) if p and p[0] == "loss"}


def test_sigterm_saves_exits_and_resumes_bit_identically(tmp_path):
    total = 40
    ref = _run(tmp_path / "ref", total)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    expected = _losses(out.splitlines())
    assert sorted(expected) == list(range(total))

    kill_at = random.Random(os.getpid()).randrange(3, total - 8)
    proc = _run(tmp_path / "run", total)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"loss {kill_at} "):
            proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    err = proc.stderr.read()
    assert proc.returncode == 42, err
    assert "SIGTERM -> stopping at step" in err and "durable" in err
    first = _losses(lines)
    stopped = max(first) + 1
    assert stopped >= kill_at + 1
    info = gpumem.checkpoint.verify(tmp_path / "run" / f"step-{stopped:09d}")
    assert info.step == stopped

    again = _run(tmp_path / "run", total)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"start {stopped}" in out
    second = _losses(out.splitlines())
    assert sorted(second) == list(range(stopped, total))
    assert {**first, **second} == expected


def test_guard_flag_only_and_reuse_of_fresh_save(tmp_path):
    ck = gpumem.Checkpointer(tmp_path)
    m = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), exit_code=7) as guard:
        assert not guard.should_stop(0)
        ck.save(5, model=m, optimizer=opt)
        ck.wait()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.requested and [i.step for i in ck.list()] == [
            5
        ]  # the handler itself saved nothing
        assert guard.should_stop(5)
        assert "reused the save of this step" in guard.outcome and guard.exit_code == 7
        assert [i.step for i in ck.list()] == [5]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    ck.close()


def test_guard_without_anything_to_save_exits_with_the_requeue_code(tmp_path):
    """A signal before the first save() (and no state=): nothing could be saved and nothing was
    lost, so the job is requeued (issue #14: it used to exit with the failure code)."""
    ck = gpumem.Checkpointer(tmp_path)
    with gpumem.PreemptionGuard(
        ck, signals=("SIGUSR1",), exit_code=7, failure_exit_code=3
    ) as guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.should_stop(1)
        assert guard.exit_code == 7 and guard.nothing_to_save and not guard.durable
        assert "nothing to save" in guard.outcome and "state=" in guard.outcome
        assert ck.list() == []
    ck.close()


@pytest.mark.parametrize("grace_s, fit", [(60.0, True), (0.05, False)])
def test_guard_says_whether_the_final_save_fit_the_notice(tmp_path, capsys, grace_s, fit):
    """The notice counts from the signal: the rest of the step in flight (0.2 s here) and the
    final save must both fit in it; the stderr line and ``notice_fit`` say whether they did."""
    ck = gpumem.Checkpointer(tmp_path)
    m = torch.nn.Linear(3, 3)
    state = {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1)}
    with gpumem.PreemptionGuard(ck, signals=("SIGTERM",), grace_s=grace_s, state=state) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the step in flight finishes before the guard sees the flag
        assert guard.should_stop(1)
    ck.close()
    err = capsys.readouterr().err
    assert guard.notice_fit is fit
    if fit:
        assert 0.2 <= guard.final_save_s < 60 and guard.durable
        assert "final save fit the 60 s notice (grace_s: given): durable " in err
        assert "s to spare" in err
    else:  # durable or not, not within the 0.05 s after the signal
        assert guard.final_save_s is None or guard.final_save_s >= 0.2
        assert "final save did NOT fit the 0.05 s notice (grace_s: given)" in err


def test_guard_reads_the_notice_from_the_environment(tmp_path, monkeypatch):
    ck = gpumem.Checkpointer(tmp_path)
    monkeypatch.delenv("GPUMEM_GRACE_S", raising=False)
    with gpumem.PreemptionGuard(ck, signals=("SIGUSR1",)) as guard:
        assert guard.grace_s == 30 and guard.grace_source.startswith("default")
    monkeypatch.setenv("GPUMEM_GRACE_S", "115")
    with gpumem.PreemptionGuard(ck, signals=("SIGUSR1",)) as guard:
        assert (guard.grace_s, guard.grace_source) == (115, "environment: GPUMEM_GRACE_S")
    with gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), grace_s=12) as guard:
        assert (guard.grace_s, guard.grace_source) == (12, "given")  # the argument wins
    for env, match in (("2m", "GPUMEM_GRACE_S='2m' is not a number"), ("0", "GPUMEM_GRACE_S=0")):
        monkeypatch.setenv("GPUMEM_GRACE_S", env)
        with pytest.raises(ValueError, match=match):
            gpumem.PreemptionGuard(ck, signals=("SIGUSR1",))
    with pytest.raises(ValueError, match=r"grace_s=-1: the notice must be a number of seconds > 0"):
        gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), grace_s=-1)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    ck.close()
