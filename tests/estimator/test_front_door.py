"""``gpumem.estimate``'s front door: at most 20 keywords, the frameworks' knobs grouped in
frozen objects checked when made, every argument checked before any work, and the flat
spellings of earlier releases put into their groups."""

import dataclasses
import inspect

import pytest

import gpumem
from gpumem.estimator.frameworks.megatron import MegatronKnobs
from gpumem.estimator.frameworks.torchtitan import TorchtitanKnobs
from gpumem.estimator.job import FLAT, GROUPS
from gpumem.estimator.knobs import ActivationKnobs, MoEKnobs, TrainingKnobs


def test_at_most_twenty_keywords():
    params = inspect.signature(gpumem.estimate).parameters.values()
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 20, keywords
    for name in ("batch_size", "seq_len", "gpu", "layout", "precision", "optimizer"):
        assert name in keywords
    assert {"recompute", "framework", "megatron", "torchtitan", "deepspeed", "moe"} <= set(keywords)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: MegatronKnobs(fp8_recipe="nvfp4"), "unknown fp8 recipe 'nvfp4'"),
        (lambda: TorchtitanKnobs(loss_chunks=-1), "loss_chunks must be an integer >= 0"),
        (lambda: TorchtitanKnobs(fsdp_float8_all_gather=True), "needs fp8_recipe='tensorwise'"),
        (lambda: MoEKnobs(imbalance=0.5), "moe_imbalance is the most loaded rank's"),
        (lambda: MoEKnobs(dispatcher="ring"), "moe_dispatcher must be one of"),
        (lambda: ActivationKnobs(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (lambda: ActivationKnobs(attention="bogus"), "unknown attention 'bogus'"),
        (lambda: ActivationKnobs(fused_ops=("norm", "gelu")), "unknown fused op"),
    ],
)
def test_knobs_are_checked_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_knobs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoEKnobs().imbalance = 2.0  # type: ignore[misc]


def test_arguments_are_checked_before_the_model_or_a_calibration_is_read(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    nocal = tmp_path / "calibration.json"
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        gpumem.estimate(str(missing), batch_size=0, calibration=str(nocal))
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
        gpumem.estimate("no-such-model", device="tpu", calibration=str(nocal))
    with pytest.raises(ValueError, match="hidden_dropout is a Megatron-LM option"):
        gpumem.estimate(
            "no-such-model", framework="torch", megatron=MegatronKnobs(hidden_dropout=0.1)
        )
    # the framework a config.json defaults to is known without reading it
    with pytest.raises(ValueError, match="framework='transformers' has none"):
        gpumem.estimate(str(missing), torchtitan=TorchtitanKnobs(loss_chunks=2))
    with pytest.raises(FileNotFoundError):  # all checks passed: now it is read
        gpumem.estimate(str(missing))


def test_grouped_and_flat_spellings_give_the_same_bill():
    lay = gpumem.Layout(dp=2, tp=2, pp=2)
    flat = gpumem.estimate(
        "llama-2-7b", seq_len=1024, layout=lay, framework="megatron", grads="fp32",
        attention="flash", fp8_recipe="delayed", hidden_dropout=0.1, pipeline_first_layers=15,
    )  # fmt: skip
    grouped = gpumem.estimate(
        "llama-2-7b",
        seq_len=1024,
        layout=lay,
        framework="megatron",
        training=TrainingKnobs(grads="fp32"),
        activations=ActivationKnobs(attention="flash"),
        megatron=MegatronKnobs(fp8_recipe="delayed", hidden_dropout=0.1, pipeline_first_layers=15),
    )
    assert grouped.per_gpu == flat.per_gpu and grouped.inputs == flat.inputs


def test_every_flat_spelling_has_a_group():
    for name, (group, key) in FLAT.items():
        if group != "extra":
            assert key in {f.name for f in dataclasses.fields(GROUPS[group])}, name


def test_flat_beside_its_group_or_unknown_is_one_line():
    with pytest.raises(ValueError, match="grads= and training= both given"):
        gpumem.estimate("llama-2-7b", grads="fp32", training=TrainingKnobs())
    with pytest.raises(ValueError, match="fp8_recipe= and megatron= both given"):
        gpumem.estimate("llama-2-7b", fp8_recipe="delayed", megatron=MegatronKnobs())
    with pytest.raises(TypeError, match="unexpected keyword argument 'gradz'"):
        gpumem.estimate("llama-2-7b", gradz="fp32")
    with pytest.raises(TypeError, match="moe must be a MoEKnobs, got dict"):
        gpumem.estimate("llama-2-7b", moe={"imbalance": 1.0})
