"""Restore is all or nothing under every error (issue #14): a manifest whose CRCs are valid but
whose values are hostile falls back to the older checkpoint and touches nothing; an optimizer or
scheduler of another class is a CheckpointStateError naming both; an operating-system error is a
CheckpointIOError, raised, never a silent fallback. Each case runs in a forked child with a 20 s
limit (``in_child``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from ckpt_files import read_manifest
from hostile_lib import (
    DATA,
    STEP2,
    forge,
    framed,
    nobody_can_enter,
    objects,
    restore,
    snapshot,
    two_steps,
)

import gpumem
from gpumem.checkpoint import (
    CheckpointCorruptError,
    CheckpointFallbackWarning,
    CheckpointIOError,
    CheckpointStateError,
    verify,
)
from gpumem.cli import main as cli

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
            model, opt = objects(step)
            ck.save(
                step, model=model, optimizer=opt, extra={"e": step}, stateful={"data": Cursor(step)}
            )
            ck.wait()
            want[step] = snapshot(model, opt)
    return want


@pytest.mark.parametrize("case_name", list(HOSTILE_VALUES))
def test_hostile_values_fall_back_and_touch_nothing(tmp_path, in_child, case_name):
    """Each used to raise OverflowError / TypeError from restore() (or load the model first)."""
    root = tmp_path / "ck"
    want = _two_steps_with_extra(root)
    forge(root / STEP2, HOSTILE_VALUES[case_name])

    def case():
        extra: dict = {}
        cursor = Cursor()
        step, got, fallbacks = restore(root, extra=extra, stateful={"data": cursor})
        assert step == 1 and got == want[1] and extra == {"e": 1} and cursor.pos == 1
        assert fallbacks[0].startswith(f"skipping damaged checkpoint {STEP2}")
        # without fallback (path=): the error names the step, and nothing was touched
        model, opt = objects(42)
        before = snapshot(model, opt)
        extra, cursor = {"mine": 0}, Cursor(5)
        with gpumem.Checkpointer(root) as ck, pytest.raises(CheckpointCorruptError):
            ck.restore(
                model=model,
                optimizer=opt,
                extra=extra,
                stateful={"data": cursor},
                path=root / STEP2,
            )
        assert snapshot(model, opt) == before and extra == {"mine": 0} and cursor.pos == 5

    in_child(case)


@pytest.mark.parametrize("created", [b"1e400", b"1" * 400, b"-1", b"253402300800"])
def test_hostile_created_time_breaks_nothing(tmp_path, in_child, capsys, created):
    root = tmp_path / "ck"
    two_steps(root)
    main, _ = read_manifest(root / STEP2 / "MANIFEST")
    main["created"] = "CREATED"
    payload = json.dumps(main, separators=(",", ":")).encode().replace(b'"CREATED"', created)
    (root / STEP2 / "MANIFEST").write_bytes(framed(payload))

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
    two_steps(root)

    def case():
        model, _ = objects(3)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = snapshot(model, sgd)
        with (
            gpumem.Checkpointer(root) as ck,
            pytest.raises(CheckpointStateError, match=r"AdamW optimizer.*is a SGD"),
        ):
            ck.restore(model=model, optimizer=sgd)
        assert snapshot(model, sgd) == before

    in_child(case)


def test_scheduler_of_another_class_is_a_state_error(tmp_path, in_child):
    root = tmp_path / "ck"
    model, opt = objects(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    with gpumem.Checkpointer(root) as ck:
        ck.save(1, model=model, optimizer=opt, scheduler=sched)

    def case():
        model, opt = objects(2)
        other = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        before = snapshot(model, opt), other.state_dict()
        with (
            gpumem.Checkpointer(root) as ck,
            pytest.raises(CheckpointStateError, match=r"StepLR scheduler.*ExponentialLR"),
        ):
            ck.restore(model=model, optimizer=opt, scheduler=other)
        assert (snapshot(model, opt), other.state_dict()) == before

    in_child(case)


def test_an_os_error_while_reading_is_raised_not_skipped(in_child):
    """EACCES on a data file of the newest step is the operating system's error, not damage:
    CheckpointIOError with errno and path, no silent fallback to the older step, nothing
    touched (it used to be CheckpointCorruptError, and restore took step 1 with a warning)."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-eacces-", dir="/tmp"))
    try:
        nobody_can_enter(root)
        two_steps(root)
        for p in [root, *root.rglob("*")]:
            p.chmod(0o777 if p.is_dir() else 0o666)
        (root / STEP2 / DATA).chmod(0o000)

        def case():
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            model, opt = objects(9)
            before = snapshot(model, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("error", CheckpointFallbackWarning)
                with gpumem.Checkpointer(root) as ck, pytest.raises(CheckpointIOError) as info:
                    ck.restore(model=model, optimizer=opt)
            assert info.value.errno == errno.EACCES
            assert info.value.filename == str(root / STEP2 / DATA)
            assert snapshot(model, opt) == before

        in_child(case)
    finally:
        shutil.rmtree(root, ignore_errors=True)
