"""Planner: the numba sweep agrees with the estimator; economics and job scripts."""

import math

import pytest

from gpumem.estimator import estimate
from gpumem.planner import economics, min_gpus, plan, realised_loss, young_daly


def test_sweep_matches_estimate():
    # Reference: the Python estimator, config by config (same formula, compiled vs not).
    res = plan("llama-2-7b", n_gpus=8, seq_len=2048, micro_batches=(1, 2))
    assert res.candidates and res.n_configs > len(res.candidates) > 0
    for c in res.candidates[:: max(1, len(res.candidates) // 12)]:
        bill = res.bill(c)
        assert bill.per_gpu["total"] == c.total_bytes
        assert bill.fits


def test_nothing_fits_and_min_gpus():
    assert plan("llama-2-70b", n_gpus=1, seq_len=1024).candidates == []
    r = min_gpus("llama-2-70b", seq_len=1024, micro_batches=(1,))
    assert r.candidates
    # 16 B/param of 68.98 B params cannot fit below 1.10 TB / 79.6 GiB = 13 GPUs
    assert r.n_gpus >= math.ceil(16 * 68_976_648_192 / (81559 * 2**20))
    # above one node the search steps in whole nodes: one node fewer must not fit
    assert (
        plan("llama-2-70b", n_gpus=r.n_gpus - 8, seq_len=1024, micro_batches=(1,)).candidates == []
    )


def test_young_daly_and_motivating_scenario():
    # Source: Young 1974 / Daly 2006: tau = sqrt(2 C MTBF). Issue #4: 64 H100 x 47 h x $3 = $9,024.
    assert young_daly(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert realised_loss(n_gpus=64, hours_lost=47, price_per_gpu_hour=3.0) == 9024.0
    e = economics(
        n_gpus=64, price_per_gpu_hour=3.0, mtbf_hours=24, stall_s=2, persist_s=30, restart_s=0
    )
    assert e.interval_s == pytest.approx(math.sqrt(2 * 2 * 24 * 3600))
    slow = economics(
        n_gpus=8, price_per_gpu_hour=3.0, preemption_rate=1.0, stall_s=1, persist_s=600
    )
    assert slow.interval_s == 600  # the persist time bounds the interval
    with pytest.raises(ValueError, match="exactly one"):
        economics(n_gpus=8, price_per_gpu_hour=3.0)


def test_cli_never_tracebacks(capsys):
    from gpumem.cli import main

    assert main(["estimate", "lama-2-70b"]) == 2
    assert "did you mean llama-2-70b" in capsys.readouterr().err
    assert main(["estimate", "gpt2", "--gpu", "H1000"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
    assert main(["estimate", "/nonexistent/config.json"]) == 2
    assert main(["estimate", "llama-2-7b", "--gpus", "8", "--tp", "3"]) == 2
    assert main(["estimate", "gpt2", "--batch-size", "-1"]) == 2
    import json

    assert main(["estimate", "llama-2-7b", "--json", "--seq-len", "512"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "inputs",
        "n_params",
        "per_gpu",
        "fits",
        "headroom_bytes",
        "cluster_model_state_bytes",
    }
    assert out["per_gpu"] == estimate("llama-2-7b", seq_len=512).per_gpu
    assert (
        main(
            [
                "plan",
                "llama-2-7b",
                "--gpus",
                "8",
                "--seq-len",
                "1024",
                "--mtbf-hours",
                "12",
                "--k8s",
            ]
        )
        == 0
    )
    assert "terminationGracePeriodSeconds" in capsys.readouterr().out


def test_cli_realised_loss_of_the_motivating_preemption(capsys):
    """Issue #4: 64 H100 x 47 h on spot at ~$3/GPU-h, preempted at hour 47 with no checkpoint
    loses 64 * 47 * 3 = $9,024; with checkpoints at most one interval + persist + restart."""
    import json

    from gpumem.cli import main

    argv = [
        "plan",
        "llama-2-70b",
        "--gpus",
        "64",
        "--run-hours",
        "47",
        "--preempted-at-hours",
        "47",
        "--mtbf-hours",
        "100",
        "--stall-s",
        "2",
        "--persist-s",
        "60",
        "--restart-s",
        "300",
    ]
    assert main(argv) == 0
    assert "$9,024 lost without a checkpoint" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["realised_loss"]
    assert loss["without_checkpoint"] == 9024.0
    interval = (2 * 2 * 100 * 3600) ** 0.5  # Young/Daly sqrt(2 C MTBF) = 1200 s
    assert loss["interval_s"] == pytest.approx(interval)
    assert loss["with_checkpoint_at_most"] == pytest.approx(64 * 3 * (interval + 60 + 300) / 3600)
