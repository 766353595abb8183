"""Inference planning: KV bytes per token, weight formats, engine reserves, the model's context
limit and layouts over the GPUs, against hand derivations."""

import pytest

from gpumem.estimator.inference import (
    ENGINES,
    estimate_inference,
    kv_bytes_per_token,
    plan_inference,
)
from gpumem.estimator.resolver import resolve_model


def test_kv_bytes_per_token_gqa_tp_pp():
    spec = resolve_model("llama-2-70b")  # 80 layers, 8 KV heads of 128
    assert kv_bytes_per_token(spec) == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB in bf16
    assert kv_bytes_per_token(spec, 1) == 163_840  # fp8 KV
    assert kv_bytes_per_token(spec, 2, tp=8) == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token(spec, 2, tp=16) == 2 * 80 * 1 * 128 * 2  # KV heads replicate
    assert kv_bytes_per_token(spec, 2, pp=4) == 2 * 20 * 8 * 128 * 2


def test_weight_formats_kv_dtype_and_engines():
    spec = resolve_model("llama-3-8b")
    kw = {"batch_size": 1, "context": 1024}
    bf16 = estimate_inference(spec, **kw)
    fp8 = estimate_inference(spec, precision="fp8", **kw)
    int4 = estimate_inference(spec, precision="int4", **kw)
    assert bf16.per_gpu["weights"] == 2 * spec.n_params
    assert fp8.per_gpu["weights"] == spec.n_params
    assert int4.per_gpu["weights"] == int(spec.n_params * (0.5 + 2 / 128))  # fp16 scale / 128
    assert fp8.kv_dtype == "bf16"  # 8-bit weights keep a 16-bit cache unless told
    kv8 = estimate_inference(spec, precision="fp8", kv_dtype="fp8", **kw)
    assert kv8.per_gpu["kv_cache"] * 2 == fp8.per_gpu["kv_cache"]
    total = bf16.gpu.total_bytes
    assert bf16.per_gpu["engine_reserve"] == int(total * (1 - ENGINES["vllm"]))
    hf = estimate_inference(spec, engine="hf", **kw)
    assert hf.per_gpu["engine_reserve"] == 0
    with pytest.raises(ValueError, match="exceeds llama-3-8b's maximum of 8192"):
        estimate_inference(spec, context=16384)
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        estimate_inference(spec, engine="tgi")
    with pytest.raises(ValueError, match="unknown kv_dtype 'int4'"):
        estimate_inference(spec, kv_dtype="int4")


def test_plan_inference_layouts_and_context_cap():
    p = plan_inference("llama-2-70b", n_gpus=8, precision="fp8")
    assert max(p.contexts) == 4096  # the model's maximum: no larger context is offered
    assert {(x.tp, x.pp, x.replicas) for x in p.layouts} >= {(8, 1, 1), (4, 1, 2), (1, 1, 8)}
    tp8 = next(x for x in p.layouts if (x.tp, x.pp) == (8, 1))
    assert tp8.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    for x in p.layouts:  # the batch that fits never holds more KV than the cache can
        for c, b in x.max_batch.items():
            assert b * c <= x.kv_tokens
    with pytest.raises(ValueError, match="tp=3 pp=1 cannot serve"):
        plan_inference("llama-2-70b", n_gpus=8, tp=3, pp=1)


def test_cli_inference_never_silently_tp1(capsys):
    from gpumem.cli import main

    assert main(["estimate", "llama-2-70b", "--inference", "--gpus", "8", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["tp"] * out["pp"] == 8
    args = ["estimate", "llama-2-70b", "--inference", "--gpus", "8", "--tp", "2", "--pp", "2"]
    assert main(args) == 2
    assert "tp*pp = 2*2 = 4 but --gpus is 8" in capsys.readouterr().err
    assert main([*args[:-4], "--tp", "2", "--json"]) == 0  # pp fills the rest: tp2 x pp4
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["pp"]) == (2, 4)
    assert (
        main(["plan", "llama-2-70b", "--inference", "--gpus", "8", "--precision", "int4", "--json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["precision"] == "int4" and plan["layouts"]


def test_inference_states_its_inputs(capsys):
    """Like a training bill, a serving bill says what it was computed for and where each value
    came from: the table's inputs line, ``--json``'s ``inputs``."""
    from gpumem.cli import main

    bill = estimate_inference("llama-3-8b", precision="int4")
    assert bill.inputs_line() == (
        "inputs: context 8192 (default: the model's context), batch 1 (default), weights int4 "
        "(given), KV cache bf16 (default: 16-bit for 8/4-bit weights), engine vllm (default), "
        "layout tp1 pp1 (default)"
    )
    assert main(["estimate", "llama-3-8b", "--inference", "--seq-len", "1024", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "inputs: context 1024 (given), batch 1 (default)" in out
    assert "layout tp2 pp1 (all 2 GPUs as tensor parallelism" in out
    assert main(["estimate", "llama-3-8b", "--inference", "--batch-size", "4", "--json"]) == 0
    import json

    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["batch_size"] == {"value": 4, "source": "given"}
    assert inputs["context"]["source"] == "default: the model's context"
