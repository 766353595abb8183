"""The capacity decision: layouts x capacities x policies ranked by expected cost subject to the
deadline, the paragraph that says why, and the CLI that prints both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumem.cli import main
from gpumem.planner.capacity import Capacity
from gpumem.planner.capacity_replay import CapacityJob
from gpumem.planner.capacity_spec import parse_capacity
from gpumem.planner.decision import decide, layout_jobs
from gpumem.planner.traces import load_trace

TRACE = Path(__file__).parent / "data" / "can-t-be-late-us-west-2a_k80_1-window.json"
OD = Capacity.on_demand(3.0)


def _job(**kw) -> CapacityJob:
    return CapacityJob(
        **{
            "work_h": 24,
            "deadline_h": 36,
            "stall_s": 10,
            "persist_s": 60,
            "restart_s": 600,
            "final_save_s": 60,
            **kw,
        }
    )


def test_cheap_plentiful_spot_wins_and_the_paragraph_says_against_what():
    spot = Capacity.from_rates("spot", 1.0, preemptions_per_day=1, mean_outage_h=0.2, notice_s=120)
    d = decide([("layout A", _job())], [spot, OD])
    assert d.best.policy in ("gpumem", "uniform-progress", "spot")
    assert d.best.prediction.expected_cost < 0.5 * 24 * 3.0
    od = next(o for o in d.options if o.policy == "on-demand")
    assert od.prediction.expected_cost == pytest.approx(24.1667 * 3.0, rel=0.01)
    text = d.paragraph()
    assert "36 h deadline" in text and "on-demand" in text and "notice" in text


def test_capacity_that_is_never_there_leaves_the_reliable_source():
    gone = Capacity.from_rates("gone", 0.1, availability=1e-6, mean_outage_h=1000)
    d = decide([("A", _job(final_save_s=None))], [gone, OD])
    assert d.best.prediction.spot_hours == pytest.approx(0, abs=0.5)
    assert d.best.prediction.miss_probability == 0
    spot_only = next(o for o in d.options if o.policy == "spot")
    assert spot_only not in d.feasible


def test_a_tight_deadline_on_scarce_spot_refuses_spot_only_and_keeps_the_guarded_policies():
    spot = Capacity.from_trace(load_trace(TRACE), 0.97, notice_s=120)
    d = decide([("A", _job(deadline_h=26))], [spot, OD], confidence=0.99)
    assert all(o.prediction.miss_probability <= 0.01 for o in d.feasible)
    assert d.best in d.feasible
    assert {o.policy for o in d.options} == {"on-demand", "spot", "uniform-progress", "gpumem"}


def test_cheaper_layout_ranks_first_and_jobs_keep_their_deadline():
    fast, slow = _job(), _job(work_h=30)
    spot = Capacity.from_rates("spot", 1.0, preemptions_per_day=2, mean_outage_h=1)
    d = decide([("fast", fast), ("slow", slow)], [spot, OD])
    assert d.best.layout == "fast"
    with pytest.raises(ValueError, match="same deadline"):
        decide([("a", _job()), ("b", _job(deadline_h=40))], [OD])


@pytest.mark.parametrize(
    ("caps", "kw", "match"),
    [([], {}, "at least one capacity"), ([OD], {"confidence": 1.0}, "confidence")],
)
def test_bad_decisions(caps, kw, match):
    with pytest.raises(ValueError, match=match):
        decide([("a", _job())], caps, **kw)


def test_a_high_tier_with_a_queue_pays_the_wait_at_every_start():
    prio = parse_capacity("tier,name=prio,price=3,queue-wait-h=2")
    assert not prio.preemptible and prio.queue_wait_s == 7200
    (o,) = decide([("a", _job(deadline_h=None))], [prio]).options
    assert o.prediction.expected_hours >= 24 + 2 + 600 / 3600 - 0.2


def test_layout_jobs_price_each_layouts_own_checkpoint_and_final_save():
    from gpumem.planner import plan

    res = plan("gpt2", n_gpus=8)
    jobs = layout_jobs(res, run_hours=10, deadline_h=20)
    assert 1 <= len(jobs) <= 3
    assert len({j for _, j in jobs}) == len(jobs)  # distinct jobs only
    name, job = jobs[0]
    best = res.candidates[0]
    assert name == best.describe() and job.work_h == 10 and job.deadline_h == 20
    assert job.final_save_s > best.step_seconds  # the step in flight, then the node's save


def test_cli_prints_the_decision_and_its_json(capsys):
    args = [
        "plan",
        "gpt2",
        "--gpus",
        "8",
        "--run-hours",
        "24",
        "--deadline",
        "1.5d",
        "--capacity",
        f"spot,trace={TRACE},price=0.97,notice=aws",
        "--capacity",
        "on-demand,price=3.06",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capacity decision (deadline 36 h" in out and "Cheapest that meets" in out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["decision"]["best"]
    assert best["policy"] in ("gpumem", "uniform-progress", "on-demand", "spot")
    assert doc["decision"]["why"].startswith("Cheapest")
    assert len(doc["decision"]["options"]) == 4 * len(
        {o["layout"] for o in doc["decision"]["options"]}
    )


def test_the_paragraph_opens_with_what_the_reader_must_know_first():
    d = decide([("a", _job())], [OD], warnings=("checkpoint times extrapolated to 28x",))
    assert d.paragraph().startswith("Warning: checkpoint times extrapolated to 28x. Cheapest")
