"""Test parts for the object-store backend: a local S3 server in its own process, and an HTTP
proxy in front of it that injects faults.

``S3Server`` runs moto's server mode (``python -m moto.server``) on 127.0.0.1 as a separate
process, started and stopped by the test that uses it. ``FaultProxy`` forwards HTTP requests to
it and, by rule, resets the connection part way through a request or a response body, answers
503 SlowDown, flips a byte of a body, mangles an ETag, drips its answer a byte at a time (a
store that never finishes), or strips the conditional-write headers (a store without
conditional-write support). It logs every request it saw, so a test can count the retries.
The Checkpointer helpers at the end (``open_checkpointer``, ``save_steps``, ``restore_from``)
save and restore a small model through an ``s3://`` root.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# moto's server app, served one request at a time: moto checks a conditional write and then
# writes (check-then-act), which its threaded server (``moto_server``) does not make atomic, so
# two racing commits could both "win" there; S3 itself decides them atomically
_SERVE = """
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
run_simple("127.0.0.1", int(sys.argv[1]), DomainDispatcherApplication(create_backend_app),
           threaded=False, request_handler=MotoRequestHandler)
"""


class S3Server:
    """moto's S3 server in a child process on 127.0.0.1 (``auth``: it checks credentials, so
    every key it does not know is denied). See ``_SERVE`` for why one request at a time."""

    def __init__(self, log_dir: Path, auth: bool = False):
        pytest.importorskip("moto.server", reason="the object-store tests need moto[server]")
        self.port = _free_port()
        env = {**os.environ, **CREDENTIALS, "MOTO_PORT": str(self.port)}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self.log = log_dir / f"moto-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto server did not start: {self.log.read_text()}"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Rule:
    """A fault for the requests ``match`` accepts, ``times`` times (None: always).

    ``action``: "reset_request" (read half the body, then reset the connection), "reset_response"
    (send the headers and half the body, then reset), "drop_response" (forward, then reset
    without answering: the write happened, the client never hears it), "slowdown" (503
    SlowDown), "bad_digest" (400 BadDigest, what S3 answers to a body that fails its checksum
    header, not forwarded), "flip_request" / "flip_response" (one byte of the body changed),
    "strip_conditions" (If-None-Match and If-Match removed before forwarding), "hang" (hold the
    request unanswered until the proxy closes: a writer stuck mid-part, to be killed),
    "mangle_etag" (one character of the answer's ETag header changed), "drip" (forward, then
    send the whole answer, status line and headers included, one byte every
    ``FaultProxy.drip_s``: a store that never stops answering and never finishes).
    """

    action: str
    match: Callable[[str, str, dict[str, list[str]], dict[str, str]], bool]
    times: int | None = 1
    hits: int = 0


def is_part(method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> bool:
    return method == "PUT" and "partNumber" in query


def is_ranged_get(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return method == "GET" and "range" in headers


def is_conditional_put(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return method == "PUT" and ("if-none-match" in headers or "if-match" in headers)


def any_request(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return True


@dataclass
class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (host, port); see the module
    docstring. ``seen`` logs (method, path, query, status) of every request."""

    upstream: tuple[str, int]
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str, str, int]] = field(default_factory=list)
    # (x-amz-checksum-crc32c header, body) of every PUT, as the proxy received them
    puts: list[tuple[str | None, bytes]] = field(default_factory=list)
    drip_s: float = 0.5  # between two bytes of a "drip" answer

    def __post_init__(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._release = threading.Event()

    def add(self, action: str, match: Callable[..., bool], times: int | None = 1) -> Rule:
        rule = Rule(action, match, times)
        with self._lock:
            self.rules.append(rule)
        return rule

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def count(self, method: str, query_has: str = "") -> int:
        return sum(1 for m, _, q, _ in self.seen if m == method and query_has in q)

    def _rule(self, method: str, path: str, query: dict, headers: dict[str, str]) -> str | None:
        with self._lock:
            for rule in self.rules:
                if (rule.times is None or rule.hits < rule.times) and rule.match(
                    method, path, query, headers
                ):
                    rule.hits += 1
                    return rule.action
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        method = h.command
        parsed = urllib.parse.urlsplit(h.path)
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        headers = {k.lower(): v for k, v in h.headers.items()}
        action = self._rule(method, parsed.path, query, headers)
        length = int(headers.get("content-length", 0) or 0)
        if action == "reset_request":
            h.rfile.read(length // 2)
            self.seen.append((method, parsed.path, parsed.query, 0))
            _reset(h)
            return
        body = h.rfile.read(length) if length else b""
        if action == "hang":
            self.seen.append((method, parsed.path, parsed.query, -1))
            self._release.wait(120)
            _reset(h)
            return
        if method == "PUT":
            self.puts.append((headers.get("x-amz-checksum-crc32c"), body))
        if action in ("slowdown", "bad_digest"):
            status, code, message = {
                "slowdown": (503, "SlowDown", "Please reduce your request rate."),
                "bad_digest": (400, "BadDigest", "The CRC32C you specified did not match."),
            }[action]
            self.seen.append((method, parsed.path, parsed.query, status))
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>"
            ).encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(xml)))
            h.end_headers()
            h.wfile.write(xml)
            return
        if action == "flip_request" and body:
            body = _flip(body)
        out_headers = {
            k: v
            for k, v in h.headers.items()
            if k.lower() not in ("expect", "connection", "host", "proxy-connection")
        }
        if action == "strip_conditions":
            out_headers = {
                k: v
                for k, v in out_headers.items()
                if k.lower() not in ("if-none-match", "if-match")
            }
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, h.path, body=body, headers=out_headers)
            resp = conn.getresponse()
            data = resp.read()
            status, resp_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
        self.seen.append((method, parsed.path, parsed.query, status))
        if action == "drop_response":
            _reset(h)
            return
        if action == "drip":
            self._drip(h, status, resp_headers, b"" if method == "HEAD" else data)
            return
        if action == "mangle_etag":
            resp_headers = [
                (k, _flip(v.encode()).decode() if k.lower() == "etag" else v)
                for k, v in resp_headers
            ]
        if action == "flip_response" and data:
            data = _flip(data)
        h.send_response(status)
        for k, v in resp_headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                h.send_header(k, v)
        declared = {k.lower(): v for k, v in resp_headers}.get("content-length")
        h.send_header(
            "Content-Length", declared if method == "HEAD" and declared else str(len(data))
        )
        h.end_headers()
        if method == "HEAD":
            return
        if action == "reset_response":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            _reset(h)
            return
        h.wfile.write(data)

    def _drip(self, h: BaseHTTPRequestHandler, status: int, headers: list, body: bytes) -> None:
        """Send the answer a byte at a time until it is sent, the client hangs up, or the
        proxy closes."""
        h.close_connection = True
        lines = [f"HTTP/1.1 {status} {http.client.responses.get(status, '')}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in ("transfer-encoding",)]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        for i in range(len(raw)):
            if self._release.wait(self.drip_s):
                return
            try:
                h.connection.sendall(raw[i : i + 1])
            except OSError:
                return  # the client gave up


def _flip(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1 :]


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Close the client's connection with a TCP reset (SO_LINGER 0), as a dying peer does."""
    h.close_connection = True
    with contextlib.suppress(OSError):
        h.wfile.flush()
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        h.connection.close()


@contextlib.contextmanager
def env(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server at ``endpoint`` (created with plain boto3)."""
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


# ---------------------------------------------------------------------- the fixtures' bodies
# (conftest.py: s3_server, s3_proxy, s3_bucket)


def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto server for a module's tests, stopped after them."""
    with env({**CREDENTIALS, "AWS_ENDPOINT_URL": None, "AWS_PROFILE": None}):
        srv = S3Server(tmp_path_factory.mktemp("moto"))
        try:
            yield srv
        finally:
            srv.stop()


def proxy_for(server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``server``."""
    p = FaultProxy(("127.0.0.1", server.port))
    try:
        yield p
    finally:
        p.close()


def open_store(endpoint: str, bucket: str, prefix: str = "run", **kw: object):
    """An ``S3Store`` on ``s3://bucket/prefix`` at ``endpoint`` with the test credentials."""
    from gpumem.checkpoint.storage.s3.object_store import S3Store

    with env(CREDENTIALS):
        return S3Store(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, **kw)


# ---------------------------------------------------------------------- Checkpointer("s3://...")


def train_state(seed: int, width: int = 1024, hidden: int = 1536) -> tuple[Any, Any]:
    """A model and Adam after one step (``width`` x ``hidden``: 1024 x 1536 are ~18 MiB with
    Adam, data files of several 5 MiB parts)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt


def open_checkpointer(url: str, endpoint: str, **kw: Any) -> Any:
    """A Checkpointer on ``url`` at ``endpoint`` uploading 5 MiB parts (several per file)."""
    import gpumem

    with env(CREDENTIALS):
        ck = gpumem.Checkpointer(
            url, endpoint_url=endpoint, staging_bytes=64 << 20, overlap=False, **kw
        )
    if ck._root.objects is not None:
        ck._root.objects.part_bytes = 5 << 20
    return ck


def snapshot(model: Any, opt: Any) -> dict[str, Any]:
    """Copies of the model's and the optimizer's tensors, by name."""
    import torch

    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"o.{pid}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def save_steps(
    url: str, endpoint: str, steps: Any, size: tuple[int, int] = (1024, 1536), **kw: Any
) -> dict[int, dict[str, Any]]:
    """Save ``steps`` (each ``train_state(step, *size)``), each waited for; their snapshots."""
    states = {}
    with open_checkpointer(url, endpoint, **kw) as ck:
        for step in steps:
            model, opt = train_state(step, *size)
            ck.save(step, model=model, optimizer=opt, blocking=True)
            ck.wait()
            states[step] = snapshot(model, opt)
    return states


def restore_from(
    url: str, endpoint: str, size: tuple[int, int] = (1024, 1536), **kw: Any
) -> tuple[int | None, dict[str, Any]]:
    """Restore into a fresh ``train_state``: the step restored and the snapshot."""
    model, opt = train_state(999, *size)
    with open_checkpointer(url, endpoint, **kw) as ck:
        step = ck.restore(model=model, optimizer=opt)
    return step, snapshot(model, opt)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two snapshots hold the same tensors, bit for bit."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
