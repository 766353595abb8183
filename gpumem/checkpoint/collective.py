"""A roll call before each checkpoint collective: who joined, within a deadline.

save() and restore() are collectives. Called on some ranks only (a rank-0-only checkpoint hook,
the Lightning CheckpointIO or HF "main process" pattern), a plain collective waits forever, or
for gloo's 30 minutes, and then cannot say who is missing. So each rank first writes a key of
its own into torch.distributed's store (the one ``init_process_group`` set up) and waits for
every rank's key: after ``timeout_s`` every rank that joined raises CheckpointStateError naming
the ranks that did not. Keys are numbered per collective; a rank deletes its key of two
collectives back, which every rank has passed by then. After a failed roll call the group is
unusable (its ranks no longer agree on the numbering), and says so.

The same store carries rank 0's directory-lock result to the other ranks, which wait for it
without the collective deadline (rank 0 may wait ``lock_timeout_s`` for a job being replaced).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from datetime import timedelta
from typing import Any

from .errors import CheckpointStateError

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
