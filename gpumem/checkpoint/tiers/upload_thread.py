"""The uploader thread of a Checkpointer's remote tier: jobs handed over under one condition, run
one at a time, the thread started on first use and let go by ``close()``.

``remote.Tiers`` (rank 0 uploads the newest waiting save) and ``node_uploads.NodeUploads`` (every
rank uploads every save, in order) differ only in which job runs next (``take``) and in what
running one means (``run``); the condition is theirs too, for what they wait on besides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class UploadThread:
    """Runs ``run(item)`` on one daemon thread for every item ``take()`` hands out.

    Args:
        take: called with ``cond`` held: the next item (and removes it from its queue), or None
            while there is none.
        run: runs one item, without ``cond``; an exception it lets out is the caller's bug, and
            ends nothing but that item.
    """

    def __init__(self, take: Callable[[], Any], run: Callable[[Any], None]):
        self.cond = threading.Condition()
        self.running: Any = None  # the item being run, or None
        self.closed = False
        self._take, self._run = take, run
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """After an item was queued, with ``cond`` held: start the thread if needed, wake it."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="gpumem-ckpt-upload", daemon=True
            )
            self._thread.start()
        self.cond.notify_all()

    def close(self) -> None:
        """Let the thread end once nothing is queued (it is not waited for)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while (item := self._take()) is None and not self.closed:
                    self.cond.wait()
                if item is None:
                    return
                self.running = item
            try:
                self._run(item)
            finally:
                with self.cond:
                    self.running = None
                    self.cond.notify_all()
