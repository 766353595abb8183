"""Per-rank profiles under torch.distributed: every rank profiles itself, rank 0 gathers the reports
and prints them side by side; a fake process group profiles one rank of a job of any size.

Reports travel as UTF-8 JSON in uint8 tensors (an ``all_gather`` of their sizes, then a
``gather`` of the padded bytes), so nothing is pickled on the way, unlike ``gather_object``.

Example:
    >>> with gpumem.profile(model, opt) as prof:
    ...     train_step()
    >>> reports = gpumem.profiler.gather(prof.report())   # list on rank 0, None elsewhere
    >>> if reports is not None:
    ...     print(gpumem.profiler.cluster_table(reports))
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gpumem.profiler.categories import CATEGORIES
from gpumem.profiler.report import Report
from gpumem.units import format_bytes


def gather(
    report: Report, dst: int = 0, group: Any = None, timeline: bool = False
) -> list[Report] | None:
    """Collect every rank's report on rank ``dst``, ordered by rank in ``group``.

    Collective: every rank of ``group`` must call it.

    Args:
        report: this rank's ``prof.report()``.
        dst: the global rank that receives the reports.
        group: the process group (``None``: the default one).
        timeline: send the memory-over-time samples too (one per op in exact mode: large).

    Returns:
        On ``dst`` the list of every rank's :class:`Report`; ``None`` on the other ranks.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "gpumem.profiler.gather needs an initialized process group; call "
            "torch.distributed.init_process_group first, or use the report itself on one process"
        )
    if not isinstance(report, Report):
        raise TypeError(
            f"gather(report) needs the Report of prof.report(), got {type(report).__name__}"
        )
    world = dist.get_world_size(group)
    device = _device_for(group)
    payload = json.dumps(report.to_dict(timeline)).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    receiving = dist.get_rank() == dst
    bufs = [torch.zeros_like(buf) for _ in range(world)] if receiving else None
    dist.gather(buf, bufs, dst=dst, group=group)
    if bufs is None:
        return None
    return [
        Report.from_dict(json.loads(bytes(b[: int(n.item())].cpu().tolist())))
        for b, n in zip(bufs, sizes, strict=True)
    ]


def cluster_table(reports: Sequence[Report], unit: str | None = None) -> str:
    """Every rank's peak and its categories side by side, and the maximum over ranks.

    Args:
        reports: what :func:`gather` returns on rank 0 (any list of reports works).
        unit: a fixed binary unit for every cell (``"MiB"``, ``"GiB"``); default: per cell.

    Returns:
        The text table: one column per rank and a ``max`` column (each row's maximum over ranks;
        the category rows are each rank's bytes at its own peak).

    Example:
        >>> print(gpumem.profiler.cluster_table(reports))
    """
    if reports is None or isinstance(reports, Report):
        raise TypeError(
            "cluster_table needs the list of reports gather() returns on rank 0 (it returns "
            "None on the other ranks: call cluster_table on rank 0 only)"
        )
    reports = list(reports)
    if not reports or not all(isinstance(r, Report) for r in reports):
        raise ValueError("cluster_table needs a non-empty list of gpumem.profiler.Report")
    top = max(range(len(reports)), key=lambda i: reports[i].peak_bytes)
    first = reports[0]
    tags = [first.model, first.device] + ([f"{first.mode} mode"] if first.mode != "exact" else [])
    cols = ["", *(_rank_name(r, i) for i, r in enumerate(reports)), "max"]
    rows: list[list[str]] = []

    def add(name: str, values: list[int | None]) -> None:
        known = [v for v in values if v is not None]
        rows.append(
            [name, *(_cell(v, unit) for v in values), _cell(max(known) if known else None, unit)]
        )

    add("peak", [r.peak_bytes for r in reports])
    rows.append(["  at", *(f"step {r.peak_step} {r.peak_phase}" for r in reports), ""])
    for c in CATEGORIES:
        add(f"  {c}", [r.at_peak.get(c) for r in reports])
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]

    def line(r: list[str]) -> str:
        cells = zip(r, widths, strict=True)
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(cells))

    head = (
        f"gpumem profile of {len(reports)} ranks ({', '.join(tags)}): max peak "
        f"{format_bytes(reports[top].peak_bytes)} ({reports[top].peak_bytes} B) on "
        f"{_rank_name(reports[top], top)}"
    )
    return "\n".join([head, "", line(cols), "  ".join("-" * w for w in widths), *map(line, rows)])


def _rank_name(r: Report, i: int) -> str:
    return f"rank {r.rank if r.rank is not None else i}"


def _cell(n: int | None, unit: str | None) -> str:
    return "-" if n is None else format_bytes(n, unit)


@contextlib.contextmanager
def fake_process_group(
    world_size: int,
    rank: int = 0,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    device_type: str = "cpu",
) -> Iterator[Any]:
    """One rank of a ``world_size`` job in this process: torch's fake process group, whose
    collectives move no data, and a device mesh over it.

    With :func:`gpumem.fake` a sharded model of any size is profiled on one machine: FSDP and
    tensor parallelism allocate on this rank exactly what they would in the real job.

    Args:
        world_size: ranks of the job.
        rank: the rank this process plays.
        mesh_shape: the device mesh's shape (``(dp, tp)`` for 2-D); default ``(world_size,)``.
        mesh_dim_names: names of the mesh dimensions (``("dp", "tp")``).
        device_type: the mesh's device type.

    Yields:
        The ``DeviceMesh`` (pass it, or its sub-meshes, to ``fully_shard`` and
        ``parallelize_module``). It is built outside any fake mode: a mesh holds real ranks.

    Example:
        >>> with gpumem.profiler.fake_process_group(64) as mesh, gpumem.fake():
        ...     block = Block(cfg); fully_shard(block, mesh=mesh)
        ...     opt = torch.optim.AdamW(block.parameters())
        ...     with gpumem.profile(block, opt) as prof: ...
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, {world_size}) for world_size {world_size}, got {rank!r}"
        )
    shape = tuple(mesh_shape) if mesh_shape is not None else (world_size,)
    n = 1
    for s in shape:
        n *= s
    if n != world_size:
        raise ValueError(
            f"mesh_shape {shape} holds {n} ranks, not world_size {world_size}; make their product "
            "equal to world_size"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized in this process; "
            "fake_process_group starts its own: destroy the other one first "
            "(torch.distributed.destroy_process_group())"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    with unset_fake_temporarily():
        dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        with unset_fake_temporarily():
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        yield mesh
    finally:
        dist.destroy_process_group()


def _device_for(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
