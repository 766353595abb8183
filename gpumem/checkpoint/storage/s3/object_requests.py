"""The request layer of the object store: the boto3 client of one ``s3://`` root and the one
funnel every request goes through (``S3Requests.call``), which turns botocore's errors into
gpumem's, one clear error per cause.

Errors: a missing bucket, denied or missing credentials, an unreachable endpoint are
``CheckpointIOError`` (errno ENOENT, EACCES, ECONNREFUSED) naming the URL and what to do; a
404 for a key is ``NotFound`` and a failed condition (412) is ``PreconditionFailed``, for the
layers above to decide what they mean.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import CheckpointIOError, CheckpointStateError
from ..location import ObjectURL

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
        max_attempts: int,
        max_concurrency: int,
        connect_timeout_s: float,
        read_timeout_s: float,
    ):
        self.url = url
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise CheckpointStateError(f"max_attempts={max_attempts!r} must be an int >= 1")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise CheckpointStateError(f"max_concurrency={max_concurrency!r} must be an int >= 1")
        boto3, self.botocore = _import_boto3()
        from botocore.config import Config

        try:
            session = boto3.session.Session(profile_name=profile, region_name=region)
        except self.botocore.exceptions.ProfileNotFound as exc:
            raise CheckpointStateError(
                f"{self.url}: {exc}; name a profile of ~/.aws/config or unset AWS_PROFILE"
            ) from None
        config = Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts},
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
        self.max_attempts, self.max_concurrency = max_attempts, max_concurrency

    def name(self, key: str) -> str:
        """The ``s3://`` URL of ``key``, for messages."""
        return f"s3://{self.url.bucket}/{key}"

    def pages(self, doing: str, pages: Any) -> Iterator[Any]:
        """A paginator's pages, each fetched through ``call``."""
        it = iter(pages)
        while True:
            try:
                page = self.call(doing, next, it)
            except StopIteration:
                return
            yield page

    def call(self, doing: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with botocore's errors as gpumem's (see the module
        docstring); ``retry_conflict``: a 409 ConditionalRequestConflict (a concurrent
        conditional write in progress) is retried with back-off."""
        retry_conflict = kwargs.pop("retry_conflict", False)
        exc_mod = self.botocore.exceptions
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except exc_mod.ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _PRECONDITION or status == 412:
                    raise PreconditionFailed() from exc
                conflict = code in _CONFLICT or status == 409
                if conflict and retry_conflict and attempt < self.max_attempts:
                    back_off(attempt)
                    continue
                if doing != "open" and (
                    code in _NO_KEY or (status == 404 and code not in _MISSING)
                ):
                    raise NotFound() from exc
                raise self._client_error(doing, code, status, err.get("Message", "")) from exc
            except exc_mod.NoCredentialsError:
                raise CheckpointIOError(
                    f"{self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run on a machine with an "
                    "instance role",
                    errno=errno.EACCES,
                    filename=str(self.url),
                ) from None
            except (exc_mod.EndpointConnectionError, exc_mod.ConnectTimeoutError) as exc:
                raise CheckpointIOError(
                    f"{self.url}: cannot reach the store at {self.endpoint} ({exc}); check "
                    "endpoint_url / AWS_ENDPOINT_URL and the network",
                    errno=errno.ECONNREFUSED,
                    filename=str(self.url),
                ) from None
            except (exc_mod.ConnectionError, exc_mod.HTTPClientError) as exc:
                raise CheckpointIOError(
                    f"{doing} {self.url} failed after {self.max_attempts} attempts: {exc}",
                    errno=errno.EIO,
                    filename=str(self.url),
                ) from exc
        raise AssertionError("unreachable")

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


def back_off(attempt: int) -> None:
    """Exponential back-off with full jitter, as botocore's standard mode: up to 2^attempt
    x 50 ms, at most 5 s."""
    time.sleep(random.uniform(0, min(5.0, 0.05 * 2**attempt)))


def _import_boto3() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore
        import botocore.exceptions
    except ImportError:
        raise CheckpointStateError("an s3:// root needs boto3: pip install 'gpumem[s3]'") from None
    return boto3, botocore
