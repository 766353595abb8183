"""gpumem checkpointing for the Lightning ``Trainer``.

    from gpumem.integrations.lightning import CheckpointCallback

    cb = CheckpointCallback("ckpts", every_n_train_steps=100, preemption=True)
    trainer = lightning.pytorch.Trainer(..., callbacks=[cb])
    trainer.fit(model, datamodule)                 # resumes from the newest checkpoint
    sys.exit(cb.exit_code)                         # 143 after a preemption with a durable save

Every ``every_n_train_steps`` optimizer steps, on every rank (``save()`` is a collective: the
callback runs on all ranks, unlike a CheckpointIO plugin, which Lightning calls on rank 0 only
under DDP), it saves the LightningModule, the optimizers, the LR schedulers, every rank's RNG
states and the fit loop's progress (``trainer.fit_loop``, Lightning's own resume state, which
also carries the state of resumable data loaders). In ``on_fit_start``, once the strategy has set
up the model and optimizers and before the first batch, it restores the newest checkpoint that
verifies, so ``trainer.fit()`` continues where the saved run stopped, Lightning's loops skipping
what the restored progress says is done. Pass ``ckpt_path`` to ``fit()`` for Lightning's own
checkpoints only; with both, gpumem's restore runs last.

Which loaders resume exactly, on one device and under DDP, is the table in docs/checkpoint.md
(each cell tested). Lightning saves a loader's position only when it has ``state_dict`` /
``load_state_dict`` (torchdata's ``StatefulDataLoader``; its state rides in the fit loop's, so
gpumem saves and restores it); a plain ``DataLoader`` resumes exactly only from an epoch's end.

The global RNG states: a sampler without a generator of its own (torch's ``RandomSampler``)
draws each epoch's order from them when the epoch's iterator is built, and dropout draws from
them at every step. So the callback keeps the states of the running epoch's start (taken in
``on_fit_start`` for the first epoch, whose iterator Lightning builds before
``on_train_epoch_start``, and in that hook for the others) and saves them with the fit loop's
state. After a mid-epoch restore it sets those before Lightning rebuilds the interrupted epoch's
iterator (the order is drawn again as it was), and the states saved at the stop in the first
``on_train_batch_start`` (dropout draws on as it did). After a stop at an epoch's end with a
resumable loader, Lightning builds the restored loader's iterator once more than the
uninterrupted run did, so the saved states are set again in the next ``on_train_epoch_start``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from gpumem.checkpoint import Checkpointer, CheckpointStateError, PreemptionGuard
from gpumem.checkpoint.capture.training_state import rng_state
from gpumem.checkpoint.optimizer_hooks import prepare_first_save
from gpumem.checkpoint.restore.load import set_rng_state
from gpumem.integrations._guarded import GuardedCallback


class CheckpointCallback(GuardedCallback, Callback):
    """Save and resume a Lightning Trainer with gpumem (see the module docs).

    Args:
        directory: the checkpoint directory.
        every_n_train_steps: save every this many optimizer steps (None: only on preemption).
        preemption: install a ``PreemptionGuard`` (SIGTERM / SIGUSR1: save at the next batch end,
            wait until durable, stop the trainer); ``exit_code`` tells what to exit with.
        grace_s: the guard's deadline for the final save, from the signal: the scheduler's
            notice (default: ``GPUMEM_GRACE_S``, else 30 s).
        resume: restore the newest checkpoint in ``on_fit_start``.
        **checkpointer: more ``Checkpointer`` arguments (keep, replicated, staging_bytes, ...).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_n_train_steps: int | None = None,
        preemption: bool = False,
        grace_s: float | None = None,
        resume: bool = True,
        **checkpointer: Any,
    ) -> None:
        super().__init__()
        n = every_n_train_steps
        if n is not None and (not isinstance(n, int) or n < 1):
            raise CheckpointStateError(f"every_n_train_steps={n!r} must be a positive int")
        self.directory, self.every = Path(directory), n
        self.preemption, self.grace_s, self.resume = preemption, grace_s, resume
        self.options = checkpointer
        self.ckpt: Checkpointer | None = None
        self.guard: PreemptionGuard | None = None
        self.restored_step: int | None = None
        self.stopped = False
        self._last = -1
        # RNG states (module docs): set again at the first batch; of the running epoch's start
        # (saved with the fit loop); set again at the next epoch's start
        self._rng: dict[str, Any] | None = None
        self._epoch_rng: dict[str, Any] | None = None
        self._epoch_start_rng: dict[str, Any] | None = None
        self._first_epoch = False
        self._loader_state = False  # whether the restored fit loop held loaders' positions

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.ckpt is None:
            options = dict(self.options)
            options.setdefault("replicated", _is_ddp(trainer))
            self.ckpt = Checkpointer(self.directory, **options)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.ckpt is not None
        self._epoch_rng, self._loader_state = None, False
        if self.resume:
            self.restored_step = self.ckpt.restore(**self._objects(trainer, pl_module))
        else:  # restore() prepares the first save's arena, so do we
            objects = self._objects(trainer, pl_module)
            prepare_first_save(self.ckpt, objects["model"], objects["optimizer"])
        if self.restored_step is None:  # a fresh start: the first epoch's states are these
            self._first_epoch, self._epoch_rng = True, rng_state()
            return
        self._last = self.restored_step
        if _mid_epoch(trainer):
            self._rng = rng_state()
            if self._epoch_rng is not None:  # the interrupted epoch's order is drawn next
                set_rng_state(self._epoch_rng)
        elif self._loader_state:
            self._epoch_start_rng = rng_state()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._epoch_start_rng is not None:  # see the module docs
            set_rng_state(self._epoch_start_rng)
            self._epoch_start_rng = None
        if self._first_epoch:  # its states were taken in on_fit_start
            self._first_epoch = False
        else:
            self._epoch_rng = rng_state()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:  # the loader is set up: draw on from the saved point
            set_rng_state(self._rng)
            self._rng = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # installed after Lightning's own SIGTERM handler (registered once fit starts), so a
        # preemption saves and stops cleanly instead of Lightning's raise-and-exit
        if self.preemption and self.guard is None:
            assert self.ckpt is not None
            self.guard = PreemptionGuard(self.ckpt, grace_s=self.grace_s)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        objects = self._objects(trainer, pl_module)
        if self.every and step % self.every == 0 and step != self._last:
            assert self.ckpt is not None
            self.ckpt.save(step, **objects)
            self._last = step
        if self.guard is not None and self.guard.should_stop(step, **objects):
            trainer.should_stop = True
            self.stopped = True

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.close()

    def _objects(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        optimizers = list(trainer.optimizers)
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        stateful: dict[str, Any] = {"fit_loop": _FitLoopState(trainer.fit_loop, self)}
        stateful.update((f"optimizer_{i}", o) for i, o in enumerate(optimizers[1:], start=1))
        stateful.update((f"scheduler_{i}", s) for i, s in enumerate(schedulers[1:], start=1))
        return {
            "model": pl_module,
            "optimizer": optimizers[0] if optimizers else None,
            "scheduler": schedulers[0] if schedulers else None,
            "stateful": stateful,
        }


class _FitLoopState:
    """Lightning's fit loop state, plus the RNG states at the start of the epoch it stopped in
    under one more key (a checkpoint without it restores as before; Lightning ignores it)."""

    KEY = "gpumem_epoch_start_rng"

    def __init__(self, loop: Any, callback: CheckpointCallback) -> None:
        self.loop, self.callback = loop, callback

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.loop.state_dict())
        if self.callback._epoch_rng is not None:
            state[self.KEY] = self.callback._epoch_rng
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.callback._epoch_rng = state.pop(self.KEY, None)
        # the loaders' positions, where Lightning's loop keeps them (resumable loaders only)
        loaders = (state.get("state_dict") or {}).get("combined_loader")
        self.callback._loader_state = bool(loaders)
        self.loop.load_state_dict(state)


def _mid_epoch(trainer: Any) -> bool:
    """Whether the restored fit loop stopped inside an epoch (not after its last batch)."""
    # saved in on_train_batch_end: "ready" counts this epoch's batches, "completed" lags by one
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.ready > 0 and not progress.is_last_batch


def _is_ddp(trainer: Any) -> bool:
    name = type(trainer.strategy).__name__
    return trainer.world_size > 1 and name.startswith("DDP")
