"""Strict reading of calibration JSON: every field typed, finite, in range, and named when wrong.

A calibration file is data another program wrote, maybe on another machine, maybe edited by
hand: nothing in it is trusted. Each object is read through :class:`Fields`, which refuses
unknown keys (a typo must not silently fall back to a default), booleans where numbers belong
(``True`` is an ``int`` in Python), NaN and infinities, and negative values; every error names
the dotted path of the field and what to do about it.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

REDO = "re-run `gpumem calibrate` on the target machine to write a new file"
MAX_TEXT = 4096  # characters in any string field (host names, paths, notes)


class CalibrationError(ValueError):
    """A calibration file (or a measurement feeding one) is missing, malformed or unusable.

    The message names the offending field as a dotted path (``checkpoint.fits.durable_s``) and
    says what to do.
    """


def utc_now() -> str:
    """The current time as ISO 8601 UTC with a ``Z`` suffix, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Fields:
    """Typed access to one JSON object, consuming its keys; :meth:`done` rejects the rest.

    Example:
        >>> f = Fields({"a": 1, "b": "x"}, "top")
        >>> f.int("a"), f.str("b")
        (1, 'x')
        >>> f.done()
    """

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise CalibrationError(f"{where}: expected a JSON object, got {_kind(data)}; {REDO}")
        self.data, self.where = data, where
        self._seen: set[str] = set()

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def _get(self, name: str, optional: bool) -> Any:
        self._seen.add(name)
        if name not in self.data:
            if optional:
                return None
            raise CalibrationError(f"{self.path(name)}: missing; {REDO}")
        return self.data[name]

    def int(self, name: str, minimum: int = 0, optional: bool = False) -> int | None:
        v = self._get(name, optional)
        if v is None and optional:
            return None
        return check_int(v, self.path(name), minimum)

    def float(self, name: str, minimum: float = 0.0, optional: bool = False) -> float | None:
        v = self._get(name, optional)
        if v is None and optional:
            return None
        return check_float(v, self.path(name), minimum)

    def str(
        self, name: str, optional: bool = False, choices: tuple[str, ...] | None = None
    ) -> str | None:
        v = self._get(name, optional)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise CalibrationError(f"{self.path(name)}: expected a string, got {_kind(v)}; {REDO}")
        if len(v) > MAX_TEXT or "\x00" in v:
            raise CalibrationError(
                f"{self.path(name)}: string longer than {MAX_TEXT} characters or with NUL; {REDO}"
            )
        if choices is not None and v not in choices:
            raise CalibrationError(
                f"{self.path(name)}: {v!r} is not one of {', '.join(choices)}; {REDO}"
            )
        return v

    def timestamp(self, name: str) -> str:
        v = self.str(name)
        assert v is not None
        try:
            _dt.datetime.strptime(v, "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            raise CalibrationError(
                f"{self.path(name)}: {v!r} is not a UTC time like 2026-01-31T12:00:00Z; {REDO}"
            ) from None
        return v

    def obj(self, name: str, optional: bool = False) -> Fields | None:
        v = self._get(name, optional)
        if v is None and optional:
            return None
        return Fields(v, self.path(name))

    def list(self, name: str, max_len: int) -> list[Any]:
        v = self._get(name, False)
        if not isinstance(v, list):
            raise CalibrationError(
                f"{self.path(name)}: expected a JSON array, got {_kind(v)}; {REDO}"
            )
        if len(v) > max_len:
            raise CalibrationError(
                f"{self.path(name)}: {len(v)} entries, at most {max_len} allowed; {REDO}"
            )
        return v

    def str_map(self, name: str) -> dict[str, str]:
        """An object of string values (versions)."""
        f = self.obj(name)
        assert f is not None
        out = {}
        for key in list(f.data):
            out[key] = f.str(key)
        return out

    def done(self) -> None:
        extra = sorted(set(self.data) - self._seen)
        if extra:
            raise CalibrationError(
                f"{self.where or 'the file'}: unknown field(s) {', '.join(map(repr, extra))}; "
                f"this gpumem does not write them: {REDO}"
            )


def check_int(v: Any, where: str, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise CalibrationError(f"{where}: expected an integer, got {_kind(v)}; {REDO}")
    if v < minimum:
        raise CalibrationError(f"{where}: {v} is below {minimum}; {REDO}")
    if v > 2**62:
        raise CalibrationError(f"{where}: {v} is implausibly large; {REDO}")
    return v


def check_float(v: Any, where: str, minimum: float = 0.0) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise CalibrationError(f"{where}: expected a number, got {_kind(v)}; {REDO}")
    v = float(v)
    if not math.isfinite(v):
        raise CalibrationError(f"{where}: {v} is not finite; {REDO}")
    if v < minimum:
        raise CalibrationError(f"{where}: {v} is below {minimum}; {REDO}")
    return v


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        int: "an integer",
        float: "a number",
    }.get(type(v), type(v).__name__)
