"""The decision: which layout on which capacity under which policy, by expected cost, subject to
meeting the deadline with a stated probability.

For the fastest layouts that fit (their work scaled by the planner's throughput proxy, their
checkpoint times C, P, R from the calibration or the stated guesses), and for every pairing of
the capacities given (each preemptible source alone, with each reliable one as the fallback, and
each reliable one alone), :func:`decide` predicts (``predict.predict_options``) the expected wall
time, cost, probability of missing the deadline and the checkpoint interval of each policy
(on-demand only, spot only, Uniform Progress, gpumem's), ranks the options that meet the deadline
with probability >= ``confidence`` by expected cost, and says why in one paragraph.

Example:
    >>> from gpumem.planner.capacity import Capacity
    >>> from gpumem.planner.capacity_replay import CapacityJob
    >>> spot = Capacity.from_rates("spot", 1.0, preemptions_per_day=2, mean_outage_h=1,
    ...                            notice_s=120)
    >>> d = decide([("one layout", CapacityJob(24, deadline_h=30, final_save_s=60))],
    ...            [spot, Capacity.on_demand(3.0)])
    >>> d.best.policy in ("gpumem", "uniform-progress", "on-demand", "spot")
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpumem.planner.capacity import Capacity
from gpumem.planner.capacity_replay import CapacityJob
from gpumem.planner.predict import Prediction, predict_options

DEFAULT_CONFIDENCE = 0.95
HORIZON_PAST_DEADLINE = 1.5  # paths stop at 1.5x the deadline: later is a miss either way


@dataclass(frozen=True)
class Option:
    """One (layout, capacities, policy) with its prediction."""

    layout: str
    prediction: Prediction
    work_h: float
    stall_s: float
    persist_s: float
    restart_s: float
    notice_fits: bool | None  # None: no notice on that spot source (or no spot at all)

    @property
    def policy(self) -> str:
        return self.prediction.policy

    @property
    def capacity(self) -> str:
        p = self.prediction
        if p.policy == "on-demand":
            return str(p.reliable)
        if p.policy == "spot":
            return str(p.spot)
        return f"{p.spot} -> {p.reliable}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "capacity": self.capacity,
            "work_h": self.work_h,
            "stall_s": self.stall_s,
            "persist_s": self.persist_s,
            "restart_s": self.restart_s,
            "notice_fits": self.notice_fits,
            **self.prediction.to_dict(),
        }


@dataclass(frozen=True)
class Decision:
    """Every option, ranked: those that meet the deadline with ``confidence`` first, by
    expected cost; then the rest by their chance of missing it."""

    options: list[Option]
    deadline_h: float | None
    confidence: float
    capacities: list[Capacity] = field(repr=False)
    warnings: tuple[str, ...] = ()
    """What the reader must know before the numbers (checkpoint times extrapolated past what a
    calibration checked): the paragraph opens with them."""

    @property
    def feasible(self) -> list[Option]:
        return [o for o in self.options if self._meets(o)]

    @property
    def best(self) -> Option:
        return self.options[0]

    def _meets(self, o: Option) -> bool:
        return _meets(o, self.confidence)

    def table(self, top: int = 12) -> str:
        dl = f"deadline {self.deadline_h:g} h" if self.deadline_h else "no deadline"
        lines = [
            f"capacity decision ({dl}, met with probability >= {self.confidence:.0%}; "
            f"expected values of each capacity's availability model, {self._lanes()} paths):",
            f"  {'layout':<28}{'capacity':<42}{'policy':<18}{'hours':>8}{'cost':>12}"
            f"{'miss':>7}{'interval spot/rel':>19}",
        ]
        for o in self.options[:top]:
            p = o.prediction
            hours = f"{p.expected_hours:,.1f}" if math.isfinite(p.expected_hours) else "never"
            ivl = "/".join(_interval(t) for t in p.interval_s)
            mark = "" if self._meets(o) else " x"
            cost = ("$" if math.isfinite(p.expected_hours) else ">$") + f"{p.expected_cost:,.0f}"
            lines.append(
                f"  {o.layout[:27]:<28}{o.capacity[:41]:<42}{o.policy:<18}{hours:>8}"
                f"{cost:>12}{p.miss_probability:>7.1%}"
                f"{ivl:>19}{mark}"
            )
        lines.append(
            "  x: misses the deadline more often than allowed; never: not finished by "
            f"{HORIZON_PAST_DEADLINE:g}x the deadline (its cost so far)"
        )
        return "\n".join([*lines, "", self.paragraph()])

    def _lanes(self) -> int:
        return max(o.prediction.lanes for o in self.options)

    def paragraph(self) -> str:
        """Why, in one paragraph a person reads."""
        warn = "".join(f"Warning: {w}. " for w in self.warnings)
        return warn + self._why()

    def _why(self) -> str:
        b = self.best
        p = b.prediction
        if not self._meets(b):
            return (
                f"No option meets the deadline with probability {self.confidence:.0%}: the "
                f"likeliest is {b.policy} on {b.capacity} with {b.layout}, missing it "
                f"{p.miss_probability:.0%} of the time (expected {_hours(p.expected_hours)}). "
                "Give a later deadline, more GPUs or a reliable capacity."
            )
        parts = [
            f"Cheapest that meets the {self.deadline_h:g} h deadline with probability "
            f">= {self.confidence:.0%}: {b.layout} on {b.capacity} under the {b.policy} policy, "
            f"expected {_hours(p.expected_hours)} and ${p.expected_cost:,.0f} "
            f"(misses {p.miss_probability:.1%})."
            if self.deadline_h
            else f"Cheapest: {b.layout} on {b.capacity} under the {b.policy} policy, expected "
            f"{_hours(p.expected_hours)} and ${p.expected_cost:,.0f}."
        ]
        parts += self._against(b)
        if p.spot is not None:
            cap = next((c for c in self.capacities if c.name == p.spot), None)
            if cap is not None:
                a = cap.availability
                parts.append(
                    f"{cap.name} can be had {a.fraction:.0%} of the time, with "
                    f"{a.preemptions_per_day:.2g} preemptions a day of running and outages of "
                    f"{_hours(a.mean_outage_s / 3600)} on average; the job spends "
                    f"{_hours(p.spot_hours)} on it and {_hours(p.reliable_hours)} on the "
                    f"fallback, and loses {_hours(p.expected_lost_hours)} of work to "
                    f"{p.expected_preemptions:.1f} preemptions."
                )
            parts.append(self._notice(b))
        parts.append(
            f"Checkpoint every {_interval(p.interval_s[0])} on spot and "
            f"{_interval(p.interval_s[1])} on the fallback (stall C {b.stall_s:.3g} s, durable "
            f"after P {b.persist_s:.3g} s, restart R {b.restart_s:.3g} s)."
        )
        return " ".join(x for x in parts if x)

    def _against(self, b: Option) -> list[str]:
        out = []
        for name in ("on-demand", "uniform-progress", "spot"):
            alt = next(
                (
                    o
                    for o in self.options
                    if o.policy == name and o.layout == b.layout and o is not b
                ),
                None,
            )
            if alt is None:
                continue
            q = alt.prediction
            verdict = "meets it" if self._meets(alt) else f"misses {q.miss_probability:.0%}"
            out.append(f"{name} on {alt.capacity}: ${q.expected_cost:,.0f} ({verdict})")
        return ["Against: " + "; ".join(out) + "."] if out else []

    @staticmethod
    def _notice(b: Option) -> str:
        if b.notice_fits is None:
            return (
                "The spot source gives no notice: each preemption rolls back to the last "
                "durable checkpoint."
            )
        if b.notice_fits:
            return "The final save fits the source's notice, so a preemption loses no work."
        return (
            "The final save does not fit the source's notice: a preemption rolls back to the "
            "last durable checkpoint (a node-local tier or more ranks would shorten the save)."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "deadline_h": self.deadline_h,
            "confidence": self.confidence,
            "best": self.best.to_dict(),
            "options": [o.to_dict() for o in self.options],
            "why": self.paragraph(),
        }


def _hours(h: float) -> str:
    if not math.isfinite(h):
        return "never"
    return f"{h * 60:.0f} min" if h < 1 else f"{h:,.1f} h"


def _interval(s: float) -> str:
    if s == 0:
        return "continuous"
    if not math.isfinite(s):
        return "never"
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def decide(
    layouts: list[tuple[str, CapacityJob]],
    capacities: list[Capacity],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    lanes: int = 256,
    seed: int = 0,
    warnings: tuple[str, ...] = (),
) -> Decision:
    """Rank every layout x capacity pairing x policy (module doc).

    Args:
        layouts: (name, :class:`~gpumem.planner.capacity_replay.CapacityJob`) per layout: its
            work, deadline and checkpoint times (every job the same deadline).
        capacities: at least one; the preemptible ones are tried alone and with each reliable
            one as the fallback.
        confidence: the probability with which the deadline must be met.
        warnings: sentences the paragraph opens with (e.g. extrapolated checkpoint times).

    Raises:
        ValueError: no capacity, a confidence outside (0, 1), jobs with different deadlines.
    """
    if not capacities:
        raise ValueError("give at least one capacity (a spot trace or rates, on-demand, a tier)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be a probability in (0, 1), got {confidence}")
    deadlines = {job.deadline_h for _, job in layouts}
    if len(deadlines) != 1:
        raise ValueError("every layout's job must have the same deadline")
    deadline_h = deadlines.pop()
    reliables = [c for c in capacities if not c.preemptible]
    # (spot, fallback, policies): every option of the same spot source runs over the same paths
    groups: list[tuple[Capacity | None, Capacity | None, tuple[str, ...]]] = [
        (None, rel, ("on-demand",)) for rel in reliables
    ]
    for spot in (c for c in capacities if c.preemptible):
        groups.append((spot, None, ("spot",)))
        groups += [(spot, rel, ("uniform-progress", "gpumem")) for rel in reliables]
    horizon = None if deadline_h is None else deadline_h * HORIZON_PAST_DEADLINE
    options: list[Option] = []
    for spot, rel, pols in groups:
        runs = [(name, job, pol) for name, job in layouts for pol in pols]
        preds = predict_options(
            [(job, pol) for _, job, pol in runs],
            spot,
            rel,
            lanes=lanes,
            seed=seed,
            horizon_h=None if spot is None else horizon,
        )
        options += [
            Option(
                name,
                p,
                job.work_h,
                job.stall_s,
                job.persist_s,
                job.restart_s,
                _notice_fits(spot, job),
            )
            for (name, job, _), p in zip(runs, preds, strict=True)
        ]
    options.sort(key=lambda o: _key(o, _meets(o, confidence)))
    return Decision(options, deadline_h, confidence, capacities, tuple(warnings))


def layout_jobs(
    result: Any,
    *,
    run_hours: float,
    deadline_h: float | None,
    top: int = 3,
    **times: float | None,
) -> list[tuple[str, CapacityJob]]:
    """The ``top`` fastest layouts of a :class:`~gpumem.planner.search.PlanResult` as jobs:
    the best layout's work is ``run_hours``, the others' is scaled by the planner's throughput
    proxy; C, P, R for each layout's own checkpoint (``times`` overrides them, as
    ``checkpoint_times`` takes them). The final save on notice lasts the step in flight plus
    every rank of a node saving at once (``notice.final_save_seconds``)."""
    from gpumem.planner.checkpoint_times import checkpoint_times
    from gpumem.planner.notice import final_save_seconds

    if not result.candidates:
        return []
    best = result.candidates[0]
    per_node = min(result.gpu.gpus_per_node, result.n_gpus)
    out: list[tuple[str, CapacityJob]] = []
    for c in result.candidates:
        if len(out) == top:
            break
        ckpt = int(c.weight_bytes + c.optimizer_bytes)
        t = checkpoint_times(result.calibration, checkpoint_bytes=ckpt, **times)
        scale = c.step_seconds / best.step_seconds if best.step_seconds > 0 else 1.0
        job = CapacityJob(
            run_hours * scale,
            gpus=result.n_gpus,
            deadline_h=deadline_h,
            stall_s=t.stall_s,
            persist_s=t.persist_s,
            restart_s=t.restart_s,
            final_save_s=c.step_seconds
            + final_save_seconds(
                rank_bytes=ckpt, ranks_per_node=per_node, calibration=result.calibration
            ),
        )
        if all(job != j for _, j in out):  # layouts with the same job price the same
            out.append((c.describe(), job))
    return out


def _meets(o: Option, confidence: float) -> bool:
    """Meets the deadline with at least ``confidence`` (and finishes at all)."""
    p = o.prediction
    return p.miss_probability <= 1 - confidence + 1e-12 and math.isfinite(p.expected_hours)


def _key(o: Option, meets: bool) -> tuple[float, ...]:
    """Options that meet the deadline first, by cost; then the rest by their risk."""
    p = o.prediction
    if meets:
        return (0.0, p.expected_cost, p.expected_hours)
    return (1.0, p.miss_probability, p.expected_hours, p.expected_cost)


def _notice_fits(spot: Capacity | None, job: CapacityJob) -> bool | None:
    """Whether the job's final save fits the spot source's notice (None: no notice, no guard)."""
    if spot is None or spot.notice_s is None or job.final_save_s is None:
        return None
    return bool(job.final_save_s <= spot.notice_s)


__all__ = ["DEFAULT_CONFIDENCE", "Decision", "Option", "decide", "layout_jobs"]
