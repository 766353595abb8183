"""The request layer of the object store: the boto3 client of one ``s3://`` root and the one
funnel every request goes through (``S3Requests.call``), which turns botocore's errors into
gpumem's, one clear error per cause.

Errors: a missing bucket, denied or missing credentials, an unreachable endpoint are
``CheckpointIOError`` (errno ENOENT, EACCES, ECONNREFUSED) naming the URL and what to do; a
404 for a key is ``NotFound`` and a failed condition (412) is ``PreconditionFailed``, for the
layers above to decide what they mean.
"""

from __future__ import annotations

import contextlib
import errno
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from gpumem._env import env_float, env_int

from ...errors import CheckpointIOError, CheckpointStateError
from ..location import ObjectURL
from .object_deadline import (
    DEADLINE_S,
    REQUEST_DEADLINE_S,
    WATCHDOG,
    Deadline,
    Guard,
    watch_connections,
)

ATTEMPTS = 8  # tries of a request (and of a ranged read broken off mid-body), the first included

_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
_MISSING = {"NoSuchBucket"}
_NO_KEY = {"NoSuchKey", "NoSuchUpload", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
# answers worth another try: the store was busy or failed, not the request
_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestLimitExceeded",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}
_BAD_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidChecksum"}


class PreconditionFailed(Exception):
    """412: a conditional write or read whose condition did not hold."""


class NotFound(Exception):
    """404 for a key (not for the bucket, which is an error of its own)."""


class S3Requests:
    """The client of one root and its request funnel (see the module docstring).

    Args:
        url: the root.
        endpoint_url, region, profile, max_attempts, max_concurrency, connect_timeout_s,
            read_timeout_s: as ``S3Store`` takes them.

    Raises:
        CheckpointStateError: boto3 is not installed, a bad setting, or an unknown profile.
    """

    def __init__(
        self,
        url: ObjectURL,
        *,
        endpoint_url: str | None,
        region: str | None,
        profile: str | None,
        max_attempts: int | None,
        max_concurrency: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        request_deadline_s: float | None,
        deadline_s: float | None,
    ):
        self.url = url
        if max_attempts is None:
            max_attempts = env_int("GPUMEM_S3_ATTEMPTS", ATTEMPTS)
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise CheckpointStateError(
                f"max_attempts={max_attempts!r} must be an int >= 1 (or GPUMEM_S3_ATTEMPTS)"
            )
        if request_deadline_s is None:
            request_deadline_s = env_float("GPUMEM_S3_REQUEST_DEADLINE_S", REQUEST_DEADLINE_S)
        if deadline_s is None:
            deadline_s = env_float("GPUMEM_S3_DEADLINE_S", DEADLINE_S)
        self.request_deadline_s = _seconds(
            "request_deadline_s", request_deadline_s, "GPUMEM_S3_REQUEST_DEADLINE_S's"
        )
        self.deadline_s = _seconds("deadline_s", deadline_s, "GPUMEM_S3_DEADLINE_S's")
        boto3, self.botocore = _import_boto3()
        from botocore.config import Config

        try:
            session = boto3.session.Session(profile_name=profile, region_name=region)
        except self.botocore.exceptions.ProfileNotFound as exc:
            raise CheckpointStateError(
                f"{self.url}: {exc}; name a profile of ~/.aws/config or unset AWS_PROFILE"
            ) from None
        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},  # retried by ``call``
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max_concurrency + 4,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # a custom endpoint (MinIO, a local server) rarely resolves bucket.host names
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )
        self.endpoint = endpoint_url or self.client.meta.endpoint_url
        watch_connections(self.client)
        self.max_attempts, self.max_concurrency = max_attempts, max_concurrency

    def name(self, key: str) -> str:
        """The ``s3://`` URL of ``key``, for messages."""
        return f"s3://{self.url.bucket}/{key}"

    def pages(self, doing: str, pages: Any, deadline: Deadline | None = None) -> Iterator[Any]:
        """A paginator's pages, each fetched through ``call``."""
        it = iter(pages)
        while True:
            page = self.call(doing, next, it, None, deadline=deadline)
            if page is None:
                return
            yield page

    def deadline(self, what: str) -> Deadline:
        """An operation's deadline (``deadline_s`` from now) for ``call``'s ``deadline``."""
        return Deadline.start(what, self.deadline_s)

    @contextlib.contextmanager
    def watch(self, doing: str, target: str, deadline: Deadline | None) -> Iterator[Guard]:
        """The block is one request (``request_deadline_s``, or less where ``deadline`` ends
        first): past its time the watchdog ends the socket it waits on, and whatever the block
        raises then becomes one ``CheckpointIOError`` naming ``doing`` and ``target``."""
        at = time.monotonic() + self.request_deadline_s
        if deadline is not None:
            at = min(at, deadline.at)
        with WATCHDOG.guard(at) as guard:
            if guard.left() <= 0:
                raise self.too_slow(doing, target, deadline, guard)
            try:
                yield guard
            except Exception as exc:
                timed_out = isinstance(exc, CheckpointIOError) and exc.errno == errno.ETIMEDOUT
                if timed_out or (guard.left() > 0 and not guard.fired):
                    raise
                raise self.too_slow(doing, target, deadline, guard) from None

    def too_slow(
        self,
        doing: str,
        target: str,
        deadline: Deadline | None,
        guard: Guard,
        fault: str = "",
    ) -> CheckpointIOError:
        """The error of a request whose time ran out (``fault``: the last transient fault
        it was retrying, if any)."""
        if deadline is not None and guard.at >= deadline.at:
            why = (
                f"the {deadline.what} passed its {deadline.seconds:g} s deadline "
                "(GPUMEM_S3_DEADLINE_S, or S3Store(deadline_s=))"
            )
        else:
            why = (
                f"no answer within the {self.request_deadline_s:g} s a request may take "
                "(GPUMEM_S3_REQUEST_DEADLINE_S, or S3Store(request_deadline_s=))"
            )
        return CheckpointIOError(
            f"{doing} {target}: {why}; the store at {self.endpoint} answers too slowly or not "
            "at all: check it and the network, or raise the deadline"
            + (f" (the last fault: {fault})" if fault else ""),
            errno=errno.ETIMEDOUT,
            filename=target,
        )

    def call(
        self,
        doing: str,
        fn: Callable[..., Any],
        *args: Any,
        deadline: Deadline | None = None,
        retry_conflict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)`` as one request (see ``watch``) with botocore's errors as
        gpumem's (see the module docstring). A transient fault (a 5xx or throttling answer, a
        reset or broken connection, a timeout; ``retry_conflict``: a 409
        ConditionalRequestConflict, a concurrent conditional write in progress) is tried again,
        ``max_attempts`` in all, after a back-off that never runs past the deadline."""
        target = self.name(kwargs["Key"]) if "Key" in kwargs else str(self.url)
        with self.watch(doing, target, deadline) as guard:
            for attempt in range(1, self.max_attempts + 1):
                for value in kwargs.values():
                    if hasattr(value, "seek"):  # a body a failed attempt read part of
                        value.seek(0)
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:
                    fault = self._fault(doing, exc, retry_conflict)
                    if guard.fired or WATCHDOG.late():  # this request's time, or an outer one's
                        raise self.too_slow(doing, target, deadline, guard) from None
                    if fault is exc:
                        raise
                    if isinstance(fault, BaseException):
                        raise fault from exc
                    last = exc
                if attempt == self.max_attempts:
                    raise self._gave_up(doing, target, fault, last) from last
                if not self.pause(attempt, guard):
                    raise self.too_slow(doing, target, deadline, guard, fault) from last
        raise AssertionError("unreachable")

    def pause(self, attempt: int, guard: Guard) -> bool:
        """Back off after failed attempt ``attempt``: exponential with full jitter, as
        botocore's standard mode (up to 2^attempt x 50 ms, at most 5 s); False, at once, where
        the guard's time would run out first."""
        delay = random.uniform(0, min(5.0, 0.05 * 2**attempt))
        if WATCHDOG.late() or delay >= guard.left():
            return False
        time.sleep(delay)
        return True

    def _fault(self, doing: str, exc: Exception, retry_conflict: bool) -> BaseException | str:
        """What ``exc`` (raised by a botocore call) is: the error to raise, or (a string
        naming it) a transient fault to try again."""
        exc_mod = self.botocore.exceptions
        if isinstance(exc, exc_mod.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _PRECONDITION or status == 412:
                return PreconditionFailed()
            if (code in _CONFLICT or status == 409) and retry_conflict:
                return f"{code or status} (a concurrent conditional write)"
            if code in _TRANSIENT or (isinstance(status, int) and status >= 500):
                return f"{status} {code}: {err.get('Message', '')}"
            if doing != "open" and (code in _NO_KEY or (status == 404 and code not in _MISSING)):
                return NotFound()
            return self._client_error(doing, code, status, err.get("Message", ""))
        if isinstance(exc, exc_mod.NoCredentialsError):
            return CheckpointIOError(
                f"{self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run on a machine with an "
                "instance role",
                errno=errno.EACCES,
                filename=str(self.url),
            )
        if isinstance(exc, (exc_mod.ConnectionError, exc_mod.HTTPClientError)):
            return str(exc)
        return exc  # not botocore's: not ours to translate

    def _gave_up(self, doing: str, target: str, fault: str, exc: Exception) -> Exception:
        """The error after ``max_attempts`` transient faults."""
        exc_mod = self.botocore.exceptions
        if isinstance(exc, (exc_mod.EndpointConnectionError, exc_mod.ConnectTimeoutError)):
            return CheckpointIOError(
                f"{self.url}: cannot reach the store at {self.endpoint} ({exc}); check "
                "endpoint_url / AWS_ENDPOINT_URL and the network",
                errno=errno.ECONNREFUSED,
                filename=str(self.url),
            )
        return CheckpointIOError(
            f"{doing} {target} failed after {self.max_attempts} attempts "
            f"(GPUMEM_S3_ATTEMPTS, or S3Store(max_attempts=)); the last: {fault}",
            errno=errno.EIO,
            filename=target,
        )

    def _client_error(self, doing: str, code: str, status: Any, message: str) -> Exception:
        where = f"{self.url} ({self.endpoint})"
        if code in _MISSING or (doing == "open" and status == 404):
            return CheckpointIOError(
                f"{where}: the bucket {self.url.bucket!r} does not exist; create it or fix the URL",
                errno=errno.ENOENT,
                filename=str(self.url),
            )
        if code in _DENIED or status == 403:
            return CheckpointIOError(
                f"{where}: access denied ({code or status}: {message}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and that they may "
                f"read and write {self.url}",
                errno=errno.EACCES,
                filename=str(self.url),
            )
        if code in _BAD_DIGEST:
            return CheckpointIOError(
                f"{doing} {where}: the store received bytes whose CRC32C differs from the one "
                f"gpumem computed ({code}): damaged in transit; the save failed",
                errno=errno.EIO,
                filename=str(self.url),
            )
        return CheckpointIOError(
            f"{doing} {where} failed: {code or status}: {message}",
            errno=errno.EIO,
            filename=str(self.url),
        )

    def denied(self, code: Any) -> bool:
        """Whether an S3 error code means the credentials may not do it."""
        return code in _DENIED

    def read_errors(self) -> tuple[type[BaseException], ...]:
        """What a response body's read raises when the connection fails mid-body."""
        exc = self.botocore.exceptions
        from urllib3.exceptions import HTTPError as Urllib3Error

        return (
            exc.IncompleteReadError,
            exc.ResponseStreamingError,
            exc.ReadTimeoutError,
            exc.ConnectionError,
            Urllib3Error,
            ConnectionError,
        )


def _seconds(name: str, value: float | None, variable: str) -> float:
    """A deadline setting, checked (``variable``: where else it may come from)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CheckpointStateError(
            f"{name}={value!r} (or {variable}) must be a positive number of seconds"
        )
    return float(value)


def _import_boto3() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore
        import botocore.exceptions
    except ImportError:
        raise CheckpointStateError("an s3:// root needs boto3: pip install 'gpumem[s3]'") from None
    return boto3, botocore
