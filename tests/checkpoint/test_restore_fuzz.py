"""Restore is all or nothing under hostile manifests (issue #14): a fuzzer rewrites one field of
a valid checkpoint's manifest (or removes it) and recomputes every CRC, so only the values are
hostile, then restores a directory that also holds an older, good checkpoint. Whatever the
mutation, only a CheckpointError may escape; either the mutated step was acceptable and is
restored, or the older one is restored with a CheckpointFallbackWarning, or (the checkpoint no
longer fits the objects) CheckpointStateError is raised and the objects are bit for bit as they
were. The peak memory of each restore stays bounded. 2,000 examples in CI, 20,000 with
--runslow.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import google_crc32c
import pytest
import torch
from ckpt_files import encode_manifest, read_manifest
from hostile_lib import peak_rss_reset, rss_kib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointFallbackWarning, CheckpointStateError

STEP2 = "step-000000002"
MAX_PEAK_KIB = 64 * 1024  # each restore reads a few KiB; 64 MiB is room for torch's own caches


class Cursor:
    def __init__(self, pos: int = 0):
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def _objects(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model(torch.randn(6, 8)).sum().backward()
    opt.step()
    sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched, "stateful": {"data": Cursor()}}


def _snapshot(objs: dict, extra: dict) -> list:
    def flat(x):
        if isinstance(x, torch.Tensor):
            return ("t", str(x.dtype), tuple(x.shape), x.detach().numpy().tobytes())
        if isinstance(x, dict):
            return sorted((str(k), flat(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [type(x).__name__, *(flat(v) for v in x)]
        return (type(x).__name__, repr(x))

    return [
        flat(objs["model"].state_dict()),
        flat(objs["optimizer"].state_dict()),
        flat(objs["scheduler"].state_dict()),
        objs["stateful"]["data"].pos,
        flat(extra),
    ]


class Setup:
    """A directory with two good checkpoints, and what restoring the older one gives."""

    def __init__(self, root: Path):
        self.root = root
        with gpumem.Checkpointer(root, keep=None) as ck:
            for step in (1, 2):
                objs = _objects(step)
                objs["stateful"]["data"].pos = step
                ck.save(step, **objs, extra={"epoch": step, "name": f"run{step}"})
                ck.wait()
        self.shard, _ = read_manifest(root / STEP2 / "manifest-r00000")
        self.main, _ = read_manifest(root / STEP2 / "MANIFEST")
        self.raw = {n: (root / STEP2 / n).read_bytes() for n in ("manifest-r00000", "MANIFEST")}
        self.ck = gpumem.Checkpointer(root, keep=None)
        self.template = _objects(7)  # the restore targets, copied for each example
        self.fresh = _snapshot(self.template, {})
        self._objects: dict | None = None
        objs, extra = self.objects(), {}
        assert self.ck.restore(**objs, extra=extra, path=root / "step-000000001") == 1
        self.step1 = _snapshot(objs, extra)
        self.used()

    def objects(self) -> dict:
        """Restore targets as the template (one deep copy keeps the optimizer on the model's
        parameters and the scheduler on the optimizer); reused until a restore changed them."""
        if self._objects is None:
            self._objects = copy.deepcopy(self.template)
        return self._objects

    def used(self) -> None:
        """The last objects were restored into: the next example gets a fresh copy."""
        self._objects = None

    def write(self, shard: dict | None, main: dict | None) -> None:
        """Write step 2's manifests (the given bodies, CRCs recomputed; None: the original)."""
        d = self.root / STEP2
        if shard is None:
            (d / "manifest-r00000").write_bytes(self.raw["manifest-r00000"])
            shard_crc = None
        else:
            raw, shard_crc = encode_manifest(shard)
            (d / "manifest-r00000").write_bytes(raw)
        if main is None and shard_crc is None:
            (d / "MANIFEST").write_bytes(self.raw["MANIFEST"])
            return
        body = json.loads(json.dumps(self.main)) if main is None else main
        if shard_crc is not None and isinstance(body.get("shards"), list):
            first = body["shards"][0] if body["shards"] else None
            if isinstance(first, dict):
                first["crc32c"] = shard_crc
        (d / "MANIFEST").write_bytes(_frame(body))


def _frame(body) -> bytes:
    """encode_manifest for any body, huge ints included (framing and CRC as the format's)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    prefix = f"gpumem-checkpoint 1 {len(payload):012d} ".encode()
    return prefix + f"{google_crc32c.value(prefix + payload):08x}\n".encode() + payload


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.ck.close()


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([10**400, -(10**400), 2**63, 2**64, -1, 0, 1, 2**32, 4096])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.sampled_from(
        [
            "model.0.weight",
            "optimizer.state.0.exp_avg",
            "rng.torch",
            "float32",
            "int64",
            "data-r00000-0000.bin",
            "../escape",
            "step-000000001",
            "inf",
            "AdamW",
            "SGD",
        ]
    )
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    *("__tensor__", "__tuple__", "__dict__", "__float__", "__bytes__"),
                    *("__ndarray__", "pos", "lr", "betas", "params", "state", "param_groups"),
                    *("python", "x"),
                ]
            ),
            children,
            max_size=3,
        )
    ),
    max_leaves=8,
)


@st.composite
def mutations(draw, setup: Setup):
    """(shard body, main body): one of them with one field replaced or removed."""
    in_main = draw(st.integers(0, 9)) == 0
    body = json.loads(json.dumps(setup.main if in_main else setup.shard))
    # a subtree first (each section equally likely: the RNG state alone has 600+ leaves)
    roots = [(k,) for k in body] + ([("state", k) for k in body["state"]] if not in_main else [])
    root = draw(st.sampled_from(roots))
    path = draw(st.sampled_from(list(_paths(_get(body, root), root))))
    parent, last = _get(body, path[:-1]), path[-1]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[last]
    else:
        parent[last] = draw(values)
    return (None, body) if in_main else (body, None)


def _one(setup: Setup, shard, main) -> str:
    """Restore after one mutation; returns the outcome, asserting what each outcome requires."""
    setup.write(shard, main)
    objs, extra = setup.objects(), {}
    measured = peak_rss_reset()
    before = rss_kib("VmRSS")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            step = setup.ck.restore(**objs, extra=extra)
        except CheckpointStateError:
            step = None  # no longer fits the objects: raised, nothing touched
    peak = rss_kib("VmHWM") - before
    if measured:
        assert peak < MAX_PEAK_KIB, f"restore took {peak} KiB of memory"
    skipped = [
        str(w.message)
        for w in seen
        if issubclass(w.category, CheckpointFallbackWarning)
        and str(w.message).startswith(f"skipping damaged checkpoint {STEP2}")
    ]
    got = _snapshot(objs, extra)
    if step is None:
        assert got == setup.fresh, "a refused restore changed the objects"
        return "refused"  # and they stay the targets of the next example
    setup.used()
    if step == 1:
        assert skipped, "fell back without a warning"
        assert got == setup.step1, "the older checkpoint was not restored exactly"
        return "fell back"
    assert step == 2 and not skipped
    return "accepted"


def _fuzz(setup: Setup, examples: int) -> None:
    seen: dict[str, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run(data):
        shard, main = data.draw(mutations(setup))
        outcome = _one(setup, shard, main)
        seen[outcome] = seen.get(outcome, 0) + 1

    try:
        run()
    finally:
        setup.write(None, None)
    # the fuzzer reached every outcome (a mutation that is harmless, one that is damage, one
    # that no longer fits), so the assertions above were exercised
    assert set(seen) == {"accepted", "fell back", "refused"}, seen


def test_hostile_manifests_restore_all_or_nothing(setup):
    _fuzz(setup, 2000)


@pytest.mark.slow
def test_hostile_manifests_restore_all_or_nothing_long(setup):
    _fuzz(setup, 20000)


def test_the_unmutated_directory_restores_the_newer_step(setup):
    assert _one(setup, None, None) == "accepted"
