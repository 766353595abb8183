"""Deadlines for the object store: no request and no save or restore waits on a store forever.

botocore's ``read_timeout`` bounds each wait for the socket, not a request: a server answering
one byte every few seconds never trips it, and a ranged GET, a multipart POST or a listing runs
until the job is killed. So every request has a deadline of its own (``request_deadline_s``,
retries and their back-off included), and every save's and restore's objects a deadline for
all their requests together (``deadline_s``, a ``Deadline``). ``Watchdog`` enforces both: each
request registers the connection it sends on, and when its time is up the watchdog shuts that
socket down, which ends a read or a send blocked on it at once; the request then fails as
``CheckpointIOError`` (errno ETIMEDOUT) naming the operation and the object.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

REQUEST_DEADLINE_S = 120.0  # one request, its retries included (a 64 MiB part at >= 0.6 MB/s)
DEADLINE_S = 3600.0  # every request of one save's or one restore's objects together


@dataclass(frozen=True)
class Deadline:
    """When an operation (one save's uploads, one restore's reads) must be done.

    Attributes:
        what: the operation, for the message (``"save of s3://b/run/step-000000005/..."``).
        at: ``time.monotonic()`` when it is over.
        seconds: the deadline it was given.
    """

    what: str
    at: float
    seconds: float

    @classmethod
    def start(cls, what: str, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now."""
        return cls(what, time.monotonic() + seconds, seconds)


@dataclass
class Guard:
    """One request's watch: until ``at`` (monotonic), on the connections it sent on."""

    at: float
    fired: bool = False
    conns: list[Any] = field(default_factory=list)

    def left(self) -> float:
        return self.at - time.monotonic()


class Watchdog:
    """Shuts down the socket of a request whose deadline passed (see the module docstring).
    One per process, on a daemon thread started with the first guard."""

    def __init__(self) -> None:
        self._forked()
        # a forked child has no watchdog thread (and its parent's lock may be held): start over
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._cond = threading.Condition()
        self._guards: dict[int, list[Guard]] = {}  # by thread: nested guards, innermost last
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, at: float) -> Iterator[Guard]:
        """Watch the calling thread's requests until ``at`` for the block."""
        g = Guard(at)
        me = threading.get_ident()
        with self._cond:
            self._guards.setdefault(me, []).append(g)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gpumem-s3-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield g
        finally:
            with self._cond:
                stack = self._guards[me]
                stack.remove(g)
                if not stack:
                    del self._guards[me]

    def sending(self, conn: Any) -> None:
        """The calling thread sends a request on ``conn``: its guards watch it (one already
        past its time shuts it down at once)."""
        with self._cond:
            stack = self._guards.get(threading.get_ident(), [])
            for g in stack:
                g.conns.append(conn)
            late = any(g.fired or g.left() <= 0 for g in stack)
        if late:
            _shut(conn)

    def late(self) -> bool:
        """Whether a guard of the calling thread (an enclosing one too) is past its time."""
        with self._cond:
            stack = self._guards.get(threading.get_ident(), [])
            return any(g.fired or g.left() <= 0 for g in stack)

    def _run(self) -> None:
        while True:
            with self._cond:
                pending = [g for s in self._guards.values() for g in s if not g.fired]
                now = time.monotonic()
                due = [g for g in pending if g.at <= now]
                if not due:
                    wait = min((g.at - now for g in pending), default=None)
                    self._cond.wait(wait)
                    continue
                conns = []
                for g in due:
                    g.fired = True
                    conns += g.conns
            for conn in conns:
                _shut(conn)


def _shut(conn: Any) -> None:
    """End whatever blocks on ``conn``'s socket now (a read or a send), from another thread."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


WATCHDOG = Watchdog()


def watch_connections(client: Any) -> bool:
    """Make ``client`` (a boto3 S3 client) tell ``WATCHDOG`` which connection each request is
    sent on, by connection classes that report themselves as they send. botocore has no public
    hook for this: its session's pool classes are set on its private pool manager, and where
    that is not found (another botocore) this returns False and deadlines are checked only
    between a response's reads."""
    try:
        from botocore.awsrequest import (
            AWSHTTPConnection,
            AWSHTTPConnectionPool,
            AWSHTTPSConnection,
            AWSHTTPSConnectionPool,
        )

        session = client._endpoint.http_session
        manager = session._manager
    except (ImportError, AttributeError):
        return False

    class WatchedHTTPConnection(AWSHTTPConnection):  # type: ignore[misc]
        def request(self, *args: Any, **kwargs: Any) -> Any:
            WATCHDOG.sending(self)
            return super().request(*args, **kwargs)

    class WatchedHTTPSConnection(AWSHTTPSConnection):  # type: ignore[misc]
        def request(self, *args: Any, **kwargs: Any) -> Any:
            WATCHDOG.sending(self)
            return super().request(*args, **kwargs)

    class WatchedHTTPPool(AWSHTTPConnectionPool):  # type: ignore[misc]
        ConnectionCls = WatchedHTTPConnection

    class WatchedHTTPSPool(AWSHTTPSConnectionPool):  # type: ignore[misc]
        ConnectionCls = WatchedHTTPSConnection

    pools = {"http": WatchedHTTPPool, "https": WatchedHTTPSPool}
    session._pool_classes_by_scheme = pools  # the proxy managers it makes later
    manager.pool_classes_by_scheme = pools
    return True
