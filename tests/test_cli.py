"""The gpumem command: in-process main(argv), python -m gpumem, and the doctor report."""

import json
import subprocess
import sys

import pytest

from gpumem.cli import main


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_doctor_without_measurement(capsys):
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "GPUs" in out


def test_doctor_json_measures_bandwidth(capsys, tmp_path):
    pytest.importorskip("gpumem._C")
    assert main(["doctor", "--json", "--size", "8MiB", "--dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    whats = [b["what"] for b in report["bandwidth"]]
    assert whats[:3] == ["memcpy (1 thread)", "crc32c (1 thread)", "crc32c (all threads)"]
    assert whats[3].startswith("write+fsync")
    assert all(b["nbytes"] == 8 << 20 and b["gb_per_s"] > 0 for b in report["bandwidth"])
    assert report["problems"] == []
    assert list(tmp_path.iterdir()) == []  # the probe cleans up after itself


def test_bad_size_is_a_clear_error(capsys):
    assert main(["doctor", "--size", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_python_dash_m_works():
    out = subprocess.run(
        [sys.executable, "-m", "gpumem", "doctor", "--no-measure"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpumem doctor")


def test_estimate_takes_deepspeed_knobs(capsys, tmp_path):
    """--ds-config reads a ds_config's zero_optimization; --deepspeed KEY=VALUE goes on top;
    the JSON bill matches gpumem.estimate with the same knobs."""
    import json

    import gpumem

    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e8}}))
    args = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--seq-len", "512"]
    extra = ["--ds-config", str(cfg), "--deepspeed", "offload_optimizer=cpu", "--offload-param"]
    assert main([*args, *extra, "--optimizer", "muon", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    bill = gpumem.estimate(
        "llama-2-7b",
        seq_len=512,
        optimizer="muon",
        layout=gpumem.Layout(dp=8, zero=3),
        deepspeed={"reduce_bucket_size": 200_000_000, "offload_optimizer": "cpu"},
        offload_param=True,
    )
    assert out["per_gpu"] == bill.per_gpu
    assert out["host_bytes_per_node"] == bill.host_bytes > 0
    assert main([*args, "--deepspeed", "reduce_bucket_size"]) == 2
    assert "--deepspeed takes KEY=VALUE" in capsys.readouterr().err
    assert main(["estimate", "llama-2-7b", "--gpus", "8", "--zero", "2", "--offload-param"]) == 2
    assert "offload_param needs ZeRO-3" in capsys.readouterr().err


@pytest.mark.parametrize("mtype", ["bert", "roberta"])
def test_estimate_reads_an_encoder_config(capsys, tmp_path, mtype):
    """A BERT / RoBERTa config.json on the command line: the bill of the same dict in Python."""
    import gpumem
    from gpumem.estimator.accuracy import HF_SWEEP

    cfg = {**HF_SWEEP[mtype], "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["estimate", str(tmp_path), "--batch-size", "4", "--seq-len", "128", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    bill = gpumem.estimate(cfg, batch_size=4, seq_len=128)
    assert out["per_gpu"] == bill.per_gpu and out["framework"] == "transformers"
    assert "logits' dtype" in out["inputs"]["loss"]["value"]


# every knob of gpumem.estimate and its flag (a new knob without a flag fails here)
KNOB_FLAGS = {
    "training": {
        "grads": ["--grads", "fp32"],
        "offload_optimizer": ["--offload-optimizer"],
        "lora_rank": ["--lora-rank", "8"],
        "base_quant": ["--lora-rank", "8", "--qlora"],
        "foreach": ["--no-foreach"],
        "fused": ["--fused-optimizer"],
        "persistent_grads": ["--persistent-grads"],
        "finetune": ["--finetune", "lora", "--target-modules", "q_proj,v_proj"],
    },
    "activations": {
        "attention": ["--attention", "flash"],
        "dropout": ["--attention-dropout", "0.1"],
        "activation_model": ["--activation-model", "korthikanti"],
        "keep_logits": ["--keep-logits"],
        "fused_ops": ["--fused-ops", "norm,ce"],
        "target_seq": ["--target-seq", "128"],
    },
    "moe": {
        "imbalance": ["--moe-imbalance", "1.5"],
        "dispatcher": ["--moe-dispatcher", "allgather"],
        "grouped_gemm": ["--no-moe-grouped-gemm"],
    },
    "megatron": {
        "fp8_recipe": ["--fp8-recipe", "delayed"],
        "fp8_param_gather": ["--fp8-recipe", "delayed", "--fp8-param-gather"],
        "hidden_dropout": ["--hidden-dropout", "0.1"],
        "defer_embedding_wgrad": ["--defer-embedding-wgrad"],
        "wgrad_deferral_limit": ["--defer-embedding-wgrad", "--wgrad-deferral-limit", "2"],
        "pipeline_first_layers": ["--pipeline-first-layers", "3"],
        "pipeline_last_layers": ["--pipeline-last-layers", "3"],
        "pipeline_split_embedding": ["--pipeline-split-embedding"],
        "pipeline_split_loss": ["--pipeline-split-loss"],
        "dist_opt_instances": ["--num-distributed-optimizer-instances", "2"],
        "pipeline_layout": ["--pipeline-model-parallel-layout", "Et|tL"],
        "recompute_modules": ["--recompute-modules", "layernorm,mlp"],
        "offload_modules": ["--offload-modules", "core_attn"],
        "cuda_graph_scope": ["--cuda-graph-scope", "attn,moe_router"],
        "cuda_graph_warmup_steps": ["--cuda-graph-scope", "attn", "--cuda-graph-warmup-steps", "0"],
    },
    "torchtitan": {
        "fp8_recipe": ["--fp8-recipe", "tensorwise"],
        "fsdp_float8_all_gather": ["--fp8-recipe", "tensorwise", "--fsdp-float8-all-gather"],
        "loss_chunks": ["--loss-chunks", "8"],
        "compiled_loss": ["--compiled-loss"],
        "pp_schedule": ["--pp-schedule", "GPipe"],
        "pp_microbatch_size": ["--pp-microbatch-size", "2"],
    },
}


def test_every_python_knob_has_a_cli_flag():
    """Each field of TrainingKnobs, ActivationKnobs, MoEKnobs, MegatronKnobs and
    TorchtitanKnobs is set by its flag (and only the field named changes from the default)."""
    import argparse
    import dataclasses

    from gpumem.cli import estimate as cli_estimate
    from gpumem.estimator.job import GROUPS

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli_estimate.register(sub)
    for group, cls in GROUPS.items():
        assert set(KNOB_FLAGS[group]) == {f.name for f in dataclasses.fields(cls)}, group
        fw = {"megatron": "megatron", "torchtitan": "torchtitan"}.get(group, "torch")
        base = cli_estimate.knobs_from_args(
            parser.parse_args(["estimate", "m", "--framework", fw])
        )[group]
        for name, flags in KNOB_FLAGS[group].items():
            args = parser.parse_args(["estimate", "m", "--framework", fw, *flags])
            knobs = cli_estimate.knobs_from_args(args)[group]
            assert getattr(knobs, name) != getattr(base, name), (group, name)


def test_cli_knobs_reach_the_estimate(capsys):
    import gpumem
    from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs

    args = ["estimate", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--seq-len", "1024"]
    extra = ["--moe-dispatcher", "allgather", "--no-moe-grouped-gemm", "--attention-dropout",
             "0.1", "--attention", "eager", "--fused-ops", "none", "--device", "cpu"]  # fmt: skip
    extra.append("--json")
    assert main([*args, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    bill = gpumem.estimate(
        "mixtral-8x7b",
        seq_len=1024,
        layout=gpumem.Layout(dp=8, ep=8),
        device="cpu",
        activations=ActivationKnobs(attention="eager", dropout=0.1, fused_ops=()),
        moe=MoEKnobs(dispatcher="allgather", grouped_gemm=False),
    )
    assert out["per_gpu"] == bill.per_gpu
    plain = gpumem.estimate("mixtral-8x7b", seq_len=1024, layout=gpumem.Layout(dp=8, ep=8),
                            device="cpu", attention="eager")  # fmt: skip
    assert plain.per_gpu != bill.per_gpu


def test_precision_help_lists_every_precision(capsys):
    from gpumem.estimator.states import FP8_PRECISIONS, PRECISIONS

    assert main(["estimate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in (*PRECISIONS, *FP8_PRECISIONS):
        assert name in text, name


def test_cli_torchtitan_on_plain_gpus_shards_by_default(capsys):
    """`--framework torchtitan --gpus 8` without --fsdp: torchtitan's dp_shard=-1, said so."""
    args = ["estimate", "llama-3-8b", "--framework", "torchtitan", "--gpus", "8", "--seq-len",
            "2048"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "fsdp-full" in text and "default: torchtitan's dp_shard=-1" in text
