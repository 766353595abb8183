"""Capacity, replay and prediction, against hand computations and a published result.

The replay's tick semantics are ``sky_spot``'s (Can't Be Late, NSDI 2024): the published
Uniform Progress cost on its window pins them to the cent. The checkpoint mechanics on top are
checked on small traces worked by hand in each test's docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpumem.planner.capacity import Availability, Capacity
from gpumem.planner.capacity_replay import NONE, RELIABLE, SPOT, CapacityJob, Run, Sources, replay
from gpumem.planner.policies import POLICIES
from gpumem.planner.predict import predict, predict_options, replay_windows, sources_for
from gpumem.planner.traces import TraceError, load_trace

DATA = Path(__file__).parent / "data"
PUBLISHED = DATA / "can-t-be-late-us-west-2a_k80_1-window.json"


def _one_lane(ticks: list[int]):
    u = np.asarray(ticks, dtype=bool)
    return lambda k: np.array([u[k] if k < len(u) else False])


@dataclass(frozen=True)
class Fixed:
    """A test policy: spot when it can be had, a fixed interval, optional switch at tick k."""

    tau: float = 500.0
    to_reliable_at: int | None = None
    name: str = "fixed"
    switch_at_checkpoint: bool = False

    def intervals(self, job, sources):
        return self.tau, self.tau

    def decide(self, s):
        if self.to_reliable_at is not None and s.t >= self.to_reliable_at * s.gap_s:
            return np.full_like(s.cluster, RELIABLE)
        return np.where(s.has_spot, SPOT, NONE)


def _sources(fits: bool = False, restart_s: float = 0.0) -> Sources:
    return Sources(1.0, 3.0, restart_s, restart_s, fits, math.inf)


def test_uniform_progress_reproduces_the_published_cost_to_the_cent():
    """Can't Be Late's README: 48 h of work, 52 h deadline, 0.2 h restart, $3.06 / $0.9731 per
    hour, one tick 600 s, on this window: $47.6819 (49 spot hours x $0.9731)."""
    spot = Capacity.from_trace(load_trace(PUBLISHED), 0.9731)
    job = CapacityJob(48, deadline_h=52, restart_s=0.2 * 3600)
    (up,) = replay_windows([(job, "uniform-progress")], spot, Capacity.on_demand(3.06), [0])
    assert round(up.expected_cost, 4) == 47.6819
    assert up.miss_probability == 0.0


def test_on_demand_pays_the_restart_then_whole_ticks():
    """48 h of work + a 0.2 h restart = 48.2 h = 289.2 ticks of 600 s, billed as 290 ticks:
    48.333 h x $3.06 = $147.90."""
    job, od = CapacityJob(48, restart_s=720), Capacity.on_demand(3.06)
    run = Run(job, sources_for(job, None, od), POLICIES["on-demand"])
    (o,) = replay([run], _one_lane([1]), 1, 600.0)
    assert o.wall_h[0] == pytest.approx(290 / 6)
    assert o.cost[0] == pytest.approx(290 / 6 * 3.06)


def test_sky_spot_model_spot_only_by_hand():
    """Trace 0,0,1,0,0 (1 = gone), 1800 s of work, no checkpoint cost (every second kept):
    ticks 0-1 run 1200 s, preempted at tick 2 (kept), waits, runs ticks 3-4: done at tick 5?
    No: 1200 + 600 = 1800 at tick 4. Wall 2400 s; 3 ticks billed at $1/h: $0.50."""
    job = CapacityJob(0.5)
    (o,) = replay([Run(job, _sources(), Fixed(tau=0.0))], _one_lane([0, 0, 1, 0, 0]), 1, 600.0)
    assert o.wall_h[0] == pytest.approx(2400 / 3600)
    assert o.cost[0] == pytest.approx(0.5)
    assert o.preemptions[0] == 1 and o.lost_h[0] == 0


def test_a_preemption_rolls_back_to_the_last_durable_checkpoint():
    """Interval 500 s of work, stall C 10 s, durable P 60 s after each stall starts; trace
    0,0,1,0,0,0; 1760 s of work.
    Ticks 0-1: 600 s run = one cycle (500 work + 10 stall) + 90 work = 590; checkpoint at y=500
    durable at 560. Ticks 1-2: y = 1200: 1000 + 180 = 1180 work; second checkpoint (y=1010)
    durable at 1070: 1000 durable. Tick 2: preempted, 180 s lost, progress 1000.
    Ticks 3-4: +590 = 1590; ticks 4-5: +590 = 2180 >= 1760: done at tick 5 (3000 s).
    With a final save that fits the notice nothing is lost: 1180 + 590 = 1770 >= 1760 at tick 4."""
    job = CapacityJob(1760 / 3600, stall_s=10, persist_s=60)
    trace = _one_lane([0, 0, 1, 0, 0, 0])
    (hard,) = replay([Run(job, _sources(fits=False), Fixed())], trace, 1, 600.0)
    assert hard.lost_h[0] * 3600 == pytest.approx(180)
    assert hard.wall_h[0] * 3600 == pytest.approx(3000)
    assert hard.checkpoints[0] == 4  # 2 before the preemption, 2 after
    (soft,) = replay([Run(job, _sources(fits=True), Fixed())], trace, 1, 600.0)
    assert soft.lost_h[0] == 0
    assert soft.wall_h[0] * 3600 == pytest.approx(2400)


def test_a_switch_at_a_checkpoint_keeps_the_work_and_pays_the_persist_time():
    """Spot for ticks 0-1, the reliable source from tick 2. The first start pays R = 100 s, so
    ticks 0-2 run 1100 s: 1000 + 80 s of work, both checkpoints durable (at y = 560 and 1070):
    1000 kept. Without a save first the switch loses 80 s; with one it loses nothing and pays
    R + P = 160 s before working again."""
    job = CapacityJob(2, stall_s=10, persist_s=60, restart_s=100)
    trace = _one_lane([0] * 40)
    plain = replay([Run(job, _sources(restart_s=100), Fixed(to_reliable_at=2))], trace, 1, 600.0)
    saved = replay(
        [Run(job, _sources(restart_s=100), Fixed(to_reliable_at=2, switch_at_checkpoint=True))],
        trace,
        1,
        600.0,
    )
    assert plain[0].lost_h[0] * 3600 == pytest.approx(80)
    assert saved[0].lost_h[0] == 0
    # first spot start pays R: 500 work + 10 + 0 ... both runs are the same until tick 2
    assert saved[0].wall_h[0] <= plain[0].wall_h[0]


def test_the_model_agrees_with_the_replay_on_a_real_trace():
    """The prediction sees only the trace's run lengths; over this window its expected hours
    and dollars stay within 5 % of the replay's mean over every start."""
    spot = Capacity.from_trace(load_trace(PUBLISHED), 0.9731, notice_s=120)
    od = Capacity.on_demand(3.06)
    job = CapacityJob(24, deadline_h=30, stall_s=10, persist_s=60, restart_s=600, final_save_s=60)
    opts = [(job, p) for p in ("uniform-progress", "gpumem")]
    for r, m in zip(replay_windows(opts, spot, od), predict_options(opts, spot, od), strict=True):
        assert m.expected_hours == pytest.approx(r.expected_hours, rel=0.05)
        assert m.expected_cost == pytest.approx(r.expected_cost, rel=0.05)


def test_gpumem_policy_never_loses_work_to_a_switch_or_a_noticed_preemption():
    spot = Capacity.from_trace(load_trace(PUBLISHED), 0.9731, notice_s=120)
    job = CapacityJob(24, deadline_h=30, stall_s=10, persist_s=60, restart_s=600, final_save_s=60)
    (g,) = replay_windows([(job, "gpumem")], spot, Capacity.on_demand(3.06))
    assert g.expected_lost_hours == 0 and g.miss_probability == 0


def test_a_trace_that_never_has_capacity_is_waited_out_or_fallen_back_from(tmp_path):
    """A real window can hold no spot at all: spot-only never finishes, the deadline policies
    run on the fallback from the start."""
    f = tmp_path / "gone.json"
    f.write_text('{"metadata": {"gap_seconds": 600}, "data": [1, 1, 1, 1]}')
    spot = Capacity.from_trace(load_trace(f), 1.0)
    assert spot.availability.fraction == 0 and spot.preemptible
    job = CapacityJob(2, deadline_h=3, restart_s=600)
    only, up = replay_windows(
        [(job, "spot"), (job, "uniform-progress")], spot, Capacity.on_demand(3.0)
    )
    assert math.isinf(only.expected_hours) and only.miss_probability == 1
    assert up.miss_probability == 0 and up.spot_hours == 0


def test_availability_runs_read_the_trace_as_a_cycle():
    a = Availability.from_ticks(np.array([0, 0, 1, 0, 1, 1], dtype=bool), 600.0)
    assert sorted(a.up.tolist()) == [1, 2] and sorted(a.down.tolist()) == [1, 2]
    assert a.fraction == pytest.approx(0.5)
    # a run across the end joins the one at the start: 1,0,0,1 is one outage of 2, one run of 2
    b = Availability.from_ticks(np.array([1, 0, 0, 1], dtype=bool), 600.0)
    assert b.up.tolist() == [2] and b.down.tolist() == [2]


def test_sampled_paths_spend_the_models_share_of_time_in_outages():
    """Started at random moments, the paths' outage share is the model's (1 - availability),
    which a start at the beginning of a cycle would bias."""
    a = Availability(60.0, mean_up=30.0, mean_down=10.0)
    paths = a.sample(2000, 50, np.random.default_rng(1))
    assert paths.mean() == pytest.approx(0.25, abs=0.02)
    assert paths[:, 0].mean() == pytest.approx(0.25, abs=0.03)


def test_rates_need_two_of_three_and_must_agree():
    c = Capacity.from_rates("s", 1.0, preemptions_per_day=2, mean_outage_h=1)
    assert c.availability.mtbf_s == pytest.approx(
        43200
    ) and c.availability.fraction == pytest.approx(12 / 13)
    assert Capacity.from_rates(
        "s", 1.0, availability=0.8, mean_outage_h=2
    ).availability.mtbf_s == pytest.approx(8 * 3600)
    with pytest.raises(ValueError, match="two of"):
        Capacity.from_rates("s", 1.0, availability=0.8)
    with pytest.raises(ValueError, match="disagrees"):
        Capacity.from_rates("s", 1.0, availability=0.5, preemptions_per_day=2, mean_outage_h=1)
    assert not Capacity.from_rates("s", 1.0, preemptions_per_day=0).preemptible


def test_csv_samples_events_and_counts(tmp_path):
    up = tmp_path / "up.csv"
    up.write_text("t_s,available\n0,1\n600,0\n1200,1\n1800,1\n")
    down = tmp_path / "down.csv"
    down.write_text("t_s,unavailable\n0,0\n600,1\n1200,0\n1800,0\n")
    a, b = load_trace(up), load_trace(down)
    assert a.gap_s == 600 and a.unavailable.tolist() == [False, True, False, False]
    assert b.unavailable.tolist() == a.unavailable.tolist()
    ev = tmp_path / "ev.csv"  # seconds header; node a held, its removal at 120 s preempts
    ev.write_text("t_s,event,node\n0,add,a\n0,add,b\n120,remove,a\n300,add,c\n")
    t = load_trace(ev, nodes=2, gap_s=60)
    assert t.unavailable.tolist() == [False, False, True, True, True, False]
    one = tmp_path / "one.csv"  # a removal of a node the job does not hold costs it nothing
    one.write_text("t_s,event,node\n0,add,a\n0,add,b\n120,remove,b\n300,add,c\n")
    assert not load_trace(one, nodes=1, gap_s=60).unavailable.any()
    counts = tmp_path / "n.csv"
    counts.write_text("t_s,nodes\n0,4\n600,3\n1200,1\n1800,4\n")
    assert load_trace(counts, nodes=2).unavailable.tolist() == [False, True, True, False]


def test_bamboo_events_a_bigger_job_is_preempted_more():
    small, big = (load_trace(DATA / "bamboo-p3-trace.csv", nodes=n) for n in (4, 32))
    assert small.gap_s == 60 and 10 < small.hours < 13
    assert small.unavailable.mean() < big.unavailable.mean()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"metadata": {"gap_seconds": 600}, "data": []}', "non-empty"),
        ('{"metadata": {"gap_seconds": 0}, "data": [0]}', "gap_seconds"),
        ('{"metadata": {}, "data": [0]}', "gap_seconds is missing"),
        ('{"metadata": {"gap_seconds": 600}, "data": [0, 2]}', "expected 0"),
        ('{"metadata": {"gap_seconds": 600}, "data": [0], "prices": [-1]}', "prices"),
        ("hello there\n", "unknown format"),
        ("0,1\n600,0\n", "header"),
        ("t_s,available\n", "no rows"),
        ("t_s,available\n5,1\n5,0\n", "gap of 0"),
        ("t_s,available\n600,1\n0,0\n", "backwards"),
        ("t_s,available,x,y\n0,1,2,3\n", "columns"),
    ],
)
def test_bad_traces_are_one_line_errors(tmp_path, text, match):
    f = tmp_path / ("t.json" if text.startswith("{") else "t.csv")
    f.write_text(text)
    with pytest.raises(TraceError, match=match) as e:
        Capacity.from_trace(load_trace(f), 1.0)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(str(f))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"work_h": 10, "deadline_h": 5}, "shorter than the work"),
        ({"work_h": 0}, "positive"),
        ({"work_h": 1, "stall_s": 5, "persist_s": 1}, "durable"),
    ],
)
def test_bad_jobs(kw, match):
    with pytest.raises(ValueError, match=match):
        CapacityJob(**kw)


def test_bad_capacities():
    with pytest.raises(ValueError, match="price"):
        Capacity.on_demand(-1.0)
    with pytest.raises(ValueError, match="notice"):
        Capacity.from_rates("s", 1.0, preemptions_per_day=1, mean_outage_h=1, notice_s=0)


def test_sources_know_whether_the_final_save_fits_the_notice():
    spot = Capacity.from_rates("s", 1.0, preemptions_per_day=1, mean_outage_h=1, notice_s=30)
    assert sources_for(CapacityJob(1, final_save_s=20), spot, None).notice_fits
    assert not sources_for(CapacityJob(1, final_save_s=40), spot, None).notice_fits
    assert not sources_for(
        CapacityJob(1), spot, None
    ).notice_fits  # no guard: nothing saved on notice


def test_predictions_are_deterministic_and_policies_share_their_paths():
    spot = Capacity.from_rates("s", 1.0, preemptions_per_day=3, mean_outage_h=2)
    od = Capacity.on_demand(3.0)
    job = CapacityJob(12, deadline_h=16, restart_s=300)
    a = predict(job, spot, od, "gpumem")
    b = predict(job, spot, od, "gpumem")
    assert a == b
    with pytest.raises(ValueError, match="unknown policy"):
        predict(job, spot, od, "cheapest")
    with pytest.raises(ValueError, match="needs a reliable"):
        predict(job, spot, None, "uniform-progress")


def test_a_priced_trace_bills_each_tick_at_its_own_price(tmp_path):
    """Prices 1, 3, 5 $/GPU-h per 600 s tick, 20 min of work on spot from tick 1: ticks 1 and 2
    at $3 and $5 = $8 x 600 / 3600 = $1.333; the capacity's price is the mean, $3."""
    f = tmp_path / "priced.json"
    f.write_text('{"metadata": {"gap_seconds": 600}, "data": [0, 0, 0], "prices": [1, 3, 5]}')
    spot = Capacity.from_trace(load_trace(f))
    assert spot.price_per_gpu_hour == 3.0
    (o,) = replay_windows([(CapacityJob(1 / 3), "spot")], spot, None, starts=np.array([1]))
    assert o.expected_cost == pytest.approx(8 * 600 / 3600)
