"""Capacities written on one line, as ``gpumem plan --capacity`` takes them.

``KIND[,key=value...]`` with KIND one of ``spot``, ``on-demand``, ``reserved`` or ``tier``, and
keys:

=====================  =========================================================================
``name=``              what the tables call it (default: the kind, or the trace's file name)
``price=``             dollars per GPU-hour (required, unless a priced trace gives it)
``trace=``             a trace file (:mod:`gpumem.planner.traces`); ``nodes=``, ``gap=`` (s)
``availability=``      rates where no trace exists: any two of availability (0-1],
``preemptions-per-day=``  preemptions per day of running and the mean outage in hours
``outage-h=``
``notice=``            ``aws`` (120 s), ``gcp``/``azure`` (30 s), ``gke`` (15 s) or seconds
                       (a Slurm partition's GraceTime)
``queue-wait-h=``      hours before each start on a reliable source (a high tier's queue)
=====================  =========================================================================

A ``spot`` or ``tier`` with a trace or rates is preemptible; ``on-demand``, ``reserved`` and a
``tier`` without them are reliable. Every mistake is a ``ValueError`` naming the key.

Example:
    >>> parse_capacity("on-demand,price=3.06").price_per_gpu_hour
    3.06
    >>> low = parse_capacity("tier,name=low,price=1,preemptions-per-day=4,outage-h=0.5,notice=30")
    >>> low.notice_s, low.preemptible
    (30.0, True)
"""

from __future__ import annotations

import math

from gpumem.planner.capacity import Capacity
from gpumem.planner.notice import notice_seconds
from gpumem.planner.traces import load_trace

KINDS = ("spot", "on-demand", "reserved", "tier")
KEYS = (
    "name",
    "price",
    "trace",
    "nodes",
    "gap",
    "availability",
    "preemptions-per-day",
    "outage-h",
    "notice",
    "queue-wait-h",
)


def parse_capacity(spec: str) -> Capacity:
    """One capacity from ``KIND[,key=value...]`` (module doc)."""
    head, *rest = [p.strip() for p in spec.split(",")]
    kind = head.lower()
    if kind not in KINDS:
        raise ValueError(
            f"capacity {spec!r}: unknown kind {head!r}; start with one of {', '.join(KINDS)}"
        )
    kv: dict[str, str] = {}
    for part in rest:
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in KEYS:
            raise ValueError(
                f"capacity {spec!r}: {part!r} is not key=value with a key of {', '.join(KEYS)}"
            )
        if key in kv:
            raise ValueError(f"capacity {spec!r}: {key} is given twice")
        kv[key] = value.strip()
    price = _price(kv, spec)
    notice = notice_seconds(kv["notice"]) if "notice" in kv else None
    wait_h = _float(kv.get("queue-wait-h", "0"), "queue-wait-h", "hours >= 0")
    if wait_h < 0:
        raise ValueError(f"capacity {spec!r}: queue-wait-h must be >= 0 hours, got {wait_h:g}")
    rates = {k: kv[k] for k in ("availability", "preemptions-per-day", "outage-h") if k in kv}
    if "trace" in kv:
        if rates:
            raise ValueError(f"capacity {spec!r}: give a trace or rates, not both")
        nodes_f = _float(kv.get("nodes", "1"), "nodes", "a whole number >= 1")
        if nodes_f != int(nodes_f) or nodes_f < 1:
            raise ValueError(f"capacity {spec!r}: nodes must be a whole number >= 1")
        nodes = int(nodes_f)
        gap = _float(kv["gap"], "gap", "seconds > 0") if "gap" in kv else None
        tr = load_trace(kv["trace"], nodes=nodes, gap_s=gap)
        stem = tr.source.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        name = kv.get("name") or f"{kind} {stem}"
        return Capacity.from_trace(tr, price, name=name, notice_s=notice, kind=kind)
    name = kv.get("name", kind)
    if price is None:
        raise ValueError(f"capacity {spec!r}: price= is required (dollars per GPU-hour)")
    if rates:
        return Capacity.from_rates(
            name,
            price,
            availability=_opt(rates, "availability"),
            preemptions_per_day=_opt(rates, "preemptions-per-day"),
            mean_outage_h=_opt(rates, "outage-h"),
            notice_s=notice,
            kind=kind,
        )
    if kind == "spot":
        raise ValueError(
            f"capacity {spec!r}: a spot capacity needs trace= or rates (availability=, "
            "preemptions-per-day=, outage-h=)"
        )
    return Capacity.on_demand(price, name=name, queue_wait_s=wait_h * 3600.0, kind=kind)


def _price(kv: dict[str, str], spec: str) -> float | None:
    if "price" not in kv:
        return None
    v = _float(kv["price"], "price", "dollars per GPU-hour >= 0")
    if v < 0:
        raise ValueError(f"capacity {spec!r}: price must be >= 0 dollars per GPU-hour, got {v:g}")
    return v


def _opt(kv: dict[str, str], key: str) -> float | None:
    return _float(kv[key], key, "a number") if key in kv else None


def _float(text: str, key: str, want: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a number ({want})") from None
    if not math.isfinite(v):
        raise ValueError(f"{key}={text!r} must be finite ({want})")
    return v


__all__ = ["KINDS", "parse_capacity"]
