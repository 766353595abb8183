"""Planner: the numba sweep agrees with the estimator and with model states by hand; economics and
job scripts."""

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


def test_sweep_model_states_by_hand():
    """The sweep's weights, gradients and optimizer state of Llama-2-7B on 8 GPUs (dp 8), for
    every ZeRO stage that fits, against the ZeRO paper's accounting (Rajbhandari et al. 2020,
    Fig. 1): with mixed precision and Adam, 2 bytes of 16-bit weights, 2 of 16-bit gradients and
    K = 12 of optimizer state (fp32 master weights, momentum, variance) per parameter; stage 1
    shards the optimizer state over the 8 ranks, stage 2 the gradients too, stage 3 the weights.

    Parameters from the architecture (vocab 32000, hidden 4096, 32 layers, MLP 11008, untied
    embeddings, RMSNorm with weights only): 2·32000·4096 + 32·(4·4096² + 3·4096·11008 + 2·4096)
    + 4096 = 6,738,415,616, the published count.
    """
    psi = 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert psi == 6_738_415_616
    res = plan("llama-2-7b", n_gpus=8, seq_len=2048, micro_batches=(1, 2))
    seen = set()
    for c in res.candidates:
        lay = c.layout
        if (lay.dp, lay.tp, lay.pp) != (8, 1, 1):
            continue
        z = lay.zero
        seen.add(z)
        # gradient accumulation over 256 / (8 · micro-batch) >= 16 micro-batches: every gradient
        # is alive at the peak (the start of the last backward, or the optimizer step)
        assert c.grad_accum >= 16
        assert c.weight_bytes == 2 * psi // (8 if z >= 3 else 1)
        assert c.grad_bytes == 2 * psi // (8 if z >= 2 else 1)
        assert c.optimizer_bytes == 12 * psi // (8 if z >= 1 else 1)
        assert c.total_bytes > c.weight_bytes + c.grad_bytes + c.optimizer_bytes
    assert seen == {1, 2, 3}  # ZeRO-0 would hold 16 B x 6.74 B = 108 GB per GPU: it cannot fit


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
        "framework",
        "per_gpu",
        "fits",
        "headroom_bytes",
        "cluster_model_state_bytes",
        "pipeline_ranks",
        "reserved",  # allocated / simulated reserved / fragmentation (docs/estimator.md)
    }
    assert out["framework"] == "torch" and len(out["pipeline_ranks"]) == 1
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
                "-",
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
