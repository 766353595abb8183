"""Save/restore round trips: every kind of state, every mode, retention, pointers, fallbacks."""

import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_files import read_manifest
from trainlib import Setup, seed_all

import gpumem
from gpumem.checkpoint import (
    CheckpointCorruptError,
    CheckpointFallbackWarning,
    CheckpointStateError,
    verify,
)


def _state_equal(a: Setup, b: Setup) -> None:
    for (ka, va), (kb, vb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    assert a.sched.state_dict() == b.sched.state_dict()
    assert a.scaler.state_dict() == b.scaler.state_dict()
    assert a.sampler.state_dict() == b.sampler.state_dict()


@pytest.mark.parametrize(
    "mode, segment",
    [("overlap", 256 << 20), ("overlap", 8192), ("blocking", 8192), ("streaming", 256 << 20)],
)
def test_round_trip_every_kind_of_state(tmp_path, mode, segment):
    seed_all(0)
    a = Setup(init_seed=0)
    for _ in range(5):
        a.step()
    budget = (
        64 << 10 if mode == "streaming" else None
    )  # 64 KiB: the ~40 KiB state streams in 16 KiB slots
    ck = gpumem.Checkpointer(
        tmp_path,
        staging_bytes=budget,
        chunk_bytes=8192,
        overlap=(mode == "overlap"),
        segment_bytes=segment,
    )
    extra = {
        "epoch": 3,
        "tuple": (1, 2.5),
        "inf": float("-inf"),
        "ids": {7: "x", (1, 2): None},
        "blob": b"\x00\xff",
        "arr": np.arange(5, dtype=np.int32),
        "t": torch.arange(4.0),
    }
    seed_all(0)
    rng_before = (random.random(), np.random.rand(), torch.rand(3))  # what the saved RNGs draw next
    seed_all(0)
    stats = ck.save(5, **a.objects(), extra=extra)
    assert stats.mode == mode
    ck.wait()
    assert stats.durable_s >= stats.staged_s > 0

    seed_all(99)  # scramble every RNG: restore must bring them back
    b = Setup(init_seed=7)
    got: dict = {}
    assert ck.restore(**b.objects(), extra=got) == 5
    _state_equal(a, b)
    assert (random.random(), np.random.rand()) == rng_before[:2]
    assert torch.equal(torch.rand(3), rng_before[2])
    assert got["tuple"] == (1, 2.5) and math.isinf(got["inf"]) and got["inf"] < 0
    assert got["ids"] == {7: "x", (1, 2): None} and got["blob"] == b"\x00\xff"
    assert got["arr"].dtype == np.int32 and got["arr"].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(got["t"], torch.arange(4.0))
    files = sorted(p.name for p in Path(ck.latest().path).glob("data-*"))
    assert (len(files) > 1) == (mode == "streaming" or segment == 8192)
    ck.close()


def test_restored_tensors_own_their_memory(tmp_path):
    a = Setup()
    a.step()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, **a.objects())
    b = Setup(init_seed=3)
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.restore(**b.objects())
    exp_avg = b.opt.state_dict()["state"][0]["exp_avg"]
    assert exp_avg.untyped_storage().nbytes() == exp_avg.numel() * 4


def test_large_restored_tensors_own_page_aligned_memory(tmp_path):
    """From 1 MiB on, a tensor is read with O_DIRECT into memory of its own that starts on a page
    (its storage is at most a page larger than the tensor); it still owns it."""
    from gpumem.checkpoint.restore.files import DIRECT_MIN_BYTES

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight, a 2 KiB bias
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, model=model, optimizer=opt, rng=False)
        ck.wait()
        model2 = torch.nn.Linear(1024, 512)
        opt2 = torch.optim.AdamW(model2.parameters())
        assert ck.restore(model=model2, optimizer=opt2) == 1
    state = opt2.state_dict()["state"]
    big = [state[0]["exp_avg"], state[0]["exp_avg_sq"]]
    assert all(t.numel() * 4 >= DIRECT_MIN_BYTES for t in big)
    for t in big:
        assert t.data_ptr() % 4096 == 0
        assert t.numel() * 4 <= t.untyped_storage().nbytes() < t.numel() * 4 + 4096
    assert len({t.untyped_storage().data_ptr() for t in big}) == 2  # one storage each
    assert torch.equal(big[0], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(model2.weight, model.weight)


def test_awkward_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "c64": torch.randn(2, 2, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "sliced": base[:, 1:4],
        "big": torch.randn(5000),  # spans chunks of 8 KiB
    }
    tied = torch.randn(10)
    tensors["tied_a"] = tied
    tensors["tied_b"] = tied
    with gpumem.Checkpointer(tmp_path, chunk_bytes=8192) as ck:
        ck.save(0, extra=tensors, rng=False)
        ck.wait()
        shard, _ = read_manifest(Path(ck.latest().path) / "manifest-r00000")
        assert len(shard["tensors"]) == len(tensors) - 1  # the tied pair is stored once
        big = next(t for t in shard["tensors"] if t["name"] == "extra.big")
        assert len(big["crc32c"]) == math.ceil(5000 * 4 / 8192)
        got: dict = {}
        ck.restore(extra=got, rng=False)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert got["tied_a"] is got["tied_b"]


def test_streaming_splits_one_large_tensor(tmp_path):
    t = torch.randn(100_000)  # 400 KB through a 64 KiB budget: 32 KiB slots, ~13 files
    with gpumem.Checkpointer(tmp_path, staging_bytes=64 << 10, chunk_bytes=4096) as ck:
        stats = ck.save(1, extra={"t": t}, rng=False)
        ck.wait()
        assert stats.mode == "streaming"
        shard, _ = read_manifest(Path(ck.latest().path) / "manifest-r00000")
        (entry,) = shard["tensors"]
        assert len(entry["extents"]) == math.ceil(400_000 / 32768)
        assert all(length == 32768 for _, _, length in entry["extents"][:-1])
        got: dict = {}
        ck.restore(extra=got)
    assert torch.equal(got["t"], t)


def test_non_contiguous_tensor_larger_than_a_slot_is_refused(tmp_path):
    t = torch.randn(200, 200).t()
    with (
        gpumem.Checkpointer(tmp_path, staging_bytes=64 << 10, chunk_bytes=4096) as ck,
        pytest.raises(CheckpointStateError, match="not contiguous and larger than a staging slot"),
    ):
        ck.save(1, extra={"t": t})


def test_unsupported_values_name_the_key(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointStateError, match=r"extra\.fn: a function cannot be stored"):
            ck.save(1, extra={"fn": lambda: 0})
        with pytest.raises(CheckpointStateError, match="step=-1"):
            ck.save(-1)


def test_retention_keeps_newest_and_list_latest(tmp_path):
    a = Setup()
    with gpumem.Checkpointer(tmp_path, keep=2) as ck:
        assert ck.latest() is None and ck.list() == []
        for step in (1, 2, 3, 4):
            a.step()
            ck.save(step, **a.objects())
        ck.wait()
        assert [i.step for i in ck.list()] == [3, 4]
        assert ck.latest().step == 4 and ck.latest().nbytes > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "latest",
        "step-000000003",
        "step-000000004",
    ]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(5, extra={"v": 1})
        ck.save(5, extra={"v": 2})
        ck.wait()
        got: dict = {}
        assert ck.restore(extra=got) == 5 and got["v"] == 2
        assert [i.step for i in ck.list()] == [5]


def test_restore_empty_directory_returns_none(tmp_path):
    with gpumem.Checkpointer(tmp_path / "none") as ck:
        assert ck.restore(model=torch.nn.Linear(2, 2)) is None


def _corrupt_data(path: Path, offset: int = 10) -> None:
    data_file = next(path.glob("data-*"))
    raw = bytearray(data_file.read_bytes())
    raw[offset] ^= 0x01
    data_file.write_bytes(bytes(raw))


def test_fallback_to_older_checkpoint_with_warning(tmp_path):
    a = Setup()
    with gpumem.Checkpointer(tmp_path, keep=3) as ck:
        a.step()
        ck.save(1, **a.objects())
        ck.wait()
        snapshot = {k: v.clone() for k, v in a.model.state_dict().items()}
        a.step()
        ck.save(2, **a.objects())
        ck.wait()
        _corrupt_data(tmp_path / "step-000000002")
        b = Setup(init_seed=5)
        with pytest.warns(CheckpointFallbackWarning, match="step-000000002"):
            assert ck.restore(**b.objects()) == 1
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, snapshot[k])


def test_all_corrupt_raises_and_leaves_objects_untouched(tmp_path):
    a = Setup()
    a.step()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, **a.objects())
        ck.wait()
    _corrupt_data(tmp_path / "step-000000001", offset=100)
    b = Setup(init_seed=5)
    b.step()
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    opt_before = b.opt.state_dict()
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt_before["state"].items()}
    rng_before = torch.get_rng_state().clone()
    sampler_before = b.sampler.state_dict()
    with gpumem.Checkpointer(tmp_path) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointFallbackWarning)
        with pytest.raises(CheckpointCorruptError) as info:
            ck.restore(**b.objects())
    assert "data-r00000-0000.bin" in str(info.value) and info.value.tensor
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, before[k])
    for i, s in b.opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k])
    assert (
        torch.equal(torch.get_rng_state(), rng_before) and b.sampler.state_dict() == sampler_before
    )


def test_mismatched_model_is_refused_before_touching_anything(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, model=torch.nn.Linear(4, 4))
        ck.wait()
        other = torch.nn.Linear(4, 3)
        before = other.weight.clone()
        with pytest.raises(CheckpointStateError, match="shape"):
            ck.restore(model=other)
        assert torch.equal(other.weight, before)
        with pytest.raises(CheckpointStateError, match="missing keys"):
            ck.restore(model=torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_damaged_latest_pointer_warns_and_scans(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, extra={"v": 1})
        ck.wait()
        (tmp_path / "latest").write_text(
            '{"step": 1, "path": "step-000000001", "manifest_crc32c": 1}'
        )
        with pytest.warns(CheckpointFallbackWarning, match="stale"):
            assert ck.restore() == 1
        (tmp_path / "latest").write_text("garbage")
        with pytest.warns(CheckpointFallbackWarning, match="damaged checkpoint pointer"):
            assert ck.restore() == 1


def test_compiled_and_plain_models_restore_from_each_other(tmp_path):
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    compiled = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), backend="eager"
    )
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    with gpumem.Checkpointer(tmp_path / "a") as ck:
        ck.save(1, model=compiled)
        ck.wait()
        ck.restore(model=plain)
    for (_, p), (_, c) in zip(
        plain.state_dict().items(), compiled.state_dict().items(), strict=True
    ):
        assert torch.equal(p, c)
    torch.nn.init.zeros_(plain[0].weight)
    with gpumem.Checkpointer(tmp_path / "b") as ck:
        ck.save(1, model=plain)
        ck.wait()
        ck.restore(model=compiled)
    assert torch.equal(compiled._orig_mod[0].weight, torch.zeros(4, 4))


def test_data_parallel_wrapped_and_plain_models_restore_from_each_other(tmp_path):
    """DataParallel / DDP add a ``module.`` prefix to every key; the checkpoint stores the plain
    keys, so wrapped, compiled-and-wrapped and plain models share checkpoints."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    wrapped = torch.nn.DataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    with gpumem.Checkpointer(tmp_path / "a") as ck:
        ck.save(1, model=wrapped)
        ck.wait()
        info = ck.latest()
        names = [
            t["name"] for t in read_manifest(Path(info.path) / "manifest-r00000")[0]["tensors"]
        ]
        assert names and not any(n.startswith("model.module.") for n in names)
        assert ck.restore(model=plain) == 1
    for (_, p), (_, w) in zip(
        plain.state_dict().items(), wrapped.state_dict().items(), strict=True
    ):
        assert torch.equal(p, w)
    torch.nn.init.zeros_(plain[0].weight)
    both = torch.compile(
        torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))),
        backend="eager",
    )
    with gpumem.Checkpointer(tmp_path / "b") as ck:
        ck.save(1, model=plain)
        ck.wait()
        assert ck.restore(model=both) == 1
    assert torch.equal(both._orig_mod.module[0].weight, torch.zeros(4, 4))


def test_verify_loaded_checks_every_restored_tensor_and_names_damage(tmp_path, monkeypatch):
    """restore(verify_loaded=True) re-checks the tensors where they live after loading (host
    here: the native CRC; on a GPU the Triton kernel, tests/checkpoint/test_gpu.py)."""
    from gpumem.checkpoint.capture.training_state import TrainingState, capture
    from gpumem.checkpoint.restore import plain as state_mod
    from gpumem.checkpoint.restore.plain import restore_tree, verify_loaded
    from gpumem.checkpoint.storage.directory import load_info
    from gpumem.checkpoint.storage.safe_fs import Dir

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(tmp_path, chunk_bytes=4096) as ck:
        ck.save(1, model=model, optimizer=opt, rng=False)
        ck.wait()
        model2 = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4)
        )
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        assert ck.restore(model=model2, optimizer=opt2, verify_loaded=True, rng=False) == 1
        # every tensor of the model and the optimizer state was checked (the 0-d AdamW steps too)
        path = ck.latest().path
        with Dir.open(path) as step:
            _, shard, _ = restore_tree(step, load_info(step), 0)
        table = capture(1, TrainingState(model=model2, optimizer=opt2, rng=False)).table
        assert verify_loaded(Path(path), shard, table) == len(shard.tensors) == len(table.names)
        real_apply = state_mod.apply

        def damaging_apply(tree, state, **kw):
            real_apply(tree, state, **kw)
            with torch.no_grad():
                state.optimizer.state[state.model[0].weight]["exp_avg_sq"].view(-1)[7] += 1.0

        monkeypatch.setattr(state_mod, "apply", damaging_apply)
        with pytest.raises(
            CheckpointCorruptError,
            match=r"optimizer\.state\.0\.exp_avg_sq' on cpu holds bytes 0-4096",
        ):
            ck.restore(model=model2, optimizer=opt2, verify_loaded=True, rng=False)
        ck.restore(model=model2, optimizer=opt2, rng=False)  # off by default: nothing re-checked


def test_verify_public_and_lazy_names(tmp_path):
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(3, extra={"x": torch.ones(3)})
    info = gpumem.checkpoint.verify(tmp_path / "step-000000003")
    assert info.step == 3 and info.world_size == 1 and info.nbytes > 12
    assert gpumem.CheckpointCorruptError is CheckpointCorruptError
    with pytest.raises(CheckpointCorruptError, match="not a checkpoint directory"):
        verify(tmp_path / "nope")


def test_closed_checkpointer_refuses_work(tmp_path):
    ck = gpumem.Checkpointer(tmp_path)
    ck.close()
    with pytest.raises(gpumem.CheckpointError, match="closed"):
        ck.save(1)


def test_back_to_back_saves_are_queued_never_dropped(tmp_path):
    t = torch.randn(300_000)
    saved = []
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        for step in range(5):
            t += 1
            saved.append(t.clone())
            ck.save(
                step, extra={"t": t}, rng=False
            )  # each waits for the previous one (back-pressure)
        assert ck.in_flight is None or ck.in_flight.step == 4
        ck.wait()
        assert [i.step for i in ck.list()] == [0, 1, 2, 3, 4]
        got: dict = {}
        ck.restore(extra=got, path=tmp_path / "step-000000002")
    assert torch.equal(got["t"], saved[2])
