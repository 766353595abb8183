"""Staging residency and the order of the background work (what keeps save()'s stall at the
floor)."""

import resource
import threading
import time

import pytest
import torch

import gpumem
import gpumem.checkpoint.save as save_mod
import gpumem.checkpoint.stage.snapshot as snapshot_mod
import gpumem.checkpoint.stage.staging as staging_mod
import gpumem.checkpoint.storage.directory as persist_mod
import gpumem.checkpoint.storage.safe_fs as safe_fs_mod
import gpumem.checkpoint.storage.writes as writes_mod
from gpumem.arena import HostArena


def _vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_lock_keeps_contents_and_is_reported_by_the_kernel():
    nbytes = 3 << 20
    with HostArena(nbytes, pinned=False) as a:
        pattern = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        a.copy_in([pattern], [0])
        before = _vm_locked_kib()
        locked = a.lock()
        assert torch.equal(a.view(0, nbytes), pattern)
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if locked:  # the kernel's own count of locked memory grew by the arena's size
            assert _vm_locked_kib() - before >= nbytes // 1024
        else:
            assert soft != resource.RLIM_INFINITY and soft < nbytes


@pytest.mark.parametrize("populate", [True, False])
def test_prefault_without_locking_keeps_contents(populate):
    nbytes = 5 * 4096 + 100
    with HostArena(nbytes, pinned=False) as a:
        a._populate = populate  # False: the one-atomic-write-per-page path of old kernels
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        a.copy_in([data], [0])
        assert a.ready_from == nbytes and a.locked is None  # nothing faulted in by prefault yet
        a.prefault(lock=False, chunk_bytes=8192)
        assert a.wait_ready() is True
        assert a.ready_from == 0 and a.locked is False
        assert torch.equal(a.view(0, nbytes), data)


_REFUSED = """
import os, resource, sys
import torch
from gpumem.arena import HostArena
n = 32 << 20
a = HostArena(n, pinned=False)
data = torch.randint(0, 256, (n,), dtype=torch.uint8)
a.copy_in([data], [0])
if os.getuid() == 0:
    os.setuid(65534)  # CAP_IPC_LOCK ignores RLIMIT_MEMLOCK: become a user it binds
soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
if soft == resource.RLIM_INFINITY or soft >= n // 2:
    print("unlimited")
    sys.exit(0)
a.prefault(chunk_bytes=soft // 2)  # the first chunks lock, a later one is refused
a.wait_ready()
vm = [l for l in open("/proc/self/status") if l.startswith("VmLck:")][0].split()[1]
print(a.locked, torch.equal(a.view(0, n), data), a.ready_from, vm)
"""


def test_lock_refused_by_rlimit_memlock_unlocks_and_prefaults():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _REFUSED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "unlimited":
        pytest.skip("RLIMIT_MEMLOCK is unlimited here: mlock is never refused")
    # all or nothing: the chunks locked before the refusal were unlocked (VmLck 0 kB), the rest
    # pre-faulted, the contents kept
    assert out.stdout.split() == ["False", "True", "0", "0"]


def test_checkpointer_locks_its_staging_arena_once(tmp_path, monkeypatch):
    calls = []
    real = HostArena.prefault

    def counting_prefault(self, **kwargs):
        calls.append(self.nbytes)
        return real(self, **kwargs)

    monkeypatch.setattr(HostArena, "prefault", counting_prefault)
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.staging_locked is None
        for step in range(3):
            ck.save(step, model=model, optimizer=opt, blocking=True)
            ck.wait()
        assert isinstance(ck.staging_locked, bool)
    assert len(calls) == 1  # allocated and locked by the first save, reused after


@pytest.mark.parametrize("blocking", [True, False])
def test_write_and_checksums_wait_until_the_state_is_staged(tmp_path, monkeypatch, blocking):
    """Over host tensors each batch is written as soon as it is staged, beside the copy of the
    next: the write hides the copy. Blocking mode takes no checksum before the whole state is
    staged (a checksum thread would take a core from the copy the caller waits for); overlap
    mode, whose background copy no caller waits for, checksums each batch as it is staged."""
    # the copy beside training on any machine (unset, a machine with no free core copies at
    # once inside save(): test_save_fastpath covers that path)
    monkeypatch.setenv("GPUMEM_SAVE_THREADS", "1")
    seen = []
    real_write, real_crc = safe_fs_mod.write_file, writes_mod.checksum_host_pieces
    jobs = []

    def write_file(path, *args, **kwargs):
        if "data-" in str(path):
            seen.append(("write", jobs[-1].staged.is_set()))
        return real_write(path, *args, **kwargs)

    def checksum(*args, **kwargs):
        seen.append(("crc", jobs[-1].staged.is_set()))
        return real_crc(*args, **kwargs)

    monkeypatch.setattr(safe_fs_mod, "write_file", write_file)
    monkeypatch.setattr(writes_mod, "checksum_host_pieces", checksum)
    real_run = save_mod.Save.run

    def run_caller(self):
        jobs.append(self)
        return real_run(self)

    monkeypatch.setattr(save_mod.Save, "run", run_caller)
    real_copy = snapshot_mod.copy_pieces

    def slow_copy(*args, **kwargs):  # a copy long enough for an eager writer to start beside it
        time.sleep(0.02)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(snapshot_mod, "copy_pieces", slow_copy)
    model, opt = _model_and_opt()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    # 4 KiB segments: one data file per tensor piece, so many writes could have overlapped the copy
    with gpumem.Checkpointer(tmp_path, chunk_bytes=4096, segment_bytes=4096) as ck:
        st = ck.save(1, model=model, optimizer=opt, blocking=blocking)
        assert st.mode == ("blocking" if blocking else "overlap")
        opt.step()
        ck.wait()
        writes = [s for kind, s in seen if kind == "write"]
        crcs = [s for kind, s in seen if kind == "crc"]
        assert len(writes) >= 4 and crcs
        # the first batches went out while later ones were still being copied
        assert not writes[0] and writes[-1]
        if blocking:
            assert all(crcs)
        else:
            assert not crcs[0]
        model2, opt2 = _model_and_opt(seed=1)
        assert ck.restore(model=model2, optimizer=opt2) == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_streaming_still_writes_while_copying(tmp_path, monkeypatch):
    """With a budget below the state, batch b is written while later batches wait for a slot."""
    real_write = safe_fs_mod.write_file
    jobs, staged_at_write = [], []

    def write_file(path, *args, **kwargs):
        if "data-" in str(path):
            staged_at_write.append(jobs[-1].staged.is_set())
        return real_write(path, *args, **kwargs)

    real_run = save_mod.Save.run

    def run_caller(self):
        jobs.append(self)
        return real_run(self)

    monkeypatch.setattr(safe_fs_mod, "write_file", write_file)
    monkeypatch.setattr(save_mod.Save, "run", run_caller)
    model = torch.nn.Linear(256, 256)  # 257 KiB of parameters, 8 KiB slots
    with gpumem.Checkpointer(tmp_path, staging_bytes=16384, chunk_bytes=4096) as ck:
        st = ck.save(1, model=model)
        ck.wait()
    assert st.mode == "streaming"
    assert (
        staged_at_write[0] is False
    )  # back-pressure: the first file is written before all is staged


def test_durable_time_is_taken_before_retention(tmp_path, monkeypatch):
    durable_at_retention = []
    real = persist_mod.apply_retention
    jobs = []
    real_run = save_mod.Save.run

    def run_caller(self):
        jobs.append(self)
        return real_run(self)

    def retention(*args, **kwargs):
        durable_at_retention.append(jobs[-1].stats.durable_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_mod.Save, "run", run_caller)
    monkeypatch.setattr(persist_mod, "apply_retention", retention)
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        for step in range(2):
            ck.save(step, model=model, optimizer=opt, blocking=True)
            ck.wait()
    assert len(durable_at_retention) == 2 and all(d > 0 for d in durable_at_retention)
    with gpumem.Checkpointer(tmp_path) as ck:
        assert [i.step for i in ck.list()] == [1]


def test_tensor_references_are_dropped_before_the_save_counts_as_done(tmp_path, monkeypatch):
    """wait() returning may be the last thing before interpreter exit: the persist thread must not
    still be freeing tensors then (a daemon thread killed inside torch aborts the process)."""
    tables_at_done = []
    real_run = save_mod.Save.run

    def run_caller(self):
        job = self

        class Done(threading.Event):
            def set(self):
                tables_at_done.append(len(job.snapshot.table.tensors))
                super().set()

        self.done = Done()
        return real_run(self)

    monkeypatch.setattr(save_mod.Save, "run", run_caller)
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        for step in range(2):
            ck.save(step, model=model, optimizer=opt, blocking=step == 0)
            opt.step()
            ck.wait()
    assert tables_at_done == [0, 0]


# ---- Checkpointer.prepare(): staging allocated ahead of the first save ----


def test_prepare_then_save_reuses_the_prepared_arena(tmp_path, monkeypatch):

    made = []
    real = staging_mod.HostArena

    def counting(*args, **kwargs):
        a = real(*args, **kwargs)
        made.append(a)
        return a

    monkeypatch.setattr(staging_mod, "HostArena", counting)
    model, opt = _model_and_opt()  # after the first AdamW step, so its state exists
    with gpumem.Checkpointer(tmp_path) as ck:
        size = ck.prepare(model=model, optimizer=opt)
        assert size > sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        assert ck.wait() is True
        prepared = ck._staging.arena
        assert (
            prepared is not None and prepared.nbytes == size and isinstance(ck.staging_locked, bool)
        )
        ptr = prepared.data_ptr
        for step in range(2):
            ck.save(step, model=model, optimizer=opt)
            ck.wait()
            assert ck._staging.arena is prepared and ck._staging.arena.data_ptr == ptr
        assert ck.prepare(model=model, optimizer=opt) == 0  # already big enough: nothing allocated
    assert len(made) == 1  # allocated once, by prepare(), never by save()


def test_save_right_after_prepare_waits_for_it_instead_of_allocating(tmp_path, monkeypatch):

    made, gate = [], threading.Event()
    real = staging_mod.HostArena

    def slow(*args, **kwargs):
        gate.wait(10)  # the allocation is still running when save() starts
        a = real(*args, **kwargs)
        made.append(a)
        return a

    monkeypatch.setattr(staging_mod, "HostArena", slow)
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.prepare(model=model, optimizer=opt)
        assert ck.wait(timeout=0.01) is False  # still allocating
        threading.Timer(0.05, gate.set).start()
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        assert len(made) == 1 and ck._staging.arena is made[0]


def test_prepare_nbytes_is_clamped_to_the_staging_cap(tmp_path):
    cap = 8 << 20
    with gpumem.Checkpointer(tmp_path, staging_bytes=cap, chunk_bytes=1 << 20) as ck:
        assert ck.prepare(nbytes=10 * cap, background=False) == cap
        assert ck._staging.arena.nbytes == cap
        model, opt = _model_and_opt()
        arena = ck._staging.arena
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        assert (
            ck._staging.arena is arena
        )  # the capped arena serves every save (streaming if need be)


def test_save_grows_the_arena_when_the_state_outgrew_prepare(tmp_path):
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.prepare(nbytes=4096)
        ck.wait()
        small = ck._staging.arena
        assert small.nbytes == 4096
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        assert ck._staging.arena is not small and ck._staging.arena.nbytes > 4096 and small.closed
        assert ck.restore(model=model, optimizer=opt) == 0


def test_prepare_allocation_failure_surfaces_at_the_next_save(tmp_path, monkeypatch):

    def refuse(*args, **kwargs):
        raise MemoryError("no host memory for staging")

    model, opt = _model_and_opt()
    ck = gpumem.Checkpointer(tmp_path)
    try:
        monkeypatch.setattr(staging_mod, "HostArena", refuse)
        ck.prepare(model=model, optimizer=opt)
        with pytest.raises(gpumem.checkpoint.CheckpointError, match="prepare") as info:
            ck.save(0, model=model, optimizer=opt)
        assert isinstance(info.value.__cause__, MemoryError)
        assert ck.list() == []
        monkeypatch.undo()
        ck.save(1, model=model, optimizer=opt)  # raised once; the next save allocates as usual
        ck.wait()
        assert [i.step for i in ck.list()] == [1]
    finally:
        ck.close()


def test_prepare_allocation_failure_surfaces_at_wait(tmp_path, monkeypatch):

    def refuse(*args, **kwargs):
        raise MemoryError("no host memory for staging")

    monkeypatch.setattr(staging_mod, "HostArena", refuse)
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.prepare(nbytes=1 << 20)
        with pytest.raises(gpumem.checkpoint.CheckpointError, match="prepare"):
            ck.wait()
        assert ck.wait() is True  # raised once


def test_save_without_prepare_still_allocates_its_arena(tmp_path):
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck._staging.arena is None
        ck.save(0, model=model, optimizer=opt)
        ck.wait()
        assert ck._staging.arena is not None and isinstance(ck.staging_locked, bool)
        assert ck.restore(model=model, optimizer=opt) == 0


def test_default_staging_is_a_quarter_of_what_the_host_or_its_container_has(monkeypatch):
    import gpumem.device
    from gpumem.checkpoint.settings import default_staging_bytes

    monkeypatch.delenv("GPUMEM_STAGING_BYTES", raising=False)
    monkeypatch.setattr(gpumem.device, "host_available_bytes", lambda: 8 << 30)
    assert default_staging_bytes() == 2 << 30
    monkeypatch.setattr(gpumem.device, "host_available_bytes", lambda: 100 << 20)
    assert default_staging_bytes() == 64 << 20  # the floor
    monkeypatch.setenv("GPUMEM_STAGING_BYTES", str(3 << 20))
    assert default_staging_bytes() == 3 << 20


# ---- no first-save cliff: a save before the arena is faulted in, the final save's bound ----


def _bytes_of(model, opt):
    """Every parameter and optimizer-state tensor, cloned (what a restore must give back)."""
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


def _bit_equal(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_before_the_arena_is_faulted_in_is_bit_identical_and_counted(
    tmp_path, monkeypatch, blocking
):
    started = []
    real = HostArena.prefault
    # the background fault-in has not got anywhere yet when the save copies: every byte lands
    # in pages the copy faults itself
    monkeypatch.setattr(HostArena, "prefault", lambda self, **kw: started.append(self))
    model, opt = _model_and_opt()
    want = _bytes_of(model, opt)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        st = ck.save(0, model=model, optimizer=opt, blocking=blocking)
        ck.wait()
        assert st.committed and st.nbytes > 0 and st.cold_bytes == st.nbytes
        assert len(started) == 1 and ck._staging.arena is started[0]
        assert ck.staging_locked is None  # never faulted in by the background: not known
        real(started[0])  # now it runs, and the next save finds every page resident
        ck.wait()
        assert isinstance(ck.staging_locked, bool) and started[0].ready_from == 0
        st = ck.save(1, model=model, optimizer=opt, blocking=blocking)
        ck.wait()
        assert st.committed and st.cold_bytes == 0
        for p in model.parameters():
            p.data.add_(1.0)
        assert ck.restore(model=model, optimizer=opt, path=ck.list()[0].path) == 0
    assert _bit_equal(_bytes_of(model, opt), want)


def test_cold_bytes_counts_the_pieces_below_the_resident_part():
    from gpumem.checkpoint.stage.host_copy import cold_bytes
    from gpumem.checkpoint.stage.pieces import Piece, StagingPlan

    plan = StagingPlan(capacity=1 << 20, streaming=False, bases=[0, 10_000])
    pieces = [Piece(0, 0, 4000, 0, 0), Piece(1, 0, 3000, 0, 4096), Piece(2, 0, 500, 1, 100)]

    class Arena:
        ready_from = 5000  # [5000, end) is resident

    # piece 0: [0, 4000) all cold; piece 1: [4096, 7096) cold up to 5000; piece 2 at 10100: warm
    assert cold_bytes(Arena, plan, pieces) == 4000 + (5000 - 4096)
    Arena.ready_from = 0
    assert cold_bytes(Arena, plan, pieces) == 0


def test_the_guards_final_save_without_an_arena_streams_through_its_bound(tmp_path, monkeypatch):
    import os
    import signal

    import gpumem.checkpoint.preemption as preemption_mod

    bound = 2 << 20
    monkeypatch.setattr(preemption_mod, "FINAL_SAVE_STAGING", bound)
    sizes = []
    real = staging_mod.HostArena

    def counting(nbytes, *args, **kwargs):
        sizes.append(nbytes)
        return real(nbytes, *args, **kwargs)

    monkeypatch.setattr(staging_mod, "HostArena", counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    want = _bytes_of(model, opt)
    assert sum(t.numel() * t.element_size() for t in want) > 3 * bound
    with gpumem.Checkpointer(tmp_path) as ck:
        guard = gpumem.PreemptionGuard(
            ck, signals=("SIGUSR1",), state={"model": model, "optimizer": opt}
        )
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert guard.should_stop(7) and guard.durable
        finally:
            guard.close()
        st = ck.history[-1]
        assert st.step == 7 and st.committed and st.mode == "streaming"
        assert sizes and max(sizes) <= bound  # never more host memory than the bound
        for p in model.parameters():
            p.data.zero_()
        assert ck.restore(model=model, optimizer=opt) == 7
    assert _bit_equal(_bytes_of(model, opt), want)


def test_new_staging_bytes_must_be_a_positive_int(tmp_path):
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(gpumem.checkpoint.CheckpointStateError, match="new_staging_bytes"):
                ck.save(0, model=model, optimizer=opt, new_staging_bytes=bad)


def test_save_right_after_prepare_does_not_wait_for_the_fault_in(tmp_path, monkeypatch):
    waits = []
    real = HostArena.wait_ready

    def recording(self, timeout=None):
        waits.append(self)
        return real(self, timeout)

    monkeypatch.setattr(HostArena, "wait_ready", recording)
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.prepare(model=model, optimizer=opt)
        for step in range(2):
            ck.save(step, model=model, optimizer=opt, blocking=True)
            assert waits == []  # neither save() nor its back-pressure waited for the fault-in
        assert ck.wait() is True and waits == [ck._staging.arena]  # wait() does


def _fresh_model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model, opt):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_restore_of_a_fresh_start_prepares_the_arena_after_the_first_step(tmp_path, monkeypatch):
    """No checkpoint yet and AdamW without state: nothing to size before the first step(); the
    one-shot post-step hook prepares the arena then, sized for the state that step made, and
    the first save copies into it without a page fault of its own."""
    prepared = []
    real = HostArena.prefault
    monkeypatch.setattr(
        HostArena, "prefault", lambda self, **kw: (prepared.append(self), real(self, **kw))[1]
    )
    model, opt = _fresh_model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.restore(model=model, optimizer=opt) is None
        assert not ck._staging.allocated and prepared == []
        _train_step(model, opt)
        assert ck._staging.allocated and not ck._hooks.prepare_pending
        assert ck.wait()  # the arena is installed and faulted in
        _train_step(model, opt)  # the hook ran once: no second arena
        st = ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        assert st.committed and st.cold_bytes == 0
        assert st.nbytes >= sum(t.nbytes for t in _bytes_of(model, opt))
        assert len(prepared) == 1 and ck._staging.arena is prepared[0]
        assert prepared[0].nbytes >= st.nbytes


def test_restore_of_a_checkpoint_prepares_the_arena_at_once(tmp_path):
    model, opt = _model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(3, model=model, optimizer=opt, blocking=True)
    model2, opt2 = _fresh_model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.restore(model=model2, optimizer=opt2) == 3
        assert ck._staging.allocated and not ck._hooks.prepare_pending
        assert ck.wait()
        st = ck.save(4, model=model2, optimizer=opt2, blocking=True)
        ck.wait()
        assert st.committed and st.cold_bytes == 0
    with gpumem.Checkpointer(tmp_path, read_only=True) as ro:  # never saves: no arena
        assert ro.restore(model=model2, optimizer=opt2) == 4
        assert not ro._staging.allocated and not ro._hooks.prepare_pending


def test_prepare_ahead_never_fails_the_restore_or_the_step(tmp_path, monkeypatch):
    model, opt = _fresh_model_and_opt()
    ck = gpumem.Checkpointer(tmp_path)
    assert ck.restore(model=model, optimizer=opt) is None
    ck.close()  # closed before the first step: the hook is gone with it
    _train_step(model, opt)
    assert not ck._hooks.prepare_pending and not ck._staging.allocated

    def broken(*args, **kwargs):
        raise RuntimeError("sizing failed")

    with gpumem.Checkpointer(tmp_path) as ck:
        monkeypatch.setattr(ck, "prepare", broken)
        with pytest.warns(RuntimeWarning, match="could not prepare the staging arena"):
            assert ck.restore(model=model, optimizer=opt) is None  # opt has state: at once
        assert not ck._staging.allocated
        monkeypatch.undo()
        st = ck.save(0, model=model, optimizer=opt, blocking=True)  # allocates it itself
        ck.wait()
        assert st.committed


def test_prepare_before_the_first_step_sizes_the_arena_after_it(tmp_path):
    """prepare() of a fresh AdamW (no state before its first step()) waits for that step and
    sizes the arena for the state it made: the first save copies into it, no second arena."""
    model, opt = _fresh_model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.prepare(model, opt) == 0
        assert not ck._staging.allocated and ck._hooks.prepare_pending
        _train_step(model, opt)
        assert ck._staging.allocated and not ck._hooks.prepare_pending
        assert ck.wait()  # installed and faulted in
        arena = ck._staging.arena
        st = ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        assert st.committed and st.cold_bytes == 0 and ck._staging.arena is arena
        assert arena.nbytes >= st.nbytes >= sum(t.nbytes for t in _bytes_of(model, opt))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert st.nbytes >= 3 * params  # the moments AdamW made in that step are in it


def test_prepare_of_an_optimizer_that_keeps_no_state_sizes_after_one_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no momentum: nothing to keep
    opt.state.clear()
    with gpumem.Checkpointer(tmp_path) as ck:
        assert ck.prepare(model=model, optimizer=opt) == 0
        _train_step(model, opt)
        assert ck._staging.allocated and not ck._hooks.prepare_pending  # not deferred again
        arena = ck._staging.arena
        _train_step(model, opt)
        assert ck._staging.arena is arena and not ck._hooks.prepare_pending


def test_a_prepare_after_the_first_step_that_fails_is_a_warning_not_the_steps_failure(
    tmp_path, monkeypatch
):
    model, opt = _fresh_model_and_opt()
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.prepare(model, opt)

        def broken(*args, **kwargs):
            raise RuntimeError("sizing failed")

        monkeypatch.setattr(ck, "_prepare", broken)
        with pytest.warns(RuntimeWarning, match="could not prepare the staging arena"):
            _train_step(model, opt)
        monkeypatch.undo()
        assert not ck._staging.allocated
        st = ck.save(0, model=model, optimizer=opt, blocking=True)  # allocates it itself
        ck.wait()
        assert st.committed
