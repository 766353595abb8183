"""The checkpoint tests' thread setting (conftest.py) reaches this process's native pool."""

import os
import subprocess
import sys

from conftest import NATIVE_THREADS

from gpumem._native import load
from gpumem.checksum import cpu_features

load()  # as in a full run, where some module's collection loads gpumem._C before any fixture


def test_native_pool_runs_with_the_conftest_thread_count():
    # gpumem._C was loaded while the tests were collected, so GPUMEM_THREADS set by a fixture
    # alone would leave the pool at its collection-time size (all cores, or an outer setting).
    assert os.environ["GPUMEM_THREADS"] == str(NATIVE_THREADS)
    assert cpu_features()["threads"] == NATIVE_THREADS


def test_child_processes_inherit_the_setting():
    code = "from gpumem.checksum import cpu_features; print(cpu_features()['threads'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(NATIVE_THREADS)


def test_background_threads_default_to_the_cores_torch_leaves_free(monkeypatch):
    import pytest
    import torch

    from gpumem.checkpoint.workers import background_threads

    monkeypatch.delenv("GPUMEM_SAVE_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        for n in sorted({1, cores}):
            torch.set_num_threads(n)
            assert background_threads() == max(1, cores - n)  # every core taken: still one
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "3")
    assert background_threads() == 3
    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "0")
    with pytest.raises(ValueError, match="GPUMEM_SAVE_THREADS"):
        background_threads()


def test_what_runs_after_save_returns_runs_on_the_background_budget(tmp_path, monkeypatch):
    """Overlap and blocking saves: the checksums and writes run after save() returns, beside
    training, on the budget and at a lower priority; a blocking save's copy (the caller waits
    for it) and a streaming save (save() waits for all of it) use every core."""
    import torch

    import gpumem
    import gpumem.checkpoint.stage.snapshot as snapshot_mod
    import gpumem.checkpoint.storage.writes as writes_mod

    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "1")
    copies, lowered = [], []
    real_copy = snapshot_mod.copy_pieces

    def recording_copy(*args, threads=None, **kwargs):
        copies.append(threads)
        return real_copy(*args, threads=threads, **kwargs)

    monkeypatch.setattr(snapshot_mod, "copy_pieces", recording_copy)
    monkeypatch.setattr(writes_mod, "lower_priority", lambda: lowered.append(1))
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(tmp_path, segment_bytes=1 << 20) as ck:
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        snap = ck._job.snapshot
        assert snap.threads == 1 and snap.beside_training and copies[-1] == 1 and lowered
        copies.clear(), lowered.clear()
        ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        snap = ck._job.snapshot
        assert snap.threads == 1 and snap.beside_training and lowered
        # the caller's copy, one call per file (each written beside the next): every core
        assert len(copies) > 1 and set(copies) == {None}
    with gpumem.Checkpointer(tmp_path / "s", staging_bytes=2 << 20) as ck:
        lowered.clear()
        st = ck.save(2, model=model, optimizer=opt)
        ck.wait()
        snap = ck._job.snapshot
        assert st.mode == "streaming" and snap.threads is None and not snap.beside_training
        assert not lowered
