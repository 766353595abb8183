"""A URL as a checkpoint root (issue 21): refused by name before anything is written, never taken
as a local path (``Path("s3://b/run")`` is a directory named ``s3:``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gpumem
from gpumem.checkpoint import CheckpointStateError
from gpumem.checkpoint.storage.location import check_root, url_scheme
from gpumem.cli import main

URLS = [  # s3:// is an object-store root (test_object_direct.py): refused only when malformed
    "gs://bucket/prefix/",
    "az://container/x",
    "file:///tmp/ckpt",
    "https://example.com/ckpt",
]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("url", URLS)
def test_a_url_root_is_refused_and_nothing_is_written(in_tmp, url):
    with pytest.raises(CheckpointStateError) as info:
        gpumem.Checkpointer(url)
    msg = str(info.value)
    assert url in msg and f"{url_scheme(url)}://" in msg and "local directory path" in msg
    assert "\n" not in msg
    assert list(in_tmp.iterdir()) == []  # no "s3:" directory


@pytest.mark.parametrize("url", ["s3://", "s3://Bad_Bucket/run", "s3://bucket/a//b", "s3://b?x=1"])
def test_a_malformed_s3_root_is_refused_and_nothing_is_written(in_tmp, url):
    with pytest.raises(CheckpointStateError) as info:
        gpumem.Checkpointer(url)
    msg = str(info.value)
    assert msg.startswith(f"directory={url!r} is not an object-store root") and "\n" not in msg
    assert "s3://BUCKET/PREFIX" in msg
    assert list(in_tmp.iterdir()) == []


def test_bytes_and_a_collapsed_pathlike_are_refused_too(in_tmp):
    with pytest.raises(CheckpointStateError, match="s3://bucket/run"):
        gpumem.Checkpointer(b"s3://bucket/run")
    # Path() has already made "s3://bucket/run" into "s3:/bucket/run": known schemes are caught
    with pytest.raises(CheckpointStateError, match="'s3://bucket/run' is a s3:// URL"):
        gpumem.Checkpointer(Path("s3://bucket/run"))
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize(
    "path", ["ckpt", "./s3://x", "run:1", "s3:", "a/b://c", os.path.join("x", "gs://y")]
)
def test_paths_with_colons_are_still_paths(in_tmp, path):
    assert check_root(path) == Path(path)
    ckpt = gpumem.Checkpointer(path, staging_bytes=64 << 20, lock_timeout_s=0)
    ckpt.close()
    assert (in_tmp / path).is_dir()


def test_url_scheme():
    assert url_scheme("s3://b") == "s3"
    assert url_scheme("GS://b") == "gs"
    assert url_scheme("s3:/b") is None and url_scheme("/s3://b") is None
    assert url_scheme("1s://b") is None and url_scheme("://b") is None


@pytest.mark.parametrize(
    "argv",
    [
        ["ckpt", "ls", "s3://bucket/run?x=1"],  # ls and verify read s3:// roots: a bad one
        ["ckpt", "ls", "--json", "s3://Bucket/run"],
        ["ckpt", "verify", "s3://bucket/a//b"],
        ["ckpt", "inspect", "s3://bucket/run/./step-3"],
        ["ckpt", "export", "s3://bucket_/run", "--out", "weights"],
        ["ckpt", "export", "ckpt", "--out", "s3://bucket/weights"],
        ["ckpt", "import", "s3://bucket/dcp", "out"],
        ["ckpt", "import", "dcp", "s3://bucket/out"],
    ],
)
def test_the_cli_refuses_a_url_in_one_line(in_tmp, argv, capsys):
    (in_tmp / "ckpt").mkdir()
    (in_tmp / "dcp").mkdir()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert "s3://" in lines[-1], err
    assert "is a s3:// URL" in lines[-1] or "is not an object-store root" in lines[-1], err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["ckpt", "dcp"]


@pytest.mark.parametrize("verb", ["ls", "verify"])
def test_ls_and_verify_refuse_other_schemes(in_tmp, verb, capsys):
    assert main(["ckpt", verb, "gs://bucket/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'gs://bucket/run' is a gs:// URL" in err


@pytest.mark.parametrize("typo", ["s3:/bucket/run", "gs:/b/x", "S3:/bucket"])
def test_a_url_typed_with_one_slash_is_refused_and_nothing_is_written(in_tmp, typo):
    with pytest.raises(CheckpointStateError) as info:
        gpumem.Checkpointer(typo)
    msg = str(info.value)
    assert msg.startswith(f"directory={typo!r} looks like a mistyped") and "\n" not in msg
    assert f"'./{typo}'" in msg  # how to mean the local directory anyway
    assert list(in_tmp.iterdir()) == []
    assert check_root(f"./{typo}") == Path(f"./{typo}")
