"""Checkpoint stall, time to durable, restore and training-loop overhead, against baselines
measured in the same run on the same tensors.

    python benchmarks/bench_checkpoint.py                  # ~1 GB and ~4 GB states
    python benchmarks/bench_checkpoint.py --sizes 256MB    # quick
    python benchmarks/bench_checkpoint.py --only save      # the save-side rows alone

State: a GPT-like stack of fp32 Linear layers plus AdamW state (exp_avg, exp_avg_sq): 12 bytes
per parameter. Per size:

- stall of save(): gpumem blocking save() (everything copied before it returns) and gpumem overlap
  mode in its worst case (optimizer.step() called right after save(), nothing to overlap with:
  save() + hook wait) against (a) the floor: the same tensors copied into preallocated host
  buffers, (b) torch.save of the same tensors, (c) torch.distributed.checkpoint.async_save
  (time until it returns).
- time to durable (save() entry to committed) against a raw write + fdatasync of the same bytes
  from a preallocated buffer.
- restore (verify + load into model and optimizer) against torch.load(weights_only=True) + copy
  into the same tensors, and a raw read of the bytes; the page cache of every file read is dropped
  first (fdatasync, then posix_fadvise(DONTNEED)), so reads come from the disk.
- step-time overhead of overlap mode in a CPU training loop that checkpoints every N steps.

``--peers`` measures gpumem against dcp.async_save, torchsnapshot, nvidia-resiliency-ext and
Lightning instead (stall, time to durable, restore; benchmarks/checkpoint_peers.py,
results/checkpoint_peers.md).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_peers
from _report import Figure, figure, machine_info, ratio_figure, steal_ticks, write_results

import gpumem
from gpumem.arena import HostArena
from gpumem.checkpoint.workers import background_threads, copy_beside_training
from gpumem.reader import drop_page_cache, read_file
from gpumem.units import format_bytes, parse_bytes
from gpumem.writer import write_file


class GPTish(torch.nn.Module):
    def __init__(self, params: int, d: int = 1024):
        super().__init__()
        per_block = 12 * d * d + 13 * d  # qkv + proj + 4x MLP up/down, with biases
        blocks = max(1, params // per_block)
        self.blocks = torch.nn.ModuleList()
        for _ in range(blocks):
            self.blocks.append(
                torch.nn.ModuleDict(
                    {
                        "qkv": torch.nn.Linear(d, 3 * d),
                        "proj": torch.nn.Linear(d, d),
                        "up": torch.nn.Linear(d, 4 * d),
                        "down": torch.nn.Linear(4 * d, d),
                        "ln": torch.nn.LayerNorm(d),
                    }
                )
            )

    def forward(self, x):
        for b in self.blocks:
            h = b["ln"](x)
            x = x + b["proj"](b["qkv"](h)[..., : h.shape[-1]])
            x = x + b["down"](torch.relu(b["up"](h)))
        return x


def make_state(nbytes: int, d: int = 1024, device: str = "cpu"):
    model = GPTish(nbytes // 12, d).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq
    tensors = list(model.state_dict().values())
    for s in opt.state.values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return model, opt, tensors


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def med(xs) -> float:
    return statistics.median(xs)


# bench_size's timed series: the name of its figure (milliseconds, lower is better)
SERIES = {
    "floor_torch": "floor: torch copy_ into preallocated buffers",
    "floor_arena": "floor: native copy_in into the arena",
    "floor_after_idle": "floor, interleaved: copied right before each save",
    "blocking": "gpumem save(), blocking",
    "overlap": "gpumem save(), overlap, worst case",
    "torch_save": "torch.save",
    "dcp": "dcp.async_save (until it returns)",
    "raw_write_buffered": "raw write + fdatasync, buffered",
    "raw_write_direct": "raw write + fdatasync, O_DIRECT",
    "durable": "gpumem time to durable",
    "stream_stall": "gpumem streaming, budget = 1/4 state: stall",
    "stream_durable": "gpumem streaming, budget = 1/4 state: durable",
    "raw_read_buffered": "raw read, buffered",
    "raw_read_direct": "raw read, O_DIRECT",
    "restore": "gpumem restore (verify + load), fresh process",
    "torch_load": "torch.load(weights_only) + load_state_dict",
}


def size_figures(label: str, r: dict[str, list[float]]) -> list[Figure]:
    """bench_size's figures: every timed series, the paired blocking/floor ratio, the targets."""
    figs = {k: figure(f"{label}: {name}", "ms", r[k], scale=1e3) for k, name in SERIES.items()}
    raw_write = min(figs["raw_write_buffered"], figs["raw_write_direct"], key=lambda f: f.p50)
    raw_read = min(figs["raw_read_buffered"], figs["raw_read_direct"], key=lambda f: f.p50)
    return [
        *figs.values(),
        figure(f"{label}: blocking save / interleaved floor, per pair", "x", r["pair_ratio"]),
        ratio_figure(
            f"{label}: time to durable / raw write", figs["durable"], raw_write, better="lower"
        ),
        ratio_figure(f"{label}: restore / raw read", figs["restore"], raw_read, better="lower"),
        ratio_figure(f"{label}: torch.load / restore", figs["torch_load"], figs["restore"]),
    ]


def bench_size(nbytes: int, root: Path, repeat: int) -> tuple[list[list[object]], dict[str, float]]:
    model, opt, tensors = make_state(nbytes)
    total = sum(t.numel() * t.element_size() for t in tensors)
    label = format_bytes(total)
    print(f"state {label}: {len(tensors)} tensors", flush=True)
    r: dict[str, list[float]] = {
        k: []
        for k in (
            "floor_torch",
            "floor_arena",
            "blocking",
            "overlap",
            "torch_save",
            "dcp",
            "durable",
            "raw_write",
            "restore",
            "torch_load",
            "raw_read",
        )
    }

    # (a) floor: the same tensors into preallocated host buffers (torch copy_ and the native
    # arena), warm: back to back, right after a warm-up copy
    dst = [torch.empty_like(t) for t in tensors]
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for d_, s_ in zip(dst, tensors, strict=True):
            d_.copy_(s_)
        r["floor_torch"].append(time.perf_counter() - t0)
    del dst
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 4095) // 4096 * 4096
    floor_arena = HostArena(off, pinned=False)
    floor_arena.copy_in(tensors, offsets)
    for _ in range(repeat):
        t0 = time.perf_counter()
        floor_arena.copy_in(tensors, offsets)
        r["floor_arena"].append(time.perf_counter() - t0)
    r["floor_torch"] = r["floor_torch"][1:]

    # raw write + fdatasync of the same bytes from the preallocated buffer into a fresh file (as
    # gpumem writes fresh files; deleting the previous one is outside the timing on both sides),
    # buffered and O_DIRECT; the faster of the two is the baseline
    raw = root / "raw.bin"
    for direct in (False, True):
        times = []
        for _ in range(repeat):
            raw.unlink(missing_ok=True)
            t0 = time.perf_counter()
            write_file(
                str(raw), [(0, floor_arena.view(0, off))], size=off, fsync=True, direct=direct
            )
            times.append(time.perf_counter() - t0)
        r["raw_write_direct" if direct else "raw_write_buffered"] = times
    r["raw_write"] = min(r["raw_write_direct"], r["raw_write_buffered"], key=med)
    # raw read into a warm buffer, the faster of one sequential buffered pass (the kernel's
    # read-ahead) and parallel O_DIRECT reads (8 MiB requests, several in flight)
    out = floor_arena.view(0, off)
    view = memoryview(out.numpy()).cast("B")
    r["raw_read_buffered"], r["raw_read_direct"] = [], []
    for _ in range(repeat):
        for direct in (False, True):
            drop_page_cache([raw])
            t0 = time.perf_counter()
            if direct:
                read_file(str(raw), [(0, out)], direct=True, threads=max(4, os.cpu_count() or 1))
            else:
                fd = os.open(raw, os.O_RDONLY)
                done = 0
                while done < off:
                    done += os.preadv(fd, [view[done:]], done)
                os.close(fd)
            r["raw_read_direct" if direct else "raw_read_buffered"].append(time.perf_counter() - t0)
    r["raw_read"] = min(r["raw_read_direct"], r["raw_read_buffered"], key=med)
    del view, out
    raw.unlink()
    gc.collect()

    # gpumem: blocking and overlap-worst-case stall, time to durable, restore
    ck_dir = root / "gpumem"
    # a budget that holds the whole state: the steady state of a job that checkpoints repeatedly
    ck = gpumem.Checkpointer(ck_dir, keep=1, staging_bytes=off + (64 << 20))
    first = ck.save(
        0, model=model, optimizer=opt, rng=False, blocking=True
    )  # allocates + locks the arena
    ck.wait()
    first_save, locked = first.save_s, ck.staging_locked
    # each blocking save is paired with a floor copy right before it, so both copy after the same
    # idle time (the previous save's write) under the same machine load: the noise of this shared
    # VM moves both sides of each pair together
    r["floor_after_idle"], r["pair_ratio"] = [], []
    for i in range(repeat):
        t0 = time.perf_counter()
        floor_arena.copy_in(tensors, offsets)
        r["floor_after_idle"].append(time.perf_counter() - t0)
        st = ck.save(1 + i, model=model, optimizer=opt, rng=False, blocking=True)
        ck.wait()
        r["blocking"].append(st.stall_s)
        r["durable"].append(st.durable_s)
        r["pair_ratio"].append(st.stall_s / r["floor_after_idle"][-1])
    for i in range(repeat):
        st = ck.save(100 + i, model=model, optimizer=opt, rng=False)
        assert st.mode == "overlap"
        opt.step()  # nothing to overlap with: the hook waits for the whole copy
        r["overlap"].append(st.stall_s)
        ck.wait()
    ck.close()  # a resuming job has no staging arena: measure restore with a fresh Checkpointer
    floor_arena.close()
    del floor_arena
    gc.collect()

    # restore vs torch.load(weights_only=True) + load_state_dict, each in a fresh process (a
    # resuming job: model and optimizer just built, optimizer state not created yet), alternated
    # so both see the same disk; one untimed warm-up each, then at least RESTORE_RUNS of each
    flat = {f"t{i}": t for i, t in enumerate(tensors)}
    ts_path = root / "torch.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, ts_path)
    for i in range(max(repeat, RESTORE_RUNS) + 1):
        for key, files in (("restore", files_under(ck_dir)), ("torch_load", [ts_path])):
            drop_page_cache(files)
            elapsed = restore_in_child(key, ck_dir if key == "restore" else ts_path, nbytes)
            if i:
                r[key].append(elapsed)
    shutil.rmtree(ck_dir)
    gc.collect()
    # streaming: a staging budget of a quarter of the state (host memory stays bounded)
    # (its staging slots allocated by prepare() first, as for the resident rows)
    ck = gpumem.Checkpointer(ck_dir, keep=1, staging_bytes=off // 4)
    ck.prepare(nbytes=off // 4, background=False)
    r["stream_stall"], r["stream_durable"] = [], []
    for i in range(repeat):
        st = ck.save(i, model=model, optimizer=opt, rng=False)
        ck.wait()
        assert st.mode == "streaming"
        r["stream_stall"].append(st.stall_s)
        r["stream_durable"].append(st.durable_s)
    ck.close()
    shutil.rmtree(ck_dir)
    gc.collect()

    # (b) torch.save of the same tensors
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.save(flat, ts_path)
        r["torch_save"].append(time.perf_counter() - t0)
    ts_path.unlink()

    # (c) torch.distributed.checkpoint.async_save: time until it returns
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        store = dist.FileStore(str(root / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    for i in range(repeat):
        path = root / f"dcp{i}"
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, checkpoint_id=str(path))
        r["dcp"].append(time.perf_counter() - t0)
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        shutil.rmtree(path)
        gc.collect()

    m = {k: med(v) for k, v in r.items()}
    floor = min(m["floor_torch"], m["floor_arena"])
    gbps = total / 1e9

    def spread(k: str) -> str:
        return f"runs {min(r[k]) * 1e3:.0f}-{max(r[k]) * 1e3:.0f} ms"

    rows = [
        [
            label,
            "floor: copy into preallocated buffers, warm (back to back)",
            f"{floor * 1e3:.0f} ms",
            "1.00x",
            (
                f"{gbps / floor:.1f} GB/s; torch copy_ {m['floor_torch'] * 1e3:.0f} ms, "
                f"native copy_in {m['floor_arena'] * 1e3:.0f} ms"
            ),
        ],
        [
            label,
            "floor, interleaved: copied right before each save",
            f"{m['floor_after_idle'] * 1e3:.0f} ms",
            f"{m['floor_after_idle'] / floor:.2f}x",
            "same idle history and machine load as the save it precedes",
        ],
        [
            label,
            "gpumem save(), blocking",
            f"{m['blocking'] * 1e3:.0f} ms",
            f"{m['blocking'] / floor:.2f}x",
            (
                f"target <= 1.2x floor; {m['pair_ratio']:.2f}x the interleaved "
                f"floor (median of per-pair ratios); {spread('blocking')}"
            ),
        ],
        [
            label,
            "gpumem save(), overlap, worst case",
            f"{m['overlap'] * 1e3:.0f} ms",
            f"{m['overlap'] / floor:.2f}x",
            "save() + hook wait, no compute to hide behind",
        ],
        [
            label,
            "torch.save",
            f"{m['torch_save'] * 1e3:.0f} ms",
            f"{m['torch_save'] / floor:.2f}x",
            "",
        ],
        [
            label,
            "dcp.async_save (until it returns)",
            f"{m['dcp'] * 1e3:.0f} ms",
            f"{m['dcp'] / floor:.2f}x",
            "",
        ],
        [
            label,
            "raw write + fdatasync (best of buffered / O_DIRECT)",
            f"{m['raw_write'] * 1e3:.0f} ms",
            "1.00x",
            (
                f"{gbps / m['raw_write']:.2f} GB/s; "
                f"buffered {m['raw_write_buffered'] * 1e3:.0f} ms, "
                f"O_DIRECT {m['raw_write_direct'] * 1e3:.0f} ms"
            ),
        ],
        [
            label,
            "gpumem time to durable",
            f"{m['durable'] * 1e3:.0f} ms",
            f"{m['durable'] / m['raw_write']:.2f}x",
            f"target <= 1.15x raw; save() entry to committed, blocking; {spread('durable')}",
        ],
        [
            label,
            "gpumem streaming, budget = 1/4 state: stall",
            f"{m['stream_stall'] * 1e3:.0f} ms",
            f"{m['stream_stall'] / floor:.2f}x",
            "save() streams through the budget while writing",
        ],
        [
            label,
            "gpumem streaming, budget = 1/4 state: durable",
            f"{m['stream_durable'] * 1e3:.0f} ms",
            f"{m['stream_durable'] / m['raw_write']:.2f}x",
            "vs raw write + fdatasync",
        ],
        [
            label,
            "raw read into a warm buffer (best of buffered / O_DIRECT)",
            f"{m['raw_read'] * 1e3:.0f} ms",
            "1.00x",
            (
                f"{gbps / m['raw_read']:.2f} GB/s; "
                f"buffered {m['raw_read_buffered'] * 1e3:.0f} ms, "
                f"O_DIRECT {m['raw_read_direct'] * 1e3:.0f} ms"
            ),
        ],
        [
            label,
            "gpumem restore (verify + load), fresh process",
            f"{m['restore'] * 1e3:.0f} ms",
            f"{m['restore'] / m['raw_read']:.2f}x",
            (
                f"torch.load time / this = {m['torch_load'] / m['restore']:.2f} (target >= 1.5; "
                f"medians of {len(r['restore'])} runs each, interleaved); {spread('restore')}"
            ),
        ],
        [
            label,
            "torch.load(weights_only) + load_state_dict",
            f"{m['torch_load'] * 1e3:.0f} ms",
            f"{m['torch_load'] / m['raw_read']:.2f}x",
            spread("torch_load"),
        ],
    ]
    extra = {
        "first_save_s": first_save,
        "floor_s": floor,
        "locked": locked,
        "figures": size_figures(label, r),
    }
    del model, opt, tensors, flat
    gc.collect()
    return rows, extra


RESTORE_RUNS = 5  # fresh-process runs of each restore side, at least (issue #14)


def child_lines(
    script: str, args: list[str], what: str, pythonpath: str | None = None
) -> list[str]:
    """Run ``script`` with ``args`` in a fresh interpreter and return its stdout lines
    (``pythonpath``: import gpumem from there instead, a baseline checkout's package)."""
    env = None
    if pythonpath:
        env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, check=False, env=env
    )
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()


def restore_in_child(kind: str, path: Path, nbytes: int, pythonpath: str | None = None) -> float:
    """Seconds a fresh process takes to load ``path`` into a just-built model and optimizer
    (``pythonpath``: import gpumem from there instead, a baseline checkout's package)."""
    args = ["--restore-child", kind, str(path), str(nbytes)]
    return float(child_lines(__file__, args, f"restore child ({kind})", pythonpath)[-1])


def restore_child(kind: str, path: str, nbytes: int) -> None:
    model = GPTish(nbytes // 12, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    # the modules each side runs are imported before the clock starts, as a resuming job
    # imports them at start-up (gpumem's are lazy, and compiled from source where
    # PYTHONDONTWRITEBYTECODE is set; torch.load's were imported with torch)
    checkpointer = gpumem.Checkpointer
    peer = checkpoint_peers.PEERS[kind]() if kind in checkpoint_peers.PEERS else None
    for name in peer.imports if peer else ():
        importlib.import_module(name)
    t0 = time.perf_counter()
    if peer is not None:
        peer.restore(Path(path), model, opt)
    elif kind == "restore":
        # timed until restore() returns: the staging arena it then starts for the first save
        # (a background thread) and close() are the training's, not the restore's
        ck = checkpointer(path, keep=1)
        assert ck.restore(model=model, optimizer=opt, rng=False) is not None
        print(f"{time.perf_counter() - t0:.6f}")
        ck.close()
        return
    else:
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    print(f"{time.perf_counter() - t0:.6f}")


def _fresh(n: int) -> torch.Tensor:
    """``n`` bytes of new, page-aligned memory (glibc maps an allocation this large afresh and
    unmaps it when freed, so every call gets pages that are not faulted in yet)."""
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + n]


def bench_restore(
    nbytes: int, root: Path, repeat: int, baseline: str | None
) -> tuple[list[list[object]], list[Figure]]:
    """``--only restore``: restore (verify + load, fresh process) against a raw read of the same
    bytes (the checkpoint's own data files, page cache dropped, into a warm buffer: the faster of
    buffered and O_DIRECT), torch.load, and optionally a baseline gpumem (``--baseline``: a
    package directory, e.g. a copy of main's ``gpumem/``), all interleaved round by round."""
    model, opt, tensors = make_state(nbytes)
    total = sum(t.numel() * t.element_size() for t in tensors)
    label = format_bytes(total)
    ck_dir, ts_path = root / "gpumem", root / "torch.pt"
    with gpumem.Checkpointer(ck_dir, keep=1) as ck:
        ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, ts_path)
    del model, opt, tensors
    gc.collect()
    data = sorted(p for p in files_under(ck_dir) if p.name.startswith("data-"))
    sizes = [p.stat().st_size for p in data]
    # one warm buffer of the largest data file, reused for each (the raw side's best case; the
    # whole state twice in memory, the parent's and a restoring child's, does not fit beside
    # the other jobs of a 24 GiB machine at 3.7 GB)
    warm = torch.ones(max(sizes) + 4096, dtype=torch.uint8)
    skip = -warm.data_ptr() % 4096
    out = warm[skip : skip + max(sizes)]
    view = memoryview(out.numpy()).cast("B")
    keys = ["raw_read_direct", "raw_read_buffered", "raw_read_fresh", "restore", "torch_load"]
    keys += ["baseline"] if baseline else []
    r: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(max(repeat, RESTORE_RUNS) + 1):  # round 0 warms up
        for key in keys:
            if key.startswith("raw_read"):
                drop_page_cache(data)
                t0 = time.perf_counter()
                for f, n in zip(data, sizes, strict=True):
                    if key == "raw_read_direct":
                        read_file(str(f), [(0, out[:n])], direct=True, threads=4)
                    elif key == "raw_read_fresh":  # new pages each file, as a restore's
                        read_file(str(f), [(0, _fresh(n))], direct=True, threads=4)
                    else:
                        fd = os.open(f, os.O_RDONLY)
                        done = 0
                        while done < n:
                            done += os.preadv(fd, [view[done:n]], done)
                        os.close(fd)
                elapsed = time.perf_counter() - t0
            else:
                drop_page_cache(files_under(ck_dir) if key != "torch_load" else [ts_path])
                kind = "torch_load" if key == "torch_load" else "restore"
                path = ts_path if key == "torch_load" else ck_dir
                elapsed = restore_in_child(
                    kind, path, nbytes, baseline if key == "baseline" else None
                )
            if i:
                r[key].append(elapsed)
    del view, out, warm
    shutil.rmtree(ck_dir)
    ts_path.unlink()
    names = {
        "raw_read_direct": "raw read, O_DIRECT",
        "raw_read_buffered": "raw read, buffered",
        "raw_read_fresh": "raw read, O_DIRECT into fresh memory",
        "restore": "gpumem restore (verify + load), fresh process",
        "torch_load": "torch.load(weights_only) + load_state_dict",
        "baseline": "baseline gpumem restore (verify + load), fresh process",
    }
    figs = {k: figure(f"{label}: {names[k]}", "ms", v, scale=1e3) for k, v in r.items()}
    raw_key = min(("raw_read_direct", "raw_read_buffered"), key=lambda k: figs[k].p50)
    raw = figs[raw_key]
    fresh = figs["raw_read_fresh"]
    figures = [*figs.values()]
    rows = []
    for key in keys:
        f = figs[key]
        ratio = f.p50 / raw.p50
        note = f"runs {min(r[key]) * 1e3:.0f}-{max(r[key]) * 1e3:.0f} ms"
        if key == "raw_read_fresh":
            note = f"{total / f.p50 / 1e6:.2f} GB/s, pays the faults a restore pays; {note}"
        elif key.startswith("raw_read"):
            note = f"{total / f.p50 / 1e6:.2f} GB/s; {note}" + (
                " (the baseline)" if key == raw_key else ""
            )
        else:
            figures.append(
                ratio_figure(f"{label}: {names[key]} / raw read", f, raw, better="lower")
            )
            # per-round ratios: both sides of a round saw the same load
            paired = {
                b: figure(
                    f"{label}: {names[key]} / {names[b]}, paired by round",
                    "x",
                    [a / d for a, d in zip(r[key], r[b], strict=True)],
                )
                for b in (raw_key, "raw_read_fresh")
            }
            figures += [
                ratio_figure(
                    f"{label}: {names[key]} / raw read into fresh memory", f, fresh, better="lower"
                ),
                *paired.values(),
            ]
            note = (
                f"p20-p80 {f.p20 / raw.p50:.2f}-{f.p80 / raw.p50:.2f}x; "
                f"{f.p50 / fresh.p50:.2f}x the read into fresh memory; paired by round "
                f"{paired[raw_key].p50:.2f}x / {paired['raw_read_fresh'].p50:.2f}x; {note}"
            )
            if key == "restore":
                note = f"target <= 1.3x; {note}"
        rows.append([label, names[key], f"{f.p50:.0f} ms", f"{ratio:.2f}x", note])
    return rows, figures


def main_restore(args: argparse.Namespace) -> int:
    """``--only restore``: the restore rows alone, into results/checkpoint_restore.md."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-bench-", dir=args.dir))
    rows: list[list[object]] = []
    figures: list[Figure] = []
    try:
        for size in args.sizes.split(","):
            size_rows, size_figures_ = bench_restore(
                parse_bytes(size), root, args.repeat, args.baseline
            )
            rows += size_rows
            figures += size_figures_
            _write_restore(args, rows, figures)  # each size as soon as it is measured
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _write_restore(
    args: argparse.Namespace, rows: list[list[object]], figures: list[Figure]
) -> None:
    notes = " ".join(
        [
            "Ratios against the raw read of the same bytes: the checkpoint's own data files,",
            "page cache dropped (fdatasync + POSIX_FADV_DONTNEED), each read into one warm",
            "page-aligned buffer of the largest file (the faster median of one buffered pass",
            "and O_DIRECT with 4 reads in flight): it pays the read alone. The read into fresh",
            "memory reads each file with O_DIRECT into new pages of its own, freed after it, so",
            "it also pays the page faults (kernel page clearing) that a restoring process pays",
            "for its fresh buffers. Each restore runs in a fresh process that has",
            "just built the model and optimizer (a resuming job), page cache dropped first;",
            "every side is measured once",
            "per round, rounds interleaved, after one warm-up round. 'baseline' imports gpumem",
            "from --baseline (a copy of main's package) in the same rounds. Where the time goes:",
            "checkpoint_restore_profile.md.",
        ]
    )
    columns = ["state", "measurement", "time (median)", "ratio", "note"]
    if args.no_write:
        from _report import markdown_table

        print(markdown_table(columns, rows))
    else:
        write_results(
            "checkpoint_restore",
            "Checkpoint restore against a raw read of the same bytes",
            columns,
            rows,
            notes=notes,
            info=machine_info(),
            figures=figures,
        )


def bench_loop(
    root: Path, every: int, steps: int, threads: int | None = None
) -> tuple[list[list[object]], list[Figure]]:
    """Mean step time of a small training loop without checkpoints and with overlap-mode saves;
    ``threads``: torch's threads for this loop (None: as they are, every core), so that the
    saves' background work gets the cores training leaves free (``workers.background_threads``)."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench_loop(
            root, every, steps, "" if threads is None else f", torch threads {threads}"
        )
    finally:
        torch.set_num_threads(old)


class _RawCheckpoint:
    """The floor of a checkpoint in the loop: the state copied into a locked buffer on the
    training thread (all cores, as a save with no free core copies), then written with O_DIRECT
    + fdatasync into one fresh file by a background thread; no checksum, manifest or commit."""

    def __init__(self, tensors: list[torch.Tensor], root: Path):
        self.tensors, self.root = tensors, root
        self.offsets, off = [], 0
        for t in tensors:
            self.offsets.append(off)
            off = (off + t.numel() * t.element_size() + 4095) // 4096 * 4096
        self.size = off
        self.arena = HostArena(off, pinned=False)
        self.arena.lock()
        self.arena.copy_in(tensors, self.offsets)
        self.thread: threading.Thread | None = None
        self.n = 0

    def save(self) -> None:
        self.wait()
        self.arena.copy_in(self.tensors, self.offsets)
        self.n += 1
        path, old = self.root / f"raw-{self.n}.bin", self.root / f"raw-{self.n - 1}.bin"

        def write() -> None:
            view = self.arena.view(0, self.size)
            write_file(str(path), [(0, view)], size=self.size, fsync=True, direct=True, threads=1)
            old.unlink(missing_ok=True)  # the previous one, once this one is durable

        self.thread = threading.Thread(target=write, daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class _RawCommit(_RawCheckpoint):
    """The floor of a *verified, atomic* checkpoint in the loop: the raw floor's copy with the
    chunk CRC32Cs computed by the copy itself (gpumem's fused copy), then on a background thread
    the data file (O_DIRECT + fdatasync) and one manifest of those CRCs (fsync) written into a
    temporary directory, which is fsync'ed, renamed into place, and its parent fsync'ed; the
    previous one is deleted. What any checkpointer that checksums and commits atomically must do,
    without gpumem's own protocol (capture, plan, shard/main manifests, ``latest``, threads)."""

    CHUNK = 4 << 20

    def __init__(self, tensors: list[torch.Tensor], root: Path):
        super().__init__(tensors, root)
        import numpy as np

        self.crc_index, n = [], 0
        for t in tensors:
            self.crc_index.append(n)
            n += -(-(t.numel() * t.element_size()) // self.CHUNK)
        self.crcs = np.zeros(n, dtype=np.int64)

    def save(self) -> None:
        self.wait()
        self.arena.copy_in(
            self.tensors,
            self.offsets,
            chunk_bytes=self.CHUNK,
            crc_index=self.crc_index,
            crc_out=self.crcs,
        )
        self.n += 1
        root, n, manifest = self.root, self.n, self.crcs.tobytes()

        def commit() -> None:
            tmp = root / f".tmp-{n}"
            tmp.mkdir()
            view = self.arena.view(0, self.size)
            write_file(
                str(tmp / "data"), [(0, view)], size=self.size, fsync=True, direct=True, threads=1
            )
            fd = os.open(tmp / "manifest", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, manifest)
                os.fsync(fd)
            finally:
                os.close(fd)
            for d in (tmp, root):
                if d is root:
                    os.rename(tmp, root / f"step-{n}")
                dfd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            shutil.rmtree(root / f"step-{n - 1}", ignore_errors=True)

        self.thread = threading.Thread(target=commit, daemon=True)
        self.thread.start()


def _bench_loop(
    root: Path, every: int, steps: int, tag: str, d: int = 512, batch: int = 64
) -> tuple[list[list[object]], list[Figure]]:
    torch.manual_seed(0)
    model = GPTish(40_000_000 // 12 * 3, d)  # ~40 MB of parameters, ~120 MB of state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, d)

    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    state = sum(p.numel() for p in model.parameters()) * 12
    tensors = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if v.numel() > 1
    ]
    (root / "loop").mkdir(parents=True, exist_ok=True)
    raw = _RawCheckpoint(tensors, root / "loop")
    (root / "loop" / "commit").mkdir()
    verified = _RawCommit(tensors, root / "loop" / "commit")
    # the machine is shared and noisy: alternate short blocks of every mode, compare the means
    ck = gpumem.Checkpointer(root / "loop" / "ckpt", keep=1)
    ck.prepare(model, opt, background=False)  # the staging allocation stays off the timed steps
    labels = (
        f"no checkpoint{tag}",
        f"overlap save every {every} steps{tag}",
        f"the floor: raw copy + O_DIRECT write every {every} steps{tag}",
        f"the floor of a verified atomic commit every {every} steps{tag}",
    )
    ts: dict[str, list[float]] = {k: [] for k in labels}
    stalls: dict[str, list] = {k: [] for k in labels}
    steal: dict[str, list[int]] = {k: [] for k in labels}  # stolen ticks per block
    for block in range(max(2, steps // (2 * every))):
        for label in labels:
            s0 = steal_ticks()
            for i in range(2 * every):
                t0 = time.perf_counter()
                step()
                if i % every == 0 and label == labels[1]:
                    stalls[label].append(
                        ck.save(block * 100 + i, model=model, optimizer=opt, rng=False)
                    )
                elif i % every == 0 and label == labels[2]:
                    raw.save()
                elif i % every == 0 and label == labels[3]:
                    verified.save()
                ts[label].append(time.perf_counter() - t0)
            ck.wait()
            raw.wait()
            verified.wait()
            steal[label].append(steal_ticks() - s0)
    ck.close()
    shutil.rmtree(root / "loop")
    # the floor copy of this state alone: its tensors copied into preallocated buffers
    dst = [torch.empty_like(t) for t in tensors]
    floor = []
    for _ in range(5):
        t0 = time.perf_counter()
        for d_, s_ in zip(dst, tensors, strict=True):
            d_.copy_(s_)
        floor.append(time.perf_counter() - t0)
    floor_ms = statistics.median(floor) * 1e3
    base = statistics.mean(ts[labels[0]])
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")

    def lost_ms(label: str) -> float:  # what all steps together lose per save
        return (statistics.mean(ts[label]) - base) * every * 1e3

    def stolen_ms(label: str) -> float:  # CPU time stolen per save beyond the loop's own
        extra = statistics.mean(steal[label]) - statistics.mean(steal[labels[0]])
        return extra * tick_ms / 2

    rows = []
    figures = [
        figure(f"{format_bytes(state)}: training loop, {label}", "ms/step", ts[label], scale=1e3)
        for label in labels
    ]
    for label in labels:
        t = statistics.mean(ts[label])
        note = ""
        if label == labels[1]:
            stall = statistics.median(s.stall_s for s in stalls[label]) * 1e3
            note = (
                f"median stall per save {stall:.1f} ms; all steps together "
                f"lose {lost_ms(label):.0f} ms per save = {lost_ms(label) / floor_ms:.1f}x "
                f"the floor copy ({floor_ms:.1f} ms) and "
                f"{lost_ms(label) / max(lost_ms(labels[2]), 1e-3):.2f}x what the raw floor "
                f"loses ({lost_ms(label) / max(lost_ms(labels[3]), 1e-3):.2f}x the verified "
                f"atomic commit's); CPU stolen by the hypervisor {stolen_ms(label):.0f} ms per "
                f"save: the background checksum and write run on {background_threads()} native "
                f"thread(s) beside training's {torch.get_num_threads()} on {os.cpu_count()} cores"
            )
        elif label == labels[2]:
            note = (
                f"the loop loses {lost_ms(label):.0f} ms per save to a copy and a raw write of "
                f"the same bytes alone ({raw.size / 2**20:.0f} MiB); CPU stolen by the "
                f"hypervisor {stolen_ms(label):.0f} ms per save"
            )
        elif label == labels[3]:
            note = (
                f"the loop loses {lost_ms(label):.0f} ms per save to what any checkpoint that "
                "is checksummed and committed atomically does: the copy with its CRC32Cs, the "
                "O_DIRECT write, one manifest (fsync), the directory fsync'ed, renamed, its "
                f"parent fsync'ed; CPU stolen by the hypervisor {stolen_ms(label):.0f} ms per save"
            )
        rows.append(
            [
                format_bytes(state),
                f"training loop: {label}",
                f"{t * 1e3:.1f} ms/step",
                f"{t / base:.3f}x",
                note,
            ]
        )
    return rows, figures


def bench_save_side(
    nbytes: int, root: Path, repeat: int
) -> tuple[list[list[object]], list[Figure]]:
    """The save side alone (``--only save``): the first save of a fresh Checkpointer (no
    prepare(), and right after prepare()), blocking stall against the floor copy, time to
    durable against a raw write + fdatasync, each ratio from pairs taken in the same round, so
    the machine's load moves both sides together."""
    model, opt, tensors = make_state(nbytes)
    total = sum(t.numel() * t.element_size() for t in tensors)
    label = format_bytes(total)
    print(f"state {label}: {len(tensors)} tensors (save side)", flush=True)
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + 4095) // 4096 * 4096
    floor_arena = HostArena(off, pinned=False)
    floor_arena.lock()
    floor_arena.copy_in(tensors, offsets)
    raw = root / "raw.bin"
    r: dict[str, list[float]] = {
        k: []
        for k in (
            "floor",
            "raw_write",
            "first",
            "first_cold",
            "prepared",
            "prepared_cold",
            "blocking",
            "staged",
            "durable",
            "pair_stall",
            "pair_durable",
            "pair_first",
            "overlap_durable",
            "pair_overlap_durable",
        )
    }
    budget = off + (64 << 20)
    for i in range(repeat):
        # a round: floor copy, raw write, then the saves, so each ratio's two sides share it
        t0 = time.perf_counter()
        floor_arena.copy_in(tensors, offsets)
        floor = time.perf_counter() - t0
        raw.unlink(missing_ok=True)
        t0 = time.perf_counter()
        write_file(str(raw), [(0, floor_arena.view(0, off))], size=off, fsync=True, direct=True)
        raw_write = time.perf_counter() - t0
        raw.unlink()
        r["floor"].append(floor)
        r["raw_write"].append(raw_write)
        # the first save of a Checkpointer that was never prepared: its arena is allocated now
        # and faulted in beside the copy
        with gpumem.Checkpointer(root / f"first{i}", keep=1, staging_bytes=budget) as ck:
            st = ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
        r["first"].append(st.stall_s)
        r["first_cold"].append(st.cold_bytes / max(1, st.nbytes))
        r["pair_first"].append(st.stall_s / floor)
        shutil.rmtree(root / f"first{i}")
        # prepare() at construction, a save right after it (the fault-in still runs)
        with gpumem.Checkpointer(root / f"prep{i}", keep=1, staging_bytes=budget) as ck:
            ck.prepare(model, opt)
            st = ck.save(0, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
            r["prepared"].append(st.stall_s)
            r["prepared_cold"].append(st.cold_bytes / max(1, st.nbytes))
            # the default mode, arena resident: the copy runs in the background, each batch
            # written as soon as it is staged (nothing waits for the copy: no optimizer step)
            ov = ck.save(1, model=model, optimizer=opt, rng=False)
            ck.wait()
            assert ov.mode == "overlap", ov.mode
            r["overlap_durable"].append(ov.durable_s)
            r["pair_overlap_durable"].append(ov.durable_s / raw_write)
            # steady state: the arena is resident
            st = ck.save(2, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
        shutil.rmtree(root / f"prep{i}")
        r["blocking"].append(st.stall_s)
        r["staged"].append(st.staged_s)
        r["durable"].append(st.durable_s)
        r["pair_stall"].append(st.stall_s / floor)
        r["pair_durable"].append(st.durable_s / raw_write)
        gc.collect()
    floor_arena.close()
    del floor_arena, tensors, model, opt
    gc.collect()
    m = {k: med(v) for k, v in r.items()}

    def spread(k: str, scale: float = 1e3, unit: str = "ms") -> str:
        return f"runs {min(r[k]) * scale:.2f}-{max(r[k]) * scale:.2f}{unit}".replace(".00", "")

    def row(what: str, key: str, ratio: str, note: str) -> list[object]:
        return [label, what, f"{m[key] * 1e3:.0f} ms", ratio, note]

    rows = [
        row("floor: copy into a locked buffer (each round)", "floor", "1.00x", spread("floor")),
        row(
            "raw write + fdatasync, O_DIRECT (each round)",
            "raw_write",
            "1.00x",
            f"{total / m['raw_write'] / 1e9:.2f} GB/s; {spread('raw_write')}",
        ),
        row(
            "first save() of a Checkpointer, no prepare(), blocking",
            "first",
            f"{m['pair_first']:.2f}x",
            f"vs the round's floor (median of per-round ratios); {m['first_cold']:.0%} of the "
            f"bytes copied into pages not yet faulted in (SaveStats.cold_bytes); {spread('first')}",
        ),
        row(
            "save() right after prepare(), blocking",
            "prepared",
            f"{m['prepared'] / m['floor']:.2f}x",
            f"{m['prepared_cold']:.0%} cold; {spread('prepared')}",
        ),
        row(
            "gpumem save(), blocking, arena resident",
            "blocking",
            f"{m['pair_stall']:.2f}x",
            f"target <= 1.2x floor (median of per-round ratios); {spread('blocking')}",
        ),
        row(
            "gpumem time to durable",
            "durable",
            f"{m['pair_durable']:.2f}x",
            f"target <= 1.15x the round's raw write (median of per-round ratios); all staged "
            f"after {m['staged'] * 1e3:.0f} ms (each file is written beside the copy of the "
            f"next), then the rest of the writes + checksums + manifests + commit "
            f"{(m['durable'] - m['staged']) * 1e3:.0f} ms; {spread('durable')}",
        ),
        row(
            "gpumem time to durable, overlap save (the default mode)",
            "overlap_durable",
            f"{m['pair_overlap_durable']:.2f}x",
            "target <= 1.15x the round's raw write (median of per-round ratios); "
            + (
                "each batch is written as soon as it is staged, beside the copy of the next; "
                if copy_beside_training()
                else "no core free: copied at once inside save(), then written; "
            )
            + spread("overlap_durable"),
        ),
    ]
    figures = [
        figure(f"{label}: save side: floor copy", "ms", r["floor"], scale=1e3),
        figure(
            f"{label}: save side: raw write + fdatasync, O_DIRECT", "ms", r["raw_write"], scale=1e3
        ),
        figure(f"{label}: first save(), no prepare() / floor, per round", "x", r["pair_first"]),
        figure(f"{label}: first save(), cold fraction", "x", r["first_cold"]),
        figure(f"{label}: blocking save / interleaved floor, per pair", "x", r["pair_stall"]),
        figure(f"{label}: time to durable / raw write", "x", r["pair_durable"]),
        figure(
            f"{label}: overlap save: time to durable / raw write", "x", r["pair_overlap_durable"]
        ),
    ]
    return rows, figures


def loop_ratio_figures(figures: list[Figure]) -> list[Figure]:
    """The training loop's same-run ratios (with saves / without, with saves / the raw floor,
    the floor / without, with saves / the verified atomic commit's floor), from its figures."""
    base, saving, floor, verified = figures[0], figures[1], figures[2], figures[3]
    name = base.name.split(": ")[0]  # the state's size
    tag = base.name.split("no checkpoint", 1)[1]  # the torch thread count, if set
    return [
        ratio_figure(
            f"{name}: training loop with saves / without{tag}", saving, base, better="lower"
        ),
        ratio_figure(
            f"{name}: training loop with saves / with the raw floor{tag}",
            saving,
            floor,
            better="lower",
        ),
        ratio_figure(
            f"{name}: training loop with the raw floor / without{tag}", floor, base, better="lower"
        ),
        ratio_figure(
            f"{name}: training loop with saves / with the verified commit's floor{tag}",
            saving,
            verified,
            better="lower",
        ),
    ]


def bench_cuda(
    nbytes: int, root: Path, repeat: int, tokens: int = 8192, spill_bytes: int = 0
) -> tuple[list[list[object]], list[Figure]]:
    """D2H throughput of the snapshot against one big pinned copy, and the stall of overlap mode
    while a forward/backward runs beside the copy, on the current CUDA device."""
    dev = torch.device("cuda")
    model, opt, tensors = make_state(nbytes, device="cuda")
    total = sum(t.numel() * t.element_size() for t in tensors)
    label = format_bytes(total)
    print(f"state {label} on {torch.cuda.get_device_name(dev)}: {len(tensors)} tensors", flush=True)

    # ceiling: one pinned.copy_(gpu, non_blocking=True) of the same number of bytes
    src = torch.empty(total, dtype=torch.uint8, device=dev)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    ceiling = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        if i:
            ceiling.append(time.perf_counter() - t0)
    del src, pinned
    torch.cuda.empty_cache()

    x = torch.randn(tokens, model.blocks[0]["qkv"].in_features, device=dev)

    def train_step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    ck = gpumem.Checkpointer(
        root / "gpu", keep=1, staging_bytes=total + (256 << 20), device_spill_bytes=spill_bytes
    )
    for step in range(2):  # allocates and pins the arena, compiles the CRC kernel
        ck.save(step, model=model, optimizer=opt, rng=False, blocking=True)
        ck.wait()
    arena = getattr(ck, "_arena", None)
    if arena is not None:
        arena.wait_pinned()
    snap, d2h, stall, base, d2h_overlap, save_call, hook_wait = [], [], [], [], [], [], []
    for i in range(repeat):
        st = ck.save(10 + i, model=model, optimizer=opt, rng=False, blocking=True)
        snap.append(
            st.staged_s
        )  # save() entry until every byte is in host memory (device CRC included)
        d2h.append(st.d2h_s)  # first copy enqueued until copies and device CRCs completed
        ck.wait()
    gpu_plain, gpu_saving, host_wait, fence, spilled = [], [], [], [], []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain_gpu = gpu_timed(train_step)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # on the compute stream: the GPU time of the step that saves
        st = ck.save(20 + i, model=model, optimizer=opt, rng=False)
        train_step()  # forward/backward beside the copy; optimizer.step() is fenced behind it
        end.record()
        torch.cuda.synchronize()
        with_save = time.perf_counter() - t0
        assert st.mode == "overlap", st.mode
        ck.wait()
        if i:
            base.append(plain)
            gpu_plain.append(plain_gpu())
            gpu_saving.append(start.elapsed_time(end) / 1e3)
            # the stall: save() blocking + hook wait + slowdown of the step beside the copy
            stall.append(max(with_save - plain, st.stall_s))
            d2h_overlap.append(st.staged_s)
            save_call.append(st.save_s)
            hook_wait.append(st.hook_wait_s)
            host_wait.append(st.stall_s)
            fence.append(st.fence_s)
            spilled.append(st.spill_bytes)
    ck.close()
    shutil.rmtree(root / "gpu", ignore_errors=True)
    m_ceil, m_snap, m_d2h = med(ceiling), med(snap), med(d2h)
    m_stall, m_base = med(stall), med(base)
    slowdown = [max(0.0, s - med(gpu_plain)) for s in gpu_saving]
    figs = {
        k: figure(f"{label}: {k}", "ms", v, scale=1e3)
        for k, v in (
            ("pinned-copy ceiling", ceiling),
            ("snapshot D2H phase", d2h),
            ("blocking save() entry to staged", snap),
            ("training step, no save", base),
            ("overlap mode: stall of the step that saves", stall),
            ("overlap mode: GPU step slowdown (CUDA events)", slowdown),
            ("overlap mode: host wait (save() + hook)", host_wait),
        )
    }
    figures = [
        *figs.values(),
        ratio_figure(
            f"{label}: snapshot D2H phase / ceiling",
            figs["snapshot D2H phase"],
            figs["pinned-copy ceiling"],
            better="lower",
        ),
    ]
    rows = [
        [
            label,
            "pinned-copy ceiling: one pinned.copy_(gpu, non_blocking=True)",
            f"{m_ceil * 1e3:.1f} ms",
            "1.00x",
            f"{total / m_ceil / 1e9:.1f} GB/s",
        ],
        [
            label,
            "gpumem snapshot D2H phase (copies + device CRC on a second stream)",
            f"{m_d2h * 1e3:.1f} ms",
            f"{m_ceil / m_d2h * 100:.0f} % of ceiling",
            f"{total / m_d2h / 1e9:.1f} GB/s; target >= 90 %",
        ],
        [
            label,
            "blocking save() entry to staged (state capture + D2H phase)",
            f"{m_snap * 1e3:.1f} ms",
            f"{m_ceil / m_snap * 100:.0f} % of ceiling",
            f"{total / m_snap / 1e9:.1f} GB/s",
        ],
        [
            label,
            "training step (forward/backward/AdamW), no save",
            f"{m_base * 1e3:.1f} ms",
            "",
            f"{tokens} tokens",
        ],
        [
            label,
            "overlap mode: stall of the step that saves",
            f"{m_stall * 1e3:.2f} ms",
            f"{m_stall / m_ceil * 100:.1f} % of D2H time",
            (
                "max(step slowdown, save() + hook wait); target <= 5 %; copy finished "
                f"{med(d2h_overlap) * 1e3:.1f} ms after save(); save() "
                f"{med(save_call) * 1e3:.2f} ms, hook wait {med(hook_wait) * 1e3:.2f} ms"
            ),
        ],
        [
            label,
            "overlap mode: GPU step slowdown of the step that saves (CUDA events)",
            f"{med(slowdown) * 1e3:.2f} ms",
            f"{med(slowdown) / m_d2h * 100:.1f} % of D2H time",
            (
                f"compute stream, step that saves minus plain step ({med(gpu_plain) * 1e3:.1f} "
                f"ms); target <= 5 %; fence wait {med(fence) * 1e3:.2f} ms; spilled "
                f"{format_bytes(int(med(spilled)))} (device_spill_bytes="
                f"{format_bytes(spill_bytes)})"
            ),
        ],
        [
            label,
            "overlap mode: host wait (save() + optimizer hook)",
            f"{med(host_wait) * 1e3:.2f} ms",
            "",
            "the time the training thread could not enqueue work",
        ],
    ]
    return rows, figures


def gpu_timed(fn):
    """Run ``fn`` between two CUDA events on the current stream; returns a callable giving its
    GPU time in seconds once the stream has passed the second event."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return lambda: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]


def bench_every_step(
    root: Path, params: int, steps: int, tokens: int = 4096
) -> tuple[list[list[object]], list[Figure]]:
    """A checkpoint at every step: a GPT-like model of ``params`` parameters in bf16 with AdamW,
    ``steps`` steps calling save() each (coalesce=True, keep=1), against the same loop without
    saves; step time from CUDA events on the compute stream, plus how many saves were written
    and how many superseded."""
    dev = torch.device("cuda")
    d = 2048
    model = GPTish(params, d).to(dev, torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)

    def train_step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def loop(ck) -> list[float]:
        times = []
        for step in range(steps):
            timer = gpu_timed(
                lambda step=step: (
                    ck.save(step, model=model, optimizer=opt, rng=False) if ck else None,
                    train_step(),
                )
            )
            times.append(timer())
        return times[3:]  # warm-up: arena allocation and pinning, kernel compilation

    for _ in range(2):
        train_step()
    plain = loop(None)
    with gpumem.Checkpointer(root / "every", keep=1, coalesce=True) as ck:
        saving = loop(ck)
        ck.wait()
        written = [st.step for st in ck.history if st.committed]
        superseded = [st.step for st in ck.history if st.superseded_by is not None]
    shutil.rmtree(root / "every", ignore_errors=True)
    label = f"GPT {n_params / 1e9:.2f}B bf16 + AdamW"
    f_plain = figure(f"{label}: step, no checkpoint", "ms", plain, scale=1e3)
    f_save = figure(f"{label}: step, checkpoint every step", "ms", saving, scale=1e3)
    over = med(saving) / med(plain) - 1
    rows = [
        [label, "training step, no checkpoint (CUDA events)", f"{med(plain) * 1e3:.1f} ms", "", ""],
        [
            label,
            f"training step, save() every step, coalesce=True, keep=1 ({steps} steps)",
            f"{med(saving) * 1e3:.1f} ms",
            f"{over * 100:+.1f} % step time",
            (
                f"target <= 3 % (moonshot 1 %); {len(written)} steps written, "
                f"{len(superseded)} superseded"
            ),
        ],
    ]
    return rows, [f_plain, f_save, ratio_figure(f"{label}: step time ratio", f_save, f_plain)]


def main_cuda(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(
            "bench_checkpoint.py --device cuda needs a CUDA GPU (torch.cuda.is_available() "
            "is False); nothing measured, results/checkpoint_gpu.md left as it is."
        )
        return 0
    root = Path(tempfile.mkdtemp(prefix="gpumem-bench-", dir=args.dir))
    rows: list[list[object]] = []
    figures: list[Figure] = []
    # Each part is written as soon as it is measured, and a failing part (a 12 GB state that does
    # not fit this GPU) is reported in the table, so a time limit or an error keeps what was done.
    parts = []
    for size in args.sizes.split(","):
        if size == "every":  # the checkpoint-every-step loop, at this point of the order
            params = parse_bytes(args.every_step_params)
            parts.append((size, lambda p=params: bench_every_step(root, p, args.steps)))
        else:
            parts.append(
                (
                    size,
                    lambda size=size: bench_cuda(
                        parse_bytes(size),
                        root,
                        args.repeat,
                        spill_bytes=parse_bytes(args.spill_bytes),
                    ),
                )
            )
    try:
        for name, run in parts:
            try:
                part_rows, part_figures = run()
            except (RuntimeError, torch.cuda.OutOfMemoryError, gpumem.CheckpointError) as exc:
                part_rows, part_figures = [[name, "FAILED", "", "", str(exc).splitlines()[0]]], []
            finally:
                torch.cuda.empty_cache()
            rows += part_rows
            figures += part_figures
            _write_cuda(args, rows, figures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _write_cuda(args: argparse.Namespace, rows: list[list[object]], figures: list[Figure]) -> None:
    notes = (
        "Ceiling: one pinned.copy_(gpu_tensor, non_blocking=True) "
        "of the state's byte count into page-locked\n"
        "memory, synchronized. Snapshot: blocking save() "
        "from entry until every tensor is in the pinned\n"
        "staging arena (device-side CRC32C of each tensor + "
        "non_blocking D2H on the compute stream; overlap\n"
        "mode runs the same on a side stream); the arena is\n"
        "allocated and pinned by two warm-up saves first. "
        "Overlap stall: wall time of a training step\n"
        "that calls save() minus a plain step (measured back "
        "to back), or save() + optimizer-hook wait if larger.\n"
        "GPU step slowdown: CUDA events on the compute stream around the step that saves, "
        "minus the median plain step."
    )
    columns = ["state", "measurement", "time (median)", "ratio", "note"]
    if args.no_write:
        from _report import markdown_table

        print(markdown_table(columns, rows))
    else:
        write_results(
            "checkpoint_gpu",
            "Checkpoint on CUDA: D2H throughput and overlap stall",
            columns,
            rows,
            notes=notes,
            info=machine_info(),
            figures=figures,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes",
        default="1GB,4GB",
        help="comma-separated state sizes (default 1GB,4GB); with --device cuda, 'every' among "
        "them runs the checkpoint-every-step loop at that point",
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="timed repetitions per measurement (median)"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument(
        "--every", type=int, default=5, help="checkpoint interval of the training-loop test"
    )
    ap.add_argument(
        "--steps", type=int, default=100, help="steps of each mode of the training-loop test"
    )
    ap.add_argument(
        "--spill-bytes",
        default="0",
        help="--device cuda: the Checkpointer's device_spill_bytes in the overlap rows (default 0)",
    )
    ap.add_argument(
        "--every-step-params",
        default="1.2G",
        help="--device cuda, with 'every' among --sizes: the checkpoint-every-step loop's GPT "
        "parameters (bf16 + AdamW, coalesce=True, keep=1, --steps steps; default 1.2G)",
    )
    ap.add_argument(
        "--no-write", action="store_true", help="do not write benchmarks/results/checkpoint.md"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=(
            "cpu: the CPU table; cuda: D2H throughput and overlap stall (results/checkpoint_gpu.md)"
        ),
    )
    ap.add_argument(
        "--only",
        choices=("save", "restore"),
        default=None,
        help="save: only the save-side rows (first save, blocking stall, time to durable, the "
        "training loop), written to results/checkpoint_save.md; restore: only the restore rows "
        "(raw read, restore, torch.load), written to results/checkpoint_restore.md",
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="gpumem against dcp.async_save, torchsnapshot, nvidia-resiliency-ext and Lightning "
        "on --sizes (results/checkpoint_peers.md) instead of the main table",
    )
    ap.add_argument(
        "--restore-child", nargs=3, metavar=("KIND", "PATH", "NBYTES"), help=argparse.SUPPRESS
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="with --only restore: a directory holding another gpumem package (e.g. a copy of "
        "main's gpumem/) whose restore is measured in the same rounds",
    )
    args = ap.parse_args(argv)
    if args.restore_child:
        kind, path, nbytes = args.restore_child
        restore_child(kind, path, int(nbytes))
        return 0
    if args.device == "cuda":
        return main_cuda(args)
    if args.only == "save":
        return main_save_side(args)
    if args.peers:
        root = Path(tempfile.mkdtemp(prefix="gpumem-bench-", dir=args.dir))
        try:
            checkpoint_peers.run(
                [parse_bytes(s) for s in args.sizes.split(",")],
                root,
                args.repeat,
                args.repeat,  # restore rounds too: the peers' run time is the limit
                make_state,
                restore_in_child,
                write=not args.no_write,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    if args.only == "restore":
        return main_restore(args)
    root = Path(tempfile.mkdtemp(prefix="gpumem-bench-", dir=args.dir))
    rows, notes = [], []
    figures: list[Figure] = []
    try:
        for size in args.sizes.split(","):
            size_rows, extra = bench_size(parse_bytes(size), root, args.repeat)
            rows += size_rows
            figures += extra["figures"]
            lock = (
                "locked (mlock)"
                if extra["locked"]
                else "pre-faulted only (mlock refused: RLIMIT_MEMLOCK)"
            )
            notes.append(
                f"- {size_rows[0][0]}: the first save() also allocates the staging arena, "
                f"{lock}: {extra['first_save_s'] * 1e3:.0f} ms "
                "(once per Checkpointer; later saves reuse it)."
            )
        loop_rows, loop_figures = bench_loop(root, args.every, args.steps)
        rows += loop_rows
        figures += loop_figures
    finally:
        shutil.rmtree(root, ignore_errors=True)
    columns = ["state", "measurement", "time (median)", "ratio", "note"]
    text = "\n".join(
        [
            (
                "Ratios: stall rows against the warm floor; durable "
                "against raw write + fdatasync; restore rows"
            ),
            (
                "against the raw read. Files read back had their "
                "page cache dropped first (posix_fadvise DONTNEED)."
            ),
            (
                "How each side is measured: the warm floor copies "
                "back to back into buffers it has just written"
            ),
            (
                "(the strictest baseline); the interleaved floor "
                "copies right before each blocking save, so each"
            ),
            (
                "(floor, save) pair shares idle history and machine "
                "load, and the median of the per-pair ratios"
            ),
            (
                "is the figure least moved by this VM's noise. "
                "gpumem's arena is allocated, faulted in and"
            ),
            (
                "mlock'ed once (by prepare() or the first save(), "
                "reported below, not in the rows), so later"
            ),
            (
                "saves copy into warm memory that reclaim (this "
                "VM runs DAMON pageout) cannot take. Time to"
            ),
            (
                "durable runs from save() entry until the `latest` "
                "pointer is durable; deleting the previous"
            ),
            (
                "checkpoint (retention) happens after that, as "
                "deleting the previous raw file happens outside"
            ),
            (
                "the raw write's timing. Restore and "
                "torch.load(weights_only) + load_state_dict each run in a"
            ),
            (
                "fresh process that has just built the model and "
                "optimizer (a resuming job), alternated, after"
            ),
            (
                "one untimed warm-up each; both fault in fresh "
                "memory for every byte, which on this VM costs"
            ),
            (
                "about as much as the disk read. This is a "
                "shared 2-vCPU VM with a noisy virtual disk: the"
            ),
            (
                "'runs' notes give the spread. CUDA figures: "
                "`--device cuda` writes results/checkpoint_gpu.md."
            ),
            *notes,
        ]
    )
    if args.no_write:
        from _report import markdown_table

        print(markdown_table(columns, rows))
    else:
        write_results(
            "checkpoint",
            "Checkpoint: stall, durability, restore",
            columns,
            rows,
            notes=text,
            info=machine_info(),
            figures=figures,
        )
    return 0


def main_save_side(args: argparse.Namespace) -> int:
    """``--only save``: the save-side rows, into results/checkpoint_save.md and its JSON."""
    root = Path(tempfile.mkdtemp(prefix="gpumem-bench-", dir=args.dir))
    rows: list[list[object]] = []
    figures: list[Figure] = []
    load_before = os.getloadavg()[0]  # this VM is shared: say how busy it was
    try:
        for size in args.sizes.split(","):
            size_rows, size_figures_ = bench_save_side(parse_bytes(size), root, args.repeat)
            rows += size_rows
            figures += size_figures_
        for threads in (None, max(1, (os.cpu_count() or 2) - 1)):  # all cores; one left free
            loop_rows, loop_figures = bench_loop(root, args.every, args.steps, threads)
            rows += loop_rows
            figures += loop_figures + loop_ratio_figures(loop_figures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    columns = ["state", "measurement", "time (median)", "ratio", "note"]
    text = "\n".join(
        [
            "The save side of checkpoint.md, alone (`--only save`). Each round copies the state "
            "into a locked",
            "buffer (the floor) and writes it raw with O_DIRECT + fdatasync, then runs the saves; "
            "every ratio is",
            "the median of per-round ratios, so this shared VM's load moves both sides together. "
            "The first",
            "save() of a fresh Checkpointer (no prepare()) allocates its arena and copies while a "
            "native",
            "thread faults in and locks the arena from the other end; `cold` is the share of the "
            "bytes the",
            "copy faulted in itself (SaveStats.cold_bytes). The training loop's background work "
            "runs on the",
            "cores torch leaves free (at least one thread), its checksum and write threads at a "
            "lower priority.",
            f"Load average (1 min) on this {os.cpu_count()}-core machine: {load_before:.1f} at "
            f"the start, {os.getloadavg()[0]:.1f} at the end: other jobs shared the cores, so "
            "absolute times",
            "are not comparable with a quiet run's; the per-round ratios are.",
        ]
    )
    if args.no_write:
        from _report import markdown_table

        print(markdown_table(columns, rows))
    else:
        write_results(
            "checkpoint_save",
            "Checkpoint: the save side (first save, stall, durability, training loop)",
            columns,
            rows,
            notes=text,
            info=machine_info(),
            figures=figures,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
