"""Restore after losing one node of four, from peer replicas and from the object store, against a
restore from local disk.

Four gloo ranks on one machine, each its own simulated node (``GPUMEM_NODE``) with its own
directory, save one step with ``replicas=2`` (each rank's data files also on the next node).
Then, in the same processes, alternated rounds:
  * local: every node's directory intact, ``restore()`` reads each rank's own files;
  * peer: node 3's step directory deleted first (a replaced node's empty disk): ``restore()``
    takes the inventory, node 0's leader sends rank 3's manifests and data over the gloo group
    (CRC-checked), node 3 commits the fetched step, then every rank restores it from local disk.
  * store: a second set of node directories saved with ``replicas=1`` and ``remote=`` (tiers,
    moto's S3 server on 127.0.0.1 started here; each rank uploaded its own shards), node 3's
    step directory deleted: no node holds the step whole, so node 3's leader fetches it from
    the store (``restore.fetch``: the whole step, verified), then the same peer restore.
The figures are the paired per-round ratios peer / local and store / local (rank 0's wall time
of ``restore()``, which waits for every rank). Local reads come from the page cache (the files
were just written), so the local restore is a lower bound and the ratios upper bounds here.

    python benchmarks/bench_checkpoint_replicas.py                 # 64 MiB a rank
    python benchmarks/bench_checkpoint_replicas.py --size 16M --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import figure, machine_info, write_results
from bench_checkpoint_storage import CREDS, start_server
from bench_native import parse_size

COLUMNS = ["measurement", "median s", "p20-p80 s", "ratio to local (p20-p80)"]
WORLD = 4


def worker(base: Path, nbytes: int, rounds: int, endpoint: str) -> None:
    import torch
    import torch.distributed as dist

    import gpumem

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=os.environ["INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank = dist.get_rank()
    model = torch.nn.Linear(nbytes // 4 // 1024, 1024, bias=False)  # nbytes of fp32 weight
    with torch.no_grad():
        model.weight.copy_(
            torch.randn(model.weight.shape, generator=torch.Generator().manual_seed(rank))
        )
    expect = model.weight.detach().clone()
    ck = gpumem.Checkpointer(base / f"node{rank}", keep=2, replicas=2)
    ck.save(1, model=model)
    ck.wait()
    tiered = gpumem.Checkpointer(
        local=base / "tiered" / f"node{rank}",
        remote="s3://bench/replicas",
        endpoint_url=endpoint,
        keep=2,
    )
    tiered.save(1, model=model)
    tiered.wait()
    assert tiered.tiers.wait(600), "the upload did not finish"
    kinds = ("local", "peer", "store")
    for i in range(3 * rounds + 1):  # a warm-up local round, then local / peer / store in turn
        kind = "local" if i == 0 else kinds[(i - 1) % 3]
        use = tiered if kind == "store" else ck
        if kind != "local" and rank == WORLD - 1:
            shutil.rmtree(use.directory / "step-000000001")
        with torch.no_grad():
            model.weight.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        step = use.restore(model=model)
        took = time.perf_counter() - t0
        use.wait()  # the staging arena restore() may start for a first save, before the next
        assert step == 1 and torch.equal(model.weight, expect), "not bit-identical"
        assert kind != "store" or tiered.tiers.restored_from == "remote", "not from the store"
        if rank == 0 and i > 0:
            print(json.dumps({"kind": kind, "s": took}), flush=True)
    tiered.close()
    ck.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="state bytes a rank (default 64M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="checkpoint_replicas")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    if args.worker:
        worker(Path(args.worker), nbytes, args.rounds, os.environ["BENCH_ENDPOINT"])
        return 0
    load = os.getloadavg()[0]
    info = machine_info()
    server, endpoint = start_server()
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-replicas-") as tmp:
        import boto3

        os.environ.update(CREDS)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        base = Path(tmp)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    str(base),
                    "--size",
                    args.size,
                    "--rounds",
                    str(args.rounds),
                ],
                env={
                    **os.environ,
                    "RANK": str(r),
                    "WORLD_SIZE": str(WORLD),
                    "INIT": f"file://{base}/rdv",
                    "GPUMEM_NODE": str(r),
                    "BENCH_ENDPOINT": endpoint,
                },
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(WORLD)
        ]
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        server.terminate()
        server.wait()
        if any(p.returncode for p in procs):
            raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    rows_in = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    local = [r["s"] for r in rows_in if r["kind"] == "local"]
    peer = [r["s"] for r in rows_in if r["kind"] == "peer"]
    store = [r["s"] for r in rows_in if r["kind"] == "store"]
    pairs = [p / lo for lo, p in zip(local, peer, strict=True)]
    store_pairs = [p / lo for lo, p in zip(local, store, strict=True)]
    f_local = figure("restore from local disk", "s", local)
    f_peer = figure("restore after losing node 3 of 4 (from peer replicas)", "s", peer)
    f_ratio = figure("peer restore / local restore (paired rounds)", "x", pairs)
    f_store = figure("restore after losing node 3 of 4 (from the object store)", "s", store)
    f_sratio = figure("store restore / local restore (paired rounds)", "x", store_pairs)
    rows = [
        [f_local.name, f"{f_local.p50:.3f}", f"{f_local.p20:.3f}-{f_local.p80:.3f}", "1"],
        [
            f_peer.name,
            f"{f_peer.p50:.3f}",
            f"{f_peer.p20:.3f}-{f_peer.p80:.3f}",
            f"{f_ratio.p50:.2f} ({f_ratio.p20:.2f}-{f_ratio.p80:.2f})",
        ],
        [
            f_store.name,
            f"{f_store.p50:.3f}",
            f"{f_store.p20:.3f}-{f_store.p80:.3f}",
            f"{f_sratio.p50:.2f} ({f_sratio.p20:.2f}-{f_sratio.p80:.2f})",
        ],
    ]
    notes = (
        f"4 gloo ranks, each its own simulated node with its own directory, {nbytes} bytes of "
        "fp32 state a rank, replicas=2; restore() wall time on rank 0, "
        f"{args.rounds} alternated rounds after a warm-up, every restore checked bit-identical. "
        "The peer round deletes node 3's step directory first: 1 of 4 ranks' shard "
        f"({nbytes} bytes plus manifests) is fetched from node 0 over gloo (TCP on loopback) and "
        "committed on node 3 before the restore. The store round uses a second set of node "
        "directories saved with replicas=1 and remote= (moto's S3 server on 127.0.0.1, started "
        "by the benchmark): node 3's leader downloads the whole step (all 4 ranks' files, "
        f"{4 * nbytes} bytes: restore.fetch fetches whole steps), verifies it and commits it "
        "locally, then the restore proceeds as the peer one. Local reads are from the page "
        "cache. "
        f"Load average at start: {load:.1f} on {os.cpu_count()} cores (shared machine)."
    )
    path = write_results(
        args.name,
        "Restore after losing one node of four: peer replicas and the object store against "
        "local disk",
        COLUMNS,
        rows,
        notes=notes,
        info=info,
        figures=[f_local, f_peer, f_ratio, f_store, f_sratio],
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
