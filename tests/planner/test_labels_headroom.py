"""Issue 23 (6): bills and plans label each input honestly (given / default / searched /
derived), and `plan` keeps a stated headroom margin free on every GPU."""

from __future__ import annotations

import pytest

from gpumem.cli import main
from gpumem.estimator import estimate
from gpumem.planner import plan
from gpumem.planner.margin import Margin

GiB = 2**30


@pytest.fixture(scope="module")
def llama8b():
    return {"r0": plan("llama-3-8b", n_gpus=8, seq_len=8192, headroom=0)}


def test_the_winning_bill_labels_searched_and_derived_inputs():
    res = plan("gpt2", n_gpus=8)
    bill = res.bill()
    assert bill.sources["batch_size"] == "searched"
    assert bill.sources["recompute"] == "searched"
    assert bill.sources["grad_accum"] == "derived: global batch / (dp x micro-batch)"
    line = bill.inputs_line()
    assert f"micro-batch {res.best.micro_batch} (searched)" in line
    assert "(given)" not in line and "micro-batch 1 (default)" not in line


def test_an_explicit_batch_size_of_one_is_given():
    assert estimate("llama-2-7b", batch_size=1).sources["batch_size"] == "given"
    assert estimate("llama-2-7b").sources["batch_size"] == "default"


def test_cli_estimate_labels_batch_size_one_given(capsys):
    assert main(["estimate", "llama-2-7b", "--batch-size", "1"]) == 0
    assert "micro-batch 1 (given)" in capsys.readouterr().out
    assert main(["estimate", "llama-2-7b"]) == 0
    assert "micro-batch 1 (default)" in capsys.readouterr().out


def test_plan_keeps_a_default_headroom_of_5_percent(llama8b):
    r0 = llama8b["r0"]
    cap = r0.gpu.total_bytes
    # without a margin the winner leaves 0.21 GiB of 79.65 GiB (the 1.1 GiB on 80 GB)
    assert round((cap - r0.best.total_bytes) / GiB, 2) == 0.21
    res = plan("llama-3-8b", n_gpus=8, seq_len=8192)
    kept = int(cap * 0.05)
    assert all(c.total_bytes <= cap - kept for c in res.candidates)
    assert len(res.candidates) < len(r0.candidates)
    assert res.sources["headroom"] == "default"
    assert "headroom 5% = 3.98 GiB kept free (default)" in res.inputs_line()


def test_plan_headroom_as_bytes_or_share(llama8b):
    r0 = llama8b["r0"]
    cap = r0.gpu.total_bytes
    for given, kept in (("10%", int(cap * 0.1)), ("8GiB", 8 * GiB), (0.1, int(cap * 0.1))):
        res = plan("llama-3-8b", n_gpus=8, seq_len=8192, headroom=given)
        assert res.sources["headroom"] == "given"
        fits = [c.describe() for c in r0.candidates if c.total_bytes <= cap - kept]
        assert sorted(c.describe() for c in res.candidates) == sorted(fits)


@pytest.mark.parametrize("bad", ["100%", "-1%", "lots", "-4GiB", 1.5, True])
def test_bad_headroom_is_refused(bad):
    with pytest.raises(ValueError, match="headroom"):
        Margin.parse(bad)


def test_cli_plan_headroom(capsys):
    assert main(["plan", "gpt2", "--gpus", "8", "--headroom", "4GiB"]) == 0
    assert "headroom 4.00 GiB kept free (given)" in capsys.readouterr().out
    assert main(["plan", "gpt2", "--gpus", "8", "--headroom", "120%"]) == 2
    err = capsys.readouterr().err
    assert "below 100%" in err and err.count("\n") == 1 and "Traceback" not in err
