"""What outlives a single call of a Checkpointer: its background threads' shutdown, the close at
the end of a ``with`` block, and the close of every live Checkpointer at interpreter exit (an
asynchronous save's failure must never look like success)."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Any, Protocol

from .errors import CheckpointError
from .workers import Worker


class _Closable(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every open Checkpointer (closed at exit)."""


def stop_workers(workers: tuple[Worker, ...]) -> None:
    for w in workers:
        w.stop()


def close_after(ckpt: _Closable, failing: bool) -> None:
    """close() at the end of a ``with`` block: a save error is raised, or printed when another
    exception is on its way already (it must not be hidden behind the save error)."""
    try:
        ckpt.close()
    except CheckpointError as err:
        if not failing:
            raise
        print(
            f"gpumem: checkpoint save failed while handling another error: {err}", file=sys.stderr
        )


@atexit.register
def _close_all_at_exit() -> None:
    """Interpreter exit: finish every save in flight; a failed one is reported loudly and the
    process exits non-zero (an async failure must never look like success). The save's failure
    (``wait``) and a failure to release the directory (``close``: its lock file) are told apart:
    the latter leaves every committed step as it was."""
    failed = False
    for ckpt in list(LIVE):
        try:
            ckpt.wait()
        except CheckpointError as exc:
            failed = True
            print(f"\ngpumem: CHECKPOINT SAVE FAILED at exit: {exc}\n", file=sys.stderr, flush=True)
        try:
            ckpt.close()
        except CheckpointError as exc:
            failed = True
            print(
                f"\ngpumem: closing the checkpoint directory failed at exit: {exc} (the saves "
                "committed before it stand)\n",
                file=sys.stderr,
                flush=True,
            )
    if failed:
        sys.stdout.flush()
        os._exit(1)
