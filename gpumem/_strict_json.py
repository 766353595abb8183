"""``json.loads`` for files gpumem reads back (checkpoint manifests, calibration files): a
duplicate key or a NaN/Infinity is refused rather than silently resolved (the last duplicate
winning, a NaN slipping past every range check)."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """Parse JSON strictly.

    Raises:
        ValueError: invalid JSON, a duplicate key in an object, or NaN / Infinity.
        RecursionError: nesting deeper than the interpreter allows.
    """
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed ({name} is not a number)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a duplicate shows as a shorter dict
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out
