"""Object-store checkpoint root against raw transfers of the same bytes, same library, same run.

Claims (issue #21), each a ratio of paired rounds against a local S3 server (moto's threaded
server in a child process on 127.0.0.1):
  * time to durable in the store (``ObjectRoot.upload_step``: every data file by multipart with
    gpumem's CRC32C per part and per object, the store's assembled CRC compared, the manifests,
    the conditional-put commit, ``latest``) <= 1.2x a raw boto3 multipart upload of the same
    data bytes with the same part size and the same parts in flight;
  * ``Checkpointer("s3://...")`` (the store as the root): save to durable against the same
    raw multipart upload (<= 1.2x), and restore (ranged GETs straight into the restore's
    buffers, every chunk CRC checked) against raw ranged GETs of the bytes it needs (<= 1.3x);
  * restore from the store through a tier: ``restore.fetch`` (every data object by
    size-checked ranged GETs into memory, pinned to one version, written to a local directory,
    then the full ``verify``) against raw ranged GETs of the same bytes into memory, same
    range size and ranges in flight (the tiers' path: through a local copy).

  * tiers (``--what tiers``): the training loop's stall (``SaveStats.stall_s``: save() time plus
    optimizer-hook waits) with ``Checkpointer(local, remote="s3://...")`` against the same loop
    saving to the local directory only, alternated in one run: the upload runs in the
    background, so it should not add to the stall (target: ratio <= 1.2). The loop's wall time
    is reported beside it: on 2 shared cores the uploader and the server take CPU from the
    training steps, which a node with spare cores would not see.

The server is a Python process on the same 2 cores as the client, so absolute MB/s say little
about a real store; the ratios compare like with like.

    python benchmarks/bench_checkpoint_storage.py                # 128 MiB state
    python benchmarks/bench_checkpoint_storage.py --size 512M --rounds 5
    python benchmarks/bench_checkpoint_storage.py --what tiers --name checkpoint_storage_tiers
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


def tiered_loop(
    directory: Path, remote: str | None, endpoint: str, dim: int, steps: int, every: int
) -> tuple[float, float, list[float]]:
    """A training loop of ``steps`` Adam steps on a ``dim`` x ``dim`` MLP saving every ``every``
    steps (overlap mode) to ``directory``, with ``remote`` as its remote tier (None: local only).
    Returns (total stall s, loop wall s, the uploads' seconds)."""
    import torch

    import gpumem

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, dim)
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    ck = gpumem.Checkpointer(
        directory,
        keep=2,
        staging_bytes=2 * state_bytes + (64 << 20),
        remote=remote,
        endpoint_url=endpoint if remote else None,
    )
    saves = []
    model(x).square().mean().backward()  # Adam's state exists before the arena is sized
    opt.step()
    ck.prepare(model=model, optimizer=opt, background=False)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if s % every == 0:
            saves.append(ck.save(s, model=model, optimizer=opt))
    loop_s = time.perf_counter() - t0
    ck.wait()
    ck.tiers.wait()
    ck.close()
    return sum(st.stall_s for st in saves), loop_s, [st.remote_s for st in saves if st.remote_s]


def tiers_rows(args: argparse.Namespace, endpoint: str, bucket: str, tmp: Path) -> tuple:
    """The tiers figures: stall and loop time with a remote tier against local only."""
    local_stall, tier_stall, local_loop, tier_loop, uploads = [], [], [], [], []
    for r in range(args.rounds + 1):  # round 0 warms both up, untimed
        a = tiered_loop(tmp / f"l-{r}", None, endpoint, args.dim, args.steps, args.every)
        b = tiered_loop(
            tmp / f"t-{r}", f"s3://{bucket}/tiers-{r}", endpoint, args.dim, args.steps, args.every
        )
        if r:
            local_stall.append(a[0])
            local_loop.append(a[1])
            tier_stall.append(b[0])
            tier_loop.append(b[1])
            uploads.extend(b[2])
    stall = figure(
        "tiers_stall_vs_local",
        "x",
        [t / max(lo, 1e-9) for t, lo in zip(tier_stall, local_stall, strict=True)],
    )
    loop = figure(
        "tiers_loop_vs_local", "x", [t / lo for t, lo in zip(tier_loop, local_loop, strict=True)]
    )
    figures = [
        figure("local_stall_s", "s", local_stall),
        figure("tiers_stall_s", "s", tier_stall),
        stall,
        figure("local_loop_s", "s", local_loop),
        figure("tiers_loop_s", "s", tier_loop),
        loop,
        figure("upload_s", "s", uploads or [0.0]),
    ]
    band = lambda f: f"{f.p50:.2f} ({f.p20:.2f}-{f.p80:.2f})"  # noqa: E731
    rows = [
        [
            "tiers: training-loop stall (save + hook waits)",
            f"{np.median(tier_stall):.3f}",
            f"{np.median(local_stall):.3f}",
            band(stall),
            "<= 1.2",
            "yes" if stall.p50 <= 1.2 else "no",
        ],
        [
            "tiers: training-loop wall time",
            f"{np.median(tier_loop):.2f}",
            f"{np.median(local_loop):.2f}",
            band(loop),
            "(reported)",
            "-",
        ],
    ]
    state = 3 * 4 * (4 * args.dim * (args.dim + 1))
    notes = (
        f"Tiers: a 4-layer {args.dim}x{args.dim} MLP with Adam ({state} bytes of state), "
        f"{args.steps} steps saving every {args.every} (overlap mode, keep=2), local only "
        f"against local + remote (moto on 127.0.0.1), alternated, {args.rounds} rounds after "
        f"an untimed warm-up. {len(uploads)} uploads committed, median "
        f"{np.median(uploads) if uploads else 0:.2f} s each (steps committed while one ran "
        "were skipped, newest queued)."
    )
    return rows, figures, notes


def direct_round(
    endpoint: str, bucket: str, prefix: str, nbytes: int, part: int, workers: int
) -> tuple[float, float, int]:
    """``Checkpointer("s3://...")``: (save to durable s, restore s, data bytes): each rank's
    data straight from the staging arena, then a restore by ranged GETs into its buffers, every
    chunk CRC checked. ``workers`` requests in flight, ``part``-byte parts and ranges."""
    import torch

    import gpumem

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(nbytes // 4))
    kw = {"endpoint_url": endpoint, "staging_bytes": max(64 << 20, 2 * nbytes), "overlap": False}

    def tuned(ck: gpumem.Checkpointer) -> gpumem.Checkpointer:
        objects = ck._root.objects
        objects.part_bytes, objects.budget_bytes = part, workers * part
        objects.store.max_concurrency = workers
        return ck

    url = f"s3://{bucket}/{prefix}"
    with tuned(gpumem.Checkpointer(url, **kw)) as ck:
        ck.prepare(nbytes=nbytes + (1 << 20), background=False)  # the arena, as a job has it
        t0 = time.perf_counter()
        ck.save(1, model=model, blocking=True)
        ck.wait()
        save_s = time.perf_counter() - t0
    fresh = torch.nn.Module()
    fresh.w = torch.nn.Parameter(torch.empty(nbytes // 4))
    with tuned(gpumem.Checkpointer(url, **kw)) as ck:
        t0 = time.perf_counter()
        assert ck.restore(model=fresh) == 1
        restore_s = time.perf_counter() - t0
        data = sum(i.nbytes for i in ck.list())
    assert torch.equal(fresh.w, model.w)
    return save_s, restore_s, data


def store_rows(
    args: argparse.Namespace, client, endpoint: str, bucket: str, tmp: Path, nbytes: int, part: int
) -> tuple:
    """The store figures: upload_step and fetch against raw boto3 transfers of the same bytes."""
    from gpumem.checkpoint.restore.fetch import fetch
    from gpumem.checkpoint.storage.s3.object_root import ObjectRoot
    from gpumem.checkpoint.storage.s3.object_store import S3Store

    step = make_checkpoint(tmp / "local", nbytes)
    files = data_files(step)
    total = sum(f.stat().st_size for f in files)
    ours_up, raw_up, ours_down, raw_down = [], [], [], []
    direct_up, direct_down, raw_down_direct = [], [], []
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
        dest = tmp / f"fetch-{r}"
        t3 = time.perf_counter()
        assert fetch(root, dest) is not None
        t4 = time.perf_counter()
        sizes = [(f"raw-{r}/{f.name}", f.stat().st_size) for f in files]
        raw_download(client, bucket, sizes, part, args.workers)
        t5 = time.perf_counter()
        save_s, restore_s, _ = direct_round(
            endpoint, bucket, f"direct-{r}", nbytes, part, args.workers
        )
        t6 = time.perf_counter()
        raw_download(client, bucket, sizes, part, args.workers)
        raw_down2 = time.perf_counter() - t6
        if r:
            ours_up.append(t1 - t0)
            raw_up.append(t2 - t1)
            ours_down.append(t4 - t3)
            raw_down.append(t5 - t4)
            direct_up.append(save_s)
            direct_down.append(restore_s)
            raw_down_direct.append(raw_down2)
    up_ratio = figure("upload_vs_raw", "x", [a / b for a, b in zip(ours_up, raw_up, strict=True)])
    down_ratio = figure(
        "fetch_vs_raw", "x", [a / b for a, b in zip(ours_down, raw_down, strict=True)]
    )
    direct_up_ratio = figure(
        "direct_save_vs_raw", "x", [a / b for a, b in zip(direct_up, raw_up, strict=True)]
    )
    direct_down_ratio = figure(
        "direct_restore_vs_raw",
        "x",
        [a / b for a, b in zip(direct_down, raw_down_direct, strict=True)],
    )
    figures = [
        figure("direct_save_s", "s", direct_up),
        direct_up_ratio,
        figure("direct_restore_s", "s", direct_down),
        figure("raw_download_2_s", "s", raw_down_direct),
        direct_down_ratio,
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
        row("Checkpointer(s3://) save (to durable)", direct_up, raw_up, direct_up_ratio, 1.2),
        row(
            "Checkpointer(s3://) restore (ranged GETs into buffers)",
            direct_down,
            raw_down_direct,
            direct_down_ratio,
            1.3,
        ),
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
        "chunk CRC from it. Checkpointer(s3://): the same state saved by a Checkpointer whose "
        "root is the store (staging arena prepared, as in a job; the data straight from it, "
        "CRC32C per part and object, manifests, conditional-put commit, latest), against the "
        "same raw upload; restored by a fresh Checkpointer (HEADs, manifests, ranged GETs of "
        "the part size straight into the restore's buffers, every chunk CRC checked) against "
        "a raw ranged download of the same bytes run right after it."
    )
    return rows, figures, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="128M", help="state size (default 128M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part", default="16M", help="multipart part size (default 16M)")
    ap.add_argument("--workers", type=int, default=4, help="parts in flight (default 4)")
    ap.add_argument("--name", default="checkpoint_storage")
    ap.add_argument("--what", choices=["store", "tiers", "all"], default="all")
    ap.add_argument("--dim", type=int, default=1024, help="tiers: the MLP's width")
    ap.add_argument("--steps", type=int, default=24, help="tiers: steps per loop")
    ap.add_argument("--every", type=int, default=4, help="tiers: save every N steps")
    args = ap.parse_args()
    nbytes, part = parse_size(args.size), parse_size(args.part)
    os.environ.update(CREDS)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    import boto3
    from botocore.config import Config

    info = machine_info()
    info["boto3"] = boto3.__version__
    load = os.getloadavg()[0]
    rows, figures, notes = [], [], []
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
            parts = []
            if args.what in ("store", "all"):
                parts.append(store_rows(args, client, endpoint, bucket, Path(tmp), nbytes, part))
            if args.what in ("tiers", "all"):
                parts.append(tiers_rows(args, endpoint, bucket, Path(tmp)))
            for r, f, n in parts:
                rows += r
                figures += f
                notes.append(n)
    finally:
        proc.terminate()
        proc.wait(10)
    notes.append(
        f"Load average at start: {load:.1f} on {os.cpu_count()} cores (shared machine; moto "
        "server in the same machine)."
    )
    path = write_results(
        args.name,
        "Object-store checkpoint root (s3://) against raw boto3 transfers, and tiers",
        COLUMNS,
        rows,
        notes=" ".join(notes),
        info=info,
        figures=figures,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
