"""The ``gpumem`` command: argparse subcommands, one module each, ``main(argv) -> int``.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func=run`` where ``run(args) -> int``. The CLI only parses arguments and calls the public face.

Every failure is one line on stderr, ``gpumem CMD: error: <problem>; <what to do>``, and exit
code 2 (``gpumem ckpt verify`` exits 1 for a corrupt checkpoint, as documented): argument
errors from argparse, errors the library raises, and anything unexpected. ``--debug`` (anywhere
on the line) or ``GPUMEM_DEBUG=1`` prints the traceback as well. A closed pipe (``| head``)
ends the command quietly.

Modules:

    profile     ``gpumem profile``: per-layer memory of training steps
    estimate    ``gpumem estimate``: the per-GPU memory bill of a job
    plan        ``gpumem plan``: which layouts fit, and what preemption costs
    calibrate   ``gpumem calibrate``: measure this machine, write calibration.json
    ckpt        ``gpumem ckpt``: list, verify, inspect, export and import checkpoints
    doctor      ``gpumem doctor``: versions, native core, GPUs, bandwidth
    demo        ``gpumem demo``: the four parts, offline
    _args       argument types: every value checked before any work starts
    _progress   progress bars (rich), on a terminal only
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

# one module per subcommand, in the order --help lists them
_SUBCOMMANDS = ("demo", "doctor", "profile", "estimate", "plan", "ckpt", "calibrate")
# errors whose message is written for the user; anything else is reported as unexpected
_USER_ERRORS = (ValueError, LookupError, OSError, MemoryError)
EXIT_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a reader that went away
MESSAGE_LIMIT = 800


class UsageError(Exception):
    """A bad command line, found by argparse; ``prog`` names the (sub)command."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block is what ``--help`` is for."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gpumem",
        description="Measure, estimate and protect the memory of PyTorch training jobs. "
        "Start with `gpumem demo`.",
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error too (anywhere on the line; or GPUMEM_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def _version() -> str:
    from gpumem._version import __version__

    return f"gpumem {__version__}"


def one_line(text: object, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` with every run of whitespace (newlines too) as one space, at most ``limit``."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _debug_requested(argv: list[str]) -> bool:
    from gpumem._env import env_flag

    try:
        env = env_flag("GPUMEM_DEBUG")
    except ValueError:
        env = True  # a malformed switch still asks for more detail, not less
    return "--debug" in argv or env


def _command(args: argparse.Namespace | None, argv: list[str]) -> str:
    """``gpumem ckpt verify``: the subcommand as far as it is known."""
    if args is not None and getattr(args, "command", None):
        parts = ["gpumem", args.command]
        if getattr(args, "ckpt_command", None):
            parts.append(args.ckpt_command)
        return " ".join(parts)
    first = next((a for a in argv if not a.startswith("-")), None)
    return f"gpumem {first}" if first in _SUBCOMMANDS else "gpumem"


def describe_error(exc: BaseException) -> str:
    """The problem and what to do, as one line."""
    if isinstance(exc, MemoryError):
        return one_line(
            f"out of memory ({exc or 'the allocation failed'}); use smaller sizes, or --fake "
            "where the command has it"
        )
    if isinstance(exc, _USER_ERRORS) or type(exc).__module__.startswith("gpumem"):
        return one_line(exc)
    return one_line(
        f"{type(exc).__name__}: {exc} (unexpected: rerun with --debug for the traceback, and "
        "report it with the command line)"
    )


@contextlib.contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    """Python warnings as ``gpumem CMD: warning: ...`` lines (not file:line and source)."""

    def show(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        print(f"{command}: warning: {one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


def _quiet_broken_pipe() -> None:
    """The reader went away: point stdout at /dev/null so the interpreter's final flush does
    not complain (the recipe of Python's `signal` documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is no file (a test's capture): nothing will flush to a pipe


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    args: argparse.Namespace | None = None
    command = _command(None, argv)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help and --version
            return int(exc.code or 0)
        command = _command(args, argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_ERROR
        with _one_line_warnings(command):
            code = int(args.func(args) or 0)
        global _skip_teardown
        _skip_teardown = bool(getattr(args, "skip_teardown", False))
        return code
    except UsageError as exc:
        print(f"{exc.prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_broken_pipe()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if debug:
            traceback.print_exc()
        print(f"{command}: error: {describe_error(exc)}", file=sys.stderr)
        return EXIT_ERROR


# set by main() for a command that asks for it (``skip_teardown`` in its defaults)
_skip_teardown = False


def console_main() -> NoReturn:
    """The ``gpumem`` executable and ``python -m gpumem``: ``main``, then a last flush that a
    closed pipe cannot turn into an error message. A command that finished with nothing left to
    do (``gpumem profile``: its files are written and closed, it starts no threads) exits
    without the interpreter's teardown, which after torch and dynamo are imported costs about
    0.6 s of CPU (atexit handlers, freeing every module)."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_broken_pipe()
        code = EXIT_BROKEN_PIPE
    if _skip_teardown:
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
