"""Bytes in, bytes out: the API speaks integer bytes; these helpers exist for display, for parsing
human input (``--gpu-memory 80GiB``) and for alignment arithmetic. GB is 10**9, GiB is 2**30,
always explicit."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,  # bare letters: binary, as in `ulimit`/`dd`
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """'80GiB' -> 85899345920, '141GB' -> 141000000000, '512' -> 512.

    Raises:
        ValueError: naming the text and the accepted units.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte count {text} is negative")
        return text
    m = _PATTERN.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: use a number with a unit such as 80GiB, 141GB, 512MiB"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return round(value)


def format_bytes(n: int | float, unit: str | None = None, digits: int = 2) -> str:
    """Binary units for display: 1536 -> '1.50 KiB'. ``unit`` forces one ('GiB', 'GB', 'MiB')."""
    if unit is not None:
        scale = _UNITS[unit.lower()]
        return f"{n / scale:.{digits}f} {unit}"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for name in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or name == "PiB":
            return f"{sign}{n:.0f} B" if name == "B" else f"{sign}{n:.{digits}f} {name}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(nbytes: int | float, seconds: float) -> str:
    """Bandwidth in decimal GB/s, the unit vendors quote for memory and disks."""
    if seconds <= 0:
        return "inf GB/s"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment
