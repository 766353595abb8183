"""gpumem checkpointing for the transformers ``Trainer``.

    from gpumem.integrations.hf import CheckpointCallback

    cb = CheckpointCallback("ckpts", save_steps=100, preemption=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from(trainer))
    sys.exit(cb.exit_code)             # 143 after a preemption with a durable final save

Every ``save_steps`` optimizer steps (and on SIGTERM / SIGUSR1 with ``preemption=True``) the
callback saves the model, the optimizer, the LR scheduler, every rank's RNG states and the
``TrainerState`` with a ``gpumem.Checkpointer`` (all ranks, in the background). The Trainer
itself skips the batches a resumed run has already consumed, from the ``TrainerState`` it reads
in ``resume_from_checkpoint``; a callback cannot reach that, so ``resume_from(trainer)`` gives
the Trainer a small *resume stub* (a local temporary directory) holding the saved
``trainer_state.json`` and a weight index that tells it the weights come from elsewhere (one
empty safetensors file: the Trainer loads nothing). The callback then restores model,
optimizer, scheduler and RNG from the newest gpumem checkpoint in ``on_train_begin``, after
the Trainer has built the optimizer and scheduler. ``resume_from`` returns None when there is
nothing to resume; call it on every rank (it builds the Checkpointer, a collective).

Under DDP the replicated state is written once, spread over the ranks
(``Checkpointer(replicated=True)``), unless ``replicated=False`` is passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gpumem.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointStateError,
    PreemptionGuard,
)
from gpumem.integrations._guarded import GuardedCallback

_STATE_KEY = "hf_trainer_state"
_STUB_WEIGHTS = "gpumem-restores-the-weights.safetensors"


class CheckpointCallback(GuardedCallback, TrainerCallback):
    """Save and resume a transformers Trainer with gpumem (see the module docs).

    Args:
        directory: the checkpoint directory.
        save_steps: save every this many optimizer steps (None: only on preemption).
        preemption: install a ``PreemptionGuard``: on SIGTERM / SIGUSR1 the run saves at the
            next step boundary, waits for it to be durable and stops; ``exit_code`` tells what
            to exit with.
        grace_s: the guard's deadline for the final save, from the signal.
        **checkpointer: more ``Checkpointer`` arguments (keep, replicated, staging_bytes, ...).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_steps: int | None = None,
        preemption: bool = False,
        grace_s: float = 30.0,
        **checkpointer: Any,
    ) -> None:
        if save_steps is not None and (not isinstance(save_steps, int) or save_steps < 1):
            raise CheckpointStateError(f"save_steps={save_steps!r} must be a positive int")
        self.directory, self.save_steps = Path(directory), save_steps
        self.preemption, self.grace_s, self.options = preemption, grace_s, checkpointer
        self.trainer: Any = None
        self.ckpt: Checkpointer | None = None
        self.guard: PreemptionGuard | None = None
        self.stopped = False
        self._resume: Path | None = None  # the gpumem checkpoint to restore in on_train_begin

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
        stub = Path(tempfile.mkdtemp(prefix="gpumem-hf-resume-"))
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
        ckpt = self._checkpointer()
        if self._resume is not None:
            step = ckpt.restore(**self._objects(), path=self._resume)
            if step != state.global_step:
                raise CheckpointStateError(
                    f"restored step {step} from {self._resume}, but the Trainer resumes at "
                    f"step {state.global_step}: pass the stub resume_from() returned"
                )
        if self.preemption and self.guard is None:
            self.guard = PreemptionGuard(ckpt, grace_s=self.grace_s)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        objects = {**self._objects(), "extra": {_STATE_KEY: _state_json(state)}}
        if self.save_steps and step % self.save_steps == 0:
            self._checkpointer().save(step, **objects)
        if self.guard is not None and self.guard.should_stop(step, **objects):
            control.should_training_stop = True
            self.stopped = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()

    def _objects(self) -> dict[str, Any]:
        t = self.trainer
        optimizer = getattr(t.optimizer, "optimizer", t.optimizer)  # accelerate's wrapper
        return {"model": t.model, "optimizer": optimizer, "scheduler": t.lr_scheduler}


def _state_json(state: Any) -> str:
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


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
