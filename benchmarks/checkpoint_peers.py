"""Peer checkpointers that bench_checkpoint.py --peers measures beside gpumem, on the same state
and disk in the same run: torch.distributed.checkpoint.async_save with its DefaultStager,
torchsnapshot's Snapshot.async_take, nvidia-resiliency-ext's async checkpoint writer and Lightning's
AsyncCheckpointIO. Install them with ``pip install -e ".[peers]"`` (see pyproject.toml).

Each peer is used the way its documentation sets it up for a single process, and measured with the
same three clocks as gpumem:

- stall: from the save call until the training loop may change the state again (the call has
  returned and, for a peer that stages in the background, its staging future has completed);
- time to durable: from the save call until every byte is on disk: the peer's completion (its
  future, queue or executor) and then an fsync of every file and directory of the checkpoint by
  this harness, which costs only the system call where the peer has synced already
  (``Peer.durable_how`` says per peer what the peer itself does);
- restore: in a fresh process that has just built the model and optimizer (no optimizer state
  yet), the peer's own load path into them (``restore``).

A peer that cannot run here says why (``Peer.unavailable``) and is listed with that reason.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _report import Figure, figure


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or ``path`` itself), then every directory bottom-up,
    ``path``'s parent last: what a crash-safe writer does before it calls a checkpoint durable."""
    if not path.exists():
        raise FileNotFoundError(f"nothing to fsync at {path}: the peer wrote no checkpoint there")
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = (
        []
        if path.is_file()
        else sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    )
    for d in [*dirs, *([path] if path.is_dir() else []), path.parent]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Peer:
    """One peer checkpointer: how to save with it, wait for it and restore from it. Subclasses set
    the class attributes and implement ``begin`` and ``restore``."""

    key = ""  # restore-child kind and results key
    label = ""  # the row's name
    dist = ""  # the distribution whose version is reported
    needs: tuple[str, ...] = ()  # distributions that must be installed
    durable_how = ""  # what the peer itself does for durability, and what the harness adds
    restore_how = ""
    imports: tuple[str, ...] = ()  # modules restore() uses, imported before its clock starts
    owns_dir = False  # True: the checkpointer manages its directory (the harness leaves it alone)

    def version(self) -> str | None:
        return _version(self.dist)

    def unavailable(self) -> str | None:
        """Why this peer cannot run here, or None."""
        for d in self.needs:
            if _version(d) is None:
                return f"{d} is not installed (pip install -e '.[peers]')"
        return None

    def open(self, model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
        """Set up what a training job sets up once (a stager, a queue), for saving ``model`` and
        ``opt`` under ``path``."""

    def close(self) -> None:
        """Release what ``open`` set up."""

    def begin(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path
    ) -> Callable[[], None]:
        """Start a save; return once the loop may change the state, with a wait for the rest."""
        raise NotImplementedError

    def restore(self, path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """Load the checkpoint at ``path`` into ``model`` and ``opt``, the peer's own way."""
        raise NotImplementedError

    def save(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        path: Path,
        step: Callable[[], float] = lambda: 0.0,
    ) -> tuple[float, float, float]:
        """(stall, time to durable, ``step()``'s seconds) of one save of ``model`` and ``opt`` to
        ``path``, with ``step`` (the loop's next writes of the state) run right after the stall,
        while the peer writes in the background."""
        t0 = time.perf_counter()
        wait = self.begin(model, opt, path)
        stall = time.perf_counter() - t0
        step_s = step()
        wait()
        fsync_tree(path)
        return stall, time.perf_counter() - t0, step_s


# ------------------------------------------------------------------ torch.distributed.checkpoint


def _dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    # DCP's own state-dict API (what torchtitan saves): FQN-keyed optimizer state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, opt)  # creates the optimizer state DCP loads into
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class DCP(Peer):
    key = "dcp"
    label = "dcp.async_save, DefaultStager"
    dist = "torch"
    durable_how = (
        "upload future; FileSystemWriter(sync_files=True) fsyncs its data and .metadata files, "
        "the harness adds the directory fsyncs"
    )
    restore_how = "get_state_dict + dcp.load + set_state_dict (DCP's state-dict API)"
    imports = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict")

    def open(self, model, opt, path):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # async_save's pinned-memory stager, reused across saves (it caches its staging
        # storages). Pinning and non-blocking copies need an accelerator (DefaultStager refuses
        # use_non_blocking_copy without one), so on a CPU machine both are off and the copy runs
        # on the stager's background thread
        accel = torch.accelerator.is_available() if hasattr(torch, "accelerator") else False
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=accel,
            )
        )

    def close(self) -> None:
        self._stager.close()

    def begin(self, model, opt, path):
        import torch.distributed.checkpoint as dcp

        resp = dcp.async_save(
            _dcp_state(model, opt),
            storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
            async_stager=self._stager,
            no_dist=True,
        )
        staged = getattr(resp, "staging_completion", None)
        if staged is not None:  # async staging: the state may change once it is copied
            staged.result()
        done = getattr(resp, "upload_completion", resp)
        return done.result

    def restore(self, path, model, opt):
        _dcp_restore(path, model, opt)


# ------------------------------------------------------------------------------- torchsnapshot


class TorchSnapshot(Peer):
    key = "torchsnapshot"
    label = "torchsnapshot Snapshot.async_take"
    dist = "torchsnapshot"
    needs = ("torchsnapshot",)
    durable_how = "PendingSnapshot.wait(); it does not fsync, the harness fsyncs every file"
    restore_how = "Snapshot(path).restore(app_state)"
    imports = ("torchsnapshot",)

    def begin(self, model, opt, path):
        from torchsnapshot import Snapshot

        # async_take returns once the state is staged in host memory (an async snapshot copies
        # CPU tensors) and writes in the background
        pending = Snapshot.async_take(str(path), app_state={"model": model, "optim": opt})
        return pending.wait

    def restore(self, path, model, opt):
        from torchsnapshot import Snapshot

        Snapshot(str(path)).restore(app_state={"model": model, "optim": opt})


# --------------------------------------------------------------------- nvidia-resiliency-ext


@contextlib.contextmanager
def _no_cuda_sync() -> Iterator[None]:
    """nvidia-resiliency-ext calls torch.cuda.synchronize() unconditionally after its
    device-to-host preload, which raises on a CPU build of torch; with no device there is nothing
    to wait for, so the call is a no-op for the duration of the save call only."""
    if torch.cuda.is_available():
        yield
        return
    orig = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = orig  # type: ignore[assignment]


class NVRx(Peer):
    key = "nvrx"
    label = "nvidia-resiliency-ext FileSystemWriterAsync"
    dist = "nvidia-resiliency-ext"
    needs = ("nvidia-resiliency-ext",)
    durable_how = (
        "maybe_finalize_async_calls(blocking=True); its writer processes fsync each data file "
        "and DCP's finish fsyncs .metadata, the harness adds the directory fsyncs"
    )
    restore_how = "get_state_dict + dcp.load + set_state_dict (it writes DCP's format)"
    imports = DCP.imports

    def open(self, model, opt, path):
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        # persistent=False: each save forks its writer (TemporalAsyncCaller), whose copy-on-write
        # view of memory is the snapshot of CPU tensors. The persistent (spawned) worker gets CPU
        # tensors through shared memory, the live parameters themselves, and its preload (a
        # .to("cpu")) copies nothing, so the loop could change them mid-write.
        self._queue = AsyncCallsQueue(persistent=False)
        # it asks torch.distributed for the rank and gathers the write results: a gloo group of
        # one process, made here (and destroyed in close) unless the job has one
        import torch.distributed as dist

        self._own_group = not dist.is_initialized()
        if self._own_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def close(self) -> None:
        import torch.distributed as dist

        self._queue.close()
        if self._own_group:
            dist.destroy_process_group()

    def begin(self, model, opt, path):
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )

        # Megatron-core's use of the writer: plan (DCP's planner), then a request whose save
        # function writes the buckets from forked processes and whose finalize writes .metadata
        path.mkdir(parents=True, exist_ok=True)
        writer = FileSystemWriterAsync(str(path), thread_count=2)
        with _no_cuda_sync():
            writer, metadata, dist_wrapper = save_state_dict_async_plan(
                _dcp_state(model, opt), writer
            )
            save_fn, preload_fn, save_args = writer.get_save_function_and_args()
            request = AsyncRequest(
                save_fn,
                save_args,
                [lambda: save_state_dict_async_finalize(writer, metadata, dist_wrapper)],
                preload_fn=preload_fn,
            )
            self._queue.schedule_async_request(request)
        return lambda: self._queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

    def restore(self, path, model, opt):
        _dcp_restore(path, model, opt)


# ----------------------------------------------------------------------------------- Lightning


class Lightning(Peer):
    key = "lightning"
    label = "Lightning AsyncCheckpointIO(TorchCheckpointIO)"
    dist = "lightning"
    needs = ("lightning",)
    durable_how = "teardown() joins its thread; torch.save does not fsync, the harness does"
    restore_how = "TorchCheckpointIO.load_checkpoint + load_state_dict (model, optimizer)"
    imports = ("lightning.pytorch.plugins.io",)

    def open(self, model, opt, path):
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self._io = AsyncCheckpointIO(TorchCheckpointIO())

    def close(self) -> None:
        self._io.teardown()

    def begin(self, model, opt, path):
        # the Trainer checkpoint's two entries that hold tensors; AsyncCheckpointIO clones every
        # tensor on the calling thread, then torch.save runs on its executor thread
        path.mkdir(parents=True, exist_ok=True)
        checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}
        self._io.save_checkpoint(checkpoint, path / "last.ckpt")
        return self._io.teardown  # joins the executor (the next save starts a new one)

    def restore(self, path, model, opt):
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        ck = TorchCheckpointIO().load_checkpoint(path / "last.ckpt", weights_only=True)
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer_states"][0])


# ------------------------------------------------------------------------------------- gpumem


class GPUMem(Peer):
    """gpumem itself, through the same harness: blocking save() (it returns once the state is
    copied), its SaveStats for the two clocks (durable_s: save() entry until `latest` is durable;
    retention runs after that, as the harness deletes a peer's previous checkpoint untimed)."""

    key = "gpumem"
    label = "gpumem Checkpointer.save(blocking=True)"
    dist = "gpumem"
    durable_how = "SaveStats.durable_s: data, manifest and directory fsyncs, commit rename, latest"
    restore_how = "Checkpointer.restore (verify + load)"
    imports = ("gpumem",)

    owns_dir = True

    def open(self, model, opt, path):
        import gpumem

        self._ck = gpumem.Checkpointer(path, keep=1)
        self._ck.prepare(model, opt, background=False)  # the arena stays off the timed saves
        self._step = 0

    def close(self) -> None:
        self._ck.close()

    def begin(self, model, opt, path):
        self._step += 1
        self._last = self._ck.save(self._step, model=model, optimizer=opt, rng=False, blocking=True)
        return self._ck.wait

    def save(self, model, opt, path, step=lambda: 0.0):
        wait = self.begin(model, opt, path)
        step_s = step()
        wait()
        return self._last.stall_s, self._last.durable_s, step_s

    def restore(self, path, model, opt):
        import gpumem

        # left open: a resuming job goes on saving with it, and the staging arena restore()
        # starts for its first save (a background thread) is not part of the restore
        self._resumed = ck = gpumem.Checkpointer(path, keep=1)
        if ck.restore(model=model, optimizer=opt, rng=False) is None:
            raise RuntimeError(f"no gpumem checkpoint under {path}")


PEERS: dict[str, type[Peer]] = {p.key: p for p in (GPUMem, DCP, TorchSnapshot, NVRx, Lightning)}


# ------------------------------------------------------------------------------------- driver

RestoreInChild = Callable[[str, Path, int], float]


def write_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """Seconds to write every parameter and optimizer-state tensor once in place (x *= 1, the
    values unchanged): the writes of the optimizer step that follows a save. Run right after the
    stall, it shows what a save leaves for the loop to pay later (a forked writer's copy-on-write
    copies, a background thread's share of the cores)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    v.mul_(1.0)
    return time.perf_counter() - t0


def measure(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    nbytes: int,
    root: Path,
    repeat: int,
    restore_runs: int,
    restore_in_child: RestoreInChild,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Every checkpointer's stall, durable and restore samples (seconds) on ``model`` and ``opt``
    (built with ``nbytes`` of state), and the reason of each one that could not run.

    Saves run one checkpointer at a time (one untimed warm-up save, then ``repeat``), so only one
    staging copy of the state is alive at once; the last checkpoint of each stays on disk, and
    the restores then alternate between them, each in a fresh process with the page cache of the
    files dropped first, one untimed round, then ``restore_runs`` rounds."""
    from gpumem.reader import drop_page_cache

    results: dict[str, dict[str, list[float]]] = {}
    skipped: dict[str, str] = {}
    kept: dict[str, Path] = {}
    for key, cls in PEERS.items():
        peer = cls()
        reason = peer.unavailable()
        if reason:
            skipped[key] = reason
            continue
        r: dict[str, list[float]] = {"stall": [], "durable": [], "restore": [], "loop": []}
        path = root / f"peer-{key}"
        try:
            peer.open(model, opt, path)
            try:
                for i in range(repeat + 1):
                    if not peer.owns_dir:
                        shutil.rmtree(path, ignore_errors=True)  # the previous one, untimed
                    gc.collect()
                    plain = write_state(model, opt)
                    stall, durable, after = peer.save(
                        model, opt, path, lambda: write_state(model, opt)
                    )
                    if i:
                        r["stall"].append(stall)
                        r["durable"].append(durable)
                        r["loop"].append(stall + max(0.0, after - plain))
            finally:
                peer.close()
        except Exception as exc:  # a peer that fails here is listed with its error
            skipped[key] = f"save failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            shutil.rmtree(path, ignore_errors=True)
            continue
        print(f"  {key}: saved", flush=True)
        results[key], kept[key] = r, path
        gc.collect()
    for i in range(restore_runs + 1):
        for key, path in list(kept.items()):
            drop_page_cache([path])
            try:
                elapsed = restore_in_child(key, path, nbytes)
            except RuntimeError as exc:
                skipped[key] = f"restore failed: {str(exc).splitlines()[-1]}"
                del kept[key], results[key]
                continue
            if i:
                results[key]["restore"].append(elapsed)
    for path in kept.values():
        shutil.rmtree(path, ignore_errors=True)
    return results, skipped


def rows_and_figures(
    label: str, results: dict[str, dict[str, list[float]]], skipped: dict[str, str]
) -> tuple[list[list[object]], list[Figure]]:
    """The table's rows (each peer against gpumem, median and spread) and the figures."""
    rows: list[list[object]] = []
    figures: list[Figure] = []
    ref = results.get("gpumem")
    what = {
        "stall": "stall",
        "loop": "stall + slowdown of the next state write",
        "durable": "time to durable",
        "restore": "restore, fresh process",
    }
    for key, r in results.items():
        peer = PEERS[key]()
        for k, name in what.items():
            f = figure(f"{label}: {key}: {name}", "ms", r[k], scale=1e3)
            figures.append(f)
            ratio, verdict = "", ""
            if ref is not None and key != "gpumem":
                g = statistics.median(ref[k])
                ratio = f"{statistics.median(r[k]) / g:.2f}x"
                verdict = "gpumem ahead" if g < statistics.median(r[k]) else "**gpumem behind**"
                figures.append(
                    figure(
                        f"{label}: {key} / gpumem: {name}",
                        "x",
                        [x / g for x in r[k]],
                        better="higher",
                    )
                )
            how = {"durable": peer.durable_how, "restore": peer.restore_how}.get(k, "")
            rows.append(
                [
                    label,
                    f"{peer.label} {peer.version() or ''}".strip(),
                    name,
                    f"{statistics.median(r[k]) * 1e3:.0f} ms",
                    f"{min(r[k]) * 1e3:.0f}-{max(r[k]) * 1e3:.0f} ms",
                    ratio,
                    "; ".join(x for x in (verdict, how) if x),
                ]
            )
    for key, reason in skipped.items():
        peer = PEERS[key]()
        rows.append(
            [label, f"{peer.label} {peer.version() or ''}".strip(), "not run", "", "", "", reason]
        )
    return rows, figures


def run(
    sizes: list[int],
    root: Path,
    repeat: int,
    restore_runs: int,
    make_state: Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]],
    restore_in_child: RestoreInChild,
    write: bool = True,
) -> None:
    """bench_checkpoint.py --peers: every size, then results/checkpoint_peers.md and .json."""
    from _report import machine_info, markdown_table, write_results

    from gpumem.units import format_bytes

    rows: list[list[object]] = []
    figures: list[Figure] = []
    columns = ["state", "checkpointer", "row", "median", "runs", "peer / gpumem", "note"]
    info = machine_info()
    for key, cls in PEERS.items():
        info[f"{cls.dist} ({key})"] = cls().version() or "not installed"
    for nbytes in sizes:
        model, opt, tensors = make_state(nbytes)
        label = format_bytes(sum(t.numel() * t.element_size() for t in tensors))
        print(f"peers, state {label}", flush=True)
        results, skipped = measure(model, opt, nbytes, root, repeat, restore_runs, restore_in_child)
        size_rows, size_figures = rows_and_figures(label, results, skipped)
        rows += size_rows
        figures += size_figures
        del model, opt, tensors
        gc.collect()
        # written after every size, so a time limit or a killed run keeps what was measured
        if not write:
            print(markdown_table(columns, rows))
            continue
        write_results(
            "checkpoint_peers",
            "Checkpoint: gpumem against its peers, same state, disk and run",
            columns,
            rows,
            notes=NOTES,
            info=info,
            figures=figures,
        )


NOTES = """\
State: bench_checkpoint.py's GPT-like fp32 stack with AdamW state (12 bytes per parameter), on
CPU. Every checkpointer saves the same model and optimizer to the same disk in the same run, one
after the other (one untimed warm-up save each, so a stager's or arena's first allocation is not
in the rows), and deletes its previous checkpoint outside the timing.
Stall: from the save call until the training loop may change the state again (for
dcp.async_save with async staging, until its staging future completes; gpumem: blocking save(),
which returns once the state is copied). Time to durable: from the save call until every byte
is on disk; for each peer, its completion (see the note) and then an fsync of every file and
directory of the checkpoint by the harness (only the system call where the peer synced already).
Stall + slowdown of the next state write: right after the stall the harness writes every tensor
of the state once in place (x *= 1, an optimizer step's writes) and adds how much longer that took
than the same writes just before the save: what the save costs the loop beyond its stall (for
nvidia-resiliency-ext's forked writer, the copy-on-write copies; for a background thread, its
share of the cores).
Restore: a fresh process that has just built the model and optimizer (no optimizer state yet)
loads the checkpoint the peer's own way, page cache of the files dropped first; the restores of
all checkpointers alternate, one untimed round first. 'peer / gpumem': the peer's median over
gpumem's (above 1: gpumem ahead). Runs: the fastest and slowest run. This is a shared 2-vCPU VM
with a noisy virtual disk.
nvidia-resiliency-ext on a CPU build of torch: its preload calls torch.cuda.synchronize()
unconditionally, which raises (torch not compiled with CUDA); the harness makes that call a no-op
during the save call only. It runs with persistent=False (a forked writer per save: the
copy-on-write fork is its snapshot of CPU tensors: the loop pays the page copies on its first
writes after each fork, while the writer lives, which the 'stall + slowdown' row shows). Without
the no-op the save fails with "AssertionError: Torch not compiled with CUDA enabled".
"""
