"""The long-lived background threads of a Checkpointer's saves (persist, overlap copy)."""

from __future__ import annotations

import queue
import threading
from typing import Any


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
