"""The CUDA branches of the snapshot, exercised on the CPU with recording fakes of torch.cuda.

The fakes stand in for streams and events and for the native enqueue (a memmove per row, logged;
the native call itself is tested against a fake libcudart in tests/test_arena_cuda_cpu.py); the
bytes really move (CPU tensors into a real HostArena) and the device CRCs are the real Triton
kernel under the interpreter, so these tests check the ordering the GPU relies on: the side
stream waits on the compute stream's event before it reads, all copies of a save are one
enqueue and never wait for the CRCs, the completion covers both, and the job synchronizes it
before the state counts as staged (what releases the optimizer hook).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import pytest
import torch

import gpumem
import gpumem.checkpoint.stage.device_copy as dev
import gpumem.checkpoint.stage.host_copy as host_copy
import gpumem.checkpoint.stage.spill as spill
import gpumem.kernels.crc32c as K
from gpumem.arena import HostArena
from gpumem.checkpoint.capture.codec import TensorTable
from gpumem.checkpoint.stage.pieces import Piece, StagingPlan
from gpumem.checkpoint.stage.snapshot import Snapshot
from gpumem.checkpoint.stats import SaveStats
from gpumem.checkpoint.workers import Worker
from gpumem.checksum import chunk_crc32c

CHUNK = 4096


class FakeStream:
    device = torch.device("cuda", 0)

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.cuda_stream = sum(map(ord, name))  # the cudaStream_t the native enqueue is handed

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    count = 0

    def __init__(self, cuda: FakeCuda):
        FakeEvent.count += 1
        self.name, self.cuda, self.stream = f"event{FakeEvent.count}", cuda, None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = (stream or self.cuda.current).name
        self.cuda.log.append(("record", self.name, self.stream))

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name, self.cuda.staged_probe()))

    def elapsed_time(self, other: FakeEvent) -> float:
        return 2.0 if other.stream == "crc" else 1.0  # ms: copies 1 ms, CRCs 2 ms after start


class FakeCuda:
    """torch.cuda.stream / current_stream / Event, per thread like the real ones."""

    def __init__(self, log: list):
        self.log = log
        self.compute = FakeStream("compute", log)
        self._local = threading.local()
        self.staged_probe = lambda: None

    @property
    def current(self) -> FakeStream:
        return getattr(self._local, "stream", self.compute)

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        before = self.current
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = before

    def event(self, *args, **kwargs) -> FakeEvent:
        return FakeEvent(self)


class FakeCudaTensor:
    """A CPU tensor that says it lives on a CUDA device and logs what the snapshot asks of it."""

    is_cuda, is_cpu = True, False
    device = torch.device("cuda", 0)

    def __init__(self, real: torch.Tensor, cuda: FakeCuda, name: str):
        self.real, self.cuda, self.name = real, cuda, name

    def is_contiguous(self) -> bool:
        return self.real.is_contiguous()

    def contiguous(self) -> FakeCudaTensor:
        self.cuda.log.append(("contiguous", self.name, self.cuda.current.name))
        return FakeCudaTensor(self.real.contiguous(), self.cuda, self.name)

    def record_stream(self, s: FakeStream) -> None:
        self.cuda.log.append(("record_stream", self.name, s.name))

    def data_ptr(self) -> int:
        return self.real.data_ptr()

    def numel(self) -> int:
        return self.real.numel()

    def element_size(self) -> int:
        return self.real.element_size()


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    cuda = FakeCuda(log)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.event)
    real_as_bytes, real_crc = dev.as_bytes, dev.chunk_crc32c

    def as_bytes(t):
        return real_as_bytes(t.real if isinstance(t, FakeCudaTensor) else t)

    monkeypatch.setattr(dev, "as_bytes", as_bytes)
    monkeypatch.setattr(spill, "as_bytes", as_bytes)

    def crc(data, chunk):
        log.append(("crc", data.numel(), cuda.current.name))
        return real_crc(data, chunk)

    monkeypatch.setattr(dev, "chunk_crc32c", crc)
    crc_stream = FakeStream("crc", log)
    monkeypatch.setattr(dev, "_crc_stream", lambda beside: crc_stream)
    real_launch = K.launch_many

    def launch_many(plan, bases, out):  # the real kernel (interpreted), logged
        log.append(("launch_many", len(plan.launches), cuda.current.name))
        real_launch(plan, bases, out)

    monkeypatch.setattr(K, "launch_many", launch_many)
    return cuda


def _logging_arena(arena: HostArena, cuda: FakeCuda, fail: str | None = None) -> HostArena:
    """The arena with its device copies logged; ``enqueue_d2h`` memmoves each row (a "device"
    address is a host one here) after checking it was handed the current stream, or raises
    ``fail`` as the native call would."""
    real = arena.copy_from_device

    def copy_from_device(src, offset):
        cuda.log.append(("copy", offset, src.numel(), cuda.current.name))
        real(src, offset)

    def enqueue_d2h(copies, stream):
        assert stream == cuda.current.cuda_stream and copies.dtype.name == "uint64"
        cuda.log.append(("enqueue", [(int(o), int(n)) for _, n, o in copies], cuda.current.name))
        if fail is not None:
            raise RuntimeError(fail)
        for src, n, off in copies.tolist():
            ctypes.memmove(arena.data_ptr + off, src, n)
        return len(copies)

    arena.copy_from_device = copy_from_device
    arena.enqueue_d2h = enqueue_d2h
    return arena


def _values(crc: torch.Tensor) -> list[int]:
    return (crc.to(torch.int64) & 0xFFFFFFFF).tolist()


def _state(cuda: FakeCuda):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, generator=g)  # 12000 bytes: three chunks
    b = torch.randn(40, 30, generator=g).t()  # not contiguous: gathered on the copying stream
    c = torch.arange(10, dtype=torch.int64)  # a host tensor among them
    tensors = [FakeCudaTensor(a, cuda, "a"), FakeCudaTensor(b, cuda, "b"), c]
    plan = StagingPlan(
        capacity=1 << 20,
        streaming=False,
        batch_sizes=[32768],
        bases=[0],
        pieces=[Piece(0, 0, 12000, 0, 0), Piece(1, 0, 4800, 0, 12288), Piece(2, 0, 80, 0, 20480)],
    )
    return tensors, plan


def _check_bytes(arena: HostArena, tensors, pieces: list[Piece]) -> None:
    for p in pieces:
        t = tensors[p.index]
        real = t.real if isinstance(t, FakeCudaTensor) else t
        want = real.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(arena.view(p.offset, p.nbytes), want), p
        if isinstance(t, FakeCudaTensor):  # device CRC of what was copied, per chunk
            assert _values(p.crc) == chunk_crc32c(want, CHUNK).tolist()
        else:  # host tensors are checksummed later, from the staged bytes
            assert p.crc is None


def test_side_stream_waits_copies_and_records_its_event_after_the_copies(fake_cuda):
    cuda = fake_cuda
    side = FakeStream("side", cuda.log)
    save_event = cuda.event()
    save_event.record()  # on the compute stream, at save() time
    cuda.log.clear()
    tensors, plan = _state(cuda)
    with HostArena(32768, pinned=False) as arena:
        done = host_copy.copy_pieces(
            _logging_arena(arena, cuda),
            plan,
            plan.pieces,
            tensors,
            CHUNK,
            stream=side,
            wait_event=save_event,
        )
        done.synchronize()
        _check_bytes(arena, tensors, plan.pieces)
    assert cuda.current is cuda.compute  # the side stream is current only inside copy_pieces
    start, copied, hashed = done.start.name, done.copied.name, done.hashed.name
    assert (done.copied.stream, done.hashed.stream) == ("side", "crc")
    assert cuda.log[: cuda.log.index(("synchronize", copied, None))] == [
        ("wait_event", "side", save_event.name),  # before the first read of a parameter
        ("record", start, "side"),  # where the CRC stream starts: after that wait
        ("enqueue", [(0, 12000)], "side"),  # every contiguous piece's copy: one native call
        ("contiguous", "b", "side"),  # the gathered copy is made (and freed) on the side stream
        ("crc", 4800, "side"),  # ... and hashed there, before its copy
        ("copy", 12288, 4800, "side"),
        ("record_stream", "b", "side"),
        ("record", copied, "side"),  # the copies never wait for the CRCs
        ("wait_event", "crc", start),  # the CRCs read the same bytes, from the same point on
        ("launch_many", 1, "crc"),  # every contiguous piece's CRCs: one launch
        ("record", hashed, "crc"),
    ]
    assert done.device_times() == (1e-3, 2e-3)
    compute = FakeStream("compute", cuda.log)
    cuda.log.clear()
    done.wait(compute)  # what the optimizer fence does: wait for both
    assert cuda.log == [("wait_event", "compute", copied), ("wait_event", "compute", hashed)]


def test_without_a_side_stream_everything_runs_on_the_current_stream(fake_cuda):
    cuda = fake_cuda
    tensors, plan = _state(cuda)
    with HostArena(32768, pinned=False) as arena:
        done = host_copy.copy_pieces(_logging_arena(arena, cuda), plan, plan.pieces, tensors, CHUNK)
        done.synchronize()
        _check_bytes(arena, tensors, plan.pieces)
    assert done.copied.stream == "compute" and done.hashed.stream == "crc"
    # only the CRC stream waits (for the start): the copies wait for nothing
    assert [e for e in cuda.log if e[0] == "wait_event"] == [("wait_event", "crc", done.start.name)]
    assert {e[-1] for e in cuda.log if e[0] in ("copy", "enqueue", "record_stream")} == {"compute"}


def test_the_program_is_built_once_per_layout_and_addresses(fake_cuda, monkeypatch):
    """A second save of the same tensors reuses the copy rows and CRC tables; tensors that moved
    get a new program. The rows hold the device addresses of the pieces."""
    cuda = fake_cuda
    built = []
    real_build = dev.build_program
    monkeypatch.setattr(dev, "build_program", lambda *a: built.append(a[0]) or real_build(*a))
    tensors, plan = _state(cuda)
    with HostArena(32768, pinned=False) as arena:
        _logging_arena(arena, cuda)
        for _ in range(2):
            host_copy.copy_pieces(arena, plan.copy(), plan.pieces, tensors, CHUNK).synchronize()
        assert built == [[tensors[0].data_ptr()]]  # tensor a: the one contiguous CUDA piece
        prog = next(iter(plan.programs.values()))
        assert prog.copies.tolist() == [[tensors[0].data_ptr(), 12000, 0]]
        assert (prog.starts, prog.counts, prog.total) == ([0], [3], 3)
        tensors[0] = FakeCudaTensor(tensors[0].real.clone(), cuda, "a")  # moved
        fresh = plan.copy()
        host_copy.copy_pieces(arena, fresh, fresh.pieces, tensors, CHUNK).synchronize()
        assert len(built) == 2 and built[1] == [tensors[0].data_ptr()]
        _check_bytes(arena, tensors, fresh.pieces)


def test_a_failed_enqueue_reaches_the_caller(fake_cuda):
    cuda = fake_cuda
    tensors, plan = _state(cuda)
    with HostArena(32768, pinned=False) as arena:
        _logging_arena(arena, cuda, fail="cudaMemcpyAsync of copy 0 (...) failed: boom")
        with pytest.raises(RuntimeError, match=r"copy 0 .* failed: boom"):
            host_copy.copy_pieces(arena, plan, plan.pieces, tensors, CHUNK)
    assert cuda.current is cuda.compute


def test_host_tensors_alone_need_no_event(fake_cuda):
    c = torch.arange(10, dtype=torch.int64)
    plan = StagingPlan(
        capacity=4096, streaming=False, batch_sizes=[80], bases=[0], pieces=[Piece(0, 0, 80, 0, 0)]
    )
    with HostArena(4096, pinned=False) as arena:
        assert (
            host_copy.copy_pieces(
                arena,
                plan,
                plan.pieces,
                [c],
                CHUNK,
                stream=FakeStream("side", []),
                wait_event=fake_cuda.event(),
            )
            is None
        )
        assert torch.equal(arena.view(0, 80), c.view(torch.uint8))
    assert fake_cuda.log == []  # no stream switch, no wait, no event for host-only pieces


@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_the_copy_event_is_synchronized_before_the_state_counts_as_staged(
    tmp_path, fake_cuda, mode
):
    """staged releases the optimizer pre-step hook (overlap) and save() (blocking): the D2H copies
    must be complete by then, not merely enqueued."""
    cuda = fake_cuda
    tensors, plan = _state(cuda)
    table = TensorTable(
        names=["a", "b", "c"], tensors=tensors, deferred=[True, True, False], has_cuda=True
    )
    side = FakeStream("side", cuda.log)
    with _logging_arena(HostArena(32768, pinned=False), cuda) as arena:
        job = _snapshot(table, plan, arena, mode, side)
        cuda.staged_probe = job.staged.is_set
        sync_event = cuda.event()
        save_event = cuda.event()
        if mode == "overlap":  # what the copier thread runs
            job._produce(lambda p: table.deferred[p.index], side, save_event, sync_event)
        else:  # blocking: everything on the caller's stream
            job._produce(None, None, None, None)
        assert job.staged.is_set() and job.stats.d2h_s > 0  # the D2H phase is timed
        _check_bytes(
            arena,
            tensors,
            [p for p in plan.pieces if mode == "blocking" or table.deferred[p.index]],
        )
    syncs = [e for e in cuda.log if e[0] == "synchronize"]
    done = job.copy_event
    assert done.copied.stream == ("side" if mode == "overlap" else "compute")
    # the copies' and the CRCs' events, and in overlap mode the event of the buffers copied by
    # save(), all waited for while staged was still clear
    want = [("synchronize", done.copied.name, False), ("synchronize", done.hashed.name, False)]
    if mode == "overlap":
        want.append(("synchronize", sync_event.name, False))
    assert syncs == want
    assert (job.stats.copy_device_s, job.stats.crc_device_s) == (1e-3, 2e-3)


def test_gpu_test_budgets_pick_the_modes_they_claim(tmp_path):
    """tests/checkpoint/test_gpu.py's budgets, on CPU tensors of the same sizes: a budget meant to
    stream that fits instead fails the GPU run on a correct implementation."""
    import test_gpu

    for budget, mode in test_gpu.BUDGET_MODES.items():
        model, opt = test_gpu._setup(0, device="cpu")
        test_gpu._train(model, opt, 3, torch.randn(64, 256))
        with gpumem.Checkpointer(
            tmp_path / str(budget), staging_bytes=budget, chunk_bytes=test_gpu.CHUNK
        ) as ck:
            assert ck.save(3, model=model, optimizer=opt).mode == mode


def test_a_cuda_rng_state_of_the_wrong_size_is_refused_before_anything_is_loaded(monkeypatch):
    """set_rng_state would raise only after the model and optimizer were loaded (or, before CUDA
    is initialized, at some later CUDA call): the size is checked with the other RNG states."""
    from gpumem.checkpoint.capture.training_state import rng_state
    from gpumem.checkpoint.errors import CheckpointCorruptError
    from gpumem.checkpoint.restore.validate import check_targets

    state = rng_state()  # CPU states of this process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i=0: torch.zeros(16, dtype=torch.uint8))
    good = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    check_targets({"step": 1, "rng": {**state, "cuda": good}})
    check_targets(
        {"step": 1, "rng": {**state, "cuda": [*good, torch.zeros(3, dtype=torch.uint8)]}}
    )  # 3rd: no device
    with pytest.raises(
        CheckpointCorruptError, match="CUDA RNG state 1 has 20 bytes, this torch's has 16"
    ):
        check_targets(
            {"step": 1, "rng": {**state, "cuda": [good[0], torch.zeros(20, dtype=torch.uint8)]}}
        )


def _snapshot(table, plan, arena, mode, side_stream) -> Snapshot:
    stats = SaveStats(1, sum(p.nbytes for p in plan.pieces), mode)
    return Snapshot(
        table,
        plan,
        arena,
        mode,
        chunk=CHUNK,
        stats=stats,
        t0=0.0,
        copier=Worker("c"),
        side_stream=side_stream,
    )


def _overlap_job(tmp_path, cuda: FakeCuda, tensors, plan, deferred):
    table = TensorTable(
        names=[f"t{i}" for i in range(len(tensors))],
        tensors=tensors,
        deferred=deferred,
        has_cuda=True,
    )
    arena = _logging_arena(HostArena(32768, pinned=False), cuda)
    return _snapshot(table, plan, arena, "overlap", FakeStream("side", cuda.log)), arena


@pytest.mark.parametrize("current", [0, 1])
def test_the_optimizer_hook_fences_its_stream_instead_of_waiting(
    tmp_path, fake_cuda, monkeypatch, current
):
    """Overlap mode on one CUDA device: the pre-step hook orders the optimizer's stream after
    the background copy (its kernels queue behind it) rather than blocking the CPU until the copy
    is done; on another current device it cannot, and the caller must wait for staged."""
    cuda = fake_cuda
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    tensors, plan = _state(cuda)
    job, arena = _overlap_job(tmp_path, cuda, tensors, plan, [True, True, False])
    with arena:
        assert job.fence_device == 0
        job._sync_event = cuda.event()  # the buffers save() copied on the compute stream
        job._sync_event.record()
        job._produce(
            lambda p: job.table.deferred[p.index],
            FakeStream("side", cuda.log),
            None,
            job._sync_event,
        )
        assert job.enqueued.is_set() and job.copy_event is not None
        cuda.log.clear()
        assert job.fence() is (current == 0)
    if current == 0:  # on the caller's (compute) stream: after the buffers' event and the copy's
        before, after = job._fence_events
        assert cuda.log == [
            ("record", before.name, "compute"),
            ("wait_event", "compute", job._sync_event.name),
            ("wait_event", "compute", job.copy_event.copied.name),
            ("wait_event", "compute", job.copy_event.hashed.name),
            ("record", after.name, "compute"),
        ]
        job._account_fence()  # what the persist thread does at its end
        assert job.stats.fence_s == 1e-3 and job._fence_events is None
        assert cuda.log[-1] == ("synchronize", after.name, None)
    else:
        assert cuda.log == [] and job._fence_events is None


def test_no_fence_for_host_only_or_mixed_devices(tmp_path, fake_cuda):
    cuda = fake_cuda
    tensors, plan = _state(cuda)
    job, arena = _overlap_job(
        tmp_path, cuda, tensors, plan, [False, False, True]
    )  # only the host tensor defers
    with arena:
        assert job.fence_device is None and job.fence() is False
    other = FakeCudaTensor(torch.zeros(1000), cuda, "other")
    other.device = torch.device("cuda", 1)
    tensors[1] = other
    job, arena = _overlap_job(tmp_path, cuda, tensors, plan, [True, True, False])  # two devices
    with arena:
        assert job.fence_device is None and job.fence() is False


def test_a_failed_copy_releases_the_fence(tmp_path, fake_cuda, monkeypatch):
    """A copy that fails before it is enqueued must not leave the optimizer hook waiting."""
    cuda = fake_cuda
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tensors, plan = _state(cuda)
    job, arena = _overlap_job(tmp_path, cuda, tensors, plan, [True, True, False])
    with arena:
        job.fail(RuntimeError("copy failed"))
        assert job.enqueued.is_set() and job.fence() is False and job.staged.is_set()


def test_the_fence_spills_what_fits_and_waits_for_the_rest(tmp_path, fake_cuda, monkeypatch):
    """device_spill_bytes: the copier enqueues one piece per wave; the fence comes while the
    second wave is being enqueued. The copier stops there; of the two pieces left, the first
    fits the 8 KiB spill buffer and is copied device to device on the optimizer's stream, the
    second is enqueued device to host at once, and the optimizer's stream waits for that (and
    every earlier wave) and for the CRCs, not for the drain; the copier then drains the buffer
    into the arena behind the D2D copy. Every byte lands where the layout says."""
    from gpumem.checkpoint.stage.spill import SpillControl

    cuda = fake_cuda
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    g = torch.Generator().manual_seed(1)
    tensors = [FakeCudaTensor(torch.randn(2048, generator=g), cuda, f"p{i}") for i in range(4)]
    pieces = [Piece(i, 0, 8192, 0, 8192 * i) for i in range(4)]
    plan = StagingPlan(
        capacity=1 << 20, streaming=False, batch_sizes=[32768], bases=[0], pieces=pieces
    )
    job, arena = _overlap_job(tmp_path, cuda, tensors, plan, [True] * 4)
    buffer = torch.zeros(8192, dtype=torch.uint8)  # the "device" spill buffer
    job.spill = control = SpillControl(buffer, wave_bytes=1)  # one piece per wave
    enqueue = arena.enqueue_d2h
    calls = []

    def enqueue_d2h(copies, stream):
        calls.append([(int(o), int(n), int(a)) for a, n, o in copies])
        if len(calls) == 2:  # the fence comes while the second wave is enqueued
            with control.cond:
                assert control.cond.wait_for(lambda: control.stop_requested, timeout=20)
        return enqueue(copies, stream)

    arena.enqueue_d2h = enqueue_d2h
    side = FakeStream("side", cuda.log)
    copier = threading.Thread(
        target=job._produce, args=(lambda p: True, side, None, None), name="copier"
    )
    with arena:
        copier.start()
        with control.cond:  # the copier has started its waves
            assert control.cond.wait_for(lambda: control.context is not None, timeout=20)
        assert job.fence() is True
        copier.join(20)
        assert not copier.is_alive() and job.error is None and job.staged.is_set()
        _check_bytes(arena, tensors, pieces)
        assert torch.equal(buffer, tensors[2].real.view(torch.uint8))  # went through the buffer
    addr = [t.real.data_ptr() for t in tensors]
    assert calls == [
        [(0, 8192, addr[0])],  # wave 1
        [(8192, 8192, addr[1])],  # wave 2: then the copier stops
        [(24576, 8192, addr[3])],  # the fence: what does not fit goes D2H at once
        [(16384, 8192, buffer.data_ptr())],  # the drain: from the spill buffer
    ]
    assert job.stats.spill_bytes == 8192 and job.stats.fence_s == 0.0  # until accounted
    log, snap = cuda.log, job.copy_event
    before, drain_after, after = [e[1] for e in log if e[0] == "record" and e[2] == "compute"]
    assert job._fence_events[0].name == before and job._fence_events[1].name == after
    # The copier is stopped (waiting for the drain order) from the fence's enqueue of the row
    # that did not fit until the fence's waits are enqueued, so these entries are consecutive:
    # the optimizer's stream waits for `copied` (every wave, then that row: not the drain) and
    # for the CRCs.
    i = log.index(("enqueue", [(24576, 8192)], "side"))
    copied = log[i + 1][1]
    assert log[i + 1 : i + 4] == [
        ("record", copied, "side"),
        ("wait_event", "compute", copied),
        ("wait_event", "compute", snap.hashed.name),
    ]
    # the D2D copies were recorded (drain_after) before, and the drain waits for them after
    assert log.index(("record", drain_after, "compute")) < i
    drain = log.index(("wait_event", "side", drain_after))
    assert drain > i + 3 and log[drain + 1] == ("enqueue", [(16384, 8192)], "side")
    job._account_fence()
    assert job.stats.fence_s == 1e-3


def test_a_copier_that_finished_before_the_fence_is_fenced_as_without_spill(
    tmp_path, fake_cuda, monkeypatch
):
    from gpumem.checkpoint.stage.spill import SpillControl

    cuda = fake_cuda
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tensors, plan = _state(cuda)
    tensors[1] = FakeCudaTensor(tensors[1].real.contiguous(), cuda, "b")  # all fast
    job, arena = _overlap_job(tmp_path, cuda, tensors, plan, [True, True, False])
    job.spill = control = SpillControl(torch.zeros(1 << 20, dtype=torch.uint8), wave_bytes=1)
    with arena:
        job._produce(
            lambda p: job.table.deferred[p.index], FakeStream("side", cuda.log), None, None
        )
        assert control.finished and control.stopped_at is None
        cuda.log.clear()
        assert job.fence() is True
    assert [e[:2] for e in cuda.log if e[0] == "wait_event"] == [("wait_event", "compute")] * 2
    assert job.stats.spill_bytes == 0
