"""Progress bars for long commands (rich), on a terminal only: never in a pipe, a file or
``--json`` output, so what a script reads is exactly the result.

The library reports progress through plain callbacks, ``progress(done, total)``; this module
turns them into a bar on stderr that disappears when the work is done.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

Callback = Callable[..., None]


def _noop(*_: Any, **__: Any) -> None:
    return None


@contextlib.contextmanager
def progress_bar(
    description: str, *, enabled: bool = True, stream: IO[str] | None = None
) -> Iterator[Callback]:
    """Yield ``update(done, total=None, description=None)``; a no-op unless ``enabled`` and
    ``stream`` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (enabled and isatty is not None and isatty()):
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=None)

        def update(done: float, total: float | None = None, description: str | None = None):
            fields: dict[str, Any] = {"completed": done}
            if total is not None:
                fields["total"] = total
            if description is not None:
                fields["description"] = description
            bar.update(task, **fields)

        yield update
