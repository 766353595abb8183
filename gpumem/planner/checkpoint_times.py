"""The stall C, persist P and restart R that the preemption economics use, and where each came
from: given by the caller, predicted by a calibration for the checkpoint a layout writes, or the
planner's stated defaults (``economics.DEFAULT_*``, the only copy of them).

Rules, in order: an explicit value wins; else, with a calibration that holds a checkpoint
measurement and a checkpoint size, the predicted times (R = predicted restore + a start-up time
the calibration cannot measure); else the default. Physical limits hold whatever the source:
a checkpoint is durable only after it was taken (P ≥ C), and nothing takes negative time. An
extrapolated fit can predict P < C: P is then raised to C and a note says so. Explicit values
that contradict each other are an error.

A calibrated prediction records how far it reaches (``extrapolation_factor``: the checkpoint
size over the largest size measured); past ``MAX_EXTRAPOLATION`` (the factor the calibration
benchmark checked) :attr:`CheckpointTimes.extrapolation_warning` is the line a headline prints.

Example:
    >>> t = checkpoint_times(stall_s=2.0)
    >>> t.stall_s, t.persist_s, t.sources["persist_s"]
    (2.0, 60.0, 'default guess')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpumem.calibrate.calibration import Calibration
from gpumem.calibrate.checkpoint_cost import MAX_EXTRAPOLATION
from gpumem.planner.economics import (
    DEFAULT_PERSIST_S,
    DEFAULT_RESTART_S,
    DEFAULT_STALL_S,
    DEFAULT_STARTUP_S,
)
from gpumem.units import format_bytes

KEYS = ("stall_s", "persist_s", "restart_s")
NAMES = {"stall_s": "stall C", "persist_s": "persist P", "restart_s": "restart R"}
DEFAULT_SOURCE = "default guess"


@dataclass(frozen=True)
class CheckpointTimes:
    """Resolved C, P, R in seconds, with the source of each and notes for the reader.

    Attributes:
        sources: per key, ``"given"``, ``"measured: ..."`` or ``"default guess"``.
        notes: sentences about the numbers (what was extrapolated, raised or guessed).
        calibration: the record of the calibration used (None without one), for JSON output.
        extrapolation_factor: the checkpoint size over the largest size the calibration
            measured (None without a calibrated prediction); at most ``extrapolation_limit``
            is what the calibration benchmark checked.
        extrapolation_limit: ``gpumem.calibrate.checkpoint_cost.MAX_EXTRAPOLATION``.
    """

    stall_s: float
    persist_s: float
    restart_s: float
    sources: dict[str, str]
    notes: tuple[str, ...] = ()
    calibration: dict[str, Any] | None = None
    extrapolation_factor: float | None = None
    extrapolation_limit: float = MAX_EXTRAPOLATION

    @property
    def beyond_calibration(self) -> bool:
        """Whether the calibrated times extrapolate past ``extrapolation_limit``."""
        f = self.extrapolation_factor
        return f is not None and f > self.extrapolation_limit

    @property
    def extrapolation_warning(self) -> str | None:
        """One line for a headline when the times go past the checked factor, else None."""
        if not self.beyond_calibration:
            return None
        largest = self.calibration.get("largest_bytes", 0) if self.calibration else 0
        return (
            f"checkpoint times extrapolated to {self.extrapolation_factor:.3g}x the largest "
            f"size calibrated ({format_bytes(largest)}; checked to "
            f"{self.extrapolation_limit:g}x): calibrate nearer the checkpoint size"
        )

    @property
    def guessed(self) -> list[str]:
        """The keys that are default guesses."""
        return [k for k in KEYS if self.sources[k] == DEFAULT_SOURCE]

    def values(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in KEYS}

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: {"value": getattr(self, k), "source": self.sources[k]} for k in KEYS},
            "notes": list(self.notes),
            "calibration": self.calibration,
            "extrapolation_factor": self.extrapolation_factor,
            "extrapolation_limit": self.extrapolation_limit,
        }

    def lines(self) -> list[str]:
        """The notes, then one line per time with its source."""
        return [
            *self.notes,
            *(f"  {NAMES[k]:<11}{getattr(self, k):>10.3f} s  {self.sources[k]}" for k in KEYS),
        ]


def checkpoint_times(
    calibration: Calibration | None = None,
    *,
    checkpoint_bytes: int | None = None,
    stall_s: float | None = None,
    persist_s: float | None = None,
    restart_s: float | None = None,
    startup_s: float | None = None,
) -> CheckpointTimes:
    """Resolve C, P and R (module doc).

    Args:
        calibration: a loaded calibration (``gpumem.calibrate.as_calibration`` reads a path).
        checkpoint_bytes: what one rank saves (its weights and optimizer state); None when no
            layout fits, which leaves nothing to predict.
        stall_s / persist_s / restart_s: explicit values, in seconds.
        startup_s: with a calibration, the restart time besides the measured restore
            (default ``DEFAULT_STARTUP_S``).

    Raises:
        ValueError: negative or non-finite times, P < C both given, or ``startup_s`` without a
            calibration (there is no measured restore to add it to).
    """
    given = {"stall_s": stall_s, "persist_s": persist_s, "restart_s": restart_s}
    for key, v in [*given.items(), ("startup_s", startup_s)]:
        if v is not None and not (v >= 0 and v != float("inf")):
            raise ValueError(f"{key} must be a finite number of seconds >= 0, got {v}")
    if calibration is None and startup_s is not None:
        raise ValueError(
            "startup_s adds to the restore time a calibration measured: give a calibration "
            "(--calibration FILE), or restart_s for the whole restart time"
        )
    values: dict[str, tuple[float, str]] = {
        "stall_s": (DEFAULT_STALL_S, DEFAULT_SOURCE),
        "persist_s": (DEFAULT_PERSIST_S, DEFAULT_SOURCE),
        "restart_s": (DEFAULT_RESTART_S, DEFAULT_SOURCE),
    }
    notes: list[str] = []
    record: dict[str, Any] | None = None
    factor = None
    if calibration is not None:
        record, measured, note = _from_calibration(calibration, checkpoint_bytes, startup_s)
        values.update(measured)
        notes.append(note)
        factor = record.get("extrapolation_factor")
    for key, v in given.items():
        if v is not None:
            values[key] = (float(v), "given")
    stall, persist = values["stall_s"][0], values["persist_s"][0]
    if persist < stall:
        if given["stall_s"] is not None and given["persist_s"] is not None:
            raise ValueError(
                f"persist_s {persist:g} is shorter than stall_s {stall:g}: a checkpoint is durable "
                "only after it was taken, so the persist time is at least the stall"
            )
        # one of them was predicted or guessed: the given (or measured) stall is the firmer
        values["persist_s"] = (stall, f"raised to the stall C ({values['persist_s'][1]})")
        notes.append(
            f"persist P {persist:.3g} s was below the stall C {stall:.3g} s; a checkpoint is "
            "durable only after it was taken, so P = C is used"
        )
    guessed = [k for k in KEYS if values[k][1] == DEFAULT_SOURCE]
    if guessed and calibration is None:
        names = ", ".join(f"{NAMES[k]} {values[k][0]:g} s" for k in guessed)
        notes.append(
            f"checkpoint times are guesses ({names}): measure them on the job's storage with "
            "`gpumem calibrate --dir CKPT_DIR` and pass the calibration"
        )
    if record is not None:
        record.update({k: {"value": v, "source": s} for k, (v, s) in values.items()})
    return CheckpointTimes(
        stall_s=values["stall_s"][0],
        persist_s=values["persist_s"][0],
        restart_s=values["restart_s"][0],
        sources={k: s for k, (_, s) in values.items()},
        notes=tuple(notes),
        calibration=record,
        extrapolation_factor=factor,
    )


def _from_calibration(
    cal: Calibration, nbytes: int | None, startup_s: float | None
) -> tuple[dict[str, Any], dict[str, tuple[float, str]], str]:
    """(JSON record, predicted values by key, a note on what was predicted for what size)."""
    record: dict[str, Any] = {
        "file": cal.path,
        "created_utc": cal.created_utc,
        "host": cal.machine.host,
    }
    if cal.checkpoint is None:
        return record, {}, f"checkpoint times: {cal.origin()} holds no checkpoint measurement"
    if nbytes is None:
        return record, {}, "checkpoint times: nothing fits, so there is no checkpoint to predict"
    stall, persist, restore = cal.checkpoint_times(nbytes)
    restore = max(0.0, restore)
    start = DEFAULT_STARTUP_S if startup_s is None else startup_s
    start_src = "given" if startup_s is not None else "default guess; set the startup time"
    fit = cal.checkpoint.fits["durable_s"]
    record.update(
        checkpoint_bytes=nbytes,
        restore_s=restore,
        startup_s=start,
        extrapolated=fit.extrapolates(nbytes),
        largest_bytes=cal.checkpoint.largest_bytes,
        extrapolation_factor=cal.checkpoint.extrapolation_factor(nbytes),
        extrapolation_limit=MAX_EXTRAPOLATION,
        directory=cal.checkpoint.directory,
        checkpoint_device=cal.checkpoint.device,
    )
    measured = {
        "stall_s": (stall, "measured: overlap save, worst case"),
        "persist_s": (persist, "measured: time to durable"),
        "restart_s": (
            restore + start,
            f"measured restore {restore:.3g} s + startup {start:g} s ({start_src})",
        ),
    }
    return record, measured, _size_note(cal, nbytes)


def _size_note(cal: Calibration, nbytes: int) -> str:
    c = cal.checkpoint
    assert c is not None
    fit = c.fits["durable_s"]
    where = f"{c.directory} ({c.filesystem or 'file system unknown'}), tensors on {c.device}"
    line = (
        f"checkpoint times for {format_bytes(nbytes)} per GPU (weights + optimizer state of the "
        f"best layout), from {cal.origin()}, {where}"
    )
    factor = c.extrapolation_factor(nbytes)
    if factor > MAX_EXTRAPOLATION:
        line += (
            f"; extrapolated to {factor:.3g}x the largest size measured "
            f"({format_bytes(fit.min_bytes)} to {format_bytes(fit.max_bytes)}), beyond the "
            f"{MAX_EXTRAPOLATION:g}x the calibration was checked to: calibrate nearer this size "
            "for a firmer number"
        )
    elif fit.extrapolates(nbytes):
        line += (
            f"; extrapolated beyond the sizes measured ({format_bytes(fit.min_bytes)} to "
            f"{format_bytes(fit.max_bytes)}), {factor:.3g}x the largest: within the "
            f"{MAX_EXTRAPOLATION:g}x the calibration was checked to"
        )
    bounded = [k for k, f in c.fits.items() if f.bounded_above(nbytes)]
    if bounded:
        line += (
            f"; {', '.join(bounded)}: no growth with size was measured, so "
            "the largest size's time is scaled in proportion (an upper bound)"
        )
    return line


__all__ = ["CheckpointTimes", "checkpoint_times"]
