"""A source of GPUs: when it can be had, how it goes away, what it costs, how much notice it gives.

Spot capacity, on-demand, reserved instances and a cluster's priority tiers are one kind of
object, :class:`Capacity`:

* **availability**: a trace (:mod:`gpumem.planner.traces`) or, where none exists, summary rates;
  either way an :class:`Availability` model: alternating runs of "can run" and "cannot run"
  (outages), with the run lengths' distributions (the trace's own runs, or exponential with the
  given means). Preemptions are the ends of "can run" runs; a job then waits out the outage.
* **price**: dollars per GPU-hour, constant or per tick of the trace.
* **notice**: seconds between the provider's warning and the kill (AWS 120 s, GCP/Azure 30 s,
  GKE pods 15 s, Slurm the partition's GraceTime); None for no notice or a reliable source.
* **queue wait**: seconds before a reliable source starts the job (a cluster's high-priority
  tier behind its queue); paid at every start on it.

Example:
    >>> spot = Capacity.from_rates("spot", 1.0, preemptions_per_day=2, mean_outage_h=1)
    >>> round(spot.availability.fraction, 3), spot.preemptible
    (0.923, True)
    >>> Capacity.on_demand(3.0).preemptible
    False
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gpumem.planner.traces import CapacityTrace, TraceError

WARMUP_CYCLES = 32


@dataclass(frozen=True)
class Availability:
    """Alternating runs of available / unavailable ticks (``gap_s`` seconds each).

    ``up`` and ``down`` hold observed run lengths in ticks (a trace), or are empty with
    ``mean_up`` / ``mean_down`` set (rates: exponential run lengths). ``down`` empty and
    ``mean_down`` 0 is a source that never goes away.
    """

    gap_s: float
    up: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    down: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    mean_up: float = math.inf
    mean_down: float = 0.0

    @classmethod
    def from_ticks(cls, unavailable: np.ndarray, gap_s: float) -> Availability:
        """Runs of a tick series, read as a cycle (the last run joins the first)."""
        x = np.asarray(unavailable, dtype=bool)
        if x.all():  # never obtainable in this window: real traces have such stretches
            return cls(gap_s, np.zeros(0, dtype=np.int64), np.asarray([len(x)]), 0.0, len(x))
        if not x.any():
            return cls(gap_s, np.asarray([len(x)]), np.zeros(0, dtype=np.int64), math.inf, 0.0)
        # rotate so that the series starts at the beginning of an up run
        start = int(np.argmax(~x & np.roll(x, 1)))
        y = np.roll(x, -start)
        edges = np.flatnonzero(np.diff(y.astype(np.int8))) + 1
        lengths = np.diff(np.concatenate([[0], edges, [len(y)]]))
        up, down = lengths[0::2], lengths[1::2]
        return cls(gap_s, up, down, float(up.mean()), float(down.mean()))

    @property
    def reliable(self) -> bool:
        return self.mean_down == 0.0

    @property
    def fraction(self) -> float:
        """Share of time the source can run a job."""
        if self.reliable:
            return 1.0
        return self.mean_up / (self.mean_up + self.mean_down)

    @property
    def mtbf_s(self) -> float:
        """Mean time a job runs before a preemption (inf for a reliable source)."""
        return self.mean_up * self.gap_s

    @property
    def mean_outage_s(self) -> float:
        return self.mean_down * self.gap_s

    @property
    def never(self) -> bool:
        """The source is never there (a trace that never had capacity)."""
        return self.mean_up == 0.0

    @property
    def preemptions_per_day(self) -> float:
        """Per day of running."""
        return 0.0 if self.reliable or self.never else 86400.0 / self.mtbf_s

    def sample(self, lanes: int, ticks: int, rng: np.random.Generator) -> np.ndarray:
        """``lanes`` independent tick series (True = unavailable), each started at a random
        moment of the process (so a lane starts inside an outage with the outages' share of
        time, and inside a run with its length-biased remainder)."""
        if self.reliable or self.never:
            return np.full((lanes, ticks), self.never, dtype=bool)
        cycle = self.mean_up + self.mean_down
        # the start is a uniform moment over the first WARMUP_CYCLES cycles, so that it falls
        # in a cycle with probability in proportion to its length (a renewal process seen at a
        # random time); then enough cycles to cover the horizon
        n = WARMUP_CYCLES + math.ceil(ticks / cycle * 2) + 16
        while True:
            ups = self._draw(self.up, self.mean_up, (lanes, n), rng)
            downs = self._draw(self.down, self.mean_down, (lanes, n), rng)
            ends = np.cumsum(np.stack([ups, downs], axis=2).reshape(lanes, 2 * n), axis=1)
            offset = rng.integers(0, ends[:, 2 * WARMUP_CYCLES - 1])
            if np.all(ends[:, -1] > offset + ticks):
                break
            n *= 2
        pos = offset[:, None] + np.arange(ticks)[None, :]
        # run index of each tick, for all lanes in one search: each lane's run ends are sorted,
        # and shifting lane i by i * span keeps the flattened array sorted
        span = int(ends[:, -1].max()) + 1
        shift = (np.arange(lanes, dtype=np.int64) * span)[:, None]
        flat = np.searchsorted((ends + shift).ravel(), (pos + shift).ravel(), side="right")
        idx = flat.reshape(lanes, ticks) - np.arange(lanes)[:, None] * (2 * n)
        return (idx % 2) == 1

    @staticmethod
    def _draw(
        observed: np.ndarray, mean: float, shape: tuple[int, int], rng: np.random.Generator
    ) -> np.ndarray:
        if len(observed):
            return rng.choice(observed, size=shape)
        return rng.geometric(min(1.0, 1.0 / max(mean, 1.0)), size=shape)


@dataclass(frozen=True)
class Capacity:
    """A source of GPUs (module doc).

    Attributes:
        name: what the reader calls it ("spot us-west-2a", "on-demand", "prio tier").
        price_per_gpu_hour: dollars; with a priced trace, the mean of its prices.
        availability: when it can be had.
        notice_s: warning before a preemption (None: none, or never preempted).
        queue_wait_s: wait before each start (a high-priority tier's queue).
        trace: the trace it was built from, if any (the replay runs on it).
        kind: "spot", "on-demand", "reserved" or "tier".
    """

    name: str
    price_per_gpu_hour: float
    availability: Availability
    notice_s: float | None = None
    queue_wait_s: float = 0.0
    trace: CapacityTrace | None = None
    kind: str = "spot"

    def __post_init__(self) -> None:
        p = self.price_per_gpu_hour
        if isinstance(p, bool) or not (p >= 0 and math.isfinite(p)):
            raise ValueError(f"{self.name}: price must be dollars per GPU-hour >= 0, got {p}")
        if self.notice_s is not None and not (self.notice_s > 0 and math.isfinite(self.notice_s)):
            raise ValueError(
                f"{self.name}: a notice must be a positive number of seconds (AWS 120, GCP and "
                f"Azure 30, GKE 15), got {self.notice_s}; leave it out for no notice"
            )
        if not (self.queue_wait_s >= 0 and math.isfinite(self.queue_wait_s)):
            raise ValueError(f"{self.name}: queue wait must be >= 0 s, got {self.queue_wait_s}")

    @property
    def preemptible(self) -> bool:
        return not self.availability.reliable

    @classmethod
    def on_demand(
        cls,
        price_per_gpu_hour: float,
        *,
        name: str = "on-demand",
        queue_wait_s: float = 0.0,
        kind: str = "on-demand",
    ) -> Capacity:
        """A source that is always there (on-demand, reserved, a high tier with a queue)."""
        return cls(name, price_per_gpu_hour, Availability(60.0), None, queue_wait_s, None, kind)

    @classmethod
    def from_trace(
        cls,
        trace: CapacityTrace,
        price_per_gpu_hour: float | None = None,
        *,
        name: str | None = None,
        notice_s: float | None = None,
        kind: str = "spot",
    ) -> Capacity:
        """Capacity as a trace saw it; the price is given, or the mean of the trace's prices."""
        if price_per_gpu_hour is None:
            if trace.prices is None:
                raise ValueError(f"{trace.source}: the trace has no prices: give a price")
            price_per_gpu_hour = float(trace.prices.mean())
        try:
            avail = Availability.from_ticks(trace.unavailable, trace.gap_s)
        except TraceError as e:
            raise TraceError(f"{trace.source}: {e}") from None
        return cls(name or trace.source, price_per_gpu_hour, avail, notice_s, 0.0, trace, kind)

    @classmethod
    def from_rates(
        cls,
        name: str,
        price_per_gpu_hour: float,
        *,
        availability: float | None = None,
        preemptions_per_day: float | None = None,
        mean_outage_h: float | None = None,
        notice_s: float | None = None,
        gap_s: float = 60.0,
        kind: str = "spot",
    ) -> Capacity:
        """Capacity from summary rates where no trace exists: any two of availability (share
        of time it can be had), preemptions per day of running and mean outage (hours); all
        three must agree. Run lengths are taken as exponential."""
        up_s, down_s = _rates(name, availability, preemptions_per_day, mean_outage_h)
        avail = Availability(gap_s, mean_up=up_s / gap_s, mean_down=down_s / gap_s)
        return cls(name, price_per_gpu_hour, avail, notice_s, 0.0, None, kind)


def _rates(
    name: str, a: float | None, per_day: float | None, outage_h: float | None
) -> tuple[float, float]:
    """(mean up seconds, mean outage seconds) from any two of the three rates."""
    if a is not None and not 0 < a <= 1:
        raise ValueError(f"{name}: availability is a share of time in (0, 1], got {a}")
    if per_day is not None and not (per_day >= 0 and math.isfinite(per_day)):
        raise ValueError(f"{name}: preemptions per day must be >= 0, got {per_day}")
    if outage_h is not None and not (outage_h >= 0 and math.isfinite(outage_h)):
        raise ValueError(f"{name}: mean outage must be >= 0 hours, got {outage_h}")
    if per_day == 0 or a == 1:
        return math.inf, 0.0
    given = sum(v is not None for v in (a, per_day, outage_h))
    if given < 2:
        raise ValueError(
            f"{name}: give two of availability, preemptions per day and mean outage hours "
            "(one alone does not say how long the capacity stays away)"
        )
    if per_day is not None and outage_h is not None:
        up, down = 86400.0 / per_day, outage_h * 3600.0
        if a is not None and abs(up / (up + down) - a) > 0.01:
            raise ValueError(
                f"{name}: availability {a:g} disagrees with {per_day:g} preemptions a day and "
                f"{outage_h:g} h outages (they give {up / (up + down):.3f}): give two of them"
            )
        return up, down
    assert a is not None
    if per_day is not None:
        up = 86400.0 / per_day
        return up, up * (1 - a) / a
    assert outage_h is not None
    down = outage_h * 3600.0
    if down == 0:
        raise ValueError(f"{name}: a mean outage of 0 h with availability {a:g} < 1 is no rate")
    return down * a / (1 - a), down


__all__ = ["Availability", "Capacity"]
