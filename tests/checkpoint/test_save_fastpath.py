"""The per-save fast paths of Checkpointer.save(): a cached layout, alignment gaps zeroed only when
they may hold stale bytes, cached host byte views, cheaper tensor naming, long-lived threads.

Each cache is checked against an independent reference: a fresh plan_staging(), the bytes of the
data files read back and compared by hand (tensor bytes where the manifest puts them, zeros
everywhere else), verify(), and a restore.
"""

import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_files import read_manifest

import gpumem
import gpumem.checkpoint.save as save_mod
import gpumem.checkpoint.stage.pieces as plan_mod
import gpumem.checkpoint.stage.snapshot as snapshot_mod
from gpumem.arena import HostArena
from gpumem.checkpoint import CheckpointCorruptError, CheckpointStateError, verify
from gpumem.checkpoint.capture.codec import TensorTable
from gpumem.checkpoint.capture.training_state import TrainingState, capture
from gpumem.checkpoint.stage.host_copy import HostViews
from gpumem.checkpoint.stage.pieces import PlanCache, plan_staging


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check_files(path: str, expected: dict[str, torch.Tensor]) -> None:
    """Read every data file of a checkpoint: each tensor's bytes where its extents say, and zero
    bytes everywhere else (the alignment padding)."""
    root = Path(path)
    shard, _ = read_manifest(root / "manifest-r00000")
    files = {name: bytearray((root / name).read_bytes()) for name in shard["files"]}
    covered = {name: np.zeros(len(data), dtype=bool) for name, data in files.items()}
    assert {t["name"] for t in shard["tensors"]} == set(expected)
    for entry in shard["tensors"]:
        got = b"".join(bytes(files[f][off : off + n]) for f, off, n in entry["extents"])
        assert got == _raw(expected[entry["name"]]), entry["name"]
        for f, off, n in entry["extents"]:
            covered[f][off : off + n] = True
    for name, data in files.items():
        gaps = np.frombuffer(bytes(data), dtype=np.uint8)[~covered[name]]
        assert not gaps.any(), f"{name}: non-zero padding"


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _pieces(plan):
    return [(p.index, p.src_offset, p.nbytes, p.batch, p.offset) for p in plan.pieces]


# ---- PlanCache ----


def test_plan_cache_reuses_only_an_identical_layout():
    ts = [torch.randn(1000), torch.randn(3, 7), torch.tensor(2.0), torch.randn(40, 40)]
    names = ["a", "b", "c", "d"]
    args = (1 << 20, 4096, 4096, 8192)
    cache = PlanCache()
    first = cache.plan(ts, names, *args)
    ref = plan_staging(ts, names, *args)
    assert (
        _pieces(first) == _pieces(ref)
        and first.bases == ref.bases
        and first.batch_sizes == ref.batch_sizes
    )
    first.pieces[0].crc = torch.zeros(1, dtype=torch.int64)  # a save fills in its CRCs...
    again = cache.plan([t.clone() for t in ts], names, *args)  # same sizes, other tensors
    assert again.layout_id == first.layout_id and _pieces(again) == _pieces(first)
    assert (
        again.pieces[0] is not first.pieces[0] and again.pieces[0].crc is None
    )  # ...never into the next one

    def changed(tensors, *a):
        plan = cache.plan(tensors, names, *a)
        ref = plan_staging(tensors, names, *a)
        assert (
            _pieces(plan) == _pieces(ref)
            and plan.bases == ref.bases
            and plan.streaming == ref.streaming
        )
        return plan.layout_id

    ids = {first.layout_id}
    grown = [torch.randn(1001), *ts[1:]]  # one element more
    ids.add(changed(grown, *args))
    transposed = [*ts[:3], ts[3].t()]  # same size, no longer contiguous
    ids.add(changed(transposed, *args))
    ids.add(changed(ts[:3], *args))  # a tensor fewer
    ids.add(changed(ts, 24576, 4096, 4096, 8192))  # a smaller budget: streaming
    assert len(ids) == 5
    back = cache.plan(ts, names, *args)  # the first layout again: planned anew, under a new id
    assert back.layout_id not in ids and _pieces(back) == _pieces(first)


def test_plan_cache_keeps_nothing_from_a_failed_plan():
    cache = PlanCache()
    ok = [torch.randn(100)]
    cache.plan(ok, ["a"], 1 << 20, 4096, 4096, 8192)
    bad = [torch.randn(200, 200).t()]  # non-contiguous and larger than a 32 KiB streaming slot
    for _ in range(2):
        with pytest.raises(
            CheckpointStateError, match="not contiguous and larger than a staging slot"
        ):
            cache.plan(bad, ["t"], 64 << 10, 4096, 4096, 8192)


def test_save_plans_once_until_the_tensors_change(tmp_path, monkeypatch):
    plans = _counting(monkeypatch, plan_mod, "plan_staging")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(0, model=model, optimizer=opt, blocking=True, rng=False)
        ck.save(1, model=model, optimizer=opt, blocking=True, rng=False)
        assert len(plans) == 1
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # the optimizer gains state: more tensors
        ck.save(2, model=model, optimizer=opt, blocking=True, rng=False)
        ck.save(3, model=model, optimizer=opt, blocking=True, rng=False)
        assert len(plans) == 2
        with torch.no_grad():  # a parameter changes shape
            model[1].bias = torch.nn.Parameter(torch.randn(5))
        ck.save(4, model=model, blocking=True, rng=False)
        assert len(plans) == 3
        ck.wait()
        for info in ck.list():
            verify(info.path)
        _check_files(ck.latest().path, {f"model.{k}": v for k, v in model.state_dict().items()})


# ---- alignment gaps ----


def _tensors(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        f"t{i}": torch.randint(1, 255, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }


# Layout A: t0 at 0 (1000 bytes, gap to 4096), t1 at 4096. Layout B: t0 takes 6000 bytes, so its
# gap (6000-8192) lies where A staged t1's bytes: stale unless B zeroes it.
_A, _B = (1000, 5000), (6000, 5000)


@pytest.mark.parametrize("blocking", [True, False])
def test_gaps_are_zeroed_once_per_layout_and_stay_zero(tmp_path, monkeypatch, blocking):
    zeroed = _counting(monkeypatch, snapshot_mod, "zero_padding")
    with gpumem.Checkpointer(tmp_path, keep=None, chunk_bytes=4096) as ck:
        ck.prepare(nbytes=1 << 20, background=False)  # one arena for every save below
        arena = ck._staging.arena
        steps = [("A", _A), ("A", _A), ("B", _B), ("B", _B), ("A", _A)]
        counts = []
        for step, (_, sizes) in enumerate(steps):
            state = _tensors(sizes, seed=step)
            opt = torch.optim.SGD(
                [torch.nn.Parameter(torch.zeros(1))], lr=0.1
            )  # overlap needs an optimizer
            ck.save(step, optimizer=opt, extra=state, rng=False, blocking=blocking)
            ck.wait()
            counts.append(len(zeroed))
            _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})
            verify(ck.latest().path)
        assert ck._staging.arena is arena
    # one zeroing pass (one batch) per layout change; repeats of a layout skip it
    assert counts == [1, 1, 2, 2, 3]


def test_skipping_the_gaps_wrongly_would_be_caught(tmp_path, monkeypatch):
    """The check above can fail: with zeroing switched off after layout A, B's stale gap is
    found by the by-hand read and by verify()."""
    with gpumem.Checkpointer(tmp_path, keep=None, chunk_bytes=4096) as ck:
        ck.prepare(nbytes=1 << 20, background=False)
        ck.save(0, extra=_tensors(_A, 0), rng=False, blocking=True)
        ck.wait()
        monkeypatch.setattr(snapshot_mod, "zero_padding", lambda *a: None)
        state = _tensors(_B, 1)
        ck.save(1, extra=state, rng=False, blocking=True)
        ck.wait()
        with pytest.raises(AssertionError, match="non-zero padding"):
            _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})
        with pytest.raises(CheckpointCorruptError, match="padding"):
            verify(ck.latest().path)


def test_a_new_arena_is_zeroed_even_with_the_same_layout(tmp_path, monkeypatch):
    zeroed = _counting(monkeypatch, snapshot_mod, "zero_padding")
    with gpumem.Checkpointer(tmp_path, keep=None, chunk_bytes=4096) as ck:
        ck.save(0, extra=_tensors(_A, 0), rng=False, blocking=True)
        ck.wait()
        ck.prepare(nbytes=1 << 20, background=False)  # installs a larger arena
        state = _tensors(_A, 1)
        ck.save(1, extra=state, rng=False, blocking=True)
        ck.wait()
        assert len(zeroed) == 2
        _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})


def test_streaming_always_zeroes_and_padding_stays_zero(tmp_path, monkeypatch):
    zeroed = _counting(monkeypatch, snapshot_mod, "zero_padding")
    # 16 KiB budget: two 8 KiB slots that batches of other layouts take in turn
    with gpumem.Checkpointer(tmp_path, keep=None, staging_bytes=16 << 10, chunk_bytes=4096) as ck:
        before = 0
        layouts = [(1000, 5000, 300, 7000), (1000, 5000, 300, 7000), (6000, 100, 5000, 2000)]
        for step, sizes in enumerate(layouts):
            state = _tensors(sizes, seed=step)
            assert ck.save(step, extra=state, rng=False).mode == "streaming"
            ck.wait()
            assert len(zeroed) > before  # every streaming save zeroes each batch
            before = len(zeroed)
            _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})
            verify(ck.latest().path)
        # back to a state that fits: resident layout, zeroed although the arena was used
        state = _tensors((500, 700), seed=9)  # its gap (500-4096) held streamed bytes
        assert ck.save(9, extra=state, rng=False, blocking=True).mode == "blocking"
        ck.wait()
        assert len(zeroed) == before + 1
        _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})


def test_a_failed_save_forgets_the_zeroed_gaps(tmp_path, monkeypatch):
    zeroed = _counting(monkeypatch, snapshot_mod, "zero_padding")
    with gpumem.Checkpointer(tmp_path, keep=None, chunk_bytes=4096) as ck:
        ck.save(0, extra=_tensors(_A, 0), rng=False, blocking=True)
        ck.wait()
        real = snapshot_mod.copy_pieces

        def failing(*args, **kwargs):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(snapshot_mod, "copy_pieces", failing)
        with pytest.raises(gpumem.checkpoint.CheckpointError, match="copy failed"):
            ck.save(1, extra=_tensors(_A, 1), rng=False, blocking=True)
        monkeypatch.setattr(snapshot_mod, "copy_pieces", real)
        n = len(zeroed)
        state = _tensors(_A, 2)
        ck.save(2, extra=state, rng=False, blocking=True)
        ck.wait()
        assert len(zeroed) == n + 1
        _check_files(ck.latest().path, {f"extra.{k}": v for k, v in state.items()})


# ---- host byte views ----


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 5).to(torch.bfloat16),
        torch.tensor([True, False]),
        torch.randn(4, dtype=torch.complex64),
        torch.tensor(7, dtype=torch.int64),
        torch.randn(2, 1, 3)[:, :, :],
    ],
)
def test_host_views_show_the_tensor_bytes(t):
    view = HostViews().get(t)
    assert view.dtype == np.uint8 and view.ndim == 1 and view.tobytes() == _raw(t)


def test_host_views_are_reused_for_one_save_and_hold_no_memory():
    a, b = torch.randn(100), torch.randn(50)
    first = HostViews()
    va, vb = first.get(a), first.get(b)
    second = HostViews(first)
    assert second.get(a) is va  # same memory, same size: found again
    head = second.get(a[:10])  # same address, other size: another view
    assert head is not va and head.tobytes() == _raw(a[:10])
    third = HostViews(second)
    assert third.get(a) is va
    assert third.get(b) is not vb and third.get(b).tobytes() == _raw(
        b
    )  # b skipped a save: made anew
    gone = torch.randn(1000)
    ref = weakref.ref(gone)
    keep = HostViews().get(gone)
    del gone
    assert ref() is None and keep is not None  # the view did not keep the tensor alive


def test_replaced_parameter_memory_is_read_from_its_new_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(0, model=model, blocking=True, rng=False)
        with torch.no_grad():
            model.weight.data = torch.randn(32, 32)  # same size, new memory
            model.bias.add_(1.0)  # same memory, new values
        ck.save(1, model=model, blocking=True, rng=False)
        ck.wait()
        _check_files(ck.latest().path, {f"model.{k}": v for k, v in model.state_dict().items()})
        fresh = torch.nn.Linear(32, 32)
        assert ck.restore(model=fresh, rng=False) == 1
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_copy_in_takes_flat_uint8_arrays_as_they_are_and_checks_the_rest():
    data = np.arange(64, dtype=np.uint8)
    ro = data.copy()
    ro.setflags(write=False)
    with HostArena(4096, pinned=False) as arena:
        arena.copy_in([data, ro[:8], data[::1]], [0, 100, np.int64(200)])
        got = arena.view(0, 264).numpy()
        assert got[:64].tolist() == list(range(64)) and got[100:108].tolist() == list(range(8))
        assert got[200:264].tolist() == list(range(64))
        with pytest.raises(ValueError, match=r"sources\[1\] is not C-contiguous"):
            arena.copy_in([data, data[::2]], [0, 0])
        with pytest.raises(TypeError, match=r"offsets\[0\] must be an int"):
            arena.copy_in([data], [1.0])
        with pytest.raises(ValueError, match="does not fit"):
            arena.copy_in([data], [4090])


# ---- tensor table ----


def test_names_are_sanitized_and_unique():
    table = TensorTable()
    ts = [torch.randn(2) for _ in range(6)]
    assert table.add(ts[0], "a/b", False) == "a_b"
    assert table.add(ts[1], "a\\b", False) == "a_b~1"
    assert table.add(ts[2], "a_b~2", False) == "a_b~2"
    assert table.add(ts[3], "a_b", False) == "a_b~3"  # the first free suffix from the position on
    assert table.add(ts[4], "x\0" + "y" * 1000, True) == "x_" + "y" * 898
    assert table.add(ts[5], "", False) == "tensor"
    assert table.names == ["a_b", "a_b~1", "a_b~2", "a_b~3", "x_" + "y" * 898, "tensor"]
    assert table.deferred == [False, False, False, False, True, False] and not table.has_cuda


def test_clashing_suffix_is_skipped():
    table = TensorTable()
    assert table.add(torch.randn(1), "n", False) == "n"
    assert table.add(torch.randn(1), "n~2", False) == "n~2"
    assert table.add(torch.randn(1), "n", False) == "n~3"  # "n~2" is taken: next free suffix


def test_views_are_stored_once_only_when_identical():
    x = torch.arange(10.0)
    c = torch.randn(4, dtype=torch.complex64)
    table = TensorTable()
    names = [
        table.add(t, p, False)
        for t, p in [
            (x, "x"),
            (x.view(10), "same"),
            (x[0:5], "lo"),
            (x[5:10], "hi"),
            (x.view(2, 5), "reshaped"),
            (c, "c"),
            (c.conj(), "c_conj"),
            (torch.empty(0), "e1"),
            (torch.empty(0), "e2"),
        ]
    ]
    assert names == ["x", "x", "lo", "hi", "reshaped", "c", "c_conj", "e1", "e2"]
    conj = table.tensors[table.names.index("c_conj")]
    assert not conj.is_conj() and torch.equal(conj, c.conj().resolve_conj())


def test_conjugate_and_negative_views_round_trip(tmp_path):
    c = torch.randn(3, 4, dtype=torch.complex64)
    extra = {
        "c": c,
        "conj": c.conj(),
        "neg_imag": c.conj().imag,
        "bf16": torch.randn(5).to(torch.bfloat16),
    }
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(0, extra=extra, rng=False, blocking=True)
        ck.wait()
        got: dict = {}
        ck.restore(extra=got, rng=False)
    for k, v in extra.items():
        assert torch.equal(got[k], v.resolve_conj().resolve_neg()), k
    assert torch.equal(got["conj"], c.conj().resolve_conj())


def test_capture_marks_cuda_presence():
    model = torch.nn.Linear(2, 2)
    table = capture(0, TrainingState(model=model, rng=False)).table
    assert not table.has_cuda and table.deferred == [True, True]


# ---- threads ----


def test_saves_reuse_two_threads_which_end_at_close(tmp_path, monkeypatch):
    served = {"persist": [], "copy": []}
    real_persist, real_copy = save_mod.Save._persist, snapshot_mod.Snapshot._copier_main

    def persist_main(self):
        served["persist"].append(threading.current_thread())
        return real_persist(self)

    def copier_main(self, copied):
        served["copy"].append(threading.current_thread())
        return real_copy(self, copied)

    monkeypatch.setattr(save_mod.Save, "_persist", persist_main)
    monkeypatch.setattr(snapshot_mod.Snapshot, "_copier_main", copier_main)
    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "1")  # the copy beside training, on any machine
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ck = gpumem.Checkpointer(tmp_path, keep=2)
    for step in range(4):
        ck.save(step, model=model, optimizer=opt, blocking=step % 2 == 0)
        want = model.weight.detach().clone()
        opt.step()  # waits for an overlap copy (pre-step hook)
        ck.wait()
    assert (
        len(served["persist"]) == 4 and len(set(served["persist"])) == 1
    )  # one thread served every save
    assert len(served["copy"]) == 2 and len(set(served["copy"])) == 1  # the two overlap saves
    threads = [served["persist"][0], served["copy"][0]]
    assert threading.current_thread() not in threads and all(t.is_alive() for t in threads)
    ck.close()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    fresh = torch.nn.Linear(16, 16)
    with gpumem.Checkpointer(tmp_path) as ck2:
        assert ck2.restore(model=fresh) == 3
    assert torch.equal(fresh.weight, want)


def test_only_a_save_that_writes_beside_its_copy_cuts_its_state_into_small_files(
    tmp_path, monkeypatch
):
    """42 MiB of host state, segment_bytes 256 MiB: an overlap save copied beside training and
    a blocking save write 16 MiB files (file b beside the copy of batch b+1); one copied at once
    (no core free) writes one file, as its write follows the whole copy and every file only
    adds its creation and sync to the CPU taken from training. Each restores exactly."""
    from gpumem.checkpoint import workers

    monkeypatch.delenv("GPUMEM_SAVE_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = torch.nn.Linear(1870, 1870)  # 3.5 M parameters: 14 MiB, 42 MiB with AdamW's state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1870)).sum().backward()
    opt.step()
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    files = {}
    try:
        for case, free, blocking in (
            ("beside", True, False),
            ("at once", False, False),
            ("blocking", True, True),
        ):
            cores = threads + (1 if free else 0)
            monkeypatch.setattr(workers.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
            with gpumem.Checkpointer(tmp_path / case, keep=1) as ck:
                st = ck.save(1, model=model, optimizer=opt, blocking=blocking)
                want = {k: v.clone() for k, v in model.state_dict().items()}
                ck.wait()
                assert st.committed
            step = tmp_path / case / "step-000000001"
            files[case] = sorted(p.name for p in step.glob("data-*.bin"))
            fresh = torch.nn.Linear(1870, 1870)
            with gpumem.Checkpointer(tmp_path / case) as ck:
                assert ck.restore(model=fresh) == 1
            assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    finally:
        torch.set_num_threads(threads)
    assert len(files["beside"]) == -(-state // (16 << 20))  # 3 files of at most 16 MiB
    assert files["blocking"] == files["beside"]
    assert files["at once"] == ["data-r00000-0000.bin"]


def test_a_blocking_save_writes_its_first_file_while_it_copies_the_next(tmp_path, monkeypatch):
    """A blocking save of host state in several files writes file 0 beside the copy of batch 1
    (time to durable ~ the first batch's copy + the write, not the whole copy + the write):
    the copy of batch 1 waits here until the first write has begun, which never happens if the
    writes wait for the whole copy (the wait then times out)."""
    import gpumem.checkpoint.storage.commit as commit_mod

    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "1")
    torch.manual_seed(0)
    model = torch.nn.Linear(1870, 1870)  # 14 MiB of parameters: one 16 MiB file and a rest
    writing = threading.Event()
    copies: list[bool] = []
    real_copy, real_write = snapshot_mod.copy_pieces, commit_mod.write_batches

    def copy(*args, **kwargs):
        if len(copies) == 1:  # batch 1: the write of file 0 must be under way already
            copies.append(writing.wait(timeout=60))
        else:
            copies.append(True)
        return real_copy(*args, **kwargs)

    def write(tmp, snap, rank, batches, direct):
        writing.set()
        return real_write(tmp, snap, rank, batches, direct)

    monkeypatch.setattr(snapshot_mod, "copy_pieces", copy)
    monkeypatch.setattr(commit_mod, "write_batches", write)
    with gpumem.Checkpointer(tmp_path, keep=1, overlap=False, segment_bytes=8 << 20) as ck:
        st = ck.save(1, model=model)
        ck.wait()
        assert st.committed
    assert len(copies) >= 2 and all(copies)  # one copy call per batch; batch 1's found a write
    fresh = torch.nn.Linear(1870, 1870)
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.restore(model=fresh) == 1
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_overlap_copies_at_once_when_no_core_is_free(tmp_path, monkeypatch):
    # torch on every core, GPUMEM_SAVE_THREADS unset: the overlap save copies the host tensors
    # inside save() (no copier thread, no hook wait), CRCs computed by that copy, and restores
    # exactly; with a core left free it copies beside training again
    from gpumem.checkpoint import workers

    monkeypatch.delenv("GPUMEM_SAVE_THREADS", raising=False)
    copier_ran = []
    real_copy = snapshot_mod.Snapshot._copier_main
    monkeypatch.setattr(
        snapshot_mod.Snapshot,
        "_copier_main",
        lambda self, copied: (copier_ran.append(1), real_copy(self, copied)),
    )
    threads = torch.get_num_threads()
    try:
        for free in (False, True):
            cores = threads + (1 if free else 0)
            monkeypatch.setattr(workers.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
            assert workers.copy_beside_training() is free
            copier_ran.clear()
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 64)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            with gpumem.Checkpointer(tmp_path / str(free), keep=1) as ck:
                st = ck.save(1, model=model, optimizer=opt)
                want = {k: v.clone() for k, v in model.state_dict().items()}
                opt.step()
                ck.wait()
                assert st.mode == "overlap" and st.committed
                assert bool(copier_ran) is free
                if not free:
                    assert st.hook_wait_s == 0.0 and st.staged_s <= st.save_s
            fresh = torch.nn.Linear(64, 64)
            with gpumem.Checkpointer(tmp_path / str(free), keep=1) as ck:
                assert ck.restore(model=fresh) is not None
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, want[k])
    finally:
        torch.set_num_threads(threads)
