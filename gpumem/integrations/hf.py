"""gpumem checkpointing for the transformers ``Trainer``.

    from gpumem.integrations.hf import CheckpointCallback

    args = TrainingArguments(..., save_strategy="no")  # gpumem saves: no checkpoint-N as well
    cb = CheckpointCallback("ckpts", every_n_train_steps=100, preemption=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from(trainer))
    sys.exit(cb.exit_code)             # 143 after a preemption with a durable final save

Every ``every_n_train_steps`` optimizer steps (and on SIGTERM / SIGUSR1 with
``preemption=True``) the callback saves the model, the optimizer, the LR scheduler, every rank's
RNG states and the ``TrainerState`` with a ``gpumem.Checkpointer`` (all ranks, in the
background). The Trainer itself skips the batches a resumed run has already consumed, from the
``TrainerState`` it reads in ``resume_from_checkpoint``; a callback cannot reach that, so
``resume_from(trainer)`` gives the Trainer a small *resume stub* (a local temporary directory)
holding the saved ``trainer_state.json`` and a weight index that tells it the weights come from
elsewhere (one empty safetensors file: the Trainer loads nothing); the callback deletes it once
the Trainer has read it. The callback then restores model, optimizer, scheduler and RNG from the
newest gpumem checkpoint in ``on_train_begin``, after the Trainer has built the optimizer and
scheduler. When the resumed epoch starts mid-way, the Trainer then skips the consumed batches,
drawing from the global generators, and would reload the RNG from its own ``rng_state.pth``
after the skip; the stub has none (gpumem writes no pickle), so the callback sets the restored
RNG states again at that same point, the first ``on_step_begin``: the resumed run draws what the
uninterrupted one drew, dropout included. ``resume_from`` returns None when there is nothing to
resume; call it on every rank (it builds the Checkpointer, a collective).

Set ``save_strategy="no"`` in the ``TrainingArguments``: otherwise the Trainer writes its own
``checkpoint-N`` (weights, ``optimizer.pt``, RNG pickles) beside gpumem's, and the callback
warns.

Under DDP the replicated state is written once, spread over the ranks
(``Checkpointer(replicated=True)``), unless ``replicated=False`` is passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gpumem.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointStateError,
    PreemptionGuard,
)
from gpumem.checkpoint.capture.training_state import rng_state
from gpumem.checkpoint.optimizer_hooks import prepare_first_save
from gpumem.checkpoint.restore.load import set_rng_state
from gpumem.integrations._guarded import GuardedCallback

_STATE_KEY = "hf_trainer_state"
_STUB_WEIGHTS = "gpumem-restores-the-weights.safetensors"


class CheckpointCallback(GuardedCallback, TrainerCallback):
    """Save and resume a transformers Trainer with gpumem (see the module docs).

    Args:
        directory: the checkpoint directory.
        every_n_train_steps: save every this many optimizer steps (None: only on preemption);
            the name of the Lightning callback's setting (``save_steps`` is the Trainer's own,
            which ``save_strategy="no"`` turns off; it is accepted here, deprecated).
        preemption: install a ``PreemptionGuard``: on SIGTERM / SIGUSR1 the run saves at the
            next step boundary, waits for it to be durable and stops; ``exit_code`` tells what
            to exit with.
        grace_s: the guard's deadline for the final save, from the signal: the scheduler's
            notice (default: ``GPUMEM_GRACE_S``, else 30 s).
        **checkpointer: more ``Checkpointer`` arguments (keep, replicated, staging_bytes, ...).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_n_train_steps: int | None = None,
        preemption: bool = False,
        grace_s: float | None = None,
        save_steps: int | None = None,
        **checkpointer: Any,
    ) -> None:
        if save_steps is not None:
            warnings.warn(
                "CheckpointCallback(save_steps=...) is deprecated: pass every_n_train_steps "
                "(save_steps is the TrainingArguments setting, which should be off)",
                DeprecationWarning,
                stacklevel=2,
            )
            every_n_train_steps = every_n_train_steps or save_steps
        n = every_n_train_steps
        if n is not None and (not isinstance(n, int) or n < 1):
            raise CheckpointStateError(f"every_n_train_steps={n!r} must be a positive int")
        self.directory, self.every = Path(directory), n
        self.preemption, self.grace_s, self.options = preemption, grace_s, checkpointer
        self.trainer: Any = None
        self.ckpt: Checkpointer | None = None
        self.guard: PreemptionGuard | None = None
        self.stopped = False
        self._resume: Path | None = None  # the gpumem checkpoint to restore in on_train_begin
        self._stub: Path | None = None  # the resume stub, deleted once the Trainer read it
        self._rng: dict[str, Any] | None = None  # RNG states to set again after the batch skip

    # ------------------------------------------------------------------ resume

    def resume_from(self, trainer: Any) -> str | None:
        """Bind the Trainer; the resume stub for ``trainer.train(resume_from_checkpoint=...)``,
        or None when ``directory`` holds no checkpoint of this callback."""
        self.trainer = trainer
        self._checkpointer()
        found = _newest(self.directory, self.ckpt)
        if found is None:
            return None
        self._resume, state_json = found
        self._drop_stub()
        stub = self._stub = Path(tempfile.mkdtemp(prefix="gpumem-hf-resume-"))
        (stub / "trainer_state.json").write_text(state_json)
        keys = list(trainer.model.state_dict())
        index = {
            "metadata": {"gpumem": f"weights restored from {self._resume}"},
            "weight_map": dict.fromkeys(keys, _STUB_WEIGHTS),
        }
        (stub / "model.safetensors.index.json").write_text(json.dumps(index))
        header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
        header += b" " * (-len(header) % 8)
        (stub / _STUB_WEIGHTS).write_bytes(len(header).to_bytes(8, "little") + header)
        return str(stub)

    def _checkpointer(self) -> Checkpointer:
        if self.ckpt is None:
            options = dict(self.options)
            if "replicated" not in options:
                options["replicated"] = _is_ddp(self.trainer)
            self.ckpt = Checkpointer(self.directory, **options)
        return self.ckpt

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise CheckpointStateError(
                "CheckpointCallback needs the Trainer: call "
                "trainer.train(resume_from_checkpoint=callback.resume_from(trainer))"
            )
        strategy = getattr(args.save_strategy, "value", args.save_strategy)  # an enum in 4.x/5.x
        if strategy != "no":
            warnings.warn(
                f"TrainingArguments(save_strategy={strategy!r}): the Trainer "
                "writes its own checkpoint-N (weights, optimizer, RNG) beside gpumem's; set "
                'save_strategy="no"',
                stacklevel=2,
            )
        ckpt = self._checkpointer()
        self._drop_stub()  # read by now: trainer_state.json, the weight index
        if self._resume is not None:
            step = ckpt.restore(**self._objects(), path=self._resume)
            if step != state.global_step:
                raise CheckpointStateError(
                    f"restored step {step} from {self._resume}, but the Trainer resumes at "
                    f"step {state.global_step}: pass the stub resume_from() returned"
                )
            if _skips_batches(args, state, kwargs.get("train_dataloader")):
                self._rng = rng_state()
            self._resume = None
        else:  # a fresh run: the first save's arena is ready before it
            objects = self._objects()
            prepare_first_save(ckpt, objects["model"], objects["optimizer"])
        if self.preemption and self.guard is None:
            self.guard = PreemptionGuard(ckpt, grace_s=self.grace_s)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # where the Trainer's own resume loads rng_state.pth: after its batch skip
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        objects = {**self._objects(), "extra": {_STATE_KEY: _state_json(state)}}
        if self.every and step % self.every == 0:
            self._checkpointer().save(step, **objects)
        if self.guard is not None and self.guard.should_stop(step, **objects):
            control.should_training_stop = True
            self.stopped = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()

    def close(self) -> None:
        self._drop_stub()
        super().close()

    def _drop_stub(self) -> None:
        if self._stub is not None:
            shutil.rmtree(self._stub, ignore_errors=True)
            self._stub = None

    def _objects(self) -> dict[str, Any]:
        t = self.trainer
        optimizer = getattr(t.optimizer, "optimizer", t.optimizer)  # accelerate's wrapper
        return {"model": t.model, "optimizer": optimizer, "scheduler": t.lr_scheduler}


def _state_json(state: Any) -> str:
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


def _skips_batches(args: Any, state: Any, loader: Any) -> bool:
    """Whether the Trainer resumes mid-epoch, skipping batches (its ``_init_training_state``):
    an epoch is ``ceil(len(loader) / gradient_accumulation_steps)`` updates, ``max_steps``
    without a length."""
    if args.ignore_data_skip:
        return False
    try:
        n = -(-len(loader) // args.gradient_accumulation_steps)
    except TypeError:
        n = args.max_steps
    return state.global_step % max(n, 1) != 0


def _is_ddp(trainer: Any) -> bool:
    args = trainer.args
    fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))
    deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
    return args.world_size > 1 and not fsdp and not deepspeed


def _newest(directory: Path, ckpt: Checkpointer) -> tuple[Path, str] | None:
    """The newest checkpoint whose main manifest reads and whose shard for this rank holds a
    TrainerState, with that state's JSON."""
    from gpumem.checkpoint.restore.files import open_checkpoint
    from gpumem.checkpoint.storage.directory import read_manifest

    for info in reversed(ckpt.list()):
        shard = info.shards[ckpt.rank % info.world_size]
        try:
            with open_checkpoint(info.path) as step:  # never through a link inside it
                body, _, _ = read_manifest(step, shard.file)
        except CheckpointError:  # a damaged shard manifest: restore() would skip it as well
            continue
        extra = body.get("state", {}).get("extra") if isinstance(body.get("state"), dict) else None
        if isinstance(extra, dict) and isinstance(extra.get(_STATE_KEY), str):
            return Path(info.path), extra[_STATE_KEY]
    return None
