"""``PYTORCH_CUDA_ALLOC_CONF`` parsed into the settings the simulator follows.

The grammar and the checks are PyTorch's (torch 2.9+: ``c10/core/AllocatorConfig.cpp``,
``AcceleratorAllocatorConfig::parseArgs`` and its ``parse*`` helpers, and
``c10/cuda/CUDAAllocatorConfig.cpp``, ``CUDAAllocatorConfig::parseArgs``): comma-separated
``key:value`` pairs; ``roundup_power2_divisions`` also takes ``[256:1,512:2,>:8]`` (interval
boundaries in MiB, powers of two). Unlike PyTorch, which raises a ``RuntimeError`` from C++, a
bad setting here is a one-line ``ValueError`` naming the option and the known ones.

Settings that change what the caching allocator reserves are kept (``max_split_size_mb``,
``max_non_split_rounding_mb``, ``roundup_power2_divisions``, ``garbage_collection_threshold``,
``expandable_segments``, ``per_process_memory_fraction`` and, in newer torch,
``large_segment_size_mb``, seen in use as ``expandable_segments:True,large_segment_size_mb:12``;
its C++ parser was not read: checked here only as >= 2 and <= ``max_split_size_mb``); the
others (pinned-memory and locking options, ``backend:native``) are accepted and ignored, as
they do not change device memory; ``backend:cudaMallocAsync`` is refused (a different
allocator, not simulated).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

MB = 1024 * 1024
K_LARGE_BUFFER = 20 * MB  # kLargeBuffer: the smallest max_split_size_mb and rounding allowed
_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one slot per power of two
_INTERVAL_START = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB)
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): "no max_split_size"

ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Read in this order (AllocatorConfig.cpp, ``instance()``: the first one set wins)."""

SIMULATED_KEYS = (
    "max_split_size_mb",
    "large_segment_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "per_process_memory_fraction",
)
IGNORED_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
)
KNOWN_KEYS = SIMULATED_KEYS + IGNORED_KEYS


@dataclass(frozen=True)
class AllocConf:
    """The caching allocator's settings (defaults: PyTorch's, nothing configured).

    Example:
        >>> AllocConf.parse("expandable_segments:True,max_split_size_mb:256").max_split_size
        268435456
    """

    max_split_size: int = SIZE_MAX
    """Blocks this large or larger are never split (``max_split_size_mb``, bytes)."""
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    """An oversize request may take a cached block up to this much larger
    (``max_non_split_rounding_mb``; default kLargeBuffer)."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    """Divisions per power-of-two interval, 1 MiB .. 64 GiB (0 or 1: plain 512-byte rounding)."""
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size: int = K_LARGE_BUFFER
    """The segment of a 1-10 MiB request and the large pool's page with expandable segments
    (``large_segment_size_mb``, newer torch; default kLargeBuffer, 20 MiB)."""
    per_process_memory_fraction: float | None = None
    text: str = field(default="", compare=False)
    """The setting string it was parsed from."""

    def divisions(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the divisions of the
        power-of-two interval holding ``size`` (sizes below 1 MiB use the first one)."""
        log_size = size.bit_length() - 1
        index = log_size - _INTERVAL_START if log_size > _INTERVAL_START else 0
        return self.roundup_power2_divisions[min(index, _INTERVALS - 1)]

    @classmethod
    def parse(cls, text: str, *, source: str = "alloc_conf") -> AllocConf:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string; ``source`` names where it came from in
        error messages (the environment variable's name when read from it)."""
        return _parse(text, source)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AllocConf:
        """The settings in ``PYTORCH_ALLOC_CONF`` or else ``PYTORCH_CUDA_ALLOC_CONF``."""
        env = os.environ if environ is None else environ
        for var in ENV_VARS:
            if var in env:
                return _parse(env[var], f"the environment variable {var}")
        return cls()


def resolve(alloc_conf: str | AllocConf | None) -> AllocConf:
    """``alloc_conf=`` as every entry point takes it: ``None`` reads the environment, a string
    is parsed, an :class:`AllocConf` is used as it is."""
    if alloc_conf is None:
        return AllocConf.from_env()
    if isinstance(alloc_conf, AllocConf):
        return alloc_conf
    if isinstance(alloc_conf, str):
        return AllocConf.parse(alloc_conf)
    raise TypeError(
        f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string, an AllocConf or None, "
        f"got {type(alloc_conf).__name__}"
    )


_TOKEN = re.compile(r"\s*([\[\]:,>]|[^\[\]:,>\s]+)")


def _tokens(text: str) -> list[str]:
    # ConfigTokenizer: the separators , : [ ] > are tokens of their own, spaces are dropped
    out = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # only trailing blanks can fail to match, and they were stripped
            break
        out.append(m.group(1))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.toks = _tokens(text)
        self.key = ""

    def fail(self, why: str) -> ValueError:
        return ValueError(f"{self.source} {self.text!r}: {why}")

    def bad(self, why: str) -> ValueError:
        return self.fail(f"option {self.key!r} {why}")

    def tok(self, i: int) -> str:
        if i >= len(self.toks):
            raise self.bad("is missing its value")
        return self.toks[i]

    def colon(self, i: int) -> None:
        if self.tok(i) != ":":
            raise self.bad(f"needs ':' after it, got {self.toks[i]!r}")

    def size_t(self, i: int) -> int:
        t = self.tok(i)
        if not t.isdigit():
            raise self.bad(f"needs a non-negative integer, got {t!r}")
        return int(t)

    def real(self, i: int) -> float:
        t = self.tok(i)
        try:
            return float(t)
        except ValueError:
            raise self.bad(f"needs a number, got {t!r}") from None

    def boolean(self, i: int) -> bool:
        t = self.tok(i)
        if t not in ("True", "False", "true", "false"):
            raise self.bad(f"needs True or False, got {t!r}")
        return t in ("True", "true")


class NotSimulated(ValueError):
    """A setting torch accepts that the simulator does not reproduce (another backend)."""


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _parse(text: str, source: str) -> AllocConf:
    p = _Parser(text, source)
    toks = p.toks
    kw: dict[str, object] = {}
    divs = [0] * _INTERVALS
    i = 0
    while i < len(toks):
        key = p.key = toks[i]
        if key not in KNOWN_KEYS:
            raise p.fail(
                f"unknown option {key!r}; known options: {', '.join(KNOWN_KEYS)}"
                if key not in ",:[]>"
                else f"expected an option name, got {key!r}; known options: {', '.join(KNOWN_KEYS)}"
            )
        p.colon(i + 1)
        i += 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            v = p.size_t(i)
            if v * MB < K_LARGE_BUFFER:  # parseMaxSplitSize / parseMaxNonSplitRoundingSize
                raise p.bad(f"is {v}, must be >= {K_LARGE_BUFFER // MB}")
            name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            kw[name] = min(v, SIZE_MAX // MB) * MB
        elif key == "large_segment_size_mb":
            v = p.size_t(i)
            if v < 2:
                raise p.bad(f"is {v}, must be >= 2")
            kw["large_segment_size"] = v * MB
        elif key == "garbage_collection_threshold":
            g = p.real(i)
            if not 0.0 < g < 1.0:  # parseGarbageCollectionThreshold
                raise p.bad(f"is {g}, must be in (0.0, 1.0)")
            kw["garbage_collection_threshold"] = g
        elif key == "per_process_memory_fraction":
            f = p.real(i)
            if not 0.0 <= f <= 1.0:
                raise p.bad(f"is {f}, must be in [0.0, 1.0]")
            kw["per_process_memory_fraction"] = f
        elif key == "expandable_segments":
            kw["expandable_segments"] = p.boolean(i)
        elif key == "roundup_power2_divisions":
            i = _parse_divisions(p, i, divs)
            kw["roundup_power2_divisions"] = tuple(divs)
        elif key == "backend":
            v2 = p.tok(i)
            if v2 == "cudaMallocAsync":
                raise NotSimulated(
                    p.bad("is cudaMallocAsync: that allocator is not simulated (only 'native')")
                )
            if v2 != "native":
                raise p.bad(f"is {v2!r}; the backends are native and cudaMallocAsync")
        elif key in ("pinned_num_register_threads", "pinned_reserve_segment_size_mb"):
            p.size_t(i)
        else:  # the boolean pinned / lock options
            p.boolean(i)
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise p.bad(f"is followed by {toks[i]!r}, expected ','")
            i += 1
            if i == len(toks):
                raise p.fail("ends with ','")
    conf = AllocConf(text=text, **kw)  # type: ignore[arg-type]
    if "max_split_size" in kw and conf.max_split_size < conf.large_segment_size:
        p.key = "max_split_size_mb"
        raise p.bad(
            f"is {conf.max_split_size // MB}, must be >= large_segment_size_mb "
            f"({conf.large_segment_size // MB})"
        )
    return conf


def _parse_divisions(p: _Parser, i: int, divs: list[int]) -> int:
    """``parseRoundUpPower2Divisions``: one value for every interval, or ``[MiB:n, ..., >:n]``.
    Returns the index of the last token used."""
    if p.tok(i) != "[":
        v = p.size_t(i)
        if not _pow2(v):
            raise p.bad(f"is {v}: the divisions must be a power of 2")
        divs[:] = [v] * _INTERVALS
        return i
    first = True
    last_index = 0
    i += 1
    while p.tok(i) != "]":
        bound = p.tok(i)
        p.colon(i + 1)
        v = p.size_t(i + 2)
        if v != 0 and not _pow2(v):
            raise p.bad(f"has {bound}:{v}: the divisions must be a power of 2 or 0")
        if bound == ">":
            divs[last_index + 1 :] = [v] * (_INTERVALS - last_index - 1)
        else:
            if not bound.isdigit() or not _pow2(int(bound)):
                raise p.bad(f"has interval {bound!r}: the intervals must be powers of 2 (MiB)")
            index = min(int(bound).bit_length() - 1, _INTERVALS - 1)
            if first:
                divs[:index] = [v] * index
                first = False
            divs[index] = v
            last_index = index
        i += 3
        if p.tok(i) != "]":
            if p.tok(i) != ",":
                raise p.bad(f"has {p.toks[i]!r} inside [...], expected ',' or ']'")
            i += 1
    return i


__all__ = ["ENV_VARS", "KNOWN_KEYS", "AllocConf", "NotSimulated", "resolve"]
