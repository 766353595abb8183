"""Coalescing saves (``Checkpointer(..., coalesce=True)``): a checkpoint every step without
making save() wait for the disk.

Every save() snapshots into host memory, in one of two staging slots (``Staging`` holds both:
the arena and a spare one of the same size). While the persist thread writes one snapshot, the
next one waits in the other slot; a newer save() does not wait for the writer but *supersedes* the
waiting snapshot: it takes that slot, and the superseded save is never written. So the disk
always writes the newest state it can, the step lost to a crash is at most the one being
written plus the one waiting, and a PreemptionGuard's final ``wait()`` persists the last
snapshot.

The race between the persist thread starting a waiting save and a newer save() superseding it
is settled under one lock: a save either started persisting (``claim`` returned True: it will
be written, and the new save takes the other slot) or was superseded (``claim`` returns False
when its turn comes, and it ends without writing anything).

Single process only: which saves are superseded depends on timing, and every rank of a
distributed job would have to agree on it before writing (not done yet).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CheckpointError


class Coalescer:
    """The two staging slots and the saves in flight of a coalescing Checkpointer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[Any] = []  # saves (``save.Save``) not yet finished, oldest first
        self._persisting: set[int] = set()  # id() of the jobs whose persist started
        self._slot: dict[int, int] = {}

    def choose(self) -> tuple[int, Any]:
        """(slot for the next snapshot, the waiting save it supersedes or None). A superseded
        save is marked at once, so the persist thread will not start it; the caller waits for its
        copy to finish (``staged``) before writing into its slot."""
        with self._lock:
            # finished saves are dropped, except failed ones not yet reported (take_error)
            self._jobs = [
                j
                for j in self._jobs
                if not j.done.is_set() or (j.error is not None and not j.reported)
            ]
            live = [j for j in self._jobs if not j.done.is_set() and j.stats.superseded_by is None]
            waiting = [j for j in live if id(j) not in self._persisting]
            if waiting:
                victim = waiting[-1]
                victim.stats.superseded_by = -1  # the new step, set by supersede()
                return self._slot[id(victim)], victim
            busy = {self._slot[id(j)] for j in live}
            return (0 if 0 not in busy else 1), None

    def add(self, job: Any, slot: int, victim: Any) -> None:
        """Track ``job`` (in ``slot``); ``victim`` (from choose()) is superseded by its step."""
        with self._lock:
            self._slot[id(job)] = slot
            self._jobs.append(job)
            if victim is not None:
                victim.stats.superseded_by = job.step
                job.stats.supersedes = victim.step

    def claim(self, job: Any) -> bool:
        """Called by the persist thread before it writes ``job``: True to write it, False when a
        newer save superseded it."""
        with self._lock:
            if job.stats.superseded_by is not None:
                return False
            self._persisting.add(id(job))
            return True

    def release(self, job: Any) -> None:
        with self._lock:
            self._persisting.discard(id(job))
            self._slot.pop(id(job), None)

    def take_error(self, newest: Any) -> CheckpointError | None:
        """The first unreported failure of a save older than ``newest`` (those are not the
        Checkpointer's current job, so nothing else would report them)."""
        with self._lock:
            jobs = list(self._jobs)
        for j in jobs:
            if j is not newest and j.done.is_set() and j.error is not None and not j.reported:
                err = j.take_error()
                if err is not None:
                    return err
        return None
