"""Notice windows: is the final save durable before the provider takes the node back?

Preemptible capacity warns before it reclaims a node (the job gets SIGTERM); the
``PreemptionGuard`` finishes the step in flight, saves it and waits for it to be durable. The job
loses at most that one step when the save is durable inside the notice. The notices, as
published (``NOTICE_S``; ``NOTICE_SOURCES`` holds the addresses):

    aws     120 s  EC2 Spot: "a warning that is issued two minutes before Amazon EC2 stops or
                   terminates your Spot Instance" (best effort; none with hibernation)
    gcp      30 s  Compute Engine Spot and preemptible VMs: "30 seconds for Spot VMs" from the
                   soft off to the hard off
    azure    30 s  Azure Spot VMs: Scheduled Events' minimum notice, "Preempt | 30 seconds"
    gke      15 s  Pods on GKE Spot or preemptible nodes: non-system Pods get 15 s of the node's
                   graceful shutdown; a terminationGracePeriodSeconds above 15 s "has no effect"
    slurm          the partition's GraceTime (``scontrol show partition``): set by the site, so
                   give it in seconds; Slurm does not export it to the job

The model (:func:`final_save_fit`). Every rank of a node saves at the same signal, so the
node's bytes (ranks per node × bytes per rank) go through the node's storage together. A
calibration's time to durable, ``a + b · bytes``, was measured with one writer; it is applied
to the node's bytes: the fixed cost ``a`` once (the ranks pay it side by side) and the
bandwidth ``1 / b`` shared by the ranks, i.e. one writer is taken to reach what the storage
gives a node. The notice must hold the step in flight (the guard saves at the next step
boundary) and this save. Without a calibration the bandwidth is ``DEFAULT_NODE_GBPS``, a stated
guess. When it does not fit, the advice says what would, with the numbers each needs.

Example:
    >>> notice_seconds("gke"), notice_seconds("45")
    (15.0, 45.0)
    >>> fit = final_save_fit(rank_bytes=2 * 10**9, ranks_per_node=8, notice_s=15)
    >>> fit.fits, fit.final_save_s, fit.node_bytes
    (False, 16.0, 16000000000)
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from gpumem.calibrate.calibration import Calibration, as_calibration
from gpumem.calibrate.fit import LinearFit

NOTICE_S: dict[str, float] = {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "gke": 15.0}
NOTICE_SOURCES: dict[str, str] = {
    "aws": "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html",
    "gcp": "https://docs.cloud.google.com/compute/docs/instances/create-use-spot",
    "azure": "https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events",
    "gke": "https://cloud.google.com/kubernetes-engine/docs/how-to/preemptible-vms",
    "slurm": "https://slurm.schedmd.com/preempt.html",
}
# a node's write bandwidth to its checkpoint storage where nothing was measured: a guess of what
# a network file system gives one node (node-local NVMe gives several times more)
DEFAULT_NODE_GBPS = 1.0


def notice_seconds(spec: str | float) -> float:
    """Seconds of notice from a provider's name (``aws``, ``gcp``, ``azure``, ``gke``) or a
    number of seconds (``45``, ``"45"``, ``"45s"``).

    Raises:
        ValueError: anything else, 0, negative or not finite (one line, naming what is valid).
    """
    names = "|".join(NOTICE_S)
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in NOTICE_S:
            return NOTICE_S[text]
        if text == "slurm":
            raise ValueError(
                "notice 'slurm': Slurm's notice is the partition's GraceTime, set by the site: "
                "give it in seconds (scontrol show partition PARTITION shows GraceTime)"
            )
        try:
            seconds = float(text.removesuffix("s"))
        except ValueError:
            raise ValueError(f"notice {spec!r}: use {names} or a number of seconds > 0") from None
    elif isinstance(spec, int | float) and not isinstance(spec, bool):
        seconds = float(spec)
    else:
        raise ValueError(f"notice {spec!r}: use {names} or a number of seconds > 0")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"notice {spec!r}: must be a number of seconds > 0 (or {names})")
    return seconds


@dataclass(frozen=True)
class NoticeFit:
    """Whether one node's final save is durable inside a notice, and what would make it so.

    Attributes:
        fits: the step in flight plus the final save end within the notice.
        final_save_s: the node's final save, from its start to durable.
        notice_s: the notice, seconds from the signal to the kill.
        margin_s: notice − step − save; negative: the save is that much late.
        node_bytes: what the node's ranks save together (``ranks_per_node × rank_bytes``).
        node_gbps: the node's write bandwidth used (GB/s; None: the calibration measured no
            growth with size).
        fixed_s: the storage's fixed cost per save (``a`` of the calibration, 0 for the guess).
        source: where the bandwidth came from (the calibration file, or the default guess).
        assumptions: the model's assumptions and notes, as sentences.
        advice: when it does not fit, what would, with the numbers each needs.
    """

    fits: bool
    final_save_s: float
    notice_s: float
    margin_s: float
    node_bytes: int
    rank_bytes: int
    ranks_per_node: int
    step_s: float
    node_gbps: float | None
    fixed_s: float
    source: str
    assumptions: tuple[str, ...]
    advice: tuple[str, ...] = ()

    def line(self) -> str:
        """One line: the node's save, its time, and whether it fits the notice."""
        step = f" after a {self.step_s:.3g} s step in flight" if self.step_s else ""
        verdict = (
            f"fits the {self.notice_s:g} s notice ({self.margin_s:.1f} s to spare)"
            if self.fits
            else f"does NOT fit the {self.notice_s:g} s notice ({-self.margin_s:.1f} s late)"
        )
        return (
            f"final save on notice: {_gb(self.node_bytes)} per node ({self.ranks_per_node} "
            f"ranks x {_gb(self.rank_bytes)}) durable in {self.final_save_s:.1f} s{step} "
            f"({self.source}): {verdict}"
        )

    def lines(self) -> list[str]:
        """:meth:`line`, then the advice when it does not fit."""
        return [self.line(), *(f"  - {a}" for a in self.advice)]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["assumptions"], out["advice"] = list(self.assumptions), list(self.advice)
        return out


def final_save_fit(
    *,
    rank_bytes: int,
    ranks_per_node: int,
    notice_s: float,
    calibration: Calibration | str | os.PathLike | None = None,
    step_s: float = 0.0,
) -> NoticeFit:
    """Whether the final save of a node is durable inside ``notice_s`` (module doc: the model).

    Args:
        rank_bytes: what one rank saves (its weights and optimizer state).
        ranks_per_node: ranks of the job on one node, all saving at once.
        notice_s: seconds from the signal to the kill (:func:`notice_seconds`).
        calibration: a calibration (or its path) with a checkpoint measurement of the job's
            storage; without one, ``DEFAULT_NODE_GBPS`` is used and said to be a guess.
        step_s: the step in flight at the signal, which finishes before the save starts.

    Raises:
        ValueError: ``notice_s`` not > 0, negative ``rank_bytes`` or ``step_s``, or
            ``ranks_per_node`` < 1 (one line each).
    """
    if not (isinstance(notice_s, int | float) and notice_s > 0 and math.isfinite(notice_s)):
        raise ValueError(f"notice_s must be a number of seconds > 0, got {notice_s!r}")
    if not isinstance(rank_bytes, int) or rank_bytes < 0:
        raise ValueError(f"rank_bytes must be a whole number of bytes >= 0, got {rank_bytes!r}")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a whole number >= 1, got {ranks_per_node!r}")
    if not (isinstance(step_s, int | float) and step_s >= 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a number of seconds >= 0, got {step_s!r}")
    node_bytes = rank_bytes * ranks_per_node
    save_s, fixed, per_byte, source, notes = _node_save(as_calibration(calibration), node_bytes)
    margin = notice_s - step_s - save_s
    assumptions = (
        f"all {ranks_per_node} ranks of a node save at once: the node's storage takes "
        f"{_gb(node_bytes)} in one go, the fixed cost paid once and the bandwidth shared (one "
        "writer is taken to reach what the storage gives a node; where one process was CPU-bound "
        "in the calibration, the ranks together may write faster)",
        "a shared file system also divides its total bandwidth among the nodes: not modelled",
        f"a periodic save still persisting at the signal is waited for first: at worst the "
        f"notice must hold two saves ({2 * save_s:.1f} s)",
        *notes,
    )
    advice = (
        () if margin >= 0 else _advice(node_bytes, rank_bytes, notice_s - step_s, fixed, per_byte)
    )
    return NoticeFit(
        fits=margin >= 0,
        final_save_s=save_s,
        notice_s=float(notice_s),
        margin_s=margin,
        node_bytes=node_bytes,
        rank_bytes=rank_bytes,
        ranks_per_node=ranks_per_node,
        step_s=float(step_s),
        node_gbps=1e-9 / per_byte if per_byte > 0 else None,
        fixed_s=fixed,
        source=source,
        assumptions=assumptions,
        advice=advice,
    )


def final_save_seconds(
    *,
    rank_bytes: int,
    ranks_per_node: int,
    calibration: Calibration | str | os.PathLike | None = None,
) -> float:
    """Seconds from the start of a node's final save (every rank at once) to durable: the time
    :func:`final_save_fit` compares with a notice, for callers that hold no notice yet."""
    return _node_save(as_calibration(calibration), rank_bytes * ranks_per_node)[0]


def _node_save(
    cal: Calibration | None, node_bytes: int
) -> tuple[float, float, float, str, tuple[str, ...]]:
    """(save seconds, fixed seconds, seconds per byte, source, notes) for a node's bytes."""
    fit, source, notes = _durable_line(cal, node_bytes)
    if fit is None:
        per_byte = 1 / (DEFAULT_NODE_GBPS * 1e9)
        return node_bytes * per_byte, 0.0, per_byte, source, notes
    fixed, per_byte = _fixed_and_per_byte(fit)
    return fit.predict(node_bytes), fixed, per_byte, source, notes


def _durable_line(
    cal: Calibration | None, node_bytes: int
) -> tuple[LinearFit | None, str, tuple[str, ...]]:
    """(the calibration's time-to-durable line or None, its source, notes on it)."""
    guess = (
        f"default guess {DEFAULT_NODE_GBPS:g} GB/s per node",
        (
            f"the node's bandwidth is a guess ({DEFAULT_NODE_GBPS:g} GB/s): measure the job's "
            "storage with `gpumem calibrate --dir CKPT_DIR` and pass the calibration",
        ),
    )
    if cal is None:
        return None, *guess
    if cal.checkpoint is None:
        return None, guess[0], (f"{cal.origin()} holds no checkpoint measurement", *guess[1])
    fit = cal.checkpoint.fits["durable_s"]
    notes = []
    if fit.extrapolates(node_bytes):
        notes.append(
            f"extrapolated: the calibration measured {_gb(fit.min_bytes)} to "
            f"{_gb(fit.max_bytes)}, the node saves {_gb(node_bytes)}"
        )
    if fit.bounded_above(node_bytes):
        notes.append(
            "the calibration measured no growth with size: the largest size's time is scaled "
            "in proportion (an upper bound)"
        )
    return fit, f"calibrated: {cal.checkpoint.directory}", tuple(notes)


def _fixed_and_per_byte(fit: LinearFit) -> tuple[float, float]:
    """The line as (fixed seconds, seconds per byte), the bounded form where b = 0."""
    if fit.seconds_per_byte > 0 or fit.intercept_s == 0:
        return fit.intercept_s, fit.seconds_per_byte
    return 0.0, fit.intercept_s / fit.max_bytes


def _advice(
    node_bytes: int, rank_bytes: int, avail_s: float, fixed_s: float, per_byte: float
) -> tuple[str, ...]:
    """What makes a node's save fit ``avail_s`` seconds (the notice less the step in flight)."""
    if avail_s <= 0:
        return (
            "the step in flight alone outlasts the notice: shorten the step (fewer micro-batches "
            "per optimizer step) so that the guard reaches a step boundary in time",
        )
    need = node_bytes / avail_s / 1e9
    here = f"{1e-9 / per_byte:.2f} GB/s" if per_byte > 0 else "no bandwidth measured"
    out = [
        f"a node-local tier (Checkpointer(local=NVMe, remote=...)): the save is durable on the "
        f"node's disk, which must write {_gb(node_bytes)} in {avail_s:.3g} s: "
        f">= {need:.2f} GB/s per node, its fixed costs aside (here: {here})",
        f"replicas=2 on node-local disks, so that the step outlives a node whose disk goes with "
        f"it: each node writes its {_gb(node_bytes)}, then sends it to a peer while writing the "
        f"peer's copy: >= {2 * need:.2f} GB/s per node, of disk and of network",
    ]
    if fixed_s >= avail_s:
        out.append(
            f"more nodes do not help: this storage's fixed cost of {fixed_s:.3g} s per save "
            "alone outlasts the notice"
        )
    else:
        room = (avail_s - fixed_s) / per_byte if per_byte > 0 else math.inf
        per_node = int(room // rank_bytes) if rank_bytes else 0
        spread = f", or the same ranks at most {per_node} per node" if per_node >= 1 else ""
        out.append(
            f"more ranks with the state sharded over all of them (ZeRO-3/FSDP; replicated state "
            f"does not shrink): a node saves at most {_gb(room)} in the notice here, so "
            f">= {node_bytes / room:.2f}x the nodes{spread}"
        )
    return tuple(out)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


__all__ = [
    "DEFAULT_NODE_GBPS",
    "NOTICE_S",
    "NOTICE_SOURCES",
    "NoticeFit",
    "final_save_fit",
    "notice_seconds",
]
