"""Sharded checkpointing: FSDP2 on CPU with gloo, 2 and 4 ranks, against baselines measured in the
same run on the same state.

    python benchmarks/bench_checkpoint_sharded.py                 # ~1.1 GB of state
    python benchmarks/bench_checkpoint_sharded.py --size 256MB    # quick

State: a GPT-like stack (d=768: qkv, proj, 4x MLP, LayerNorm per block) wrapped with
``fully_shard`` per block and at the root, plus AdamW state: 12 bytes per parameter over all
ranks. Per world size (2, then 4), every rank measures:

- stall of ``save()`` against the *copy floor* of its own local bytes (the same local shards
  copied by the native multithreaded memcpy into a preallocated buffer, right before each save,
  so both copy after the same idle time) and against ``dcp.async_save`` of the same state
  (``get_state_dict``, DCP's FileSystemWriter, a private gloo group) until it returns;
- time to durable (save() entry until committed) of the default overlap save (its data files
  written beside its background copy) and of a blocking save (copy first), against a raw write
  + fdatasync of the same local bytes from a preallocated buffer, all ranks writing at once as
  in the save;
- resharding restore 2 -> 4 and 4 -> 2 (a fresh model whose optimizer state exists, page cache
  dropped first): bytes each rank reads against the bytes it needs, and the wall time of the
  whole restore against ``dcp.load`` (+ ``set_state_dict``) of the same state from a
  FileSystemWriter checkpoint. The two restores are then compared tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import figure, machine_info, ratio_figure, value_figure, write_results

from gpumem.units import format_bytes, parse_bytes

D = 768


class Block(torch.nn.Module):
    """One GPT-like block: attention projections and a 4x MLP (the shapes, not the maths)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.ln(x)
        x = x + self.proj(self.qkv(h)[..., :D])
        return x + self.down(torch.relu(self.up(h)))


def _model(nbytes: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    per_block = 12 * D * D + 13 * D
    model = torch.nn.Sequential(*[Block() for _ in range(max(1, nbytes // 12 // per_block))])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # explicit: a GPU box would pick cuda
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq (as DTensors placed like their parameters)
    for p in model.parameters():
        p.grad = None
    return model, opt


def _locals(model, opt) -> list[torch.Tensor]:
    out = [p._local_tensor for p in model.parameters()]
    for st in opt.state.values():
        out += [v._local_tensor if hasattr(v, "_local_tensor") else v for v in st.values()]
    return [t for t in out if t.numel()]


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _init(rank: int, world: int, root: str, tag: str) -> None:
    torch.set_num_threads(1)
    # the ranks share the cores: the native copy / CRC / write pools split them
    os.environ["GPUMEM_THREADS"] = str(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv-{tag}", rank=rank, world_size=world
    )


def _save_worker(rank: int, world: int, root: str, nbytes: int, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import gpumem
    from gpumem.arena import HostArena
    from gpumem.writer import write_file

    _init(rank, world, root, f"save{world}")
    model, opt = _model(nbytes, 0)
    tensors = _locals(model, opt)
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 4095) // 4096 * 4096
    local = sum(t.numel() * t.element_size() for t in tensors)
    floor = HostArena(off, pinned=False)
    floor.copy_in(tensors, offsets)
    keys = ("floor", "stall", "durable", "overlap", "durable_overlap", "dcp")
    r: dict[str, list[float]] = {k: [] for k in keys}

    # raw write + fdatasync of this rank's bytes, every rank at once; buffered and O_DIRECT, the
    # faster is the baseline
    raw = {}
    for direct in (False, True):
        times = []
        for _ in range(repeat):
            path = Path(root, f"raw{world}-{rank}.bin")
            path.unlink(missing_ok=True)
            dist.barrier()
            t0 = time.perf_counter()
            write_file(str(path), [(0, floor.view(0, off))], size=off, fsync=True, direct=direct)
            times.append(time.perf_counter() - t0)
            path.unlink()
        raw["direct" if direct else "buffered"] = times
    r["raw_write"] = min(raw.values(), key=_med)

    ck_dir = Path(root, f"gpumem{world}")
    with gpumem.Checkpointer(ck_dir, keep=1, staging_bytes=off + (64 << 20)) as ck:
        ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)  # allocates the arena
        ck.wait()
        for i in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            floor.copy_in(tensors, offsets)
            r["floor"].append(time.perf_counter() - t0)
            st = ck.save(1 + i, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
            r["stall"].append(st.stall_s)
            r["durable"].append(st.durable_s)
        for i in range(repeat):
            dist.barrier()
            st = ck.save(100 + i, model=model, optimizer=opt, rng=False)
            opt.step()  # nothing to overlap with: the hook waits for the whole copy
            ck.wait()
            r["overlap"].append(st.stall_s)
            r["durable_overlap"].append(st.durable_s)
        # the checkpoint the restores read: the state as it is now
        dist.barrier()
        ck.save(1000, model=model, optimizer=opt, rng=False, blocking=True)
        ck.wait()

    side = dist.new_group(backend="gloo")
    for i in range(repeat):
        msd, osd = get_state_dict(model, opt)
        d = Path(root, f"dcp_async{world}-{i}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(
            {"model": msd, "optim": osd},
            storage_writer=dcp.FileSystemWriter(d),
            process_group=side,
        )
        r["dcp"].append(time.perf_counter() - t0)
        getattr(fut, "upload_completion", fut).result()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(f"{root}/dcp{world}")
    )
    Path(root, f"save{world}.{rank}.json").write_text(json.dumps({"local": local, **r}))
    dist.barrier()
    dist.destroy_process_group()


def _restore_worker(rank: int, world: int, root: str, nbytes: int, src: int, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gpumem
    from gpumem.reader import drop_page_cache

    _init(rank, world, root, f"restore{src}to{world}")
    model, opt = _model(nbytes, 7)
    r: dict[str, list[float]] = {"gpumem": [], "dcp": []}
    read = needed = 0
    # a resuming job has its Checkpointer (it saves with it too): not part of the restore
    ck = gpumem.Checkpointer(Path(root, f"gpumem{src}"), keep=1)
    for _ in range(repeat):
        if rank == 0:
            drop_page_cache([Path(root, f"gpumem{src}")])
        dist.barrier()
        t0 = time.perf_counter()
        ck.restore(model=model, optimizer=opt, rng=False)
        dist.barrier()
        r["gpumem"].append(time.perf_counter() - t0)
        ck.wait()  # the staging arena restore() starts for a first save, before dcp's turn
        read, needed = ck.last_restore.bytes_read, ck.last_restore.bytes_needed
        ours = [t.clone() for t in _locals(model, opt)]
        if rank == 0:
            drop_page_cache([Path(root, f"dcp{src}")])
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/dcp{src}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        dist.barrier()
        r["dcp"].append(time.perf_counter() - t0)
        theirs = _locals(model, opt)
        same = len(ours) == len(theirs) and all(
            torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)
        )
        del ours
    ck.close()
    out = {"read": read, "needed": needed, "same": same, **r}
    Path(root, f"restore{src}to{world}.{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _save_figures(world: int, rank: int, res: dict) -> list:
    tag = f"w{world}_r{rank}"
    stall = figure(f"{tag}_stall_blocking", "ms", res["stall"], scale=1e3)
    dcp = figure(f"{tag}_dcp_async_save", "ms", res["dcp"], scale=1e3)
    durable = figure(f"{tag}_durable_overlap", "ms", res["durable_overlap"], scale=1e3)
    blocking = figure(f"{tag}_durable_blocking", "ms", res["durable"], scale=1e3)
    raw = figure(f"{tag}_raw_write_fsync", "ms", res["raw_write"], scale=1e3)
    pairs = [a / b for a, b in zip(res["stall"], res["floor"], strict=True)]
    return [
        stall,
        figure(f"{tag}_copy_floor", "ms", res["floor"], scale=1e3),
        figure(f"{tag}_stall_over_floor", "x", pairs),
        figure(f"{tag}_stall_overlap_worst", "ms", res["overlap"], scale=1e3),
        dcp,
        ratio_figure(f"{tag}_stall_over_dcp_async_save", stall, dcp, better="lower"),
        durable,
        blocking,
        raw,
        ratio_figure(f"{tag}_durable_overlap_over_raw_write", durable, raw, better="lower"),
        ratio_figure(f"{tag}_durable_blocking_over_raw_write", blocking, raw, better="lower"),
    ]


def _save_rows(world: int, rank: int, res: dict) -> list[list[object]]:
    floor, stall, overlap = _med(res["floor"]), _med(res["stall"]), _med(res["overlap"])
    dcp_stall, durable, raw = _med(res["dcp"]), _med(res["durable_overlap"]), _med(res["raw_write"])
    blocking = _med(res["durable"])
    job, local = f"{world} ranks, rank {rank}", format_bytes(res["local"])
    return [
        [job, local, "save() stall, blocking", _ms(stall), f"copy floor {_ms(floor)}",
         f"{stall / floor:.2f}x", "<= 1.2x"],
        ["", "", "save() stall, overlap worst case", _ms(overlap), f"copy floor {_ms(floor)}",
         f"{overlap / floor:.2f}x", ""],
        ["", "", "save() stall vs dcp.async_save", _ms(stall), f"async_save {_ms(dcp_stall)}",
         f"{stall / dcp_stall:.2f}x", "<= 0.33x"],
        ["", "", "time to durable, overlap (default)", _ms(durable),
         f"raw write+fsync {_ms(raw)}", f"{durable / raw:.2f}x", "<= 1.2x"],
        ["", "", "time to durable, blocking", _ms(blocking), f"raw write+fsync {_ms(raw)}",
         f"{blocking / raw:.2f}x", ""],
    ]  # fmt: skip


def _gather(root: Path, tag: str, world: int) -> list[dict]:
    return [json.loads((root / f"{tag}.{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1.1GB", help="total model + AdamW state over all ranks")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    nbytes = parse_bytes(args.size)
    root = Path(tempfile.mkdtemp(prefix="gpumem-bench-sharded-", dir=args.dir))
    info = machine_info()
    load0 = os.getloadavg()[0]
    rows: list[list[object]] = []
    figures: list = []
    notes: list[str] = []
    try:
        for world in (2, 4):
            mp.spawn(_save_worker, args=(world, str(root), nbytes, args.repeat), nprocs=world)
            for rank, res in enumerate(_gather(root, f"save{world}", world)):
                rows += _save_rows(world, rank, res)
                figures += _save_figures(world, rank, res)
        for src, world in ((2, 4), (4, 2)):
            mp.spawn(
                _restore_worker,
                args=(world, str(root), nbytes, src, max(1, args.repeat // 2)),
                nprocs=world,
            )
            res = _gather(root, f"restore{src}to{world}", world)
            ours = max(_med(x["gpumem"]) for x in res)
            theirs = max(_med(x["dcp"]) for x in res)
            tag = f"restore_{src}to{world}"
            # every rank times the whole restore between barriers: rank 0's samples are the job's
            mine = figure(f"{tag}_gpumem", "s", res[0]["gpumem"])
            base = figure(f"{tag}_dcp_load", "s", res[0]["dcp"])
            figures += [
                mine,
                base,
                ratio_figure(f"{tag}_over_dcp_load", mine, base, better="lower"),
            ]
            figures += [
                value_figure(f"{tag}_r{r}_read_over_needed", "x", x["read"] / x["needed"])
                for r, x in enumerate(res)
            ]
            for rank, x in enumerate(res):
                rows.append([
                    f"restore {src} -> {world}, rank {rank}", format_bytes(x["needed"]),
                    "bytes read / needed", format_bytes(x["read"]), format_bytes(x["needed"]),
                    f"{x['read'] / x['needed']:.3f}x", "<= 1.1x",
                ])  # fmt: skip
            rows.append([
                f"restore {src} -> {world}", "", "restore wall time", f"{ours:.2f} s",
                f"dcp.load {theirs:.2f} s", f"{ours / theirs:.2f}x", "<= 1.0x",
            ])  # fmt: skip
            if not all(x["same"] for x in res):
                notes.append(f"restore {src} -> {world}: gpumem and dcp.load DISAGREE")
            else:
                notes.append(f"restore {src} -> {world}: every rank's tensors equal dcp.load's")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()[0]
    notes.append(
        f"1-minute load average {load0:.1f} at the start, {load1:.1f} at the end, on "
        f"{os.cpu_count()} cores: above the core count, other processes shared the cores and "
        "the disk, and each figure's spread (p20/p80 in the JSON) widens with it."
    )
    notes.append(
        "Medians of the repeats; the copy floor of each save is measured right before it. "
        "All ranks share this machine's cores, memory bandwidth and disk, so 4 ranks have less "
        "of each than 2."
    )
    write_results(
        "checkpoint_sharded",
        f"Sharded checkpoint (FSDP2, gloo, CPU), {args.size} of model + AdamW state",
        ["job", "local bytes", "measure", "gpumem", "baseline", "ratio", "target"],
        rows,
        "\n".join(f"- {n}" for n in notes),
        info,
        figures=figures,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
