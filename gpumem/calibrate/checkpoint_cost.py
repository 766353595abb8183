"""What a checkpoint costs on this machine and this storage, measured with the real Checkpointer.

For each size a synthetic training state is built (fp32 parameters in a few hundred tensors
plus AdamW's ``exp_avg`` and ``exp_avg_sq``: 12 bytes per parameter, like a model and its
optimizer) and saved by :class:`gpumem.Checkpointer` into a temporary directory under the one
given, after ``prepare()`` (so the staging allocation is not timed, as in a job that prepares).
Each repeat measures, from the real code path's own ``SaveStats``:

* ``blocking_stall_s``: ``save(..., blocking=True)``: every tensor copied before it returns;
* ``overlap_stall_s``: the default mode, ``save()`` plus the wait of the optimizer pre-step hook
  when ``optimizer.step()`` is called right after it. That is overlap mode's *worst case*: in a
  real loop the forward and backward between save() and the step hide some or all of the copy;
* ``durable_s``: ``save()`` entry until the checkpoint is committed (``wait()`` returns), of
  the overlap save: the persist time P of the planner;
* ``restore_s``: ``restore()`` into the same model and optimizer, page cache of the
  checkpoint's files dropped first (``posix_fadvise(DONTNEED)``), as on a freshly started node.

Rounds go round-robin over the sizes (every size's state and Checkpointer exist at once: host
memory for about twice the sum of the sizes, plus one restored copy at a time), so that load
from other processes falls on all sizes alike. The medians over repeats are fitted per quantity
with :func:`fit_cost`: the bandwidth from the largest sizes, the fixed cost from the smaller.
The temporary directory is removed afterwards, also on error.

The default sizes (:func:`default_sizes`) reach where bandwidth dominates the fixed costs: a
largest size of up to 2 GiB, chosen from the memory and disk free now, and two smaller ones
(a 16th and a quarter of it). States of 16-64 MiB are all fixed cost and noise, and their lines
put a 28 GiB restore at 175 s where one measured at 1-2 GiB puts it at 14 s. A prediction for
more than :data:`MAX_EXTRAPOLATION` times the largest size measured is beyond what
``benchmarks/bench_calibration.py`` checks, and the planner says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumem.calibrate._schema import CalibrationError, Fields, check_float
from gpumem.calibrate.fit import LinearFit, fit_cost

QUANTITIES = ("blocking_stall_s", "overlap_stall_s", "durable_s", "restore_s")
MODES = ("blocking", "overlap", "streaming")
BYTES_PER_PARAM = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq
MIN_SIZE = 1 << 20  # below this only fixed costs would be measured
MAX_POINTS, MAX_REPEAT = 64, 1000
# how far past the largest size measured benchmarks/bench_calibration.py checks predictions
# (target: within 20 %; benchmarks/results/calibration.md and docs/calibration.md)
MAX_EXTRAPOLATION = 4.0
LADDER = (16, 4, 1)  # the default sizes: the largest divided by these
TOP_MIN, TOP_MAX = 64 << 20, 2 << 30
MEMORY_SHARE = 16  # the largest default size is at most this fraction of the memory free


@dataclass(frozen=True)
class CheckpointPoint:
    """The measurements at one size.

    Attributes:
        target_bytes: the state size asked for (parameters + optimizer state).
        nbytes: tensor bytes the save staged (``SaveStats.nbytes``: the target plus AdamW step
            counters and RNG states); the fits use this.
        tensors: tensors in the saved state.
        blocking_mode / overlap_mode: ``SaveStats.mode`` of the two kinds of save (``streaming``
            when the state exceeded the staging budget).
        samples: every repeat's seconds, per quantity in :data:`QUANTITIES`.
    """

    target_bytes: int
    nbytes: int
    tensors: int
    blocking_mode: str
    overlap_mode: str
    samples: dict[str, tuple[float, ...]]

    def median(self, quantity: str) -> float:
        return statistics.median(self.samples[quantity])

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_bytes": self.target_bytes,
            "nbytes": self.nbytes,
            "tensors": self.tensors,
            "blocking_mode": self.blocking_mode,
            "overlap_mode": self.overlap_mode,
            "samples": {q: list(self.samples[q]) for q in QUANTITIES},
        }

    @classmethod
    def from_fields(cls, f: Fields) -> CheckpointPoint:
        s = f.obj("samples")
        assert s is not None
        samples = {}
        for q in QUANTITIES:
            values = s.list(q, MAX_REPEAT)
            if not values:
                raise CalibrationError(f"{s.path(q)}: no samples; re-run `gpumem calibrate`")
            samples[q] = tuple(check_float(v, f"{s.path(q)}[{i}]") for i, v in enumerate(values))
        s.done()
        out = cls(
            target_bytes=f.int("target_bytes", minimum=1),
            nbytes=f.int("nbytes", minimum=1),
            tensors=f.int("tensors", minimum=1),
            blocking_mode=f.str("blocking_mode", choices=MODES),
            overlap_mode=f.str("overlap_mode", choices=MODES),
            samples=samples,
        )
        f.done()
        return out


@dataclass(frozen=True)
class CheckpointCost:
    """Checkpoint cost lines of one directory (file system) and device.

    Attributes:
        directory: the directory measured (absolute).
        filesystem: its file-system type from ``/proc/self/mountinfo`` (None where unknown).
        device: ``cpu`` or ``cuda``: where the saved tensors lived.
        repeat: repeats per size (medians are fitted).
        points: the raw measurements, smallest size first.
        fits: per quantity, ``seconds = a + b · bytes``.
    """

    directory: str
    filesystem: str | None
    device: str
    repeat: int
    points: tuple[CheckpointPoint, ...]
    fits: dict[str, LinearFit] = field(default_factory=dict)

    def predict(self, nbytes: int) -> dict[str, float]:
        """Seconds of each quantity for a state of ``nbytes`` tensor bytes."""
        return {q: self.fits[q].predict(nbytes) for q in QUANTITIES}

    @property
    def largest_bytes(self) -> int:
        """The largest state measured."""
        return max(p.nbytes for p in self.points)

    def extrapolation_factor(self, nbytes: int) -> float:
        """How many times the largest state measured ``nbytes`` is (<= 1: within the sizes
        measured or below them); past :data:`MAX_EXTRAPOLATION` the prediction is unchecked."""
        return nbytes / self.largest_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "filesystem": self.filesystem,
            "device": self.device,
            "repeat": self.repeat,
            "fits": {q: self.fits[q].to_dict() for q in QUANTITIES},
            "points": [p.to_dict() for p in self.points],
        }

    @classmethod
    def from_fields(cls, f: Fields) -> CheckpointCost:
        fits_f = f.obj("fits")
        assert fits_f is not None
        fits = {}
        for q in QUANTITIES:
            sub = fits_f.obj(q)
            assert sub is not None
            fits[q] = LinearFit.from_fields(sub)
        fits_f.done()
        raw = f.list("points", MAX_POINTS)
        points = tuple(
            CheckpointPoint.from_fields(Fields(p, f"{f.path('points')}[{i}]"))
            for i, p in enumerate(raw)
        )
        if len({p.nbytes for p in points}) < 2:
            raise CalibrationError(
                f"{f.path('points')}: {len(points)} point(s) of "
                f"{len({p.nbytes for p in points})} distinct size(s); a cost line needs "
                "two sizes or more: re-run `gpumem calibrate --sizes 64MiB,256MiB`"
            )
        out = cls(
            directory=f.str("directory"),
            filesystem=f.str("filesystem", optional=True),
            device=f.str("device", choices=("cpu", "cuda")),
            repeat=f.int("repeat", minimum=1),
            points=points,
            fits=fits,
        )
        f.done()
        return out


def default_sizes(directory: str | os.PathLike = ".") -> list[int]:
    """Sizes that reach where bandwidth dominates, within this host's memory and disk.

    The largest is the largest power of two from 64 MiB to 2 GiB that is at most the memory
    available now over :data:`MEMORY_SHARE` (the measurement holds about 3.6 times it) and whose
    checkpoints fit the disk free in ``directory`` twice over; the others are a quarter and a
    16th of it (the fixed cost, measured where it dominates).
    """
    from gpumem.device import host_available_bytes

    total = sum(1 / d for d in LADDER)
    try:
        disk = shutil.disk_usage(directory).free
    except OSError:
        disk = TOP_MAX
    room = min(host_available_bytes() // MEMORY_SHARE, disk / (4 * total))
    top = TOP_MAX
    while top > TOP_MIN and top > room:
        top //= 2
    return [top // d for d in LADDER]


def measure_checkpoint(
    directory: str | os.PathLike,
    sizes: Sequence[int] | None = None,
    *,
    device: str = "cpu",
    repeat: int = 5,
    tensors: int = 96,
    warmup: int = 1,
    staging_bytes: int | None = None,
    drop_cache: bool = True,
    progress: Any = None,
) -> CheckpointCost:
    """Measure save stalls, time to durable and restore at each size; fit a line per quantity.

    Args:
        directory: where the job's checkpoints will live (an existing directory); a temporary
            ``.gpumem-calibrate-*`` subdirectory is used and removed afterwards.
        sizes: state sizes in bytes (parameters + AdamW state), at least two different ones
            (default :func:`default_sizes`).
        device: ``cpu`` or ``cuda`` (the state on the current CUDA device).
        repeat: measured rounds per size (the median is fitted).
        tensors: parameter tensors in the synthetic model (3× as many tensors are saved, plus
            AdamW's step counters).
        warmup: untimed rounds first (thread start-up, first-touch of files).
        staging_bytes: the Checkpointer's staging cap (default: as a job's, see
            ``gpumem.checkpoint.settings.default_staging_bytes``).
        drop_cache: drop the checkpoint files' page cache before each restore.
        progress: called as ``progress(done, total)`` after each size's round (a CLI bar).

    Raises:
        CalibrationError: bad arguments, a missing directory, sizes this host's memory or the
            directory's free space cannot hold, or no CUDA device for ``cuda``.
        gpumem.CheckpointError: the Checkpointer itself failed (disk full, permissions).
    """
    if sizes is None:
        sizes = default_sizes(directory) if Path(directory).is_dir() else []
    points = measure_points(
        directory,
        sizes,
        device=device,
        repeat=repeat,
        tensors=tensors,
        warmup=warmup,
        staging_bytes=staging_bytes,
        drop_cache=drop_cache,
        progress=progress,
        least=2,
    )
    xs = [p.nbytes for p in points]
    fits = {q: fit_cost(xs, [p.median(q) for p in points]) for q in QUANTITIES}
    root_dir = Path(directory).resolve()
    return CheckpointCost(
        directory=str(root_dir),
        filesystem=filesystem_type(root_dir),
        device=device,
        repeat=repeat,
        points=tuple(points),
        fits=fits,
    )


def measure_points(
    directory: str | os.PathLike,
    sizes: Sequence[int],
    *,
    device: str = "cpu",
    repeat: int = 5,
    tensors: int = 96,
    warmup: int = 1,
    staging_bytes: int | None = None,
    drop_cache: bool = True,
    progress: Any = None,
    least: int = 1,
) -> list[CheckpointPoint]:
    """The rounds of :func:`measure_checkpoint` without the fit, for ``least`` sizes or more
    (one: a state to check a calibration's prediction against). Arguments and errors as there.
    """
    sizes = _check_args(directory, sizes, device, repeat, tensors, warmup, least)
    root = Path(tempfile.mkdtemp(prefix=".gpumem-calibrate-", dir=Path(directory).resolve()))
    try:
        with contextlib.ExitStack() as stack:
            runs = [
                _SizeRun(stack, root / f"size-{i}", size, device, tensors, staging_bytes)
                for i, size in enumerate(sizes)
            ]
            # rounds go round-robin over the sizes: a burst of load from other processes then
            # lands on every size alike instead of skewing one size's whole sample (the slope)
            total, done = (warmup + repeat) * len(runs), 0
            for r in range(warmup + repeat):
                for run in runs:
                    run.round(device, drop_cache, keep=r >= warmup)
                    done += 1
                    if progress is not None:
                        progress(done, total)
            return [run.point() for run in runs]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_args(directory, sizes, device, repeat, tensors, warmup, least) -> list[int]:
    d = Path(directory)
    if not d.is_dir():
        raise CalibrationError(
            f"{d} is not a directory: pass the existing directory your checkpoints will live in"
        )
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"device={device!r}: use 'cpu' or 'cuda'")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CalibrationError("device='cuda' but torch sees no CUDA device; use device='cpu'")
    for name, v, lo, hi in (
        ("repeat", repeat, 1, MAX_REPEAT),
        ("tensors", tensors, 1, 100_000),
        ("warmup", warmup, 0, 100),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise CalibrationError(f"{name}={v!r} must be an integer in [{lo}, {hi}]")
    out = sorted({int(s) for s in sizes})
    if len(out) < least or len(out) > MAX_POINTS:
        why = "; a cost line a + b*bytes needs two" if least == 2 else ""
        raise CalibrationError(
            f"sizes={list(sizes)!r}: give {least} to {MAX_POINTS} different "
            f"sizes (e.g. 256MiB,1GiB){why}"
        )
    floor = max(MIN_SIZE, BYTES_PER_PARAM * 2 * tensors)
    if out[0] < floor:
        raise CalibrationError(
            f"size {out[0]} bytes is below {floor} bytes ({MIN_SIZE >> 20} MiB): "
            "smaller states measure only fixed costs; use larger sizes"
        )
    _check_room(d, out)
    return out


def _check_room(directory: Path, sizes: list[int]) -> None:
    """Every size's state and staging copy live at once, plus one restored state; each size
    keeps one checkpoint and writes the next beside it. Refuse what cannot fit, before any."""
    from gpumem.device import host_available_bytes
    from gpumem.units import format_bytes

    memory = 2 * sum(sizes) + max(sizes)
    avail = host_available_bytes()
    fix = "use smaller --sizes (e.g. 64MiB,256MiB)"
    if memory > avail:
        raise CalibrationError(
            f"sizes {', '.join(format_bytes(s) for s in sizes)} need about "
            f"{format_bytes(memory)} of host memory (each state and its staging copy, plus one "
            f"restore) but {format_bytes(avail)} is available; {fix}"
        )
    disk = 2 * sum(sizes)
    free = shutil.disk_usage(directory).free
    if disk > free:
        raise CalibrationError(
            f"sizes {', '.join(format_bytes(s) for s in sizes)} need about {format_bytes(disk)} "
            f"free in {directory} (two checkpoints per size at a time) but "
            f"{format_bytes(free)} is free; {fix}, or calibrate on a larger file system"
        )


def split_elements(elements: int, tensors: int) -> list[int]:
    """Element counts of ``tensors`` parameters summing to ``elements``: a third are small
    vectors (biases, norms) of ``elements // (256 · tensors)`` elements, the rest share the
    remainder as evenly as integers allow (the larger ones first)."""
    n_small = tensors // 3
    small = max(1, elements // (256 * tensors)) if n_small else 0
    rest = elements - n_small * small
    n_big = tensors - n_small
    if rest < n_big:
        raise CalibrationError(
            f"{elements} elements cannot fill {tensors} tensors; use fewer tensors"
        )
    q, r = divmod(rest, n_big)
    return [q + 1] * r + [q] * (n_big - r) + [small] * n_small


def synthetic_state(
    nbytes: int, tensors: int = 96, device: str = "cpu", seed: int = 0
) -> tuple[Any, Any]:
    """A model of fp32 parameters and an AdamW optimizer after one step: ``nbytes`` of state.

    The values are random (uniform), so no copy is made cheaper by zero pages. Returns
    ``(model, optimizer)``; gradients are dropped again (a checkpoint does not hold them).
    """
    import torch

    sizes = split_elements(nbytes // BYTES_PER_PARAM, tensors)
    gen = torch.Generator(device=device).manual_seed(seed)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.empty(n, device=device).uniform_(-1, 1, generator=gen))
        for n in sizes
    )
    # fused, with each parameter its own gradient: a third of the set-up time of random
    # gradients and an unfused step (the measured saves and restores are the same)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False, fused=True)
    for p in model.parameters():
        p.grad = p.detach()
    opt.step()  # creates exp_avg and exp_avg_sq, with values
    for p in model.parameters():
        p.grad = None
    return model, opt


class _SizeRun:
    """One size's synthetic state, its prepared Checkpointer (closed by ``stack``), its samples."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        path: Path,
        size: int,
        device: str,
        tensors: int,
        staging_bytes: int | None,
    ):
        from gpumem.checkpoint import Checkpointer

        self.size = size
        self.model, self.opt = synthetic_state(size, tensors, device)
        # entered through the stack: closed on the way out, and its __exit__ never hides an error
        self.ckpt = stack.enter_context(Checkpointer(path, keep=1, staging_bytes=staging_bytes))
        self.ckpt.prepare(self.model, self.opt, background=False)
        self.samples: dict[str, list[float]] = {q: [] for q in QUANTITIES}
        self.modes: dict[str, str] = {}
        self.nbytes, self.step = 0, 0

    def round(self, device: str, drop_cache: bool, keep: bool) -> None:
        row, self.modes, self.nbytes = _round(
            self.ckpt, self.model, self.opt, self.step, device, drop_cache
        )
        self.step += 2
        if keep:
            for q in QUANTITIES:
                self.samples[q].append(row[q])

    def point(self) -> CheckpointPoint:
        n_tensors = len(self.model.state_dict()) + sum(len(s) for s in self.opt.state.values())
        return CheckpointPoint(
            target_bytes=self.size,
            nbytes=self.nbytes,
            tensors=n_tensors,
            blocking_mode=self.modes["blocking"],
            overlap_mode=self.modes["overlap"],
            samples={q: tuple(v) for q, v in self.samples.items()},
        )


def _round(ckpt: Any, model: Any, opt: Any, step: int, device: str, drop_cache: bool):
    """One blocking save, one overlap save (worst case) and one restore."""
    import torch

    ckpt.wait()
    blocking = ckpt.save(step, model=model, optimizer=opt, blocking=True)
    ckpt.wait()
    overlap = ckpt.save(step + 1, model=model, optimizer=opt)
    opt.step()  # no gradients: updates nothing, but its pre-hook waits for the background copy
    ckpt.wait()
    if drop_cache:
        info = ckpt.latest()
        if info is not None:
            from gpumem.reader import drop_page_cache

            drop_page_cache([info.path])
    t0 = time.perf_counter()
    restored = ckpt.restore(model=model, optimizer=opt)
    if device == "cuda":
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - t0
    if restored != step + 1:
        raise CalibrationError(
            f"restore() returned step {restored}, expected {step + 1}: the measurement is void"
        )
    row = {
        "blocking_stall_s": blocking.save_s,
        "overlap_stall_s": overlap.stall_s,
        "durable_s": overlap.durable_s,
        "restore_s": restore_s,
    }
    return row, {"blocking": blocking.mode, "overlap": overlap.mode}, overlap.nbytes


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (``ext4``, ``xfs``, ``nfs4``, ``lustre``,
    ``tmpfs`` ...), from the longest matching mount point in ``/proc/self/mountinfo``."""
    target = os.path.realpath(path)
    best, best_len = None, -1
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                parts = left.split()
                if not sep or len(parts) < 5 or not right.split():
                    continue
                mount = _unescape(parts[4])
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best_len:
                    best, best_len = right.split()[0], len(mount)
    except OSError:
        return None
    return best


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field
