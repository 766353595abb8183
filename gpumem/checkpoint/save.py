"""One save() in flight: its snapshot (the stage) and its commit (the storage), run in order.

``Checkpointer.save`` builds the three parts and hands them over: ``capture`` made the tree and
the tensors, the ``Snapshot`` copies them into host memory (on the caller's thread, and in
overlap mode on the copier thread), the ``Commit`` writes and commits them on the persist
thread. ``Save`` starts the persist thread at the point where it has something to do (before
the copy when the caller's copy pipelines batch by batch: streaming mode, blocking mode over host
tensors; after it otherwise), runs the copy,
and after the commit releases what the save held. Its failure, from either side, is kept in the
snapshot and reported once (``take_error``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

from .errors import CheckpointError
from .stage.snapshot import Mode, Snapshot
from .storage.commit import Commit, as_error
from .workers import Worker


class Save:
    """The handle of one save: ``done`` is set once it is committed or failed.

    Args:
        snapshot: the copy into host memory (``stage.snapshot``).
        commit: the writes and the commit (``storage.commit``).
        persister: the worker thread that runs the commit.
        coalescer: with ``coalesce=True``, the Coalescer that may supersede this save before it
            is written (see ``stage.coalesce``); ``slot``/``victim`` are what it chose.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        commit: Commit,
        persister: Worker,
        coalescer: Any = None,
        slot: int = 0,
        victim: Any = None,
    ):
        self.snapshot, self.commit, self.step = snapshot, commit, commit.step
        self.stats = snapshot.stats
        self.staged = snapshot.staged
        self.done = threading.Event()
        self.reported = False
        self._persister = persister
        self._started = False
        self.coalescer = coalescer
        if coalescer is not None:
            coalescer.add(self, slot, victim)

    @property
    def error(self) -> BaseException | None:
        return self.snapshot.error

    def run(self) -> None:
        """The caller's part: start the persist thread when it has work, and copy."""
        snap = self.snapshot
        if snap.batched and snap.mode is not Mode.OVERLAP:  # it writes batch b while b+1 is copied
            self._start()
        self.snapshot.run_caller()
        self._start()  # also after a failed copy: the persist thread tells the other ranks

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._persister.submit(self._persist)

    def _persist(self) -> None:
        try:
            if self.coalescer is None or self.coalescer.claim(self):
                self.commit.run()
        except BaseException as exc:
            self.snapshot.fail(exc)
        finally:
            try:
                if self.coalescer is not None:
                    self.coalescer.release(self)
                self.snapshot.finish()
                self.commit.close()
            except BaseException as exc:
                self._failed_late(exc)
            finally:
                self.done.set()  # on every path: wait(), close() and the next save() wait for it

    def _failed_late(self, exc: BaseException) -> None:
        """A failure releasing what the save held, once its outcome is decided, never changes
        that outcome: a committed step stays committed (its files and its rename were fsync'ed)
        and the failure is a RuntimeWarning; a save not committed fails (with its first
        failure, else this one)."""
        if not self.stats.committed:
            self.snapshot.fail(exc)
            return
        with contextlib.suppress(Exception):  # a warnings filter of "error": the save is done
            warnings.warn(
                f"step {self.step} is committed, but releasing what its save held failed "
                f"({type(exc).__name__}: {exc})",
                RuntimeWarning,
                stacklevel=1,
            )

    def take_error(self) -> CheckpointError | None:
        """The save's failure as a CheckpointError, once (later calls return None); with a
        coalescer, else the first unreported failure of an older save."""
        if self.error is not None and not self.reported:
            self.reported = True
            return as_error(self.error, self.step)
        return self.coalescer.take_error(self) if self.coalescer is not None else None
