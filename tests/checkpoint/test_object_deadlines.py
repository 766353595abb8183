"""Issue 39, items 3 and 5: an object store never holds a save or a restore forever, and a fault
in transit is read again before a step is called damaged.

The store is moto's S3 server behind s3_lib.FaultProxy. "drip" answers one byte every
``drip_s`` (status line and headers too): botocore's per-read timeout never trips on it, so
only gpumem's deadlines end such a request. Each slow case runs under a watchdog (``_ends``):
the test fails, instead of hanging, if the operation does not end; no test asserts a speed.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from s3_lib import (
    is_part,
    is_ranged_get,
    open_checkpointer,
    open_store,
    restore_from,
    same,
    save_steps,
    train_state,
)

import gpumem
from gpumem.checkpoint import CheckpointFallbackWarning, CheckpointIOError, CheckpointStateError

pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
pytest.importorskip("moto", reason="the object-store tests need moto[server]")

MiB = 1 << 20
DEADLINE = "2"  # seconds: a tiny request deadline (moto answers a request in milliseconds)
WATCHDOG_S = 60.0  # what "never hangs" means here: far beyond the deadline and its clean-up


def _ends(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` on a thread; fail the test if it is still running after ``WATCHDOG_S``.
    Returns what it raised (None: nothing)."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test
            out[0] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    assert not t.is_alive(), f"still running after {WATCHDOG_S} s: it hangs"
    return out[0]


SIZE = (512, 1152)  # ~7 MiB with Adam: data files of two 5 MiB parts


def _ck(url: str, endpoint: str) -> gpumem.Checkpointer:
    return open_checkpointer(url, endpoint)


def _save(url: str, endpoint: str, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    return save_steps(url, endpoint, steps, SIZE)


def _restore(url: str, endpoint: str) -> tuple[int | None, dict[str, torch.Tensor]]:
    return restore_from(url, endpoint, SIZE)


def _is_data_get(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return is_ranged_get(method, path, query, headers) and "/data-" in path


def _is_data_head(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return method == "HEAD" and "/data-" in path


def _is_create_upload(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return method == "POST" and "uploads" in query


def _is_listing(method: str, path: str, query: dict, headers: dict[str, str]) -> bool:
    return method == "GET" and "list-type" in query


# ---------------------------------------------------------------------- deadlines


def test_a_dripping_ranged_get_in_restore_ends_at_the_deadline(
    s3_server, s3_proxy, s3_bucket, monkeypatch
):
    url = f"s3://{s3_bucket}/drip-get"
    _save(url, s3_server.url, [1])
    monkeypatch.setenv("GPUMEM_S3_REQUEST_DEADLINE_S", DEADLINE)
    s3_proxy.add("drip", _is_data_get, times=None)
    exc = _ends(lambda: _restore(url, s3_proxy.url))
    assert isinstance(exc, CheckpointIOError), exc
    msg = str(exc)
    assert f"read s3://{s3_bucket}/drip-get/step-000000001/" in msg and "/data-" in msg
    assert f"within the {DEADLINE} s a request may take" in msg
    assert "GPUMEM_S3_REQUEST_DEADLINE_S" in msg


def test_a_dripping_multipart_post_in_save_ends_at_the_deadline(
    s3_server, s3_proxy, s3_bucket, monkeypatch
):
    url = f"s3://{s3_bucket}/drip-post"
    monkeypatch.setenv("GPUMEM_S3_REQUEST_DEADLINE_S", DEADLINE)
    s3_proxy.add("drip", _is_create_upload, times=None)
    model, opt = train_state(1, *SIZE)

    def save_and_wait() -> None:
        with _ck(url, s3_proxy.url) as ck:
            ck.save(1, model=model, optimizer=opt)
            ck.wait()

    exc = _ends(save_and_wait)
    assert isinstance(exc, CheckpointIOError), exc
    assert f"write s3://{s3_bucket}/drip-post/step-000000001/" in str(exc)
    assert "a request may take" in str(exc)
    s3_proxy.rules.clear()  # the failed save left the store as it was: nothing committed
    with _ck(url, s3_server.url) as ck:
        assert ck.list() == []


def test_a_dripping_first_listing_fails_construction_at_the_deadline(
    s3_server, s3_proxy, s3_bucket, monkeypatch
):
    url = f"s3://{s3_bucket}/drip-list"
    monkeypatch.setenv("GPUMEM_S3_REQUEST_DEADLINE_S", DEADLINE)
    s3_proxy.add("drip", _is_listing, times=None)
    exc = _ends(lambda: _ck(url, s3_proxy.url))
    assert isinstance(exc, CheckpointIOError), exc
    assert f"list s3://{s3_bucket}/drip-list" in str(exc) and "a request may take" in str(exc)


def test_an_operation_deadline_bounds_many_requests_together(s3_server, s3_proxy, s3_bucket):
    # each request well inside its own deadline, the operation's ends first: a restore's reads
    store = open_store(s3_proxy.url, s3_bucket, request_deadline_s=600.0, deadline_s=1.5)
    data = np.random.default_rng(0).integers(0, 256, MiB, dtype=np.uint8)
    store.upload("run/big", [data])
    s3_proxy.add("drip", is_ranged_get, times=None)
    out = np.zeros_like(data)
    deadline = store.deadline("restore of s3://x/run")
    exc = _ends(lambda: store.read_into("run/big", 0, out, object_size=MiB, deadline=deadline))
    assert isinstance(exc, CheckpointIOError), exc
    assert f"read s3://{s3_bucket}/run/big" in str(exc)
    assert "the restore of s3://x/run passed its 1.5 s deadline" in str(exc)


@pytest.mark.parametrize("doing", ["save", "restore"])
def test_a_save_or_a_restore_ends_at_its_own_deadline(
    s3_server, s3_proxy, s3_bucket, monkeypatch, doing
):
    # each request may take 10 minutes, the whole save or restore 2 s
    url = f"s3://{s3_bucket}/op-{doing}"
    if doing == "restore":
        _save(url, s3_server.url, [1])
    monkeypatch.setenv("GPUMEM_S3_REQUEST_DEADLINE_S", "600")
    monkeypatch.setenv("GPUMEM_S3_DEADLINE_S", DEADLINE)
    s3_proxy.add("drip", is_part if doing == "save" else _is_data_get, times=None)
    exc = _ends(
        lambda: _save(url, s3_proxy.url, [1]) if doing == "save" else _restore(url, s3_proxy.url)
    )
    assert isinstance(exc, CheckpointIOError), exc
    assert f"the {doing} of s3://{s3_bucket}/op-{doing}/step-000000001/" in str(exc)
    assert f"passed its {DEADLINE} s deadline (GPUMEM_S3_DEADLINE_S" in str(exc)


@pytest.mark.parametrize("in_child", [False, True], ids=["here", "in-a-forked-child"])
def test_the_watchdog_ends_a_read_blocked_past_its_deadline(in_child):
    from gpumem.checkpoint.storage.s3.object_deadline import WATCHDOG

    def blocked_read() -> list:
        a, b = socket.socketpair()  # b never writes: a.recv blocks until a is shut down
        got: list = []
        with a, b, WATCHDOG.guard(time.monotonic() + 0.3) as guard:
            WATCHDOG.sending(types.SimpleNamespace(sock=a))
            got += [a.recv(1), guard.fired]
        return got

    with WATCHDOG.guard(time.monotonic() + 60):  # the watchdog thread runs in this process
        pass
    if not in_child:
        out: list = []
        assert _ends(lambda: out.extend(blocked_read())) is None
        assert out == [b"", True]  # the read ended (end of stream), because the guard fired
        return
    pid = os.fork()
    if pid == 0:  # the child has no watchdog thread until its first guard starts one
        signal.alarm(30)  # a child whose read never ends is killed, and the test fails
        os._exit(0 if blocked_read() == [b"", True] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize(
    "kw, fault",
    [
        ({"request_deadline_s": 0}, "request_deadline_s=0"),
        ({"deadline_s": -1.0}, "deadline_s=-1.0"),
        ({"deadline_s": "soon"}, "deadline_s='soon'"),
        ({"max_attempts": 0}, "max_attempts=0"),
    ],
)
def test_bad_deadline_settings_are_one_clear_error(s3_server, s3_bucket, kw, fault):
    with pytest.raises(CheckpointStateError, match=fault):
        open_store(s3_server.url, s3_bucket, **kw)


def test_a_bad_deadline_in_the_environment_is_one_clear_error(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("GPUMEM_S3_DEADLINE_S", "0")
    with pytest.raises(CheckpointStateError, match="GPUMEM_S3_DEADLINE_S"):
        open_store(s3_server.url, s3_bucket)


# ---------------------------------------------------------------------- transient faults


@pytest.mark.parametrize(
    "action, match",
    [("flip_response", "_is_data_get"), ("mangle_etag", "_is_data_head")],
    ids=["one-flipped-byte-in-a-data-get", "one-mangled-etag-on-a-head"],
)
def test_one_fault_in_transit_is_read_again_and_the_newest_step_restored(
    s3_server, s3_proxy, s3_bucket, action, match
):
    url = f"s3://{s3_bucket}/{action}"
    states = _save(url, s3_server.url, [1, 2])
    s3_proxy.add(action, globals()[match], times=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointFallbackWarning)  # no fallback
        step, got = _restore(url, s3_proxy.url)
    assert step == 2 and same(got, states[2])
    assert s3_proxy.rules[0].hits == 1


def test_a_byte_flipped_every_time_is_damage_and_falls_back(s3_server, s3_proxy, s3_bucket):
    url = f"s3://{s3_bucket}/flips"
    states = _save(url, s3_server.url, [1, 2])
    s3_proxy.add(
        "flip_response",
        lambda *r: _is_data_get(*r) and "/step-000000002/" in r[1],
        times=None,
    )
    with pytest.warns(
        CheckpointFallbackWarning, match="skipping damaged checkpoint step-000000002: .*data-r"
    ):
        step, got = _restore(url, s3_proxy.url)
    assert step == 1 and same(got, states[1])
    assert s3_proxy.rules[0].hits >= 3  # read, and read again twice, before it was damage


def test_a_5xx_once_is_retried_and_always_is_one_error_after_the_attempts(
    s3_server, s3_proxy, s3_bucket
):
    store = open_store(s3_proxy.url, s3_bucket, max_attempts=3)
    s3_proxy.add("slowdown", lambda m, *_: m == "PUT", times=1)
    store.put("run/a", b"hello")
    assert store.get("run/a")[0] == b"hello"
    assert [s for m, _, _, s in s3_proxy.seen if m == "PUT"][-2:] == [503, 200]
    s3_proxy.add("slowdown", lambda m, *_: m == "PUT", times=None)
    before = s3_proxy.count("PUT")
    with pytest.raises(CheckpointIOError, match=r"write s3://.*/run/b failed after 3 attempts"):
        store.put("run/b", b"x")
    assert s3_proxy.count("PUT") - before == 3  # the documented count, no more
