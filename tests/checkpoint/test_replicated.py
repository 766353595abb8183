"""Checkpointer(..., replicated=True): DDP state written once in total, spread over the ranks.

One spawn of two gloo ranks (module fixture) holds the same model, optimizer and scheduler on both
ranks (same seed, same batches, as DDP keeps them) and saves it: without replication (reference),
and replicated in overlap and in blocking mode, restoring each on two ranks. The same spawn checks
the optimizer hook (owners wait, a rank that owns nothing does not), a flipped byte in a tensor
rank 1 holds (found by rank 0's own read), and what a replicated save refuses. The ranks write
what they saw as JSON; the tests below assert it, read the manifests, restore elastically on one
rank (this process) and on three, and forge hostile manifests for the new fields.

The model and its tensors, in save order, with bytes: model.0.weight 512, model.0.bias 32,
model.2.weight 128, model.2.bias 16, then AdamW's state per parameter (step 4, exp_avg and
exp_avg_sq as the parameter). Greedy, largest first to the least-loaded rank (ties: lower index,
lower rank) by hand: 512 (model.0.weight) -> r0, 512 (state.0.exp_avg) -> r1, 512
(state.0.exp_avg_sq) -> r0 (tie at 512), then every 128, 32 and 16 goes to r1 (1024 at most)
until 1024 = 1024 and state.3.exp_avg_sq (16) goes to r0 (tie), and the four 4-byte steps go to
r1: rank 0 holds 512 + 512 + 16 = 1040 bytes, rank 1 the other 1040 of the 2080.
"""

import contextlib
import json
import random
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_files import encode_manifest, read_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointStateError, verify
from gpumem.checkpoint.capture.replicated import assign_owners, split
from gpumem.checkpoint.capture.training_state import TrainingState, capture

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

STEP_DIR = "step-000000002"
OWNED_BY_0 = {"model.0.weight", "optimizer.state.0.exp_avg_sq", "optimizer.state.3.exp_avg_sq"}
REPLICATED = [
    ("model.0.weight", 512),
    ("model.0.bias", 32),
    ("model.2.weight", 128),
    ("model.2.bias", 16),
    *(
        (f"optimizer.state.{i}.{k}", 4 if k == "step" else n)
        for i, n in enumerate((512, 32, 128, 16))
        for k in ("step", "exp_avg", "exp_avg_sq")
    ),
]


# ------------------------------------------------------------------------------ the DDP-like job


def _setup(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):  # batch i is the same on every rank, as DDP's reduced one
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sched.step()


def _trained():
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 2)
    return model, opt, sched


def _snapshot(model, opt, sched) -> dict:
    """Every value as exact JSON (float32 -> float round-trips), so ranks and tests can compare."""
    sd = opt.state_dict()
    return json.loads(
        json.dumps(
            {
                "model": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
                "optimizer": {
                    f"{p}.{k}": v.flatten().tolist()
                    for p, s in sd["state"].items()
                    for k, v in s.items()
                },
                "groups": sd["param_groups"],
                "scheduler": sched.state_dict(),
            }
        )
    )


def _seed_rank(rank: int) -> None:
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)


def _rng() -> list:
    return [
        repr(random.getstate()),
        torch.get_rng_state().tolist(),
        np.random.get_state()[1].tolist(),
    ]


def _restore_fresh(ck, **kw) -> tuple[int, dict, dict]:
    model, opt, sched = _setup(99)
    _train(model, opt, sched, 1, start=50)  # other values everywhere, optimizer state included
    got: dict = {}
    step = ck.restore(model=model, optimizer=opt, scheduler=sched, extra=got, **kw)
    return step, _snapshot(model, opt, sched), got


def _worker(rank: int, world: int, root: str) -> None:
    import gpumem.checkpoint.stage.snapshot as job_mod

    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world
    )
    out: dict = {}
    try:
        torch.set_num_threads(1)
        model, opt, sched = _trained()
        _seed_rank(rank)
        extra = {"rank": rank, "noise": torch.full((3,), float(rank))}
        out["saved"], out["rng"] = _snapshot(model, opt, sched), _rng()
        with gpumem.Checkpointer(
            f"{root}/full"
        ) as ck:  # the reference: every rank writes everything
            ck.save(2, model=model, optimizer=opt, scheduler=sched, extra=extra)

        for mode in ("overlap", "blocking"):
            with gpumem.Checkpointer(
                f"{root}/{mode}", replicated=True, overlap=mode == "overlap"
            ) as ck:
                stats = ck.save(2, model=model, optimizer=opt, scheduler=sched, extra=extra)
                if (
                    mode == "overlap"
                ):  # the step right after save(): the hook holds it for the owner's copy
                    _train(model, opt, sched, 1, start=2)
                ck.wait()
                random.seed(1234)  # scramble the RNGs: restore must bring this rank's own back
                torch.manual_seed(1234)
                step, snap, got = _restore_fresh(ck)
                out[mode] = {
                    "mode": stats.mode,
                    "nbytes": stats.nbytes,
                    "step": step,
                    "restored": snap,
                    "rng": _rng(),
                    "extra_rank": got["rank"],
                    "noise": got["noise"].tolist(),
                }
                if (
                    mode == "overlap"
                ):  # continue from the restored state: the blocking save saves the same
                    model, opt, sched = _setup(99)
                    ck.restore(model=model, optimizer=opt, scheduler=sched)

        # the hook: rank 0 owns the only parameter (SGD without momentum keeps no state), rank 1
        # owns nothing deferred; the background copy is slowed, so a hook that waits shows it
        real_copy = job_mod.copy_pieces

        def slow_copy(*a, **kw):
            if threading.current_thread().name == "gpumem-ckpt-copy":
                time.sleep(0.3)
            return real_copy(*a, **kw)

        torch.manual_seed(5)
        lin = nn.Linear(4, 1, bias=False)
        sgd = torch.optim.SGD(lin.parameters(), lr=0.5)
        lin(torch.ones(2, 4)).sum().backward()
        before = lin.weight.detach().clone()
        job_mod.copy_pieces = slow_copy
        try:
            with gpumem.Checkpointer(f"{root}/hook", replicated=True) as ck:
                stats = ck.save(1, model=lin, optimizer=sgd, rng=False)
                sgd.step()  # mutates the weight: only after rank 0's copy of it
                ck.wait()
                lin.weight.data.zero_()
                ck.restore(model=lin)
        finally:
            job_mod.copy_pieces = real_copy
        out["hook"] = {
            "mode": stats.mode,
            "waited": stats.hook_wait_s > 0,
            "restored_pre_step": torch.equal(lin.weight, before),
        }

        # a byte flipped in rank 1's copy of model.2.weight: both ranks fall back to step 1, and
        # rank 0 names the tensor itself (it read it from rank 1's data file)
        with gpumem.Checkpointer(f"{root}/flip", keep=None, replicated=True) as ck:
            ck.save(1, model=model, optimizer=opt, scheduler=sched, extra=extra)
            ck.wait()
            at_one = _snapshot(model, opt, sched)
            _train(model, opt, sched, 1, start=3)
            ck.save(2, model=model, optimizer=opt, scheduler=sched, extra=extra)
            ck.wait()
            if rank == 1:
                shard, _ = read_manifest(Path(root, "flip", STEP_DIR, "manifest-r00001"))
                entry = next(t for t in shard["tensors"] if t["name"] == "model.2.weight")
                file, offset, _ = entry["extents"][0]
                with open(Path(root, "flip", STEP_DIR, file), "r+b") as f:
                    f.seek(offset + 5)
                    byte = f.read(1)[0]
                    f.seek(offset + 5)
                    f.write(bytes([byte ^ 0x10]))
            dist.barrier()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step, snap, _ = _restore_fresh(ck)
            out["flip"] = {
                "step": step,
                "at_step_1": snap == at_one,
                "warnings": [str(w.message) for w in caught],
            }

        # refused: replicas that differ (rank 1's learning rate), mixed replicated= arguments,
        # DTensors
        m2, o2, s2 = _trained()
        if rank == 1:
            o2.param_groups[0]["lr"] = 0.05
        out["refused"] = {}
        for name, replicated in (("diverged", True), ("mixed", rank == 0)):
            with gpumem.Checkpointer(f"{root}/{name}", replicated=replicated) as ck:
                ck.save(1, model=m2, optimizer=o2, scheduler=s2)
                try:
                    ck.wait()
                    out["refused"][name] = None
                except CheckpointStateError as exc:
                    out["refused"][name] = str(exc)
                out["refused"][name + "_steps"] = [i.step for i in ck.list()]
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        sharded = nn.Linear(4, 4)
        mesh = init_device_mesh("cpu", (world,))
        sharded.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        with gpumem.Checkpointer(f"{root}/dtensor", replicated=True) as ck:
            try:  # DTensor blocks are each rank's own; the plain bias is written once
                ck.save(1, model=sharded, rng=False)
                ck.wait()
                out["refused"]["dtensor"] = None
            except CheckpointStateError as exc:
                out["refused"]["dtensor"] = str(exc)
        dist.barrier()  # no rank tears its gloo pairs down while a peer still talks
    finally:
        Path(root, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicated")
    mp.spawn(_worker, args=(2, str(root)), nprocs=2, join=True)
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def _shards(step_dir: Path) -> list[dict]:
    return [read_manifest(step_dir / f"manifest-r{r:05d}")[0] for r in range(2)]


# ------------------------------------------------------------------------------ ownership


def test_assign_owners_by_hand():
    assert assign_owners([8, 4, 4, 2], 2) == [0, 1, 1, 0]
    # 10 -> r0; 7 -> r1; 6 -> r2; 5 -> r2 (6 < 7 < 10); 4 -> r1 (7 < 10, 11); 3 -> r0 (10 < 11 = 11)
    assert assign_owners([5, 10, 4, 7, 3, 6], 3) == [2, 0, 1, 1, 0, 2]
    assert assign_owners([5, 5, 5, 5], 3) == [
        0,
        1,
        2,
        0,
    ]  # ties: lower index first, to the lower rank
    assert assign_owners([0, 0], 2) == [0, 0]  # empty tensors add no load: both go to rank 0
    assert assign_owners([3, 1], 1) == [0, 0] and assign_owners([], 4) == []


def test_split_writes_each_replicated_tensor_once_and_the_own_state_everywhere():
    model, opt, sched = _trained()
    state = TrainingState(model=model, optimizer=opt, scheduler=sched, extra={"x": torch.ones(2)})
    table = capture(2, state).table
    assert (
        list(zip(table.names, (t.numel() * t.element_size() for t in table.tensors), strict=True))[
            :16
        ]
        == REPLICATED
    )
    assert table.replicated_count == 16
    parts = [split(table, r, 2) for r in range(2)]
    own = set(table.names[16:])
    assert own >= {"extra.x", "rng.torch"}
    for rank, (sub, rep) in enumerate(parts):
        assert rep.owners == {n: 0 if n in OWNED_BY_0 else 1 for n, _ in REPLICATED}
        held = {n for n in rep.owners if rep.owners[n] == rank}
        assert set(sub.names) == held | own and sub.names[-len(own) :] == table.names[16:]
        assert (
            sum(
                t.numel() * t.element_size()
                for n, t in zip(sub.names, sub.tensors, strict=True)
                if n in held
            )
            == 1040
        )
    sub, rep = split(table, 0, 1)
    assert sub.names == table.names and set(rep.owners.values()) == {0}


# ------------------------------------------------------------------------------ save


def test_replicated_tensors_are_written_once_in_the_greedy_split(run):
    root, _ = run
    full = _shards(root / "full" / STEP_DIR)
    sizes = dict(REPLICATED)
    for mode in ("overlap", "blocking"):
        step_dir = root / mode / STEP_DIR
        shards = _shards(step_dir)
        main, _ = read_manifest(step_dir / "MANIFEST")
        assert main["replicated"] is True and all(s["replicated"] is True for s in shards)
        assert (step_dir / "MANIFEST").read_bytes().startswith(b"gpumem-checkpoint 2 ")
        expected_owners = {n: 0 if n in OWNED_BY_0 else 1 for n in sizes}
        for rank, (shard, ref) in enumerate(zip(shards, full, strict=True)):
            assert shard["owners"] == expected_owners  # the whole map, in every shard
            held = {t["name"]: t["nbytes"] for t in shard["tensors"] if t["name"] in sizes}
            assert set(held) == {n for n, r in expected_owners.items() if r == rank}
            assert sum(held.values()) == 1040
            # the rank's own state (RNG states, extra.noise) is written by every rank, as before
            own = {t["name"]: t["nbytes"] for t in shard["tensors"] if t["name"] not in sizes}
            ref_own = {t["name"]: t["nbytes"] for t in ref["tensors"] if t["name"] not in sizes}
            assert own == ref_own and "extra.noise" in own
            assert sum(t["nbytes"] for t in ref["tensors"] if t["name"] in sizes) == 2080
            assert main["shards"][rank]["nbytes"] == 1040 + sum(own.values())
            # the non-tensor parts stay in every shard's tree
            assert shard["state"]["scheduler"] == ref["state"]["scheduler"]
            assert (
                shard["state"]["optimizer"]["param_groups"]
                == ref["state"]["optimizer"]["param_groups"]
            )
        full_main, _ = read_manifest(root / "full" / STEP_DIR / "MANIFEST")
        assert (
            sum(s["nbytes"] for s in full_main["shards"]) - sum(s["nbytes"] for s in main["shards"])
            == 2080
        )
        assert "replicated" not in full_main and "owners" not in full[0]
        assert verify(step_dir).replicated and not verify(root / "full" / STEP_DIR).replicated


def test_restore_on_two_ranks_is_bit_identical_with_each_ranks_own_state(run):
    root, ranks = run
    ref = _snapshot(*_trained())
    for rank, out in enumerate(ranks):
        assert (
            out["saved"] == ref
        )  # the replicas were identical (and this process computes the same)
        for mode in ("overlap", "blocking"):
            got = out[mode]
            assert got["mode"] == mode and got["step"] == 2
            assert (
                got["restored"] == out["saved"]
            )  # model, optimizer state, param_groups, scheduler
            assert (
                got["rng"] == out["rng"]
                and got["extra_rank"] == rank
                and got["noise"] == [float(rank)] * 3
            )
            # it staged what its shard holds: its 1040 bytes of replicated tensors plus its own
            # state
            main, _ = read_manifest(root / mode / STEP_DIR / "MANIFEST")
            assert got["nbytes"] == main["shards"][rank]["nbytes"]


def test_overlap_hook_waits_on_owners_only(run):
    _, ranks = run
    assert ranks[0]["hook"] == {"mode": "overlap", "waited": True, "restored_pre_step": True}
    assert ranks[1]["hook"] == {"mode": "overlap", "waited": False, "restored_pre_step": True}


def test_flipped_byte_in_rank_1s_tensor_is_found_by_rank_0(run):
    _, ranks = run
    for out in ranks:
        assert out["flip"]["step"] == 1 and out["flip"]["at_step_1"]
        (message,) = [
            w for w in out["flip"]["warnings"] if "skipping damaged checkpoint step-000000002" in w
        ]
        # each rank read the damaged bytes itself (not "damaged on another rank")
        assert (
            "data-r00001-0000.bin: tensor 'model.2.weight' bytes 0-128 fail their CRC32C" in message
        )


def test_refusals(run):
    _, ranks = run
    for out in ranks:
        refused = out["refused"]
        assert "rank 1's optimizer state differs from rank 0's" in refused["diverged"]
        assert "rank 1 saves with replicated=False, rank 0 with replicated=True" in refused["mixed"]
        assert refused["diverged_steps"] == refused["mixed_steps"] == []  # nothing committed
        assert refused["dtensor"] is None


# ------------------------------------------------------------------------------ restore elsewhere


def test_dtensor_state_with_replicated_true(run):
    """replicated=True with a DTensor weight: each rank writes its own block of it, the plain
    bias is written once (by its owner)."""
    root, _ = run
    step = root / "dtensor" / "step-000000001"
    info = verify(step)
    assert info.sharded and info.replicated
    bodies = _shards(step)
    blocks = [next(t for t in b["tensors"] if t["name"] == "model.weight") for b in bodies]
    assert [t["global"]["offsets"] for t in blocks] == [[0, 0], [2, 0]]
    holders = [
        r for r, b in enumerate(bodies) if any(t["name"] == "model.bias" for t in b["tensors"])
    ]
    assert len(holders) == 1 and bodies[0]["owners"] == {"model.bias": holders[0]}


def test_elastic_restore_on_one_rank(run):
    root, ranks = run
    state = random.getstate(), torch.get_rng_state(), np.random.get_state()
    try:
        with gpumem.Checkpointer(root / "blocking") as ck:  # another world size: the default
            step, snap, got = _restore_fresh(ck)
            assert _rng() == ranks[0]["rng"]  # rank 0's own state: saved rank 0 seeds rank 0
        assert step == 2 and snap == ranks[0]["saved"] and got["rank"] == 0
        # the damaged step 2 of "flip": this process reads rank 1's tensor itself and falls back
        damaged = pytest.warns(gpumem.CheckpointFallbackWarning, match="model.2.weight")
        with gpumem.Checkpointer(root / "flip") as ck, damaged:
            assert _restore_fresh(ck)[0] == 1
        with pytest.raises(
            CheckpointCorruptError, match=r"tensor 'model.2.weight' bytes 0-128 fail their CRC32C"
        ):
            verify(root / "flip" / STEP_DIR)
    finally:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
        np.random.set_state(state[2])


def _elastic_worker(rank: int, world: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous3", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        with gpumem.Checkpointer(f"{root}/overlap") as ck:
            step, snap, got = _restore_fresh(ck)
        Path(root, f"grown{rank}.json").write_text(
            json.dumps({"step": step, "restored": snap, "rank": got["rank"], "rng": _rng()})
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_elastic_restore_on_three_ranks(run):
    root, ranks = run
    mp.spawn(_elastic_worker, args=(3, str(root)), nprocs=3, join=True)
    for rank in range(3):
        got = json.loads((root / f"grown{rank}.json").read_text())
        src = ranks[rank % 2]  # rank 2 takes saved rank 0's own state
        assert got["step"] == 2 and got["restored"] == src["saved"]
        assert got["rank"] == rank % 2 and got["rng"] == src["rng"]


def test_cli_inspect_and_verify(run, capsys):
    from gpumem.cli import main

    root, _ = run
    assert main(["ckpt", "verify", str(root / "overlap")]) == 0
    assert "2 rank(s), replicated state written once" in capsys.readouterr().out
    assert main(["ckpt", "inspect", str(root / "overlap"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["replicated"] is True
    assert [(r["replicated_tensors"], r["replicated_nbytes"]) for r in info["ranks"]] == [
        (3, 1040),
        (13, 1040),
    ]
    assert main(["ckpt", "inspect", str(root / "overlap")]) == 0
    assert "written once (16 tensors, 2.03 KiB)" in capsys.readouterr().out


# ------------------------------------------------------------------------------ hostile manifests


def _forge(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint, let ``edit(main, shards, dst)`` change its manifests, and frame them
    again with valid CRCs (recorded in the main manifest), so only the new checks can object."""
    shutil.copytree(src, dst)
    main, _ = read_manifest(dst / "MANIFEST")
    shards = _shards(dst)
    edit(main, shards, dst)
    for rank, body in enumerate(shards):
        raw, crc = encode_manifest(body)
        (dst / f"manifest-r{rank:05d}").write_bytes(raw)
        main["shards"][rank]["crc32c"] = crc
        main["shards"][rank]["nbytes"] = sum(t["nbytes"] for t in body["tensors"])
    (dst / "MANIFEST").write_bytes(encode_manifest(main)[0])
    return dst


def _owner_out_of_range(main, shards, dst):
    shards[0]["owners"]["model.2.weight"] = 2


def _owned_tensor_missing(main, shards, dst):
    for s in shards:
        s["owners"]["model.ghost"] = 1


def _reference_nobody_holds(main, shards, dst):
    for s in shards:
        s["state"]["model"]["ghost"] = {"__tensor__": "model.ghost"}


def _tensor_in_two_shards(main, shards, dst):
    """Rank 1's shard gets a valid copy of model.0.weight (rank 0's), appended to its data file."""
    entry = next(t for t in shards[0]["tensors"] if t["name"] == "model.0.weight")
    file, offset, length = entry["extents"][0]
    data = (dst / file).read_bytes()[offset : offset + length]
    target = dst / "data-r00001-0000.bin"
    size = target.stat().st_size
    start = -(-size // 4096) * 4096
    with open(target, "ab") as f:
        f.write(bytes(start - size) + data)
    shards[1]["files"][target.name] = start + length
    shards[1]["tensors"].append({**entry, "extents": [[target.name, start, length]]})


def _scheduler_disagrees(main, shards, dst):
    shards[1]["state"]["scheduler"]["last_epoch"] += 1


def _owners_disagree(main, shards, dst):
    shards[1]["owners"]["model.ghost"] = 0  # valid in rank 1's shard alone


def _owners_without_flag(main, shards, dst):
    del shards[0]["replicated"]


def _main_not_replicated(main, shards, dst):
    del main["replicated"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (_owner_out_of_range, r"owner of tensor 'model.2.weight' is 2, not a rank in \[0, 1\]"),
        (
            _owned_tensor_missing,
            r"tensor 'model.ghost' is owned by this shard \(rank 1\) but missing from its tensors",
        ),
        (_reference_nobody_holds, r"refers to tensor 'model.ghost', which the table lacks"),
        (
            _tensor_in_two_shards,
            r"tensor 'model.0.weight' is listed here \(rank 1\) but owned by rank 0",
        ),
        (_scheduler_disagrees, r"rank 1's shard and rank 0's record different scheduler state"),
        (_owners_disagree, r"record other owners of the replicated tensor 'model.ghost'"),
        (_owners_without_flag, r"has field 'owners' but is not marked replicated"),
        (_main_not_replicated, r"marked replicated=True, the main manifest replicated=False"),
    ],
)
def test_hostile_replicated_manifests(run, tmp_path, edit, match):
    root, _ = run
    forged = _forge(root / "blocking" / STEP_DIR, tmp_path / STEP_DIR, edit)
    with pytest.raises(CheckpointCorruptError, match=match):
        verify(forged)
    if edit in (_scheduler_disagrees, _owners_disagree, _tensor_in_two_shards):
        # restore refuses too (rank 0's tree, checked against the shard it reads rank 1's tensors
        # from)
        with (
            gpumem.Checkpointer(tmp_path) as ck,
            pytest.raises(CheckpointCorruptError, match="rank 1"),
        ):
            ck.restore(model=_setup(1)[0], path=forged, rng=False)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.text(max_size=12)
    | st.sampled_from(["model.0.weight", "model.2.weight", "__tensor__"]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["model.0.weight", "model.0.bias", "owners", "replicated", "x"]),
            children,
            max_size=3,
        )
    ),
    max_leaves=8,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_replicated_fields_fail_cleanly(run, tmp_path_factory, data):
    root, _ = run
    rank = data.draw(st.sampled_from([0, 1]))
    field_ = data.draw(st.sampled_from(["owners", "replicated"]))

    def edit(main, shards, dst):
        body = shards[rank]
        if field_ == "owners" and data.draw(st.booleans()):
            name = data.draw(st.sampled_from(sorted(body["owners"])))
            body["owners"][name] = data.draw(json_values)
        else:
            body[field_] = data.draw(json_values)

    forged = _forge(root / "blocking" / STEP_DIR, tmp_path_factory.mktemp("fuzz") / STEP_DIR, edit)
    with contextlib.suppress(CheckpointError):
        verify(forged)


# ------------------------------------------------------------------------------ CUDA


def _cuda_worker(rank: int, world: int, root: str) -> None:
    import os

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts: deterministic GEMMs
    torch.use_deterministic_algorithms(True, warn_only=True)  # the replicas stay bit-identical
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous_cuda", rank=rank, world_size=world
    )
    try:

        def setup(seed):
            torch.manual_seed(seed)
            model = nn.Sequential(
                nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Linear(256, 8)
            ).cuda()
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train(model, opt, seed):
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).cuda()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        def host(model, opt) -> dict:
            sd = opt.state_dict()["state"]
            return {
                **{k: v.cpu().clone() for k, v in model.state_dict().items()},
                **{f"opt.{p}.{k}": v.cpu().clone() for p, s in sd.items() for k, v in s.items()},
            }

        model, opt = setup(0)
        for i in range(2):
            train(model, opt, i)
        saved = host(model, opt)
        with gpumem.Checkpointer(f"{root}/cuda", replicated=True, chunk_bytes=65536) as ck:
            stats = ck.save(2, model=model, optimizer=opt)
            train(model, opt, 2)  # right after save(): the hook fences the owner's side-stream copy
            ck.wait()
            model2, opt2 = setup(1)
            train(model2, opt2, 9)
            step = ck.restore(model=model2, optimizer=opt2, verify_loaded=True)
        got = host(model2, opt2)
        same = sorted(k for k in saved if torch.equal(saved[k], got[k]))
        on_gpu = all(v.is_cuda for v in model2.state_dict().values())
        Path(root, f"cuda{rank}.json").write_text(
            json.dumps(
                {
                    "mode": stats.mode,
                    "step": step,
                    "same": same,
                    "all": sorted(saved),
                    "on_gpu": on_gpu,
                }
            )
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_replicated_overlap_save_and_restore_on_two_ranks(tmp_path):
    """Both ranks on one GPU: device CRCs and side-stream copies of only the owned tensors, the
    optimizer hook for owners, restore reading the other rank's tensors, verify_loaded on the
    GPU."""
    mp.spawn(_cuda_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    shards = _shards(tmp_path / "cuda" / STEP_DIR)
    held = [{t["name"] for t in s["tensors"] if t["name"] in s["owners"]} for s in shards]
    assert (
        held[0]
        and held[1]
        and not held[0] & held[1]
        and held[0] | held[1] == set(shards[0]["owners"])
    )
    for rank in range(2):
        out = json.loads((tmp_path / f"cuda{rank}.json").read_text())
        assert out["mode"] == "overlap" and out["step"] == 2 and out["on_gpu"]
        assert out["same"] == out["all"]
    verify(tmp_path / "cuda" / STEP_DIR)
