"""An on-disk cache of the step simulations' results (``step_trace.fragmentation``), so that a
fresh process — each ``gpumem plan`` on the command line — does not simulate again the shapes
an earlier one did (a 1024-GPU Llama-2-70B sweep simulates some 3,400).

Safe by construction: JSON only (never pickle), one file per gpumem version and hash of the
source of the simulator and of the traces (any change to either starts a new file, so a stale
result is never read), written atomically (a temporary file renamed over the old one, so a
concurrent process reads the old file or the new one, never half of one), read only when it is
under ``MAX_BYTES`` and parses as ``{key: [int, int]}`` with non-negative values — anything
else is ignored and rewritten. A result is a pure function of its key (the settings, the shape,
the layer count), so a hit returns exactly what simulating would.

Where: ``$GPUMEM_CACHE_DIR`` only — off unless the user names a folder, because a command
writes nowhere the user did not point it (``off``/empty is off too; nothing read or written).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
from pathlib import Path

from gpumem._env import env_str
from gpumem._version import __version__

MAX_BYTES = 64 << 20
"""A larger file is not read (nor grown): the cache starts again."""
MAX_ENTRIES = 200_000

_SOURCES = ("allocator/caching.py", "allocator/alloc_conf.py", "estimator/step_trace.py")
_state: dict[str, object] = {}


def cache_dir() -> Path | None:
    """The cache's folder, or None when turned off."""
    env = env_str("GPUMEM_CACHE_DIR")
    if env is None or env.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(env)


def _file(folder: Path) -> Path:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(__version__.encode())
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return folder / f"reserved-{__version__}-{h.hexdigest()[:16]}.json"


def _read(path: Path) -> dict[str, tuple[int, int]]:
    try:
        if path.stat().st_size > MAX_BYTES:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for k, v in data.items():
        if not (
            isinstance(v, list)
            and len(v) == 2
            and all(type(x) is int and x >= 0 for x in v)  # no bools
        ):
            return {}  # not a file this module wrote: ignore all of it
        out[k] = (v[0], v[1])
    return out


def _load() -> dict[str, tuple[int, int]] | None:
    """The entries (read once per process), or None when the cache is off."""
    if "entries" not in _state:
        folder = cache_dir()
        if folder is None:
            _state["entries"] = None
        else:
            path = _file(folder)
            _state["path"] = path
            _state["entries"] = _read(path)
            _state["new"] = 0
    return _state["entries"]  # type: ignore[return-value]


def enabled() -> bool:
    """Whether the cache is on (a caller skips building keys when it is not)."""
    return _load() is not None


def lookup(key: str) -> tuple[int, int] | None:
    entries = _load()
    return None if entries is None else entries.get(key)


def store(key: str, value: tuple[int, int]) -> None:
    entries = _load()
    if entries is None or len(entries) >= MAX_ENTRIES:
        return
    entries[key] = (int(value[0]), int(value[1]))
    if not _state["new"]:
        atexit.register(flush)
    _state["new"] = int(_state["new"]) + 1  # type: ignore[call-overload]


def flush() -> None:
    """Write the entries if this process added any (atomically; a failure is ignored: the cache
    is only a shortcut)."""
    entries = _state.get("entries")
    if not entries or not _state.get("new"):
        return
    path = _state["path"]
    assert isinstance(path, Path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read(path), **entries}  # another process may have added some meanwhile
        fd, tmp = tempfile.mkstemp(prefix=".reserved-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({k: list(v) for k, v in merged.items()}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return
    _state["new"] = 0


def reset() -> None:
    """Forget what this process read (the next lookup reads the folder again)."""
    _state.clear()


__all__ = ["MAX_BYTES", "cache_dir", "enabled", "flush", "lookup", "reset", "store"]
