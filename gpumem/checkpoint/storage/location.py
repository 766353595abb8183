"""Where a checkpoint root is: a local directory, or a URL (``scheme://...``) gpumem must refuse
or hand to an object-store backend, never a local path.

``Path("s3://bucket/run")`` is a relative path to a directory named ``s3:``: taken as a path, a
job that "checkpoints to S3" writes to the node's working directory and loses everything with
the node. So every root goes through ``check_root`` first: a URL-looking text is refused (naming
it and what is supported) before anything is created.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointStateError

# RFC 3986 scheme, then "://": what a user means as a URL (a path that merely holds a colon,
# like "run:1" or "./s3://x", is a path)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# Path() collapses "s3://b" to "s3:/b": for a PathLike the scheme is recognised by name only
_KNOWN = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "hdfs", "http", "https", "file", "hf"})
SUPPORTED = "a local directory path (e.g. /nvme/ckpt or ./ckpts)"
# S3 bucket names (virtual-host safe): 3-63 lowercase letters, digits, dots and hyphens, a letter
# or digit at each end; no "..", not an IP address
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
OBJECT_FORM = "s3://BUCKET or s3://BUCKET/PREFIX (e.g. s3://my-bucket/runs/llama)"


def url_scheme(text: str) -> str | None:
    """The scheme of ``text`` if it looks like a URL (``scheme://...``), else None."""
    m = _URL.match(text)
    return m.group(1).lower() if m else None


def url_problem(text: str) -> str | None:
    """Why ``text`` cannot be a checkpoint root (it is a URL), or None: it is a path."""
    scheme = url_scheme(text)
    if scheme is None:
        return None
    return (
        f"{text!r} is a {scheme}:// URL, which gpumem does not read or write; give "
        f"{SUPPORTED} (a URL is never taken as a local path, so nothing was written)"
    )


def check_root(root: str | bytes | os.PathLike, argument: str = "directory") -> Path:
    """``root`` as a local directory path, or CheckpointStateError when it is a URL.

    Raises:
        CheckpointStateError: ``root`` looks like a URL (``s3://...``, ``gs://...``, ``file://``):
            names it and the supported forms; nothing is created.
        TypeError: ``root`` is not a str, bytes or os.PathLike.
    """
    is_pathlike = not isinstance(root, str | bytes)
    text = os.fsdecode(root)
    if is_pathlike and url_scheme(text) is None:
        first = text.split("/", 1)[0]
        if first.endswith(":") and first[:-1].lower() in _KNOWN and "/" in text:
            text = f"{first}/{text[len(first) :]}"  # as the user wrote it, before Path()
    problem = url_problem(text)
    first = text.split("/", 1)[0]
    if problem is None and not is_pathlike and _mistyped(first, text):
        problem = (
            f"{text!r} looks like a mistyped {first}// URL (one slash after {first!r}); give "
            f"{first}//... for an object store, or {'./' + text!r} for a local directory of "
            "that name (nothing was written)"
        )
    if problem is not None:
        if url_scheme(text) == "s3":  # bytes or a PathLike: the object store takes a str
            problem += (
                f"; for an object store give the URL as a str (Checkpointer({text!r})), or a "
                f"local directory and remote={text!r} (saved locally, uploaded in the background)"
            )
        raise CheckpointStateError(f"{argument}={problem}")
    return Path(text)


def _mistyped(first: str, text: str) -> bool:
    """``s3:/bucket/run`` (a known scheme, one slash, more after it): what ``Path()`` makes of
    ``s3://bucket/run`` and what a typo of it looks like, never meant as a directory ``s3:``."""
    return first.endswith(":") and first[:-1].lower() in _KNOWN and len(text) > len(first) + 1


@dataclass(frozen=True)
class ObjectURL:
    """An object-store root: ``s3://bucket/prefix``, parsed and checked (see ``parse``).

    Attributes:
        bucket: the bucket name (S3's rules).
        prefix: the key prefix without leading or trailing "/" ("" for the bucket's top).
    """

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, text: str) -> ObjectURL:
        """``text`` as an ``s3://`` root.

        Raises:
            CheckpointStateError: another scheme, a bad bucket name, a query or fragment, or a
                prefix with empty, ``.`` or ``..`` segments or control characters (naming the
                URL and the form expected).
        """

        def bad(why: str) -> CheckpointStateError:
            return CheckpointStateError(
                f"{text!r} is not an object-store root: {why}; give {OBJECT_FORM}"
            )

        scheme = url_scheme(text)
        if scheme != "s3":
            raise bad(f"the scheme is {scheme + '://' if scheme else 'missing'}, not s3://")
        rest = text[len("s3://") :]
        if any(c in rest for c in "?#") or any(ord(c) < 32 or ord(c) == 127 for c in rest):
            raise bad("it holds a query, a fragment or a control character")
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket or _IP.match(bucket):
            raise bad(
                f"{bucket!r} is not a bucket name (3-63 lowercase letters, digits, dots "
                "and hyphens)"
            )
        prefix = prefix.rstrip("/")
        if prefix and any(seg in ("", ".", "..") for seg in prefix.split("/")):
            raise bad("its prefix has an empty, '.' or '..' segment")
        if len(prefix.encode()) > 512:
            raise bad("its prefix is longer than 512 bytes")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` (a relative "/"-separated name) under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
