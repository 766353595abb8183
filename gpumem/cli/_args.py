"""Argument types for the subcommands: every value is checked by argparse before any work starts.

Each function takes the text from the command line and returns the value, or raises
``argparse.ArgumentTypeError`` with a message that says what was wrong and what is accepted;
the parser turns it into one line, ``gpumem CMD: error: argument --flag: <message>``, exit 2.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gpumem.units import parse_bytes

# counts beyond these are typing mistakes, not jobs; they would otherwise run for hours
MAX_COUNT = 1 << 40
MAX_GPUS = 1 << 17


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def bounded_int(lo: int, hi: int = MAX_COUNT, what: str = "") -> type[int]:
    def check(text: str) -> int:
        v = _int(text)
        if not lo <= v <= hi:
            rule = f">= {lo}" if hi == MAX_COUNT else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"{what or 'must be'} {rule}, got {v}")
        return v

    check.__name__ = "integer"  # argparse names the type in its own messages
    return check  # type: ignore[return-value]


positive_int = bounded_int(1, what="must be a whole number")
non_negative_int = bounded_int(0, what="must be a whole number")
gpu_count = bounded_int(1, MAX_GPUS, what="GPUs must be")
step_count = bounded_int(1, 10_000, what="steps must be")


def _float(text: str, lo: float, strict: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if v < lo or (strict and v == lo):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}, got {v:g}")
    return v


def name_list(known: tuple[str, ...]) -> type[tuple]:
    """Comma-separated names from ``known`` (``none``: the empty tuple)."""

    def check(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if names == ("none",):
            return ()
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad)) or 'empty list'}; give names from "
                f"{', '.join(known)} (comma-separated), or none"
            )
        return names

    check.__name__ = "names"
    return check  # type: ignore[return-value]


def probability(text: str) -> float:
    v = _float(text, 0.0, strict=False)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {v:g}")
    return v


def positive_float(text: str) -> float:
    return _float(text, 0.0, strict=True)


def non_negative_float(text: str) -> float:
    return _float(text, 0.0, strict=False)


def size(text: str) -> int:
    """A positive byte count with a unit: 64MiB, 80GiB, 141GB."""
    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; e.g. 256MiB")
    return n


def size_list(text: str) -> list[int]:
    """Comma-separated sizes: 64MiB,256MiB."""
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} holds no size; e.g. 64MiB,256MiB")
    return [size(s) for s in items]


def existing_dir(text: str) -> str:
    p = Path(text)
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory"
        raise argparse.ArgumentTypeError(f"{text} {what}; give an existing directory")
    return text


def checkpoint_dir(text: str) -> str:
    """An existing checkpoint directory; a URL (``s3://...``) is refused by name, never looked up
    as a local path."""
    return existing_dir(not_url(text))


def checkpoint_root(text: str) -> str:
    """An existing checkpoint directory, or an ``s3://bucket/prefix`` root (checked for form
    here, for existence when opened); any other URL is refused by name."""
    if text.lower().startswith("s3://"):
        from gpumem.checkpoint import CheckpointStateError
        from gpumem.checkpoint.storage.location import ObjectURL

        try:
            ObjectURL.parse(text)
        except CheckpointStateError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return checkpoint_dir(text)


def not_url(text: str) -> str:
    """``text`` unless it is a URL (``s3://...``): that is refused by name, never looked up or
    created as a local path (``Path("s3://b")`` is a directory named ``s3:``)."""
    from gpumem.checkpoint.storage.location import url_problem

    problem = url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def output_file(text: str) -> str:
    """A file to write: its directory must exist and it must not be a directory itself."""
    if text == "-":
        return text
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name inside it")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"the directory of {text} ({p.parent}) does not exist; create it or write elsewhere"
        )
    return text


def png_file(text: str) -> str:
    """A PNG to write (``.png``; the directory must exist)."""
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: the chart is a PNG; give a name ending in .png")
    if text == "-":
        raise argparse.ArgumentTypeError("a chart cannot go to stdout; give a .png file name")
    return output_file(text)


def new_or_existing_dir(text: str) -> str:
    """A directory to write into: an existing one, or a new one whose parent exists (never a
    URL)."""
    p = Path(not_url(text))
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    if not p.exists() and not p.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"the parent of {text} ({p.parent}) does not exist; create it or choose another"
        )
    return text


def alloc_conf(text: str) -> str:
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string the simulator reproduces (checked, kept as text)."""
    from gpumem.allocator.alloc_conf import AllocConf

    try:
        AllocConf.parse(text, source="--alloc-conf")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
