"""Checkpoint files sent between two ranks over torch.distributed (the checkpoint's gloo group).

One transfer is a header (the files' names and sizes, JSON in a uint8 tensor) and then each
file in chunks of at most ``CHUNK`` bytes, followed by its CRC32C: the receiver checks what it
wrote against it, so a transfer damaged on the way is an error, never a file that looks whole
(the restore verifies every chunk of the data by the manifests' CRCs again, as for local files).
Both sides always exchange every announced byte, whatever fails, so a failure on one side never
leaves the other waiting in a receive: a file the sender cannot read is sent as zeros with a
CRC that cannot match. Files are written under a temporary name, fdatasync'ed and renamed into
place; names are checked against what the receiver expects before anything is created.

Transfers between several pairs run in one order every rank knows (``run``): the first pending
transfer of that order always has both of its ranks ready, so blocking sends and receives never
deadlock.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpumem.checksum import crc32c

from ...errors import CheckpointCorruptError
from ...group import Group, peers_gone, torch_distributed
from ..safe_fs import Dir, close_fd, release_fd

CHUNK = 16 << 20
_MAX_HEADER = 1 << 20
_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass
class Transfer:
    """``src`` sends ``names`` from its directory to ``dst``, which keeps those ``allowed``."""

    src: int
    dst: int
    names: list[str]


def run(
    group: Group,
    transfers: list[Transfer],
    source: Callable[[Transfer], Dir],
    target: Callable[[Transfer], Dir | None],
    allowed: Callable[[Transfer, str], bool],
) -> BaseException | None:
    """This rank's part of ``transfers`` (the same list on every rank), in order: the first
    failure here (later transfers still run, to keep the peers in step), or None."""
    failure: BaseException | None = None
    for t in transfers:
        if t.src == group.rank:
            d: Dir | None = None
            try:
                d = source(t)
            except Exception as exc:  # announce no files: the peer stays in step
                failure = failure or exc
            failure = failure or send(group, t.dst, d, t.names if d is not None else [])
        elif t.dst == group.rank:
            into = target(t)  # None: drained, nothing kept (this side failed already)
            err = receive(group, t.src, into, functools.partial(allowed, t))
            failure = failure or err or (None if into is not None else OSError("no directory"))
    return failure


def send(group: Group, dst: int, d: Dir | None, names: list[str]) -> BaseException | None:
    dist, failure = torch_distributed(), None
    sizes = []
    for name in names:
        try:
            assert d is not None
            sizes.append(os.stat(name, dir_fd=d.fd, follow_symlinks=False).st_size)
        except OSError as exc:
            failure = failure or exc
            sizes.append(0)
    header = json.dumps([[n, s] for n, s in zip(names, sizes, strict=True)]).encode()
    with peers_gone():
        dist.send(torch.tensor([len(header)], dtype=torch.int64), dst, group=group.pg)
        dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group.pg)
        for name, size in zip(names, sizes, strict=True):
            assert d is not None
            fd, crc, broken = -1, 0, False
            try:
                fd = os.open(name, _READ, dir_fd=d.fd)
            except OSError as exc:
                failure, broken = failure or exc, True
            for off in range(0, size, CHUNK):
                n = min(CHUNK, size - off)
                data = b""
                if fd >= 0:
                    try:
                        data = os.pread(fd, n, off)
                    except OSError as exc:
                        failure = failure or exc
                if len(data) != n:  # unreadable or shrunk: zeros, and a CRC that cannot match
                    failure = failure or OSError(f"{d.path / name} changed while sent")
                    data, broken = bytes(n), True
                crc = crc32c(data, crc)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group.pg)
            if fd >= 0:  # read only: a close failure loses nothing, and the CRC must follow
                release_fd(fd, d.path / name)
            sent = crc ^ 0xFFFFFFFF if broken else crc
            dist.send(torch.tensor([sent], dtype=torch.int64), dst, group=group.pg)
    return failure


def receive(
    group: Group, src: int, d: Dir | None, allowed: Callable[[str], bool]
) -> BaseException | None:
    dist = torch_distributed()
    failure: BaseException | None = None
    where = d.path if d is not None else Path("(not kept)")
    with peers_gone():
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, src, group=group.pg)
        if not 2 <= int(n.item()) <= _MAX_HEADER:
            raise CheckpointCorruptError(f"rank {src} sent a header of {int(n.item())} bytes")
        raw = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(raw, src, group=group.pg)
        files = _header(raw.numpy().tobytes(), src, allowed)
        for name, size in files:
            tmp, fd, crc = f".recv-{name}", -1, 0
            try:
                if d is not None:
                    d.remove_tree(tmp)
                    fd = os.open(tmp, _WRITE, 0o644, dir_fd=d.fd)
            except OSError as exc:
                failure = failure or exc
            for off in range(0, size, CHUNK):
                buf = torch.empty(min(CHUNK, size - off), dtype=torch.uint8)
                dist.recv(buf, src, group=group.pg)
                view = memoryview(buf.numpy())
                crc = crc32c(view, crc)
                if fd >= 0:
                    try:
                        os.pwrite(fd, view, off)
                    except OSError as exc:
                        failure = failure or exc
            want = torch.empty(1, dtype=torch.int64)
            dist.recv(want, src, group=group.pg)
            if int(want.item()) != crc:
                failure = failure or CheckpointCorruptError(
                    f"{where / name}: received from rank {src} with CRC32C {crc:08x}, sent as "
                    f"{int(want.item()):08x} (unreadable at the sender or damaged on the way)"
                )
            if fd >= 0:
                assert d is not None
                failure = failure or _keep(d, fd, tmp, name, failure is None)
    if failure is None and d is not None:
        try:
            d.fsync()
        except OSError as exc:
            failure = exc
    return failure


def _keep(d: Dir, fd: int, tmp: str, name: str, ok: bool) -> OSError | None:
    """Make the received ``tmp`` durable as ``name`` (``ok``), else remove it. A failure is
    returned, never raised: the transfers that follow must still run."""
    failure: OSError | None = None
    try:
        os.fdatasync(fd)
    except OSError as exc:
        failure = exc
    try:  # written through: its close failing fails the file (a CheckpointIOError)
        close_fd(fd, d.path / tmp)
    except OSError as exc:
        failure = failure or exc
    if failure is not None:
        return failure
    if not ok:
        d.discard_tree(tmp)
        return None
    try:
        d.replace(tmp, name)
    except OSError as exc:
        return exc
    return None


def _header(raw: bytes, src: int, allowed: Callable[[str], bool]) -> list[tuple[str, int]]:
    try:
        rows = json.loads(raw)
        files = [(str(n), int(s)) for n, s in rows if isinstance(n, str) and isinstance(s, int)]
        ok = len(files) == len(rows) and all(allowed(n) and s >= 0 for n, s in files)
    except (ValueError, TypeError):
        ok, files = False, []
    if not ok:
        raise CheckpointCorruptError(f"rank {src} sent files not expected here: {raw[:200]!r}")
    return files
