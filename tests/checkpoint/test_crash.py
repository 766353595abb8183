"""Crash consistency: kill -9 during persist, a full disk, failures at interpreter exit."""

import errno
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from ckpt_files import load_info, read_latest, step_dirs

import gpumem
from gpumem.checkpoint import CheckpointIOError, verify


def _payload(step: int) -> torch.Tensor:
    return torch.randn(64 * 1024, generator=torch.Generator().manual_seed(step))  # 256 KiB


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 3
        try:
            code = child()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _saver(root, first_step: int, wfd: int):
    def child() -> int:
        torch.set_num_threads(1)
        ck = gpumem.Checkpointer(root, keep=2, chunk_bytes=65536)
        step = first_step
        while True:
            ck.save(step, extra={"step": step, "t": _payload(step)}, rng=False)
            ck.wait()
            os.write(wfd, f"{step}\n".encode())  # reported only once durable
            step += 1

    return child


def _check_directory(root, committed: int | None) -> int:
    """Every step dir verifies; the pointer is intact and names one; nothing committed was lost."""
    dirs = step_dirs(root)
    for _, path in dirs:
        verify(path)
    newest = dirs[0][0] if dirs else None
    if committed is not None:
        assert newest is not None and newest >= committed, (newest, committed)
    # a step is committed when its directory is renamed into place; the pointer follows, so a
    # kill between the two leaves the newest step without a pointer (restore scans the dirs)
    ptr = read_latest(root)
    if ptr is not None:
        assert load_info(root / ptr["path"]).manifest_crc32c == ptr["manifest_crc32c"]
    with gpumem.Checkpointer(root, keep=2) as ck:
        got: dict = {}
        step = ck.restore(extra=got, rng=False)
        assert step == newest
        if step is not None:
            assert got["step"] == step and torch.equal(got["t"], _payload(step))
    return newest if newest is not None else -1


def kill_trials(root, trials: int, seed: int, max_delay: float = 0.25) -> dict:
    """Kill a saving process with SIGKILL at random moments; check the directory after each."""
    rng = random.Random(seed)
    committed, killed_mid_save = None, 0
    next_step = 0
    for _ in range(trials):
        rfd, wfd = os.pipe()
        pid = _fork(_saver(root, next_step, wfd))
        os.close(wfd)
        time.sleep(rng.uniform(0.0, max_delay))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(rfd) as f:
            reported = [int(x) for x in f.read().split()]
        if reported:
            committed = reported[-1]
        if any(name.startswith(".tmp-") for name in os.listdir(root)):
            killed_mid_save += 1
        newest = _check_directory(root, committed)
        next_step = max(newest, committed if committed is not None else -1) + 1
    return {"trials": trials, "killed_mid_save": killed_mid_save, "last_committed": committed}


def test_kill_9_during_persist_never_loses_a_checkpoint(tmp_path):
    result = kill_trials(tmp_path, trials=50, seed=1)
    # the kills must really land inside saves, not only between them
    assert result["killed_mid_save"] >= 5 and result["last_committed"] is not None


def test_full_disk_raises_in_wait_and_loses_nothing(tmp_path):
    def child() -> int:
        ck = gpumem.Checkpointer(tmp_path)
        ck.save(1, extra={"t": _payload(1)}, rng=False)
        ck.wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        ck.save(2, extra={"t": _payload(2)}, rng=False)
        try:
            ck.wait()
            return 1
        except CheckpointIOError as exc:
            if exc.errno != errno.EFBIG or "saving step 2" not in str(exc):
                return 2
        ck.save(3, extra={"t": _payload(3)}, rng=False)  # fails again: reported by the next save()
        try:
            ck.save(4, extra={"small": 1}, rng=False)
            return 4
        except CheckpointIOError:
            pass
        return 0

    pid = _fork(child)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [s for s, _ in step_dirs(tmp_path)] == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # failed saves cleaned up
    assert read_latest(tmp_path)["step"] == 1
    verify(tmp_path / "step-000000001")


def test_guard_final_save_runs_after_an_earlier_background_failure(tmp_path):
    """A background save that failed before the signal is reported in the outcome; the final
    save is still attempted (and here succeeds, the disk having room again)."""

    def child() -> int:
        ck = gpumem.Checkpointer(tmp_path)
        m = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        guard = gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), exit_code=7)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        ck.save(1, model=m, optimizer=opt, extra={"t": _payload(1)}, rng=False)
        job = ck.in_flight
        if job is not None:  # let it fail in the background, unobserved
            job.done.wait()
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.kill(os.getpid(), signal.SIGUSR1)
        if not guard.should_stop(2, model=m, optimizer=opt):
            return 3
        if (
            not guard.durable
            or guard.exit_code != 7
            or "an earlier save had failed" not in guard.outcome
        ):
            return 4
        ck.close()
        return 0

    pid = _fork(child)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [s for s, _ in step_dirs(tmp_path)] == [2]
    verify(tmp_path / "step-000000002")


def test_failed_background_save_at_exit_is_loud_and_nonzero(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch, gpumem
        ck = gpumem.Checkpointer({str(tmp_path)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.RLIM_INFINITY))
        ck.save(1, extra={{"t": torch.zeros(100_000)}}, rng=False)
        print("main done")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert "main done" in proc.stdout
    assert proc.returncode != 0
    assert "CHECKPOINT SAVE FAILED" in proc.stderr and "saving step 1" in proc.stderr


def test_exit_waits_for_an_inflight_save(tmp_path):
    script = textwrap.dedent(f"""
        import torch, gpumem
        ck = gpumem.Checkpointer({str(tmp_path)!r})
        ck.save(7, extra={{"t": torch.ones(1_000_000)}}, rng=False)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert verify(tmp_path / "step-000000007").step == 7


@pytest.mark.slow
def test_kill_9_200_trials(tmp_path):
    assert kill_trials(tmp_path, trials=200, seed=2)["killed_mid_save"] >= 40


def test_resave_of_a_step_survives_a_crash_between_the_renames(tmp_path):
    """Saving step N again moves the committed step-N aside before the new one takes its place;
    a crash between the two renames leaves the old copy aside and the new one in .tmp: the next
    start puts the old, complete copy back instead of deleting both (keep=1 would lose all)."""
    m = torch.nn.Linear(8, 8)
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        ck.save(5, model=m, rng=False)
    committed = tmp_path / "step-000000005"
    before = load_info(committed).manifest_crc32c
    # the crash state: step-N renamed aside, the new save complete in its temporary directory
    os.rename(committed, tmp_path / ".replaced-step-000000005-1700000000000000000")
    (tmp_path / ".tmp-step-000000005").mkdir()
    (tmp_path / ".tmp-step-000000005" / "MANIFEST").write_bytes(b"partial")
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        assert [i.step for i in ck.list()] == [5]
        assert load_info(committed).manifest_crc32c == before
        verify(committed)
        m2 = torch.nn.Linear(8, 8)
        assert ck.restore(model=m2, rng=False) == 5
        assert torch.equal(m2.weight, m.weight)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == [".lock"]
    # and a crash after the second rename: the new step-N stays, the moved-aside copy goes
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        ck.save(5, model=m2, rng=False)
    os.makedirs(tmp_path / ".replaced-step-000000005-1700000000000000001")
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        assert [i.step for i in ck.list()] == [5]
        verify(committed)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".replaced-")]


def test_one_job_per_directory_new_job_waits_for_the_old_ones_final_save(tmp_path):
    """A second job on the same directory waits for the first to release it (a preempted pod
    still flushing), then restores what it committed; within one process a second open
    Checkpointer is refused at once; a holder that never lets go makes the waiter fail clearly."""
    m = torch.nn.Linear(16, 16)
    r, w = os.pipe()

    def old_job() -> int:  # holds the directory, saves step 7 slowly, then exits
        os.close(r)
        ck = gpumem.Checkpointer(tmp_path, keep=1)
        os.write(w, b"locked")
        time.sleep(1.0)
        ck.save(7, model=m, rng=False)
        ck.close()
        return 0

    pid = _fork(old_job)
    os.close(w)
    assert os.read(r, 16) == b"locked"
    os.close(r)
    t0 = time.monotonic()
    with gpumem.Checkpointer(tmp_path, keep=1, lock_timeout_s=60) as ck:  # waits for the old job
        waited = time.monotonic() - t0
        m2 = torch.nn.Linear(16, 16)
        assert (
            ck.restore(model=m2, rng=False) == 7
        )  # the old job's final save, committed before we went on
        assert torch.equal(m2.weight, m.weight)
        with pytest.raises(
            gpumem.checkpoint.CheckpointStateError,
            match="another open Checkpointer of this process",
        ):
            gpumem.Checkpointer(tmp_path)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and waited > 0.5

    def holder() -> int:
        ck = gpumem.Checkpointer(tmp_path)
        time.sleep(30)
        ck.close()
        return 0

    pid = _fork(holder)
    try:
        deadline = time.monotonic() + 20
        while (
            time.monotonic() < deadline
            and f'"pid": {pid},'.encode() not in (tmp_path / ".lock").read_bytes()
        ):
            time.sleep(0.05)
        with pytest.raises(
            gpumem.checkpoint.CheckpointStateError,
            match=rf"in use by another job \(pid {pid} on .*\) and was not released within 0.3 s",
        ):
            gpumem.Checkpointer(tmp_path, lock_timeout_s=0.3)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with gpumem.Checkpointer(tmp_path, lock_timeout_s=5):  # a killed holder leaves no stale lock
        pass


def _restore_on_three(rank: int, world: int, root: str) -> None:
    """A 3-rank FSDP job restores the 4-rank checkpoint that survived the crash."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from sharded_lib import build, differences, full_state

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv-three", rank=rank, world_size=world
    )
    model, opt = build("fsdp", seed=9)
    with gpumem.Checkpointer(root) as ck:
        step = ck.restore(model=model, optimizer=opt)
    diff = differences(torch.load(Path(root, "step1.pt")), full_state(model, opt))
    Path(root, f"three.{rank}.json").write_text(json.dumps({"step": step, "diff": diff}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(
    not torch.distributed.is_available()
    or not __import__(
        "gpumem.checkpoint.capture.dtensor"
    ).checkpoint.capture.dtensor.sharding_supported(),
    reason="needs torch.distributed and torch >= 2.6",
)
def test_rank_killed_mid_sharded_save_never_becomes_latest(tmp_path):
    """kill -9 of one rank of four while step 2 of an FSDP(4) job is being written: the others
    fail the save instead of hanging, step 2 is never committed nor named by ``latest``, and
    step 1 restores bit-exact on one process and on three ranks."""
    import json

    import torch.multiprocessing as mp
    from sharded_lib import build, differences, full_state

    here = os.path.dirname(__file__)
    root = tmp_path / "ck"
    root.mkdir()
    env = dict(os.environ, WORLD_SIZE="4", INIT=f"file://{tmp_path}/rdzv", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(here, "sharded_crash_worker.py"), str(root)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
    victim = procs[2]
    for line in victim.stdout:  # step 1 is committed once a rank says it is saving step 2
        if line.startswith("saving 2"):
            break
    else:
        raise AssertionError("rank 2 never reached the save of step 2")
    victim.send_signal(signal.SIGKILL)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert victim.returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        assert procs[r].returncode == 3, outs[r][-3000:]
        assert "step 2 failed" in outs[r] and "COMMITTED" not in outs[r]
    assert [s for s, _ in step_dirs(root)] == [1]
    assert read_latest(root)["step"] == 1
    verify(root / "step-000000001")

    model, opt = build("plain", seed=5)  # any world size: one plain process ...
    with gpumem.Checkpointer(root) as ck:  # (removes the crashed save's .tmp directory)
        assert ck.restore(model=model, optimizer=opt) == 1
    assert differences(torch.load(root / "step1.pt"), full_state(model, opt)) == []
    assert not list(root.glob(".tmp-*"))
    mp.spawn(_restore_on_three, args=(3, str(root)), nprocs=3, join=True)  # ... and three ranks
    for r in range(3):
        got = json.loads((root / f"three.{r}.json").read_text())
        assert got == {"step": 1, "diff": []}
