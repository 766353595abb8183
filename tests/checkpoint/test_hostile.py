"""A checkpoint directory is input (issue #14): one built by an attacker cannot make gpumem write,
read or hang outside it. Symbolic links for every kind of file and directory, FIFOs, devices,
huge sparse files, and a ``.lock`` that points at someone's file whose bytes must stay unchanged.

Every case runs in a forked child with a 20 s limit (``in_child``), so a read that blocks on a
FIFO fails the test instead of hanging the suite. Each was found against the code before issue
#14 (symlinked lock files truncated, FIFOs hung restore, /dev/zero was read until memory ran out).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from ckpt_files import step_dirs
from hostile_lib import (
    DATA,
    STEP2,
    objects,
    peak_rss_reset,
    restore,
    rss_kib,
    two_steps,
)

import gpumem
from gpumem.checkpoint import (
    CheckpointCorruptError,
    CheckpointFallbackWarning,
    verify,
)
from gpumem.cli import main as cli

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
    want = two_steps(root)
    target = root / STEP2 / name
    outside = tmp_path / f"outside-{name}"
    shutil.copyfile(target, outside)
    target.unlink()
    target.symlink_to(outside)

    def case():
        step, got, fallbacks = restore(root)
        assert step == 1 and got == want[1]
        assert fallbacks[0].startswith(f"skipping damaged checkpoint {STEP2}")
        assert "symbolic link" in fallbacks[0] and name in fallbacks[0]
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            verify(root / STEP2)

    in_child(case)


def test_a_data_file_linked_to_a_fifo_outside_is_not_opened(tmp_path, in_child):
    """Unknown content behind the link: it used to be opened (and a FIFO blocked forever)."""
    root = tmp_path / "ck"
    want = two_steps(root)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (root / STEP2 / DATA).unlink()
    (root / STEP2 / DATA).symlink_to(fifo)

    def case():
        step, got, fallbacks = restore(root)
        assert step == 1 and got == want[1] and "symbolic link" in fallbacks[0]

    in_child(case)


def test_latest_symlink_is_ignored_with_a_warning(tmp_path, in_child):
    root = tmp_path / "ck"
    want = two_steps(root)
    outside = tmp_path / "latest-copy"
    shutil.copyfile(root / "latest", outside)
    (root / "latest").unlink()
    (root / "latest").symlink_to(outside)

    def case():
        step, got, fallbacks = restore(root)
        assert step == 2 and got == want[2]
        assert len(fallbacks) == 1 and "ignoring the latest pointer" in fallbacks[0]
        assert "symbolic link" in fallbacks[0]

    in_child(case)


def test_abandoned_symlink_never_receives_checkpoints(tmp_path, in_child):
    """Saving a lower step moves higher ones into abandoned/: never into a link's target."""
    root, outside = tmp_path / "ck", tmp_path / "elsewhere"
    two_steps(root)
    outside.mkdir()
    (root / "abandoned").symlink_to(outside)

    def case():
        model, opt = objects(5)
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
        model, opt = objects(3)
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
    two_steps(root)
    with gpumem.Checkpointer(other) as ck:
        ck.save(7, extra={"x": 1})
    (root / "step-000000007").symlink_to(other / "step-000000007")

    def case():
        step, _, _ = restore(root)
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
    want = two_steps(root)
    _replace_with_fifo(root / STEP2 / name)

    def case():
        step, got, fallbacks = restore(root)
        assert step == 1 and got == want[1] and "a FIFO" in fallbacks[0]

    in_child(case)


def test_fifo_latest_does_not_hang_restore(tmp_path, in_child):
    root = tmp_path / "ck"
    want = two_steps(root)
    _replace_with_fifo(root / "latest")

    def case():
        step, got, fallbacks = restore(root)
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
    want = two_steps(root)
    path = root / name if name == "latest" else root / STEP2 / name
    path.unlink()
    if how == "symlink":
        path.symlink_to("/dev/zero")
    else:
        _char_device(path)

    def case():
        measured = peak_rss_reset()
        before = rss_kib("VmRSS")
        step, got, fallbacks = restore(root)
        assert step == (2 if name == "latest" else 1) and got == want[step]
        assert ("symbolic link" if how == "symlink" else "character device") in fallbacks[0]
        assert not measured or rss_kib("VmHWM") - before < 256 * 1024

    in_child(case)


def test_huge_sparse_latest_is_not_read(tmp_path, in_child):
    root = tmp_path / "ck"
    want = two_steps(root)
    with open(root / "latest", "r+b") as f:
        f.truncate(3 << 29)  # 1.5 GiB, sparse: costs no disk
    if not peak_rss_reset():
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")

    def case():
        peak_rss_reset()
        before = rss_kib("VmRSS")
        step, got, fallbacks = restore(root)
        assert step == 2 and got == want[2] and "byte limit" in fallbacks[0]
        assert rss_kib("VmHWM") - before < 256 * 1024  # it used to read 1.5 GiB

    in_child(case)


def test_huge_sparse_data_file_is_not_read(tmp_path, in_child):
    root = tmp_path / "ck"
    want = two_steps(root)
    with open(root / STEP2 / DATA, "r+b") as f:
        f.truncate(3 << 29)

    def case():
        peak_rss_reset()
        before = rss_kib("VmRSS")
        step, got, fallbacks = restore(root)
        assert step == 1 and got == want[1] and "truncated or damaged" in fallbacks[0]
        assert rss_kib("VmHWM") - before < 256 * 1024

    in_child(case)
