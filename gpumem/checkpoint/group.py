"""The few collectives checkpointing needs, on a private gloo group (never the training group).

Background saves and preemption checks run collectives from other threads than the training
loop's; sharing its process group would interleave them with training collectives and deadlock
(the KempnerForge#104 failure). Each user of collectives therefore gets its own gloo group,
created collectively when the object is built, and a roll call (``RollCall``) that names the
ranks missing from a collective after ``timeout_s``. The gloo group itself keeps
torch's default timeout: once every rank has joined, a later collective of a save waits for the
slowest rank's writes, which can take longer than the roll call's deadline on slow storage (a
rank that dies closes its connections, and the others fail at once). Without torch.distributed
every call is local.

The roll call: save() and restore() are collectives. Called on some ranks only (a rank-0-only
checkpoint hook, the Lightning CheckpointIO or HF "main process" pattern), a plain collective
waits forever, or for gloo's 30 minutes, and then cannot say who is missing. So each rank first
writes a key of its own into torch.distributed's store (the one ``init_process_group`` set up)
and waits for every rank's key: after ``timeout_s`` every rank that joined raises
CheckpointStateError naming the ranks that did not. Keys are numbered per collective; a rank
deletes its key of two collectives back, which every rank has passed by then. After a failed
roll call the group is unusable (its ranks no longer agree on the numbering), and says so.

The same store carries rank 0's directory-lock result to the other ranks, which wait for it
without the collective deadline (rank 0 may wait ``lock_timeout_s`` for a job being replaced).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from .errors import CheckpointError, CheckpointStateError


class Group:
    """rank / world size and int collectives; trivial when not running distributed."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.rank, self.world_size, self.pg = 0, 1, None
        self.roll: RollCall | None = None
        dist = torch_distributed()
        if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.pg = _new_gloo_group(dist)
            store = default_store()
            if store is not None:
                self.roll = RollCall(store, self.rank, self.world_size, timeout_s)

    @classmethod
    def private(cls, timeout_s: float) -> Group:
        """Another gloo group over the same ranks, for one background thread's collectives
        (they can then never interleave with this group's, nor with the training's), each
        waiting up to ``timeout_s``; no roll call. Created collectively, like any group."""
        g = cls.__new__(cls)
        g.rank, g.world_size, g.pg, g.roll = 0, 1, None, None
        dist = torch_distributed()
        if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
            g.rank, g.world_size = dist.get_rank(), dist.get_world_size()
            g.pg = _new_gloo_group(dist, timedelta(seconds=timeout_s))
        return g

    def join(self, what: str) -> None:
        """Wait until every rank has reached this collective (see ``collective.RollCall``)."""
        if self.roll is not None:
            self.roll.join(what)

    def publish(self, name: str, value: str) -> None:
        if self.roll is not None:
            self.roll.publish(name, value)

    def await_value(self, name: str, timeout_s: float, what: str) -> str:
        """What rank 0 published under ``name``; CheckpointStateError after ``timeout_s``."""
        if self.roll is None:
            return ""
        value = self.roll.await_value(name, timeout_s)
        if value is None:
            raise CheckpointStateError(f"rank 0 did not report {what} within {timeout_s:g} s")
        return value

    def from_rank0(self, name: str, value: int, timeout_s: float, what: str) -> int:
        """Rank 0's ``value`` on every rank. Through the store where there is one: the other
        ranks wait ``timeout_s`` for it (CheckpointStateError after that) rather than in a
        collective; else an all-gather."""
        if self.roll is not None:
            if self.rank == 0:
                self.roll.publish(name, str(value))
                return value
            return int(self.await_value(name, timeout_s, what))
        return self.all_gather([value])[0][0]

    def all_reduce(self, value: int, op: str) -> int:
        """``op`` in {"min", "max"} over every rank."""
        if self.pg is None:
            return value
        dist = torch_distributed()
        t = torch.tensor([value], dtype=torch.int64)
        with peers_gone():
            dist.all_reduce(
                t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.pg
            )
        return int(t.item())

    def all_gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on all ranks), indexed by rank."""
        if self.pg is None:
            return [list(values)]
        dist = torch_distributed()
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with peers_gone():
            dist.all_gather(out, mine, group=self.pg)
        return [t.tolist() for t in out]

    def all_gather_bytes(self, data: bytes, sizes: list[int]) -> list[bytes]:
        """Every rank's ``data``, indexed by rank; ``sizes[r]`` is rank r's ``len(data)``, known
        to every rank already (from an earlier ``all_gather``), so this is one collective."""
        if self.pg is None:
            return [data]
        dist = torch_distributed()
        width = max(sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with peers_gone():
            dist.all_gather(out, mine, group=self.pg)
        return [t[:n].numpy().tobytes() for t, n in zip(out, sizes, strict=True)]

    def broadcast_text(self, text: str, src: int) -> str:
        """``src``'s ``text`` on every rank (UTF-8 bytes in a tensor: no pickle)."""
        if self.pg is None:
            return text
        dist = torch_distributed()
        data = text.encode()[:65536] if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        with peers_gone():
            dist.broadcast(size, src=src, group=self.pg)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if self.rank == src and data:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            if buf.numel():
                dist.broadcast(buf, src=src, group=self.pg)
        return bytes(buf.tolist()).decode(errors="replace")


@contextlib.contextmanager
def peers_gone() -> Iterator[None]:
    """A gloo error mid-collective (a peer's connection closed or timed out) as a
    CheckpointError that says what it means for the checkpoint."""
    try:
        yield
    except RuntimeError as exc:
        raise CheckpointError(
            "a collective with the other ranks failed: a rank died, left, or is stuck past "
            f"collective_timeout_s; nothing was committed ({str(exc)[:300]})"
        ) from exc


def _new_gloo_group(dist: Any, timeout: timedelta | None = None) -> Any:
    """A new gloo group over every rank (collectively), ``timeout`` or torch's default."""
    global _EXIT_HOOK
    pg = dist.new_group(backend="gloo", **({} if timeout is None else {"timeout": timeout}))
    if not _EXIT_HOOK:
        _EXIT_HOOK = True
        atexit.register(_let_gloo_threads_finish)
    return pg


def _let_gloo_threads_finish() -> None:
    """At interpreter exit, give gloo's worker threads the GIL once more. A gloo collective's
    worker drops its last reference to the collective's tensors after the caller has seen it
    complete, and that needs the GIL; a process that exits right after a collective (say a
    rank that raised on a directory it cannot open) finalizes Python while the worker waits
    for it, and Python's finalization ends such a thread with an unwind that aborts the whole
    process ("terminate called without an active exception", SIGABRT). Sleeping here, before
    finalization begins and with the GIL released, lets the waiting worker finish."""
    time.sleep(_EXIT_GRACE_S)


_EXIT_HOOK = False  # _let_gloo_threads_finish is registered (once per process)
_EXIT_GRACE_S = 0.05


def torch_distributed():
    """``torch.distributed`` where this torch build has it, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() else None


_GROUPS = itertools.count()  # groups are created in the same order on every rank (new_group)


class RollCall:
    """Store-based join of the ranks of one group."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.prefix = f"gpumem/ckpt/{next(_GROUPS)}"
        self.seq = 0
        self.broken: str | None = None

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def join(self, what: str) -> None:
        """Return once every rank has called ``join`` for the same collective.

        Raises:
            CheckpointStateError: ranks missing after ``timeout_s`` (named), or an earlier roll
                call failed.
        """
        if self.broken is not None:
            raise CheckpointStateError(
                f"{what}: an earlier checkpoint collective failed ({self.broken}); the ranks no "
                "longer agree on which call is which: create a new Checkpointer on every rank"
            )
        self.seq += 1
        keys = [self._key(self.seq, r) for r in range(self.world_size)]
        self.store.set(keys[self.rank], what)
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # DistStoreError or RuntimeError, by torch version
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:  # they all arrived just now
                return self._tidy()
            self.broken = f"rank(s) {missing} did not join {what}"
            raise CheckpointStateError(
                f"{what}: rank(s) {missing} of {self.world_size} did not join within "
                f"{self.timeout_s:g} s (collective_timeout_s): they died, or do not call it. "
                "save() and restore() are collectives: call them on every rank at the same "
                "point, also from checkpoint hooks that run on the main process only"
            ) from None
        self._tidy()

    def _tidy(self) -> None:
        if self.seq > 2:
            # a store without delete_key keeps the (small) key
            with contextlib.suppress(Exception):
                self.store.delete_key(self._key(self.seq - 2, self.rank))

    def publish(self, name: str, value: str) -> None:
        self.store.set(f"{self.prefix}/{name}", value)

    def await_value(self, name: str, timeout_s: float) -> str | None:
        """The value rank 0 published under ``name``, or None after ``timeout_s``."""
        key = f"{self.prefix}/{name}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.store.wait(
                    [key], timedelta(seconds=max(0.01, min(5.0, deadline - time.monotonic())))
                )
                return bytes(self.store.get(key)).decode()
            except Exception:
                if time.monotonic() >= deadline:
                    return None


def default_store() -> Any:
    """The store of the default process group (None where torch lacks the accessor)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None
