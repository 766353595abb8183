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


def test_only_an_overlap_save_runs_on_the_background_budget(tmp_path, monkeypatch):
    import torch

    import gpumem

    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "1")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(0, model=model, optimizer=opt)
        assert ck._job.snapshot.threads == 1  # beside training: the budget
        ck.wait()
        ck.save(1, model=model, optimizer=opt, blocking=True)
        assert ck._job.snapshot.threads is None  # the caller waits: every core
        ck.wait()
