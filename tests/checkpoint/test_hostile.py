"""A checkpoint directory is input (issue #14): one built by an attacker cannot make gpumem write,
read or hang outside it, and restore is all or nothing under every error.

Every case runs in a forked child with a 20 s limit (``in_child``), so a read that blocks on a
FIFO fails the test instead of hanging the suite. Each case was found against the code before
issue #14 (symlinked lock files truncated, FIFOs hung restore, hostile values raised TypeError
after the model was loaded, ...).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import google_crc32c
import pytest
import torch
from ckpt_files import read_manifest, step_dirs
from torch import nn

import gpumem
from gpumem.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointPointerWarning,
    CheckpointStateError,
    verify,
)
from gpumem.checkpoint.format import encode_manifest
from gpumem.cli import main as cli

STEP1, STEP2 = "step-000000001", "step-000000002"
DATA = "data-r00000-0000.bin"


def _objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    model(torch.randn(6, 8)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list:
    """Everything restore could change, as comparable values (tensors as bytes)."""

    def flat(x):
        if isinstance(x, torch.Tensor):
            return ("t", str(x.dtype), tuple(x.shape), x.detach().cpu().numpy().tobytes())
        if isinstance(x, dict):
            return sorted((str(k), flat(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [flat(v) for v in x]
        return x

    return [flat(model.state_dict()), flat(opt.state_dict())]


def _two_steps(root: Path) -> dict[int, list]:
    """Steps 1 and 2 of different objects; returns each step's snapshot."""
    want = {}
    with gpumem.Checkpointer(root, keep=None) as ck:
        for step in (1, 2):
            model, opt = _objects(step)
            ck.save(step, model=model, optimizer=opt)
            ck.wait()
            want[step] = _snapshot(model, opt)
    return want


def _restore(root: Path, **kw) -> tuple[int | None, list, list[str]]:
    """Restore into fresh objects; (step, snapshot of the objects, fallback warning texts: the
    skipped checkpoints', then the latest pointer's)."""
    model, opt = _objects(99)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gpumem.Checkpointer(root, keep=None) as ck:
            step = ck.restore(model=model, optimizer=opt, **kw)
    texts = [str(w.message) for w in seen if issubclass(w.category, CheckpointFallbackWarning)]
    texts.sort(key=lambda t: not t.startswith("skipping"))
    return step, _snapshot(model, opt), texts


def _forge(step_dir: Path, mutate) -> None:
    """Rewrite the shard manifest with ``mutate(body)`` applied and every CRC recomputed (the
    main manifest records the new shard CRC): only the values are hostile, the framing is
    valid."""
    body, _ = read_manifest(step_dir / "manifest-r00000")
    mutate(body)
    raw, crc = encode_manifest(body)
    (step_dir / "manifest-r00000").write_bytes(raw)
    main, _ = read_manifest(step_dir / "MANIFEST")
    main["shards"][0]["crc32c"] = crc
    (step_dir / "MANIFEST").write_bytes(encode_manifest(main)[0])


def _framed(payload: bytes) -> bytes:
    prefix = f"gpumem-checkpoint 1 {len(payload):012d} ".encode()
    return prefix + f"{google_crc32c.value(prefix + payload):08x}\n".encode() + payload


def _peak_rss_reset() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


# ------------------------------------------------------------------ the lock file


def _lock_case(root: Path, match: str):
    def case():
        with pytest.raises(CheckpointCorruptError, match=match) as info:
            gpumem.Checkpointer(root)
        assert info.value.path == str(root / ".lock")

    return case


def test_lock_symlink_to_a_file_outside_leaves_it_untouched(tmp_path, in_child):
    root, canary = tmp_path / "ck", tmp_path / "canary"
    root.mkdir()
    canary.write_bytes(b"someone's file\n")
    (root / ".lock").symlink_to(canary)
    in_child(_lock_case(root, "symbolic link"))
    assert canary.read_bytes() == b"someone's file\n"


def test_dangling_lock_symlink_creates_nothing_outside(tmp_path, in_child):
    root, target = tmp_path / "ck", tmp_path / "would-be-created"
    root.mkdir()
    (root / ".lock").symlink_to(target)
    in_child(_lock_case(root, "symbolic link"))
    assert not target.exists() and not target.is_symlink()


def test_lock_hard_link_to_a_file_outside_leaves_it_untouched(tmp_path, in_child):
    root, canary = tmp_path / "ck", tmp_path / "canary"
    root.mkdir()
    canary.write_bytes(b"someone's file\n")
    os.link(canary, root / ".lock")
    in_child(_lock_case(root, "2 links"))
    assert canary.read_bytes() == b"someone's file\n"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_lock_that_is_not_a_file_is_refused(tmp_path, in_child, kind):
    root = tmp_path / "ck"
    root.mkdir()
    if kind == "directory":
        (root / ".lock").mkdir()
    else:
        os.mkfifo(root / ".lock")
    in_child(_lock_case(root, "a directory" if kind == "directory" else "a FIFO"))


# ------------------------------------------------------------------ files that are links


@pytest.mark.parametrize("name", ["MANIFEST", "manifest-r00000", DATA])
def test_a_file_that_is_a_symlink_outside_is_never_read(tmp_path, in_child, name):
    """The link points at an exact copy (CRCs match): restore still refuses it and falls back."""
    root = tmp_path / "ck"
    want = _two_steps(root)
    target = root / STEP2 / name
    outside = tmp_path / f"outside-{name}"
    shutil.copyfile(target, outside)
    target.unlink()
    target.symlink_to(outside)

    def case():
        step, got, fallbacks = _restore(root)
        assert step == 1 and got == want[1]
        assert fallbacks[0].startswith(f"skipping damaged checkpoint {STEP2}")
        assert "symbolic link" in fallbacks[0] and name in fallbacks[0]
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            verify(root / STEP2)

    in_child(case)


def test_a_data_file_linked_to_a_fifo_outside_is_not_opened(tmp_path, in_child):
    """Unknown content behind the link: it used to be opened (and a FIFO blocked forever)."""
    root = tmp_path / "ck"
    want = _two_steps(root)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (root / STEP2 / DATA).unlink()
    (root / STEP2 / DATA).symlink_to(fifo)

    def case():
        step, got, fallbacks = _restore(root)
        assert step == 1 and got == want[1] and "symbolic link" in fallbacks[0]

    in_child(case)


def test_latest_symlink_is_ignored_with_a_warning(tmp_path, in_child):
    root = tmp_path / "ck"
    want = _two_steps(root)
    outside = tmp_path / "latest-copy"
    shutil.copyfile(root / "latest", outside)
    (root / "latest").unlink()
    (root / "latest").symlink_to(outside)

    def case():
        step, got, fallbacks = _restore(root)
        assert step == 2 and got == want[2]
        assert len(fallbacks) == 1 and "ignoring the latest pointer" in fallbacks[0]
        assert "symbolic link" in fallbacks[0]

    in_child(case)


def test_abandoned_symlink_never_receives_checkpoints(tmp_path, in_child):
    """Saving a lower step moves higher ones into abandoned/: never into a link's target."""
    root, outside = tmp_path / "ck", tmp_path / "elsewhere"
    _two_steps(root)
    outside.mkdir()
    (root / "abandoned").symlink_to(outside)

    def case():
        model, opt = _objects(5)
        with gpumem.Checkpointer(root, keep=None) as ck:
            ck.save(1, model=model, optimizer=opt)
            with pytest.raises(CheckpointCorruptError, match="abandoned"):
                ck.wait()
            assert [i.step for i in ck.list()] == [1, 2]

    in_child(case)
    assert list(outside.iterdir()) == []
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    for _, path in step_dirs(root):
        verify(path)


def test_a_planted_tmp_symlink_is_removed_not_followed(tmp_path, in_child):
    root, outside = tmp_path / "ck", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (root / ".tmp-step-000000003").symlink_to(outside)

    def case():
        model, opt = _objects(3)
        with gpumem.Checkpointer(root) as ck:
            # the constructor's clean-up removed the link (not what it points to); plant it again
            (root / ".tmp-step-000000003").symlink_to(outside)
            ck.save(3, model=model, optimizer=opt)
            assert ck.wait() and [i.step for i in ck.list()] == [3]

    in_child(case)
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]


def test_a_step_directory_that_is_a_symlink_is_not_a_checkpoint(tmp_path, in_child):
    """A ``step-*`` link to a valid checkpoint elsewhere is neither restored, listed nor removed
    by retention (this part held before issue #14 too)."""
    root, other = tmp_path / "ck", tmp_path / "other"
    _two_steps(root)
    with gpumem.Checkpointer(other) as ck:
        ck.save(7, extra={"x": 1})
    (root / "step-000000007").symlink_to(other / "step-000000007")

    def case():
        step, _, _ = _restore(root)
        assert step == 2
        with gpumem.Checkpointer(root, keep=1) as ck:
            assert [i.step for i in ck.list()] == [1, 2]
            ck.save(3, extra={"y": 2})
        assert (other / "step-000000007").is_dir()

    in_child(case)


# ------------------------------------------------------------------ FIFOs, devices, huge files


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("name", ["MANIFEST", "manifest-r00000"])
def test_fifo_manifest_does_not_hang_restore(tmp_path, in_child, name):
    root = tmp_path / "ck"
    want = _two_steps(root)
    _replace_with_fifo(root / STEP2 / name)

    def case():
        step, got, fallbacks = _restore(root)
        assert step == 1 and got == want[1] and "a FIFO" in fallbacks[0]

    in_child(case)


def test_fifo_latest_does_not_hang_restore(tmp_path, in_child):
    root = tmp_path / "ck"
    want = _two_steps(root)
    _replace_with_fifo(root / "latest")

    def case():
        step, got, fallbacks = _restore(root)
        assert step == 2 and got == want[2] and "a FIFO" in fallbacks[0]
        assert cli(["ckpt", "ls", str(root)]) == 0

    in_child(case)


def test_fifo_as_an_empty_data_file_does_not_hang_restore(tmp_path, in_child):
    """A state of empty tensors has a 0-byte data file: a FIFO there has the same size."""
    root = tmp_path / "ck"
    with gpumem.Checkpointer(root, keep=None) as ck:
        ck.save(1, extra={"t": torch.ones(3)}, rng=False)
        ck.save(2, extra={"t": torch.empty(0)}, rng=False)
    assert (root / STEP2 / DATA).stat().st_size == 0
    _replace_with_fifo(root / STEP2 / DATA)

    def case():
        got: dict = {}
        with (
            pytest.warns(CheckpointFallbackWarning, match="a FIFO"),
            gpumem.Checkpointer(root) as ck,
        ):
            assert ck.restore(extra=got, rng=False) == 1
        assert torch.equal(got["t"], torch.ones(3))

    in_child(case)


def _char_device(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # what /dev/zero is
    except OSError as exc:
        pytest.skip(f"cannot create a device node here ({exc.strerror})")


@pytest.mark.parametrize("how", ["symlink", "node"])
@pytest.mark.parametrize("name", ["latest", "MANIFEST"])
def test_zero_device_is_never_read(tmp_path, in_child, how, name):
    """``/dev/zero`` never ends: it used to be read until the size cap (or memory) ran out."""
    root = tmp_path / "ck"
    want = _two_steps(root)
    path = root / name if name == "latest" else root / STEP2 / name
    path.unlink()
    if how == "symlink":
        path.symlink_to("/dev/zero")
    else:
        _char_device(path)

    def case():
        measured = _peak_rss_reset()
        before = _rss_kib("VmRSS")
        step, got, fallbacks = _restore(root)
        assert step == (2 if name == "latest" else 1) and got == want[step]
        assert ("symbolic link" if how == "symlink" else "character device") in fallbacks[0]
        assert not measured or _rss_kib("VmHWM") - before < 256 * 1024

    in_child(case)


def test_huge_sparse_latest_is_not_read(tmp_path, in_child):
    root = tmp_path / "ck"
    want = _two_steps(root)
    with open(root / "latest", "r+b") as f:
        f.truncate(3 << 29)  # 1.5 GiB, sparse: costs no disk
    if not _peak_rss_reset():
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")

    def case():
        _peak_rss_reset()
        before = _rss_kib("VmRSS")
        step, got, fallbacks = _restore(root)
        assert step == 2 and got == want[2] and "byte limit" in fallbacks[0]
        assert _rss_kib("VmHWM") - before < 256 * 1024  # it used to read 1.5 GiB

    in_child(case)


def test_huge_sparse_data_file_is_not_read(tmp_path, in_child):
    root = tmp_path / "ck"
    want = _two_steps(root)
    with open(root / STEP2 / DATA, "r+b") as f:
        f.truncate(3 << 29)

    def case():
        _peak_rss_reset()
        before = _rss_kib("VmRSS")
        step, got, fallbacks = _restore(root)
        assert step == 1 and got == want[1] and "truncated or damaged" in fallbacks[0]
        assert _rss_kib("VmHWM") - before < 256 * 1024

    in_child(case)


# ------------------------------------------------------------------ valid CRCs, hostile values


def _set(*keys, value):
    def mutate(body):
        node = body["state"]
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return mutate


HOSTILE_VALUES = {
    "python RNG state with a negative int": _set(
        "rng", "python", "__tuple__", 1, "__tuple__", 0, value=-5
    ),
    "python RNG state with a 400-digit int": _set(
        "rng", "python", "__tuple__", 1, "__tuple__", 3, value=10**400
    ),
    "an int where the optimizer state dict belongs": _set("optimizer", value=7),
    "an int where the model's mapping belongs": _set("model", value=7),
    "an int where the stateful objects' mapping belongs": _set("stateful", value=7),
    "a str where a stateful object's counter belongs": _set("stateful", "data", "pos", value="x"),
    "a list where extra's dict belongs": _set("extra", value=[1, 2]),
    "optimizer betas of the wrong type": _set("optimizer", "param_groups", 0, "betas", value="abc"),
    "optimizer lr as a list": _set("optimizer", "param_groups", 0, "lr", value=[1e-3]),
    "state for a parameter no group lists": _set("optimizer", "state", "__dict__", 0, 0, value=99),
    "an optimizer state tensor of another shape": lambda body: body["state"]["optimizer"]["state"][
        "__dict__"
    ][0][1].update(exp_avg=body["state"]["model"]["1.weight"]),
}


class Cursor:
    """A data position, restored through a stateful object's own load_state_dict."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"] + 0  # a str fails here, in the object's own code


def _two_steps_with_extra(root: Path) -> dict[int, list]:
    want = {}
    with gpumem.Checkpointer(root, keep=None) as ck:
        for step in (1, 2):
            model, opt = _objects(step)
            ck.save(
                step, model=model, optimizer=opt, extra={"e": step}, stateful={"data": Cursor(step)}
            )
            ck.wait()
            want[step] = _snapshot(model, opt)
    return want


@pytest.mark.parametrize("case_name", list(HOSTILE_VALUES))
def test_hostile_values_fall_back_and_touch_nothing(tmp_path, in_child, case_name):
    """Each used to raise OverflowError / TypeError from restore() (or load the model first)."""
    root = tmp_path / "ck"
    want = _two_steps_with_extra(root)
    _forge(root / STEP2, HOSTILE_VALUES[case_name])

    def case():
        extra: dict = {}
        cursor = Cursor()
        step, got, fallbacks = _restore(root, extra=extra, stateful={"data": cursor})
        assert step == 1 and got == want[1] and extra == {"e": 1} and cursor.pos == 1
        assert fallbacks[0].startswith(f"skipping damaged checkpoint {STEP2}")
        # without fallback (path=): the error names the step, and nothing was touched
        model, opt = _objects(42)
        before = _snapshot(model, opt)
        extra, cursor = {"mine": 0}, Cursor(5)
        with gpumem.Checkpointer(root) as ck, pytest.raises(CheckpointCorruptError):
            ck.restore(
                model=model,
                optimizer=opt,
                extra=extra,
                stateful={"data": cursor},
                path=root / STEP2,
            )
        assert _snapshot(model, opt) == before and extra == {"mine": 0} and cursor.pos == 5

    in_child(case)


@pytest.mark.parametrize("created", [b"1e400", b"1" * 400, b"-1", b"253402300800"])
def test_hostile_created_time_breaks_nothing(tmp_path, in_child, capsys, created):
    root = tmp_path / "ck"
    _two_steps(root)
    main, _ = read_manifest(root / STEP2 / "MANIFEST")
    main["created"] = "CREATED"
    payload = json.dumps(main, separators=(",", ":")).encode().replace(b'"CREATED"', created)
    (root / STEP2 / "MANIFEST").write_bytes(_framed(payload))

    def case():
        with pytest.raises(CheckpointCorruptError, match="created"):
            verify(root / STEP2)
        with gpumem.Checkpointer(root) as ck:
            assert [i.step for i in ck.list()] == [1] and ck.latest().step == 1
        assert cli(["ckpt", "ls", str(root)]) == 0
        assert cli(["ckpt", "verify", str(root)]) == 1

    in_child(case)


# ------------------------------------------------------------------ another class


def test_optimizer_of_another_class_is_a_state_error(tmp_path, in_child):
    root = tmp_path / "ck"
    _two_steps(root)

    def case():
        model, _ = _objects(3)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = _snapshot(model, sgd)
        with (
            gpumem.Checkpointer(root) as ck,
            pytest.raises(CheckpointStateError, match=r"AdamW optimizer.*is a SGD"),
        ):
            ck.restore(model=model, optimizer=sgd)
        assert _snapshot(model, sgd) == before

    in_child(case)


def test_scheduler_of_another_class_is_a_state_error(tmp_path, in_child):
    root = tmp_path / "ck"
    model, opt = _objects(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    with gpumem.Checkpointer(root) as ck:
        ck.save(1, model=model, optimizer=opt, scheduler=sched)

    def case():
        model, opt = _objects(2)
        other = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        before = _snapshot(model, opt), other.state_dict()
        with (
            gpumem.Checkpointer(root) as ck,
            pytest.raises(CheckpointStateError, match=r"StepLR scheduler.*ExponentialLR"),
        ):
            ck.restore(model=model, optimizer=opt, scheduler=other)
        assert (_snapshot(model, opt), other.state_dict()) == before

    in_child(case)


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
        model, opt = _objects(1)
        with gpumem.Checkpointer(root) as ck:
            with pytest.warns(CheckpointPointerWarning, match="step 1 is committed"):
                st = ck.save(1, model=model, optimizer=opt)
                assert ck.wait() is True
            assert st.committed and st.status.startswith("committed; latest not updated")
        step, got, fallbacks = _restore(root)
        assert step == 1 and got == _snapshot(model, opt) and "latest pointer" in fallbacks[0]

    in_child(case)


def test_guard_exits_with_the_requeue_code_when_only_latest_failed(tmp_path, in_child):
    root = tmp_path / "ck"
    root.mkdir()
    _block_latest(root)

    def case():
        model, opt = _objects(1)
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
    _two_steps(root)
    (root / "abandoned").write_text("not a directory")

    def case():
        model, opt = _objects(1)
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
    want = _two_steps(tmp_path)
    (tmp_path / ".tmp-step-000000009").mkdir()  # a crashed save's leftover: left alone

    def case():
        with gpumem.Checkpointer(tmp_path) as writer:  # holds the lock
            (tmp_path / ".tmp-step-000000009").mkdir()
            with gpumem.Checkpointer(tmp_path, read_only=True, lock_timeout_s=0) as ro:
                assert ro.read_only
                model, opt = _objects(0)
                assert ro.restore(model=model, optimizer=opt) == 2
                assert _snapshot(model, opt) == want[2]
                with pytest.raises(CheckpointStateError, match="read_only=True"):
                    ro.save(3, model=model)
            assert (tmp_path / ".tmp-step-000000009").is_dir()
            writer.save(3, extra={"x": 1})

    in_child(case)


def _nobody_can_enter(path: Path) -> None:
    path.chmod(0o755)
    for parent in path.parents:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            pytest.skip(f"{parent} is not searchable by other users")


def test_a_directory_without_write_permission_restores_read_only(in_child):
    """EACCES: restore works, said once; save() is refused with the errno. Root ignores
    permission bits, so a root run drops to uid 65534 (nobody) in the child."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-ro-", dir="/tmp"))
    try:
        _nobody_can_enter(root)
        want = _two_steps(root)
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
            model, opt = _objects(9)
            assert ck.restore(model=model, optimizer=opt) == 2
            assert _snapshot(model, opt) == want[2]
            with pytest.raises(CheckpointIOError, match="save\\(\\) is refused") as info:
                ck.save(3, model=model)
            assert info.value.errno == errno.EACCES
            ck.close()

        in_child(case)
    finally:
        for p in [root, *root.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(root, ignore_errors=True)


def test_an_os_error_while_reading_is_raised_not_skipped(in_child):
    """EACCES on a data file of the newest step is the operating system's error, not damage:
    CheckpointIOError with errno and path, no silent fallback to the older step, nothing
    touched (it used to be CheckpointCorruptError, and restore took step 1 with a warning)."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-eacces-", dir="/tmp"))
    try:
        _nobody_can_enter(root)
        _two_steps(root)
        for p in [root, *root.rglob("*")]:
            p.chmod(0o777 if p.is_dir() else 0o666)
        (root / STEP2 / DATA).chmod(0o000)

        def case():
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            model, opt = _objects(9)
            before = _snapshot(model, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("error", CheckpointFallbackWarning)
                with gpumem.Checkpointer(root) as ck, pytest.raises(CheckpointIOError) as info:
                    ck.restore(model=model, optimizer=opt)
            assert info.value.errno == errno.EACCES
            assert info.value.filename == str(root / STEP2 / DATA)
            assert _snapshot(model, opt) == before

        in_child(case)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_read_only_mount_restores_read_only(tmp_path):
    """EROFS, for real: the directory bind-mounted read-only in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    _two_steps(tmp_path)
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
    model, _ = _objects(2)  # what step 2 saved
    assert out["weight"] == model[0].weight.flatten().tolist()
