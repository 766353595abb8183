"""The headroom a plan keeps free on every GPU: a share of its memory or a byte count.

An estimate is a model of the allocator, not a measurement: a layout that fits with 1 GiB to
spare on an 80 GB GPU is one fragmentation spike or library workspace away from an
out-of-memory error. So ``plan`` ranks only the layouts whose peak leaves this margin free
(``--headroom``; default 5 % of the GPU's memory, 4 GiB on an 80 GB H100) and says so.

Example:
    >>> Margin.parse("5%").bytes_of(80 * 2**30) / 2**30
    4.0
    >>> Margin.parse("6GiB").describe(80 * 2**30)
    '6.00 GiB'
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.units import format_bytes, parse_bytes

DEFAULT_HEADROOM = "5%"


@dataclass(frozen=True)
class Margin:
    """Memory kept free per GPU: ``fraction`` of its capacity, or ``nbytes`` (one is set)."""

    fraction: float = 0.0
    nbytes: int = 0

    @classmethod
    def parse(cls, value: str | int | float | Margin) -> Margin:
        """``"5%"`` or a fraction below 1 (``0.05``) is a share; ``"4GiB"`` or an int, bytes.

        Raises:
            ValueError: negative, a share of 100 % or more, or unreadable.
        """
        if isinstance(value, Margin):
            return value
        if isinstance(value, bool):
            raise ValueError(f"headroom must be a share or a size, got {value!r}")
        text = str(value).strip()
        if text.endswith("%"):
            try:
                share = float(text[:-1]) / 100
            except ValueError:
                raise ValueError(f"cannot read headroom {value!r}: use e.g. 5% or 4GiB") from None
            return cls._share(share, value)
        if isinstance(value, float):
            return cls._share(value, value)
        try:
            return cls(nbytes=parse_bytes(value if isinstance(value, int) else text))
        except ValueError:
            raise ValueError(
                f"cannot read headroom {value!r}: use a share (5%) or a size (4GiB)"
            ) from None

    @classmethod
    def _share(cls, share: float, value: object) -> Margin:
        if not 0 <= share < 1:  # also refuses nan
            raise ValueError(f"headroom {value!r} must be at least 0% and below 100%")
        return cls(fraction=share)

    def bytes_of(self, capacity: int) -> int:
        """The bytes kept free on a GPU of ``capacity`` bytes."""
        return self.nbytes if not self.fraction else int(capacity * self.fraction)

    def describe(self, capacity: int) -> str:
        """``5% = 4.00 GiB`` or ``6.00 GiB``."""
        kept = format_bytes(self.bytes_of(capacity))
        return f"{self.fraction * 100:g}% = {kept}" if self.fraction else kept
