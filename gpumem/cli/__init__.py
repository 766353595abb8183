"""The ``gpumem`` command: argparse subcommands, one module each, ``main(argv) -> int``.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func=run`` where ``run(args) -> int``. The CLI only parses arguments and calls the public face.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# one module per subcommand, in the order --help lists them
_SUBCOMMANDS = ("doctor", "profile", "estimate", "plan", "ckpt", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpumem",
        description="Measure, estimate and protect the memory of PyTorch training jobs.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def _version() -> str:
    from gpumem import __version__

    return f"gpumem {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, LookupError) as exc:  # user-facing errors: one line, no traceback
        print(f"gpumem {args.command}: error: {exc}", file=sys.stderr)
        return 2
