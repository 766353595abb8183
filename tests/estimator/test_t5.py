"""T5 from its config.json (``t5_ops.py``): the estimate of the model transformers builds
against ``gpumem.profile`` of that model under fake tensors (the sweep's method and bound: 3 %
or 64 KiB per category), for what the held-out sweep (``HF_SWEEP``'s ``t5`` and ``t5-v1.1``,
every precision x recompute in benchmarks/bench_hf_sweep.py) does not vary: a target length
other than the source's, the checkpoints' dropout, ``Trainer``'s loop; and the parameter count
against transformers' own module."""

import pytest

pytest.importorskip("transformers")

from gpumem.estimator.accuracy import (
    HF_SWEEP,
    PROFILER_CATEGORIES,
    HFCase,
    compare_hf,
    within_tolerance,
)


def _misses(case: HFCase) -> dict:
    c = compare_hf(case)
    return {
        k: (c.measured.get(k, 0), c.estimated.get(k, 0))
        for k in PROFILER_CATEGORIES
        if not within_tolerance(c.measured.get(k, 0), c.estimated.get(k, 0))
    }


CASES = [
    # the decoder shorter than the encoder (summarisation's shape) and longer
    ("t5", "bf16", {}, 32, "logits"),
    ("t5-v1.1", "bf16-autocast", {}, 96, "logits"),
    # the checkpoints' dropout_rate 0.1: masks after every sub-layer, inside the MLP, on the
    # attention probabilities (the CPU's math path for cross-attention too)
    ("t5", "fp32", {"dropout_rate": 0.1}, None, "logits"),
    ("t5", "bf16", {"dropout_rate": 0.1}, None, "logits"),
    ("t5", "bf16-autocast", {"dropout_rate": 0.1}, 96, "logits"),
    # Trainer's loop: model(input_ids=, labels=).loss, labels shifted into the decoder's input
    ("t5", "fp32", {}, 48, "trainer"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:2] + c[3:])))
def test_t5_matches_its_fake_profile(case):
    name, precision, change, target, loop = case
    cfg = {**HF_SWEEP[name], **change}
    assert not _misses(HFCase(name, cfg, precision, False, target_seq=target, loop=loop))


# the peaks the rules do not reach yet (strict: fixing one shows up); the figures of every
# row are in benchmarks/results/hf_sweep.md
GAPS = [
    pytest.param(
        ("t5", "bf16", True),
        marks=pytest.mark.xfail(
            strict=True,
            reason="recompute: the decoder's first layer's recomputation holds more temporaries "
            "than t5_ops.checkpointed counts (-7 % of them here, -2.5..-6 % in total)",
        ),
    ),
    pytest.param(
        ("t5", "bf16", False, {"dropout_rate": 0.1}, 32),
        marks=pytest.mark.xfail(
            strict=True,
            reason="pure bf16 with dropout and a target shorter than the source: the profile "
            "peaks as the loss's backward starts, the estimate inside the last layer's (two "
            "moments this close: +1.2 % in total, activations -5.7 %, temporaries over)",
        ),
    ),
    pytest.param(
        ("t5-v1.1", "bf16", False),
        marks=pytest.mark.xfail(
            strict=True,
            reason="v1.1 peaks in the forward here (at lm_head; with dropout at the decoder's "
            "final dropout): the previous step's logits still held beside the forward's "
            "temporaries, a moment the rules do not price for T5",
        ),
    ),
]


@pytest.mark.parametrize("case", GAPS, ids=lambda c: "-".join(map(str, c)))
def test_t5_gaps(case):
    name, precision, recompute, change, target = (*case, {}, None)[:5]
    cfg = {**HF_SWEEP[name], **change}
    assert not _misses(HFCase(name, cfg, precision, recompute, target_seq=target))


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
        {"num_decoder_layers": 3, "d_kv": 64, "relative_attention_num_buckets": 16},
        {"model_type": "mt5"},
    ],
    ids=str,
)
def test_param_count_is_transformers(change):
    """The count from the config equals the parameters of the module transformers builds (on
    the meta device; transformers 5 ties the LM head whatever tie_word_embeddings says)."""
    import torch
    import transformers

    from gpumem.estimator.hf_config import from_hf_config

    cfg = {**HF_SWEEP["t5"], "d_model": 96, "d_ff": 160, **change}
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    expected = len({p.data_ptr(): p for p in model.parameters()}) and sum(
        p.numel() for p in {id(p): p for p in model.parameters()}.values()
    )
    assert from_hf_config(cfg).n_params == expected


def test_target_seq_prices_the_decoder():
    """A longer target grows the decoder's activations and the loss (b x target x vocab), not
    the encoder's: the difference between two targets is what the decoder layers and head save
    for the extra tokens, and the bill's inputs line names the target."""
    import gpumem
    from gpumem.estimator.knobs import ActivationKnobs

    cfg = HF_SWEEP["t5"]

    def acts(target):
        return gpumem.estimate(
            dict(cfg), batch_size=2, seq_len=64, precision="fp32", device="cpu",
            activations=ActivationKnobs(target_seq=target),
        )  # fmt: skip

    short, long = acts(32), acts(64)
    assert short.inputs["target_seq"] == 32 and long.inputs["target_seq"] == 64
    assert short.per_gpu["activations"] < long.per_gpu["activations"]
    assert acts(None).inputs["target_seq"] == 64  # default: the source's length


@pytest.mark.parametrize(
    ("config", "kwargs", "words"),
    [
        ({"feed_forward_proj": "gated-silu"}, {}, ("'gated-silu'", "relu", "gated-gelu")),
        ({"dropout_rate": 1.0}, {}, ("dropout_rate", "[0, 1)")),
        ({"model_type": "llama"}, {"target_seq": 32}, ("target_seq", "one stack", "seq_len")),
        ({}, {"target_seq": 0}, ("target_seq", "positive integer")),
    ],
)
def test_bad_t5_input_is_one_line(config, kwargs, words):
    import gpumem
    from gpumem.estimator.knobs import ActivationKnobs

    cfg = {**HF_SWEEP["t5"], **config}
    if config.get("model_type") == "llama":
        cfg = dict(HF_SWEEP["llama"])
    with pytest.raises(ValueError) as e:
        gpumem.estimate(cfg, device="cpu", activations=ActivationKnobs(**kwargs))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_cli_target_seq(tmp_path, capsys):
    import json

    from gpumem.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_SWEEP["t5"]))
    args = ["estimate", str(path), "--seq-len", "64", "--device", "cpu", "--json"]
    assert main([*args, "--target-seq", "16"]) == 0
    bill = json.loads(capsys.readouterr().out)
    assert bill["inputs"]["target_seq"]["value"] == 16
