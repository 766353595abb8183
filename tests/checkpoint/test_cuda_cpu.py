"""The CUDA branches of the snapshot, exercised on the CPU with recording fakes of torch.cuda.

The fakes stand in for streams and events only and log what the code asks of them; the bytes
really move (CPU tensors into a real HostArena) and the CRCs are the native ones, so these tests
check the ordering the GPU relies on: the side stream waits on the compute stream's event before
it reads, the completion event is recorded on the stream that ran the copies, after them, and the
job synchronizes it before the state counts as staged (what releases the optimizer hook).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import gpumem
import gpumem.checkpoint.snapshot as snap
from gpumem.arena import HostArena
from gpumem.checkpoint.codec import TensorTable
from gpumem.checkpoint.job import SaveJob, Worker
from gpumem.checkpoint.safe_fs import Dir
from gpumem.checkpoint.snapshot import ArenaLayout, Piece
from gpumem.checksum import chunk_crc32c

CHUNK = 4096


class FakeStream:
    device = torch.device("cuda", 0)

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

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
    real_as_bytes, real_crc = snap.as_bytes, snap.chunk_crc32c
    monkeypatch.setattr(
        snap, "as_bytes", lambda t: real_as_bytes(t.real if isinstance(t, FakeCudaTensor) else t)
    )

    def crc(data, chunk):
        log.append(("crc", data.numel(), cuda.current.name))
        return real_crc(data, chunk)

    monkeypatch.setattr(snap, "chunk_crc32c", crc)
    crc_stream = FakeStream("crc", log)
    monkeypatch.setattr(snap, "_crc_stream", lambda beside: crc_stream)

    def device_crcs(sources, chunk):  # the batched device CRCs: logged, computed natively
        log.append(("device_crcs", [s.numel() for s in sources], cuda.current.name))
        return [real_crc(s, chunk) for s in sources]

    monkeypatch.setattr(snap, "device_crcs", device_crcs)
    return cuda


def _logging_arena(arena: HostArena, cuda: FakeCuda) -> HostArena:
    real = arena.copy_from_device

    def copy_from_device(src, offset):
        cuda.log.append(("copy", offset, src.numel(), cuda.current.name))
        real(src, offset)

    arena.copy_from_device = copy_from_device
    return arena


def _state(cuda: FakeCuda):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3000, generator=g)  # 12000 bytes: three chunks
    b = torch.randn(40, 30, generator=g).t()  # not contiguous: gathered on the copying stream
    c = torch.arange(10, dtype=torch.int64)  # a host tensor among them
    tensors = [FakeCudaTensor(a, cuda, "a"), FakeCudaTensor(b, cuda, "b"), c]
    plan = ArenaLayout(
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
            assert p.crc.tolist() == chunk_crc32c(want, CHUNK).tolist()
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
        done = snap.copy_pieces(
            _logging_arena(arena, cuda),
            plan,
            plan.pieces,
            tensors,
            CHUNK,
            stream=side,
            wait_event=save_event,
        )
        _check_bytes(arena, tensors, plan.pieces)
    assert cuda.current is cuda.compute  # the side stream is current only inside copy_pieces
    assert done.stream == "side"
    start, hashed = (e[1] for e in cuda.log if e[0] == "record" and e[1] != done.name)
    assert cuda.log == [
        ("wait_event", "side", save_event.name),  # before the first read of a parameter
        ("record", start, "side"),  # where the CRC stream starts: after that wait
        ("copy", 0, 12000, "side"),  # the DMA is enqueued at once
        (
            "record_stream",
            "a",
            "side",
        ),  # the allocator must not reuse it before the side stream ran
        ("contiguous", "b", "side"),  # the gathered copy is made (and freed) on the side stream
        ("crc", 4800, "side"),  # ... and hashed there, before its copy
        ("copy", 12288, 4800, "side"),
        ("record_stream", "b", "side"),
        ("wait_event", "crc", start),  # the CRCs read the same bytes, from the same point on
        ("device_crcs", [12000], "crc"),
        ("record_stream", "a", "crc"),
        ("record", hashed, "crc"),
        ("wait_event", "side", hashed),  # the returned event covers the CRCs too
        ("record", done.name, "side"),  # after every copy, on the stream that ran them
    ]


def test_without_a_side_stream_everything_runs_on_the_current_stream(fake_cuda):
    cuda = fake_cuda
    tensors, plan = _state(cuda)
    with HostArena(32768, pinned=False) as arena:
        done = snap.copy_pieces(_logging_arena(arena, cuda), plan, plan.pieces, tensors, CHUNK)
        _check_bytes(arena, tensors, plan.pieces)
    assert done.stream == "compute"
    assert [e for e in cuda.log if e[0] == "wait_event"] == [  # only the CRC stream's, both ways
        ("wait_event", "crc", cuda.log[0][1]),
        ("wait_event", "compute", cuda.log[-3][1]),
    ]
    assert {e[-1] for e in cuda.log if e[0] in ("crc", "copy", "record_stream", "record")} == {
        "compute",
        "crc",
    }
    assert {e[-1] for e in cuda.log if e[0] == "copy"} == {"compute"}
    assert cuda.log[-1] == ("record", done.name, "compute")


def test_host_tensors_alone_need_no_event(fake_cuda):
    c = torch.arange(10, dtype=torch.int64)
    plan = ArenaLayout(
        capacity=4096, streaming=False, batch_sizes=[80], bases=[0], pieces=[Piece(0, 0, 80, 0, 0)]
    )
    with HostArena(4096, pinned=False) as arena:
        assert (
            snap.copy_pieces(
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
    with HostArena(32768, pinned=False) as arena:
        job = SaveJob(
            root=Dir.open(tmp_path),
            root_path=tmp_path,
            step=1,
            tree={"step": 1},
            table=table,
            plan=plan,
            arena=arena,
            mode=mode,
            chunk=CHUNK,
            alignment=4096,
            direct=False,
            group=gpumem.checkpoint._dist.Group(),
            keep=None,
            versions={},
            workers=(Worker("p"), Worker("c")),
            side_stream=side,
            t0=0.0,
        )
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
    records = [e for e in cuda.log if e[0] == "record"][2:]  # after the CRC stream's start and end
    assert len(records) == 1 and records[0][2] == ("side" if mode == "overlap" else "compute")
    # the copy event, and in overlap mode the event of the buffers copied by save(), both waited
    # for while staged was still clear
    want = [("synchronize", records[0][1], False)]
    if mode == "overlap":
        want.append(("synchronize", sync_event.name, False))
    assert syncs == want


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
    from gpumem.checkpoint.errors import CheckpointCorruptError
    from gpumem.checkpoint.state import rng_state
    from gpumem.checkpoint.validate import check_targets

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


def _overlap_job(tmp_path, cuda: FakeCuda, tensors, plan, deferred):
    table = TensorTable(
        names=[f"t{i}" for i in range(len(tensors))],
        tensors=tensors,
        deferred=deferred,
        has_cuda=True,
    )
    arena = HostArena(32768, pinned=False)
    job = SaveJob(
        root=Dir.open(tmp_path),
        root_path=tmp_path,
        step=1,
        tree={"step": 1},
        table=table,
        plan=plan,
        arena=arena,
        mode="overlap",
        chunk=CHUNK,
        alignment=4096,
        direct=False,
        group=gpumem.checkpoint._dist.Group(),
        keep=None,
        versions={},
        workers=(Worker("p"), Worker("c")),
        side_stream=FakeStream("side", cuda.log),
        t0=0.0,
    )
    return job, arena


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
        assert cuda.log == [
            ("wait_event", "compute", job._sync_event.name),
            ("wait_event", "compute", job.copy_event.name),
        ]
    else:
        assert cuda.log == []


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
        job._fail(RuntimeError("copy failed"))
        assert job.enqueued.is_set() and job.fence() is False and job.staged.is_set()
