"""What one rank of a save writes: its data files from the staged snapshot, the CRC32Cs of its
host-staged pieces, and its shard manifest.

Each batch of the snapshot's plan is one data file, written from its arena slot with one large
``pwrite`` (``O_DIRECT`` where the file system allows) and ``fdatasync``'ed; several are written
at once (``write_batches``), so the disk queue never drains while one file's ``fdatasync``
waits. The chunk CRC32Cs of pieces staged from host tensors are computed from the staged bytes on
a thread of their own (``HostChecksums``), batch by batch, beside the writes: the disk is the
bottleneck there, never the copy the caller waits for (device pieces were checksummed on the GPU
as they were copied).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gpumem.checksum import chunk_crc32c

from ..capture.training_state import Capture
from ..stage.pieces import Piece, StagingPlan
from ..stage.snapshot import Mode, Snapshot
from ..workers import lower_priority
from .format import Manifest, data_file_name, shard_manifest, tensor_entry
from .safe_fs import Dir

_WRITERS = 4  # data files written at once


def write_batches(
    tmp: Dir, snapshot: Snapshot, rank: int, batches: range, direct: bool
) -> list[tuple[str, int]]:
    """Write ``batches`` of the snapshot as data files into ``tmp``, by up to ``_WRITERS`` plain
    threads (an executor would refuse work at interpreter exit, when a save in flight must still
    finish); one batch is written on the calling thread. Returns (file name, size) of each."""
    if len(batches) == 1:
        return [_write_batch(tmp, snapshot, rank, batches[0], direct)]
    results: list[tuple[str, int] | None] = [None] * len(batches)
    errors: list[BaseException] = []
    todo = iter(range(len(batches)))
    lock = threading.Lock()

    def worker() -> None:
        if snapshot.beside_training:  # training, which must keep its cores, goes on meanwhile
            lower_priority()
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = _write_batch(tmp, snapshot, rank, batches[i], direct)
            except BaseException as exc:
                errors.append(exc)

    threads = [
        threading.Thread(target=worker, name="gpumem-ckpt-write", daemon=True)
        for _ in range(max(1, min(len(batches), _WRITERS)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def planned_files(plan: StagingPlan, rank: int) -> dict[str, int]:
    """The data files of this rank's plan and their sizes, as ``write_batches`` writes them."""
    return {data_file_name(rank, b): size for b, size in enumerate(plan.batch_sizes)}


def _write_batch(tmp: Dir, snapshot: Snapshot, rank: int, b: int, direct: bool) -> tuple[str, int]:
    """Write batch b's slot as data file b (fdatasync'ed); returns (file name, size)."""
    plan = snapshot.plan
    name, size = data_file_name(rank, b), plan.batch_sizes[b]
    buf = snapshot.arena.view(plan.slot_base(b), size) if size else None
    tmp.write_pieces(name, [(0, buf)] if buf is not None else [], size, direct, snapshot.threads)
    return name, size


class HostChecksums:
    """The chunk CRC32Cs of a snapshot's host-staged pieces, batch by batch on a thread of its
    own. In blocking mode, and outside batched mode, it starts only once the whole state is
    staged: the copy is what training waits for (save() or the optimizer hook) and on a small
    machine a concurrent CRC would take cores from it; it then runs beside the disk write, which
    is slower than both.
    ``done[b]`` is set once batch b is checksummed (or the save failed); ``then`` runs on this
    thread once every batch is (its failure fails the save)."""

    def __init__(self, snapshot: Snapshot, step: int, then: Callable[[], None] | None = None):
        self.snapshot = snapshot
        self._then = then
        self.done = [threading.Event() for _ in snapshot.plan.batch_sizes]
        self._thread = threading.Thread(
            target=self._main, daemon=True, name=f"gpumem-ckpt-crc-{step}"
        )
        self._thread.start()

    def _main(self) -> None:
        snap = self.snapshot
        plan = snap.plan
        if snap.beside_training:  # training, which must keep its cores, goes on meanwhile
            lower_priority()
        try:
            if not snap.batched or snap.mode is Mode.BLOCKING:  # the caller waits for the copy
                snap.staged.wait()
            for b in range(len(plan.batch_sizes)):
                snap.wait_ready(b)
                checksum_host_pieces(
                    snap.arena, plan, plan.batch_pieces(b), snap.chunk, snap.threads
                )
                self.done[b].set()
            if self._then is not None:
                self._then()
        except BaseException as exc:  # the save's own failure, or this thread's
            snap.fail(exc)
        finally:
            for ev in self.done:
                ev.set()

    def wait(self, batches: range) -> None:
        for b in batches:
            self.done[b].wait()

    def join(self) -> None:
        self._thread.join()


def checksum_host_pieces(
    arena: Any, plan: StagingPlan, pieces: list[Piece], chunk: int, threads: int | None = None
) -> None:
    """CRCs of pieces staged from host tensors, from the staged copy (off the training thread),
    on ``threads`` native threads (None: all cores)."""
    for p in pieces:
        if p.crc is None:
            view = arena.view(plan.slot_base(p.batch) + p.offset, p.nbytes)
            p.crc = chunk_crc32c(view, chunk, threads=threads)


def tensor_crcs(plan: StagingPlan, count: int) -> list[list[int]]:
    """Per-tensor chunk CRC lists, concatenated over each tensor's pieces (pieces are chunk
    aligned)."""
    out: list[list[int]] = [[] for _ in range(count)]
    for p in plan.pieces:  # host int64 values (native) or int32 bits (device_crcs)
        assert p.crc is not None
        crc = p.crc if p.crc.device.type == "cpu" else p.crc.cpu()  # .cpu(): ~10 us each
        out[p.index].extend(int(x) & 0xFFFFFFFF for x in crc.tolist())
    return out


def rank_manifest(
    captured: Capture,
    snapshot: Snapshot,
    *,
    rank: int,
    world_size: int,
    step: int,
    alignment: int,
    files: dict[str, int],
) -> Manifest:
    """This rank's shard manifest: a tensor entry per staged tensor (its chunk CRCs, its extents
    in the data files, for a DTensor block its place in the global tensor), the state tree."""
    table, plan = snapshot.table, snapshot.plan
    crcs = tensor_crcs(plan, len(table.tensors))
    extents: list[list[list[Any]]] = [[] for _ in table.tensors]
    for p in plan.pieces:
        extents[p.index].append([data_file_name(rank, p.batch), p.offset, p.nbytes])
    meshes: dict[Any, int] = {}
    entries = []
    for i, (name, t, block) in enumerate(
        zip(table.names, table.tensors, table.blocks, strict=True)
    ):
        where: dict[str, Any] = {}
        if block is not None:
            mesh = meshes.setdefault(block.mesh, len(meshes))
            where = {"block": block.box, "mesh": mesh, "placements": block.placements}
        entries.append(tensor_entry(name, t.dtype, t.shape, crcs[i], extents[i], **where))
    replication = captured.replication
    return shard_manifest(
        rank=rank,
        world_size=world_size,
        step=step,
        chunk_bytes=snapshot.chunk,
        alignment=alignment,
        files=files,
        tensors=entries,
        state=captured.tree,
        meshes=list(meshes) if table.sharded else None,
        owners=replication.owners if replication is not None else None,
    )
