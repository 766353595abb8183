"""One outcome per candidate checkpoint on every rank: the ranks exchange what each found and all
raise, or fall back, with the same error class and message.

A rank sees only its own shard: one hostile shard manifest (a rewritten class name, a tensor
reference of another kind) fails on its rank while the others prepare the step fine. Without
this exchange that rank raised its own error and the others a bare "another rank cannot restore
it", and none fell back. The rules (``unify``), over every rank's verdict:

- some rank found the step damaged → damaged for all (fall back to the next older step), with
  the lowest such rank's message;
- every rank found the checkpoint does not fit its objects → CheckpointStateError for all;
- some ranks found it does not fit and others restore it → the ranks' shards disagree about
  the job: damaged for all (a checkpoint one job wrote fits that job on every rank; objects that
  differ between ranks fail the older steps the same way, so the last error still names them);
- otherwise (an operating-system error, an unexpected failure) → that error, raised on every
  rank: CheckpointIOError keeps the failing rank's errno and file.

Verdicts travel as JSON in uint8 tensors (two collectives, only when some rank failed): no pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIOError,
    CheckpointStateError,
)
from ..group import Group

OK, DAMAGED, RAISE = 2, 1, 0  # a candidate's outcome; the all-reduced MIN is the worst
MAX_MESSAGE = 4000  # characters of a rank's message that travel


@dataclass(frozen=True)
class Verdict:
    """What one rank found: its outcome, the error's kind and message, and whether it found the
    fault itself (False: it only heard that another rank failed)."""

    status: int
    kind: str = ""
    message: str = ""
    errno: int | None = None
    path: str | None = None
    tensor: str | None = None
    own: bool = True

    @classmethod
    def of(cls, status: int, err: BaseException | None, own: bool = True) -> Verdict:
        if err is None:
            return cls(status, own=own)
        kind = next(
            k.__name__
            for k in (CheckpointCorruptError, CheckpointIOError, CheckpointStateError, Exception)
            if isinstance(err, k)
        )
        errno = getattr(err, "errno", None) if isinstance(err, CheckpointIOError) else None
        path = getattr(err, "path", None) or getattr(err, "filename", None)
        tensor = getattr(err, "tensor", None)
        return cls(status, kind, str(err)[:MAX_MESSAGE], errno, path, tensor, own)

    def error(self, note: str = "") -> CheckpointError:
        text = self.message + note
        if self.kind == "CheckpointCorruptError":
            return CheckpointCorruptError(text, path=self.path, tensor=self.tensor)
        if self.kind == "CheckpointIOError":
            return CheckpointIOError(text, errno=self.errno, filename=self.path)
        if self.kind == "CheckpointStateError":
            return CheckpointStateError(text)
        return CheckpointError(text)


def exchange(group: Group, mine: Verdict) -> list[Verdict]:
    """Every rank's verdict, indexed by rank (two collectives)."""
    blob = json.dumps(mine.__dict__).encode()
    sizes = [s[0] for s in group.all_gather([len(blob)])]
    return [Verdict(**json.loads(b)) for b in group.all_gather_bytes(blob, sizes)]


def unify(
    verdicts: list[Verdict], label: str, mine: BaseException | None = None, rank: int = 0
) -> tuple[int, CheckpointError]:
    """The one outcome and error of a candidate every rank takes (rules in the module doc).
    The rank whose error speaks for all (``mine`` on ``rank``) chains it as the cause."""
    status, who, err = _unify(verdicts, label)
    if who == rank and mine is not None and err is not mine:
        err.__cause__ = mine
    return status, err


def _unify(verdicts: list[Verdict], label: str) -> tuple[int, int, CheckpointError]:
    failed = [(r, v) for r, v in enumerate(verdicts) if v.status != OK]
    many = len(verdicts) > 1

    def on(r: int) -> str:
        return f" (found by rank {r})" if many else ""

    damaged = [(r, v) for r, v in failed if v.status == DAMAGED]
    if damaged:
        r, v = next(((r, v) for r, v in damaged if v.own), damaged[0])
        err = v.error(on(r))
        if not isinstance(err, CheckpointCorruptError):
            err = CheckpointCorruptError(str(err), path=label)
        return DAMAGED, r, err
    state = [(r, v) for r, v in failed if v.kind == "CheckpointStateError"]
    if state and len(state) == len(failed):
        r, v = state[0]
        if len(failed) == len(verdicts):
            note = on(r) if len({x.message for _, x in state}) > 1 else ""
            return RAISE, r, v.error(note)
        fine = [i for i, x in enumerate(verdicts) if x.status == OK]
        return (
            DAMAGED,
            r,
            CheckpointCorruptError(
                f"{label}: the ranks' shards disagree: rank {r} finds it does not fit its "
                f"objects ({v.message}) while rank(s) {fine[:8]} restore it",
                path=label,
            ),
        )
    other = [(r, v) for r, v in failed if v.kind not in ("", "CheckpointStateError")]
    r, v = (other or failed)[0]
    return RAISE, r, v.error(on(r))
