"""What every trainer callback shares once built: its exit code and its release."""

from __future__ import annotations

from gpumem.checkpoint import Checkpointer, PreemptionGuard


class GuardedCallback:
    """A mixin for callbacks that hold a ``Checkpointer`` (``ckpt``) and, with
    ``preemption=True``, a ``PreemptionGuard`` (``guard``) that sets ``stopped``."""

    ckpt: Checkpointer | None
    guard: PreemptionGuard | None
    stopped: bool

    @property
    def exit_code(self) -> int:
        """0 unless a preemption stopped the run: then the guard's (143 after a durable save)."""
        return self.guard.exit_code if self.stopped and self.guard is not None else 0

    def close(self) -> None:
        """Wait for the last save and release the Checkpointer and the signal handlers."""
        if self.guard is not None:
            self.guard.close()
        if self.ckpt is not None:
            self.ckpt.close()
