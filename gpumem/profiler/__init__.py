"""The measuring half of gpumem: where the memory of a training step goes, per layer and phase.

    with gpumem.profile(model, optimizer=opt) as prof:
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    rep = prof.report()

Modules, bottom up:

    categories    the memory categories and training phases every report speaks in
    fsdp_tp       FSDP2 units, DTensor (tensor parallelism) and collectives, as seen here
    tracker       live storages per category (a TorchDispatchMode and weakref finalizers)
    reserved      what the caching allocator would reserve for them (gpumem.allocator, simulated)
    records       what a profile keeps while it runs: call frames, snapshots, steps
    samples       a k-block profile's per-sample vectors, for extrapolate
    communication FSDP2's gathers and reduce-scatters: the communication a profile accounts
    fake          ``gpumem.fake()``: fake tensors, fake CUDA
    cuda          what the caching allocator and the driver say (CUDA only)
    hooks         every hook a profile installs; ``ProfileEvents``, what they call
    modes         exact and light: what differs between the two ways a profile sees memory
    levels        where a profiled run is and how high: steps, peaks, module calls, timeline
    headroom      the warning before a profiled step runs out of memory
    pictures      a report's PNG and Chrome trace
    memory_viz    the timeline as PyTorch's memory snapshot (pytorch.org/memory_viz)
    report        ``Report``: the records rolled up into tables, JSON and pictures
    session       ``Profile``, the context manager and its accounting
    distributed   per-rank reports gathered on rank 0, ``cluster_table``, a fake process group
    extrapolate   a fake profile of N identical blocks from profiles with 1, 2 and 3 of them
    runner        profile N steps of a built-in or ``config.json`` model (the CLI's)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem._assumptions import note_assumption
from gpumem.profiler.categories import CATEGORIES, PHASES
from gpumem.profiler.distributed import cluster_table, fake_process_group, gather
from gpumem.profiler.fake import fake
from gpumem.profiler.headroom import ProfileMemoryWarning
from gpumem.profiler.report import LayerStats, Report, StepReport
from gpumem.profiler.session import Profile
from gpumem.profiler.tracker import DataDependentError

if TYPE_CHECKING:
    import torch

    from gpumem.allocator.alloc_conf import AllocConf


def profile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    snapshot: str | None = None,
    timeline: bool = True,
    mode: str = "exact",
    alloc_conf: str | AllocConf | None = None,
) -> Profile:
    """Measure the memory of the training steps run inside a ``with`` block.

    Two modes (see docs/profiler.md, "Modes"):

    - ``"exact"`` (default): a TorchDispatchMode sees every op, so every storage created or freed
      in the region is counted the moment it happens. All seven categories, per-layer
      temporaries, exact peaks (on CUDA in the allocator's 512-byte blocks, plus the allocator's
      own peaks). Costs a Python call per aten op.
    - ``"light"``: no dispatch mode, only hooks (module forward/backward, saved tensors,
      gradient accumulation, optimizer step). Exact, and equal to exact mode, for ``weights``,
      ``gradients``, ``optimizer`` (per layer and per step), ``activations`` (per layer) and
      ``inputs``; these are sampled at hook boundaries. Temporaries are measured only on CUDA,
      from the caching allocator's allocated peak between boundaries (so ``peak_bytes`` is the
      allocator's true peak less what was allocated at entry and is not the model's). On CPU
      temporaries are not measured: they are ``None`` in the report, and ``peak_bytes`` is the
      peak of the measured categories only (a lower bound of the true peak).

    Under torch.distributed each rank profiles itself: FSDP2 (``fully_shard``), tensor
    parallelism and 2-D meshes work in both modes and under :func:`fake` (with
    :func:`fake_process_group`); what sharding costs is the ``communication`` category, and
    :func:`gather` with :func:`cluster_table` shows every rank (docs/profiler.md, "Distributed").

    Args:
        model: the module trained in the region; its forward marks the phases and names layers.
        optimizer: the optimizer stepping ``model``'s parameters, or ``None`` (forward and
            backward phases only; a step then ends with each backward pass).
        snapshot: on CUDA, where to write PyTorch's allocator snapshot if the region raises
            ``torch.OutOfMemoryError`` (open it at https://pytorch.org/memory_viz).
        timeline: keep the memory-over-time samples for ``plot`` and ``to_chrome_trace``.
        mode: ``"exact"`` or ``"light"`` (above).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` the report's ``peak_reserved_bytes`` is
            simulated under (exact mode); ``None`` reads ``PYTORCH_ALLOC_CONF`` /
            ``PYTORCH_CUDA_ALLOC_CONF`` from the environment. A bad setting is a ``ValueError``.

    Returns:
        A :class:`Profile`; call ``.report()`` on it during or after the region.

    Example:
        >>> with gpumem.profile(model, optimizer=opt) as prof:
        ...     loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
        >>> print(prof.report().table())
    """
    return Profile(
        model, optimizer, snapshot=snapshot, timeline=timeline, mode=mode, alloc_conf=alloc_conf
    )


__all__ = [
    "CATEGORIES",
    "PHASES",
    "DataDependentError",
    "LayerStats",
    "Profile",
    "ProfileMemoryWarning",
    "Report",
    "StepReport",
    "cluster_table",
    "fake",
    "fake_process_group",
    "gather",
    "note_assumption",
    "profile",
]
