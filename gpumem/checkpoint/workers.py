"""The background threads of a Checkpointer's saves: the long-lived workers (persist, overlap
copy), and how much of the machine the background work of a save may take beside training.

Overlap mode copies, checksums and writes while the next steps train (a blocking save
checksums and writes then too, once its copy is done). torch's intra-op pool
(``torch.get_num_threads()``, every core by default) keeps all cores busy, and its parallel
regions end at a barrier: a background thread that takes a core from one of its threads stalls
the whole region, so the loop loses far more than the background work costs. Two rules keep
it small: the background work runs on at most ``background_threads()`` native threads, the
cores the training process leaves free (at least one), and the checksum and write threads,
which have until the next save to finish, run at a lower priority (``lower_priority``) than
training, so the scheduler gives training its cores first (one file written alone is written
by the long-lived persist thread, which keeps the normal priority); the overlap copy keeps the
normal priority, since the next ``optimizer.step()`` waits for it.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

BACKGROUND_NICE = 5  # niceness added to a save's checksum and write threads in overlap mode


def _save_threads_setting() -> int | None:
    from gpumem._env import env_int

    value = env_int("GPUMEM_SAVE_THREADS")
    if value is not None and value < 1:
        raise ValueError(f"GPUMEM_SAVE_THREADS={value} must be >= 1; unset it for the default")
    return value


def free_cores() -> int:
    """The cores this process may run on (its CPU affinity) less the threads torch computes
    with: what training leaves to a save's background work (0 or less: none)."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores - torch.get_num_threads()


def background_threads() -> int:
    """Native threads a save's background work may use: GPUMEM_SAVE_THREADS, else
    ``free_cores()``, at least 1."""
    value = _save_threads_setting()
    return value if value is not None else max(1, free_cores())


def copy_beside_training() -> bool:
    """Whether an overlap save of host tensors copies them beside training (a background
    thread, while the next forward and backward run) or at once on the caller's thread with
    every core. Beside training only pays where a core is free: torch's parallel regions end at
    a barrier, so a copy thread that takes a core from one of its threads holds the whole region
    up, and the loop loses ~2-3x the copy's CPU time (``benchmarks/results/save_timeline.md``);
    copied at once, it loses the copy itself. GPUMEM_SAVE_THREADS set: beside training, on
    that many threads."""
    return _save_threads_setting() is not None or free_cores() > 0


def lower_priority() -> None:
    """Lower the calling thread's scheduling priority by ``BACKGROUND_NICE`` (Linux sets it per
    thread); best effort elsewhere. A thread cannot raise it again: call it only on threads made
    for this purpose."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class Worker:
    """A daemon thread, started on first use, that runs submitted calls one after another.

    save() hands its background work (persist, overlap copy) to a Checkpointer's workers rather
    than to new threads: Thread.start() returns only once the new thread has run, and a thread
    that goes on running Python keeps the GIL from the starter for up to the switch interval
    (5 ms), which save() would spend waiting. A submitted call must not raise.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any) -> None:
        if self._thread is None or not self._thread.is_alive():
            # each thread its own queue: a stopping one takes nothing new
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=_serve, args=(self._queue,), name=self.name, daemon=True
            )
            self._thread.start()
        self._queue.put(fn)

    def stop(self) -> None:
        """Let the thread end once the calls submitted so far have run."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None


def _serve(calls: queue.SimpleQueue) -> None:
    while (fn := calls.get()) is not None:
        fn()
        # Let go of the job at once, while its Checkpointer still holds it: released later, at
        # stop() say, this could be its last reference, and freeing it here during interpreter
        # exit is what Snapshot.finish() guards against.
        del fn
