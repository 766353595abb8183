"""Errors and commit semantics of the Checkpointer (issue #14): the commit point is the rename, a
failed ``latest`` update is a warning, a failed commit frees its space at once, every argument is
checked, values that cannot be stored raise from save(), read-only storage restores.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from ckpt_files import step_dirs
from hostile_lib import (
    nobody_can_enter,
    objects,
    restore,
    snapshot,
    two_steps,
)

import gpumem
from gpumem.checkpoint import (
    CheckpointError,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
    verify,
)

# ------------------------------------------------------------------ commit semantics


def _block_latest(root: Path) -> None:
    """A directory named ``latest`` (with a file in it): replacing it by the new pointer fails
    (a real failure of the pointer's rename, not a simulated one)."""
    (root / "latest").mkdir()
    (root / "latest" / "x").write_text("x")


def test_a_failed_latest_update_is_a_warning_not_a_failed_save(tmp_path, in_child):
    root = tmp_path / "ck"
    root.mkdir()
    _block_latest(root)

    def case():
        model, opt = objects(1)
        with gpumem.Checkpointer(root) as ck:
            with pytest.warns(CheckpointPointerWarning, match="step 1 is committed"):
                st = ck.save(1, model=model, optimizer=opt)
                assert ck.wait() is True
            assert st.committed and st.status.startswith("committed; latest not updated")
        step, got, fallbacks = restore(root)
        assert step == 1 and got == snapshot(model, opt) and "latest pointer" in fallbacks[0]

    in_child(case)


def test_guard_exits_with_the_requeue_code_when_only_latest_failed(tmp_path, in_child):
    root = tmp_path / "ck"
    root.mkdir()
    _block_latest(root)

    def case():
        model, opt = objects(1)
        with gpumem.Checkpointer(root) as ck:
            guard = gpumem.PreemptionGuard(ck, signals=("SIGUSR1",), exit_code=7)
            os.kill(os.getpid(), signal.SIGUSR1)
            with pytest.warns(CheckpointPointerWarning):
                assert guard.should_stop(4, model=model, optimizer=opt)
            assert guard.durable and guard.exit_code == 7
            assert "committed; latest not updated" in guard.outcome
            guard.close()
        assert [s for s, _ in step_dirs(root)] == [4]

    in_child(case)


def test_a_failed_commit_frees_its_temporary_directory_at_once(tmp_path, in_child):
    """``abandoned`` is a file, so moving the higher step aside fails in the commit phase: the
    failed save's ``.tmp-step-*`` is gone right away, not at the next start."""
    root = tmp_path / "ck"
    two_steps(root)
    (root / "abandoned").write_text("not a directory")

    def case():
        model, opt = objects(1)
        with gpumem.Checkpointer(root, keep=None) as ck:
            ck.save(1, model=model, optimizer=opt)
            with pytest.raises(CheckpointError):
                ck.wait()
            assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
            assert [i.step for i in ck.list()] == [1, 2]

    in_child(case)


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("step", [10**20, 2**63, -1, True, 1.0])
def test_steps_out_of_range_are_refused_by_save(tmp_path, step):
    with gpumem.Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointStateError, match=r"\[0, 2\*\*63 - 1\]"):
            ck.save(step, extra={"x": 1})
        assert ck.in_flight is None and ck.list() == []


def test_the_largest_step_round_trips(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(2**63 - 1, extra={"x": 1}, rng=False)
        ck.wait()
        got: dict = {}
        assert ck.restore(extra=got) == 2**63 - 1 and got == {"x": 1}
        assert [i.step for i in ck.list()] == [2**63 - 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep": True}, "keep"),
        ({"keep": 0}, "keep"),
        ({"keep": 2.5}, "keep"),
        ({"staging_bytes": "1e9"}, "staging_bytes"),
        ({"staging_bytes": 0}, "staging_bytes"),
        ({"segment_bytes": 0}, "segment_bytes"),
        ({"chunk_bytes": "4096"}, "chunk_bytes"),
        ({"chunk_bytes": 3000}, "chunk_bytes"),
        ({"lock_timeout_s": -5}, "lock_timeout_s"),
        ({"lock_timeout_s": float("nan")}, "lock_timeout_s"),
        ({"overlap": "no"}, "overlap"),
        ({"read_only": 1}, "read_only"),
    ],
)
def test_bad_arguments_are_state_errors(tmp_path, kwargs, match):
    with pytest.raises(CheckpointStateError, match=match):
        gpumem.Checkpointer(tmp_path, **kwargs)


def test_a_path_that_is_a_file_is_an_io_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointIOError, match="not a directory") as info:
        gpumem.Checkpointer(tmp_path / "f")
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(tmp_path / "f")


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_non_utf8_directory_name_works(tmp_path, as_bytes):
    root = os.path.join(os.fsencode(tmp_path), b"ck-\xff\xfe")
    with gpumem.Checkpointer(root if as_bytes else os.fsdecode(root)) as ck:
        ck.save(1, extra={"t": torch.arange(5)}, rng=False)
        ck.wait()
        got: dict = {}
        assert ck.restore(extra=got) == 1 and torch.equal(got["t"], torch.arange(5))
    verify(os.path.join(root, b"step-000000001"))


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


UNSTORABLE = {
    "a 5000-digit int": (lambda: 10**5000, "an integer of 16610 bits"),
    "lists 3000 deep": (lambda: _nested(3000), "nested more than 100"),
    "a meta tensor": (lambda: torch.empty(3, device="meta"), "meta"),
}


@pytest.mark.parametrize("what", list(UNSTORABLE))
def test_values_that_cannot_be_stored_raise_from_save(tmp_path, what):
    make, match = UNSTORABLE[what]
    value = make()
    with gpumem.Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointStateError, match=match):
            ck.save(1, extra={"v": value}, rng=False)
        assert ck.in_flight is None and ck.wait()  # nothing was queued
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".tmp-", "step-"))]


# ------------------------------------------------------------------ read-only storage


def test_read_only_true_takes_no_lock_and_refuses_save(tmp_path, in_child):
    want = two_steps(tmp_path)
    (tmp_path / ".tmp-step-000000009").mkdir()  # a crashed save's leftover: left alone

    def case():
        with gpumem.Checkpointer(tmp_path) as writer:  # holds the lock
            (tmp_path / ".tmp-step-000000009").mkdir()
            with gpumem.Checkpointer(tmp_path, read_only=True, lock_timeout_s=0) as ro:
                assert ro.read_only
                model, opt = objects(0)
                assert ro.restore(model=model, optimizer=opt) == 2
                assert snapshot(model, opt) == want[2]
                with pytest.raises(CheckpointStateError, match="read_only=True"):
                    ro.save(3, model=model)
            assert (tmp_path / ".tmp-step-000000009").is_dir()
            writer.save(3, extra={"x": 1})

    in_child(case)


def test_a_directory_without_write_permission_restores_read_only(in_child):
    """EACCES: restore works, said once; save() is refused with the errno. Root ignores
    permission bits, so a root run drops to uid 65534 (nobody) in the child."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-ro-", dir="/tmp"))
    try:
        nobody_can_enter(root)
        want = two_steps(root)
        for p in [root, *root.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)

        def case():
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ck = gpumem.Checkpointer(root)
            said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
            assert len(said) == 1 and "read-only" in said[0]
            model, opt = objects(9)
            assert ck.restore(model=model, optimizer=opt) == 2
            assert snapshot(model, opt) == want[2]
            with pytest.raises(CheckpointIOError, match="save\\(\\) is refused") as info:
                ck.save(3, model=model)
            assert info.value.errno == errno.EACCES
            ck.close()

        in_child(case)
    finally:
        for p in [root, *root.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(root, ignore_errors=True)


def test_a_read_only_mount_restores_read_only(tmp_path):
    """EROFS, for real: the directory bind-mounted read-only in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    two_steps(tmp_path)
    script = textwrap.dedent(f"""
        import json, subprocess, sys, warnings, torch, gpumem
        root = {str(tmp_path)!r}
        for args in (["--bind", root, root], ["-o", "remount,ro,bind", root, root]):
            done = subprocess.run(["mount", *args], capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({{"skip": done.stderr.strip()}}))
                sys.exit(0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck = gpumem.Checkpointer(root)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
        step = ck.restore(model=model, optimizer=opt)
        try:
            ck.save(3, model=model)
            errno = None
        except gpumem.CheckpointIOError as exc:
            errno = exc.errno
        print(json.dumps({{"step": step, "errno": errno, "warned": [str(w.message) for w in seen],
                           "weight": model[0].weight.flatten().tolist()}}))
    """)
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0 and "unshare:" in proc.stderr:  # no user namespaces here
        pytest.skip(f"cannot make a read-only mount here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"cannot make a read-only mount here: {out['skip'][-200:]}")
    assert out["step"] == 2 and out["errno"] == errno.EROFS
    assert len(out["warned"]) == 1 and "read-only" in out["warned"][0]
    model, _ = objects(2)  # what step 2 saved
    assert out["weight"] == model[0].weight.flatten().tolist()
