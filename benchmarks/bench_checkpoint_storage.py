"""Object-store checkpoint root against raw transfers of the same bytes, same library, same run.

Claims (issue #21), each a ratio of paired rounds against a local S3 server (moto's threaded
server in a child process on 127.0.0.1):
  * time to durable in the store (``ObjectRoot.upload_step``: every data file by multipart with
    gpumem's CRC32C per part and per object, the store's assembled CRC compared, the manifests,
    the conditional-put commit, ``latest``) <= 1.2x a raw boto3 multipart upload of the same
    data bytes with the same part size and the same parts in flight;
  * restore from the store: ``restore.fetch`` (every data object by size-checked ranged GETs
    into memory, pinned to one version, written to a local directory, then the full
    ``verify``) against raw ranged GETs of the same bytes into memory, same range size and
    ranges in flight. The 1.3x target of the issue is for ranged reads
    straight into the restore targets, which is not built yet (fetch goes through a local
    copy): the figure says how far this path is from it.

The server is a Python process on the same 2 cores as the client, so absolute MB/s say little
about a real store; the ratios compare like with like.

    python benchmarks/bench_checkpoint_storage.py                # 128 MiB state
    python benchmarks/bench_checkpoint_storage.py --size 512M --rounds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import figure, machine_info, write_results
from bench_native import parse_size

COLUMNS = ["measurement", "median s", "raw baseline s", "ratio (p20-p80)", "target", "met"]
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **CREDS},
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def make_checkpoint(local: Path, nbytes: int) -> Path:
    import torch

    import gpumem

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(nbytes // 4))
    with gpumem.Checkpointer(local, staging_bytes=max(64 << 20, 2 * nbytes), overlap=False) as ck:
        ck.save(1, model=model, blocking=True)
    return local / "step-000000001"


def data_files(step: Path) -> list[Path]:
    return sorted(p for p in step.iterdir() if p.name.startswith("data-"))


def raw_upload(client, bucket: str, prefix: str, files, part: int, workers: int) -> None:
    """boto3 multipart of each file's bytes (mmap'ed), ``workers`` parts in flight."""
    import mmap

    for f in files:
        key = f"{prefix}/{f.name}"
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            uid = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

            def send(i: int, key=key, uid=uid, view=view) -> dict:
                body = view[i * part : (i + 1) * part]
                r = client.upload_part(
                    Bucket=bucket, Key=key, UploadId=uid, PartNumber=i + 1, Body=bytes(body)
                )
                return {"PartNumber": i + 1, "ETag": r["ETag"]}

            n = -(-len(view) // part)
            with ThreadPoolExecutor(workers) as pool:
                parts = list(pool.map(send, range(n)))
            client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts}
            )
            view.release()


def raw_download(client, bucket: str, keys_sizes, part: int, workers: int) -> None:
    """Ranged GETs of ``part`` bytes into one buffer per object, ``workers`` in flight."""

    def get(key: str, buf: np.ndarray, start: int) -> None:
        end = min(start + part, buf.nbytes)
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
        done = start
        while done < end:
            block = body.read(min(4 << 20, end - done))
            buf[done : done + len(block)] = np.frombuffer(block, dtype=np.uint8)
            done += len(block)

    for key, size in keys_sizes:
        buf = np.empty(size, dtype=np.uint8)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda a, key=key, buf=buf: get(key, buf, a), range(0, size, part)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="128M", help="state size (default 128M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part", default="16M", help="multipart part size (default 16M)")
    ap.add_argument("--workers", type=int, default=4, help="parts in flight (default 4)")
    ap.add_argument("--name", default="checkpoint_storage")
    args = ap.parse_args()
    nbytes, part = parse_size(args.size), parse_size(args.part)
    os.environ.update(CREDS)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    import boto3
    from botocore.config import Config

    from gpumem.checkpoint.restore.fetch import fetch
    from gpumem.checkpoint.storage.object_root import ObjectRoot
    from gpumem.checkpoint.storage.object_store import S3Store

    info = machine_info()
    info["boto3"] = boto3.__version__
    proc, endpoint = start_server()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        config = Config(
            retries={"mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=args.workers + 4,
            s3={"addressing_style": "path"},
        )
        client = boto3.client("s3", endpoint_url=endpoint, config=config)
        client.create_bucket(Bucket=bucket)
        with tempfile.TemporaryDirectory(prefix="gpumem-bench-s3-") as tmp:
            step = make_checkpoint(Path(tmp) / "local", nbytes)
            files = data_files(step)
            total = sum(f.stat().st_size for f in files)
            ours_up, raw_up, ours_down, raw_down = [], [], [], []
            for r in range(args.rounds + 1):  # round 0 warms both paths up, untimed
                root = ObjectRoot(
                    S3Store(
                        f"s3://{bucket}/ours-{r}",
                        endpoint_url=endpoint,
                        max_concurrency=args.workers,
                    ),
                    part_bytes=part,
                    budget_bytes=args.workers * part,
                )
                t0 = time.perf_counter()
                root.upload_step(step)
                t1 = time.perf_counter()
                raw_upload(client, bucket, f"raw-{r}", files, part, args.workers)
                t2 = time.perf_counter()
                dest = Path(tmp) / f"fetch-{r}"
                t3 = time.perf_counter()
                assert fetch(root, dest) is not None
                t4 = time.perf_counter()
                sizes = [(f"raw-{r}/{f.name}", f.stat().st_size) for f in files]
                raw_download(client, bucket, sizes, part, args.workers)
                t5 = time.perf_counter()
                if r:
                    ours_up.append(t1 - t0)
                    raw_up.append(t2 - t1)
                    ours_down.append(t4 - t3)
                    raw_down.append(t5 - t4)
    finally:
        proc.terminate()
        proc.wait(10)
    up_ratio = figure("upload_vs_raw", "x", [a / b for a, b in zip(ours_up, raw_up, strict=True)])
    down_ratio = figure(
        "fetch_vs_raw", "x", [a / b for a, b in zip(ours_down, raw_down, strict=True)]
    )
    figures = [
        figure("upload_s", "s", ours_up),
        figure("raw_upload_s", "s", raw_up),
        up_ratio,
        figure("fetch_s", "s", ours_down),
        figure("raw_download_s", "s", raw_down),
        down_ratio,
    ]

    def row(name, ours, raw, ratio, target):
        band = f"{ratio.p50:.2f} ({ratio.p20:.2f}-{ratio.p80:.2f})"
        met = "yes" if ratio.p50 <= target else "no"
        return [name, f"{np.median(ours):.2f}", f"{np.median(raw):.2f}", band, f"<= {target}", met]

    rows = [
        row("upload_step (time to durable)", ours_up, raw_up, up_ratio, 1.2),
        row("fetch (download + verify)", ours_down, raw_down, down_ratio, 1.3),
    ]
    notes = (
        f"State: {nbytes} bytes of float32 in {len(files)} data file(s), {total} data bytes. "
        f"Part size {part} bytes, {args.workers} parts in flight on both sides. Each ratio: median "
        f"of {args.rounds} paired rounds (ours then raw, after one untimed warm-up round), into "
        "fresh prefixes. The raw upload passes each part as bytes (boto3's documented body type: "
        "one copy per part; gpumem sends from the mmap'ed file as it is), sends no checksum and "
        "checks nothing; the raw download reads into memory only (same range size and ranges "
        "in flight), while fetch also writes the local copy and verifies every "
        f"chunk CRC from it. Load average at start: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores (shared machine; moto server in the same machine)."
    )
    path = write_results(
        args.name,
        "Object-store checkpoint root (s3://) against raw boto3 transfers",
        COLUMNS,
        rows,
        notes=notes,
        info=info,
        figures=figures,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
