"""PreemptionGuard: turn SIGTERM / SIGUSR1 into a durable checkpoint and a requeue exit code.

The signal handler only sets a flag: no I/O, no locks, nothing that can deadlock when the signal
lands mid-backward or inside the allocator. The training loop polls ``should_stop(step)`` at step
boundaries (call it in eval/warm-up loops too: a flag polled only in the main loop misses signals
that arrive elsewhere). Under torch.distributed the flag is all-reduced (MAX, on a private gloo
group), so every rank stops at the same step and saves the same one. The final save reuses the
save of this very step if one was already taken (it is fresh: nothing changed since), otherwise
saves the objects of the last save(); then it waits for durability up to the grace deadline,
counted from the signal's arrival, and reports the outcome on stderr. It allocates at most
``FINAL_SAVE_STAGING`` bytes of new host memory: with no (or too small a) staging arena it
streams through a buffer that size rather than allocating the whole state at the signal.
With tiers (``remote=``) durability is the local commit; the upload then gets what is left of
the grace period and the report names the tier(s) holding the final step (the upload still in
flight at the deadline is abandoned: never committed remotely).

Exit codes: ``exit_code`` (the requeue code) when the final step is committed, whether or not the
``latest`` pointer could be moved (restore() does not need it), and also when there was nothing
to save at all (no save() yet and no ``state=``): the job did no harm by stopping, and a requeued
job starts again from where the directory stands. ``failure_exit_code`` only when a final save
was attempted and did not become durable in time.

The notice: ``grace_s`` is what the scheduler grants from the signal to the kill (the provider's
notice: ``gpumem.planner.notice``); without it, ``GPUMEM_GRACE_S`` from the environment, else
30 s. At the stop the guard also says whether the final save fit it: the time from the signal
to durable against the notice (``final_save_s``, ``notice_fit``), on its own stderr line.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from typing import Any

from gpumem._env import env_float

from .errors import CheckpointError, CheckpointStateError
from .group import Group

# Host memory the final save may allocate when no staging arena is there yet (a signal before the
# first save, or a state that outgrew it): it streams through this much instead of allocating and
# faulting in the whole state during the grace period, at a time memory may be short.
FINAL_SAVE_STAGING = 256 << 20
DEFAULT_GRACE_S = 30.0  # where neither grace_s= nor GPUMEM_GRACE_S says (Kubernetes' default)


class PreemptionGuard:
    """Save and stop cleanly when the scheduler asks the job to go.

    Args:
        checkpointer: the Checkpointer to save with.
        signals: signal names (or numbers) that request a stop.
        grace_s: seconds from the signal to the deadline for the checkpoint to be durable: the
            notice the scheduler gives (AWS spot 120, GCP and Azure 30, GKE pods 15, Slurm the
            partition's GraceTime). Default: ``GPUMEM_GRACE_S`` if set, else 30.
        exit_code: the code to exit with after a durable final checkpoint (143 = 128 + SIGTERM;
            set what your scheduler requeues on).
        failure_exit_code: the code when the final checkpoint did not become durable in time.
        state: the objects to save (model=..., optimizer=..., ...); default: those of the last
            save(). Pass it for a requeue-safe stop from the first step: a signal before the
            first save() otherwise has nothing to save (the guard then still exits with
            ``exit_code`` and says so).

    Example:
        >>> guard = gpumem.PreemptionGuard(ckpt, grace_s=30)                   # doctest: +SKIP
        >>> for step in range(start, steps):                                    # doctest: +SKIP
        ...     train_step()
        ...     if guard.should_stop(step):
        ...         sys.exit(guard.exit_code)
    """

    def __init__(
        self,
        checkpointer: Any,
        signals: tuple[str | int, ...] = ("SIGTERM", "SIGUSR1"),
        grace_s: float | None = None,
        exit_code: int = 143,
        failure_exit_code: int = 1,
        state: dict[str, Any] | None = None,
    ):
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointStateError(
                "PreemptionGuard must be created on the main thread (Python delivers signals there)"
            )
        self.checkpointer = checkpointer
        self.grace_s, self.grace_source = _grace(grace_s)
        self._exit_code, self.failure_exit_code = int(exit_code), int(failure_exit_code)
        self.state = state
        self.signum: int | None = None
        self.received_at: float | None = None
        self.saved_step: int | None = None
        self.durable = False
        self.nothing_to_save = False  # the signal came before anything could be saved
        self.uploaded = False  # with tiers: the final step reached the remote in time
        self.outcome = ""
        self.final_save_s: float | None = None  # signal to durable (None: not durable)
        self.notice_fit: bool | None = None  # durable within grace_s (None: nothing to save)
        self._flag = False
        self._stopped = False
        self._group = Group()
        self._previous: dict[int, Any] = {}
        for s in signals:
            num = _signum(s)
            self._previous[num] = signal.signal(num, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # flag only: the work happens at the next step boundary, on the training thread
        if not self._flag:
            self.signum, self.received_at = signum, time.monotonic()
            self._flag = True

    @property
    def requested(self) -> bool:
        """A stop signal arrived in this process (not yet agreed with other ranks)."""
        return self._flag

    @property
    def exit_code(self) -> int:
        """``exit_code`` if the final checkpoint is durable (committed) or there was nothing to
        save, else ``failure_exit_code``."""
        ok = self.durable or self.nothing_to_save
        return self._exit_code if ok else self.failure_exit_code

    def should_stop(self, step: int, **state: Any) -> bool:
        """True when the job must stop at this step; the final checkpoint has then been saved
        (and waited for, up to the grace deadline). ``state`` overrides the objects to save."""
        if self._stopped:
            return True
        flag = self._group.all_reduce(1 if self._flag else 0, "max")
        if not flag:
            return False
        self._stopped = True
        if self.received_at is None:  # another rank got the signal
            self.received_at = time.monotonic()
        deadline = self.received_at + self.grace_s
        t0 = time.monotonic()
        last = self.checkpointer.last_save
        objects = state or self.state or (last[1] if last else None)
        reused = last is not None and last[0] == step and not state
        try:
            if not reused and objects is None:
                self.nothing_to_save = True
                self.outcome = (
                    "nothing to save (no save() yet and no state= given to PreemptionGuard): "
                    "stopped without a checkpoint; a requeued job starts from the directory's "
                    "newest checkpoint, or from scratch"
                )
            else:
                self._final_save(step, objects, reused, deadline, t0)
        except CheckpointError as exc:
            self.durable = False
            self.outcome = f"final checkpoint FAILED: {exc}"
        name = signal.Signals(self.signum).name if self.signum else "a stop request on another rank"
        print(
            f"gpumem: {name} -> stopping at step {step}: "
            f"{self.outcome}; exit code {self.exit_code}",
            file=sys.stderr,
            flush=True,
        )
        if not self.nothing_to_save:
            self.notice_fit = self.final_save_s is not None and self.final_save_s <= self.grace_s
            print(f"gpumem: {self._fit_line()}", file=sys.stderr, flush=True)
        return True

    def _fit_line(self) -> str:
        """Whether the final save was durable within the notice (``grace_s``), and by how much."""
        notice = f"the {self.grace_s:g} s notice (grace_s: {self.grace_source})"
        if self.final_save_s is None:
            return f"final save did NOT fit {notice}: not durable within it"
        margin = self.grace_s - self.final_save_s
        if self.notice_fit:
            return (
                f"final save fit {notice}: durable {self.final_save_s:.2f} s after the signal, "
                f"{margin:.2f} s to spare"
            )
        return (
            f"final save did NOT fit {notice}: durable {self.final_save_s:.2f} s after the "
            f"signal, {-margin:.2f} s late (see `gpumem plan --notice` for what would fit)"
        )

    def _final_save(
        self, step: int, objects: Any, reused: bool, deadline: float, t0: float
    ) -> None:
        ckpt, earlier = self.checkpointer, ""
        stats = ckpt.history[-1] if reused and ckpt.history else None
        if not reused:
            try:  # an earlier background failure is reported, and must not stop the final save
                ckpt.wait(timeout=max(0.0, deadline - time.monotonic()))
            except CheckpointError as exc:
                earlier = f"an earlier save had failed ({exc}); "
            stats = ckpt.save(step, **objects, new_staging_bytes=FINAL_SAVE_STAGING)
        try:
            self.durable = ckpt.wait(timeout=max(0.0, deadline - time.monotonic()))
        except CheckpointError as exc:
            if not reused or objects is None:
                raise CheckpointError(f"{earlier}{exc}") from exc
            # the reused save had failed: one fresh attempt
            stats = ckpt.save(step, **objects, new_staging_bytes=FINAL_SAVE_STAGING)
            self.durable = ckpt.wait(timeout=max(0.0, deadline - time.monotonic()))
        done = time.monotonic()
        self.saved_step = step
        how = "reused the save of this step" if reused else "saved"
        if self.durable:
            assert self.received_at is not None
            self.final_save_s = done - self.received_at
            status = stats.status if stats is not None else "committed"
            self.outcome = f"{earlier}{how}; {status}; durable in {done - t0:.2f} s"
        else:
            self.outcome = f"{earlier}{how}; NOT durable within the {self.grace_s:g} s grace period"
        tiers = getattr(ckpt, "tiers", None)
        if (
            tiers is not None and tiers.url is not None
        ):  # the upload gets what is left of the grace period, no more
            if self.durable:
                idle = tiers.wait(timeout=max(0.0, deadline - time.monotonic()))
                self.uploaded = idle and tiers.uploaded == step
            tiers.stop_waiting()  # close() at exit must not outlast the grace period either
            self.outcome += f"; {tiers.where(step)}" if self.durable else ""

    def close(self) -> None:
        """Reinstate the previous signal handlers."""
        for num, prev in self._previous.items():
            signal.signal(num, prev)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


def _grace(grace_s: float | None) -> tuple[float, str]:
    """(seconds, where they came from): grace_s=, else GPUMEM_GRACE_S, else the default."""
    value, source = grace_s, "given"
    if value is None:
        value, source = env_float("GPUMEM_GRACE_S"), "environment: GPUMEM_GRACE_S"
    if value is None:
        return DEFAULT_GRACE_S, "default; set grace_s= or GPUMEM_GRACE_S to the notice"
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        where = "grace_s" if source == "given" else source.removeprefix("environment: ")
        raise ValueError(f"{where}={value!r}: the notice must be a number of seconds > 0")
    return float(value), source


def _signum(s: str | int) -> int:
    if isinstance(s, int):
        return s
    try:
        return int(getattr(signal, s if s.startswith("SIG") else f"SIG{s}"))
    except AttributeError:
        raise CheckpointStateError(f"unknown signal {s!r}; use names like 'SIGTERM'") from None
