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

Exact mid-epoch resume needs a resumable loader: Lightning saves a loader's position only when
it has ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``; its state rides
in the fit loop's, so gpumem saves and restores it). A plain ``DataLoader`` (shuffled or not)
restarts the interrupted epoch from its first batch (Lightning warns), so only a stop at an
epoch boundary resumes exactly. Under DDP shuffle with
``sampler=torch.utils.data.RandomSampler`` (Lightning swaps it for its seeded
``DistributedSampler``), not ``shuffle=True``, whose torchdata sampler Lightning wraps, drawing
each epoch's order from the global generator. Between the restore and the first resumed batch
Lightning builds the loader's iterator and restores its position, which draws from the global
generators; the uninterrupted run drew that at the epoch's start. So after a mid-epoch restore
the callback sets the restored RNG states again in the first ``on_train_batch_start``: dropout
draws what it drew in the uninterrupted run.
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
        self._rng: dict[str, Any] | None = None  # RNG states to set again at the first batch

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.ckpt is None:
            options = dict(self.options)
            options.setdefault("replicated", _is_ddp(trainer))
            self.ckpt = Checkpointer(self.directory, **options)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.ckpt is not None
        if self.resume:
            self.restored_step = self.ckpt.restore(**self._objects(trainer, pl_module))
            if self.restored_step is not None:
                self._last = self.restored_step
                if _mid_epoch(trainer):
                    self._rng = rng_state()
        else:  # restore() prepares the first save's arena, so do we
            objects = self._objects(trainer, pl_module)
            prepare_first_save(self.ckpt, objects["model"], objects["optimizer"])

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

    @staticmethod
    def _objects(trainer: Any, pl_module: Any) -> dict[str, Any]:
        optimizers = list(trainer.optimizers)
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        stateful: dict[str, Any] = {"fit_loop": trainer.fit_loop}
        stateful.update((f"optimizer_{i}", o) for i, o in enumerate(optimizers[1:], start=1))
        stateful.update((f"scheduler_{i}", s) for i, s in enumerate(schedulers[1:], start=1))
        return {
            "model": pl_module,
            "optimizer": optimizers[0] if optimizers else None,
            "scheduler": schedulers[0] if schedulers else None,
            "stateful": stateful,
        }


def _mid_epoch(trainer: Any) -> bool:
    """Whether the restored fit loop stopped inside an epoch (not after its last batch)."""
    # saved in on_train_batch_end: "ready" counts this epoch's batches, "completed" lags by one
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.ready > 0 and not progress.is_last_batch


def _is_ddp(trainer: Any) -> bool:
    name = type(trainer.strategy).__name__
    return trainer.world_size > 1 and name.startswith("DDP")
