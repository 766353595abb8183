"""``framework="torchtitan"`` with pipeline parallelism (``titan_schedules``, ``titan_pipeline``):
the split and the schedule order against torchtitan's and torch's own code, each pipeline rank's
peak against one rank of torchtitan's model driven through torch's ``PipelineStage`` in its
schedule's order under fake tensors (``benchmarks/published/torchtitan_pp_reference.py``), and
the rules by hand.

The reference tests need torchtitan (``pip install --no-deps torchtitan==0.3.0``); the order
tests need only torch.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import gpumem
from gpumem.estimator.frameworks import titan_schedules
from gpumem.estimator.model_spec import ModelSpec

SEQ = 512


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
# the shrunken torchtitan Llama of test_torchtitan.py: dim 256, 4 blocks, GQA 8/2, ffn 1024
TINY = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_dim_multiplier": 1.3,
        "multiple_of": 256, "vocab": 8192}  # fmt: skip


def tiny_spec(n_layers: int = 4) -> ModelSpec:
    kv = {"hidden": 256, "n_heads": 8, "n_kv_heads": 2, "ffn": 1024, "vocab": 8192}
    return ModelSpec(name="titan-tiny", arch="llama", n_layers=n_layers, max_seq=SEQ, **kv)


def allocated(bill: gpumem.Bill) -> int:
    return sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))


def estimate(world: int, pp: int, n_mb: int, recompute: str, schedule: str, **kw) -> gpumem.Bill:
    return gpumem.estimate(
        kw.pop("spec", tiny_spec()),
        batch_size=n_mb * kw.get("pp_microbatch_size", 1),
        seq_len=SEQ,
        framework="torchtitan",
        recompute=recompute,
        layout=gpumem.Layout(dp=world, pp=pp),
        pp_schedule=schedule,
        device="cpu",
        **kw,
    )


# --- the split and the order: torchtitan's and torch's own code -------------------------------


@pytest.mark.parametrize(("n_layers", "n_stages"), [(4, 2), (4, 4), (32, 4), (32, 8), (7, 3)])
def test_stage_parts_equal_torchtitans_split(n_layers: int, n_stages: int) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    fqns = _generate_llm_fqn_per_model_part(n_stages, n_layers, 1, 1)
    parts = titan_schedules.stage_parts(n_layers, n_stages)
    assert [
        ("tok_embeddings" in f, sum(m.startswith("layers.") for m in f), "lm_head" in f)
        for f in fqns
    ] == [(p.embed, p.blocks, p.head) for p in parts]


def _torch_order(schedule: str, pp: int, n_mb: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's own order per rank (``pipeline_order``: F and full-backward actions), each rank's
    stages built on a fake process group (construction only: nothing runs)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    per = 1 if single else 2
    out = {}
    for rank in range(pp):
        dist.init_process_group("fake", rank=rank, world_size=pp)
        try:
            stages = [
                PipelineStage(torch.nn.Linear(2, 2), rank + k * pp, pp * per, torch.device("cpu"))
                for k in range(per)
            ]
            sched = cls(stages[0] if single else stages, n_microbatches=n_mb, loss_fn=torch.sum)
            acts = [a for a in sched.pipeline_order[rank] if a is not None]
        finally:
            dist.destroy_process_group()
        names = {"FORWARD": "F", "FULL_BACKWARD": "B"}
        out[rank] = [
            (names[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in acts
            if a.computation_type.name in names
        ]
    return out


@pytest.mark.parametrize(
    ("schedule", "pp", "n_mb"),
    [("Interleaved1F1B", 2, 4), ("Interleaved1F1B", 4, 8), ("Interleaved1F1B", 4, 4),
     ("Interleaved1F1B", 4, 12), ("GPipe", 4, 8), ("GPipe", 4, 2), ("1F1B", 4, 8), ("1F1B", 4, 4)],
)  # fmt: skip
def test_rank_order_equals_torchs(schedule: str, pp: int, n_mb: int) -> None:
    """The transcribed order equals torch's for every rank. (torch's 1F1B ``pipeline_order`` is
    drawn for display only, and its last rank's row starts at F1 and names an F{M} that
    ``_step_microbatches`` never runs: that rank is compared with the loop's own rule, one
    forward then its backward.)"""
    torch_order = _torch_order(schedule, pp, n_mb)
    for rank in range(pp):
        ours = titan_schedules.rank_order(schedule, rank, pp, n_mb)
        if schedule == "1F1B" and rank == pp - 1:
            assert ours == [(k, rank, i) for i in range(n_mb) for k in ("F", "B")]
        else:
            assert ours == torch_order[rank], rank


# --- the rules by hand ---------------------------------------------------------------------------


def test_first_rank_holds_min_of_microbatches_and_pp() -> None:
    """1F1B: rank 0 keeps min(M, pp) micro-batches' activations at its peak; each micro-batch
    beyond pp + 1 (from pp + 1 on, the widest backward has every fp32 accumulator) adds only
    its ids and labels (16 B a token) and the recv buffer of its output's
    gradient (bf16, 2 · dim B a token; the first stage receives no activation). GPipe keeps
    them all."""
    n = SEQ  # tokens per micro-batch of 1
    acts = {m: estimate(2, 4, m, "none", "1F1B", spec=tiny_spec(8)).pipeline_ranks[0]
            for m in (5, 6, 7)}  # fmt: skip
    assert allocated(acts[7]) - allocated(acts[6]) == 16 * n + 2 * 256 * n
    assert allocated(acts[6]) - allocated(acts[5]) == 16 * n + 2 * 256 * n
    four = allocated(estimate(2, 4, 4, "none", "GPipe", spec=tiny_spec(8)).pipeline_ranks[0])
    five = allocated(estimate(2, 4, 5, "none", "GPipe", spec=tiny_spec(8)).pipeline_ranks[0])
    assert five - four > 16 * n + 2 * 256 * n  # a fifth micro-batch in flight


def test_bill_names_the_worst_rank_and_the_pipeline() -> None:
    bill = gpumem.estimate(
        "llama-3.1-8b",
        framework="torchtitan",
        batch_size=8,
        seq_len=8192,
        recompute="selective",
        layout=gpumem.Layout(dp=8, pp=4),
    )
    totals = [r.per_gpu["total"] for r in bill.pipeline_ranks]
    assert len(totals) == 4 and bill.per_gpu["total"] == max(totals)
    assert bill.stage == totals.index(max(totals))
    assert "pipeline 1F1B over 4 ranks, 8 micro-batches of 1 (default: torchtitan's" in (
        bill.inputs_line()
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pp_schedule": "ZBVZeroBubble"}, ("ZBVZeroBubble", "not modelled", "1F1B, GPipe")),
        ({"pp_schedule": "1f1b"}, ("'1f1b'", "1F1B, GPipe, Interleaved1F1B")),
        ({"pp_microbatch_size": 3}, ("batch_size=8", "pp_microbatch_size=3")),
        ({"pp_microbatch_size": 0}, ("pp_microbatch_size", ">= 1")),
        ({"batch_size": 2}, ("1F1B", "2 < pp=4", "GPipe")),
        ({"loss_chunks": 8}, ("loss_chunks", "pp=4", "not modelled")),
        ({"layout": gpumem.Layout(dp=4, pp=4, tp=2)}, ("tp", "pp=4")),
        ({"layout": gpumem.Layout(dp=8, pp=4, vpp=4)}, ("vpp=4", "pp_schedule")),
        ({"framework": "megatron", "pp_schedule": "GPipe"}, ("pp_schedule", "megatron")),
    ],
)
def test_bad_pipeline_input_is_one_line(kwargs: dict, words: tuple[str, ...]) -> None:
    kw = {"framework": "torchtitan", "batch_size": 8, "seq_len": 8192,
          "layout": gpumem.Layout(dp=8, pp=4), **kwargs}  # fmt: skip
    with pytest.raises(ValueError) as e:
        gpumem.estimate("llama-3.1-8b", **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


# --- against torchtitan's own model, one pipeline rank fake-profiled ---------------------------


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(BENCH))  # it imports its sibling torchtitan_reference
    yield importlib.import_module("torchtitan_pp_reference")
    sys.path.remove(str(BENCH))


def _check(reference, schedule: str, pp: int, rank: int, n_mb: int, recompute: str, world: int):
    ac = recompute.split(":")[1] if ":" in recompute else recompute
    ref = reference.profile_pp_step(
        **TINY, world=world, pp=pp, pp_rank=rank, schedule=schedule, n_microbatches=n_mb,
        seq=SEQ, ac=ac,
    )  # fmt: skip
    bill = estimate(world, pp, n_mb, recompute, schedule).pipeline_ranks[rank]
    # AdamW's step counters and the loss's scalars: a few kB
    assert abs(allocated(bill) / ref.peak_bytes - 1) < 1e-3, (allocated(bill), ref.peak_bytes)


SAMPLE = [
    # schedule, pp, rank, micro-batches, recompute, FSDP ranks per stage
    ("1F1B", 2, 0, 4, "none", 2),  # the first rank: pp micro-batches in flight
    ("1F1B", 2, 1, 4, "selective", 2),  # the last rank: the loss with its logits cached
    ("1F1B", 4, 2, 8, "full", 1),  # a middle rank: its checkpointed input is the recv buffer
    ("Interleaved1F1B", 2, 0, 4, "selective", 2),
    ("GPipe", 2, 0, 4, "none", 2),  # every micro-batch in flight, the first backward's moments
]
SWEEP = [
    (s, pp, r, m, rc, w)
    for s, pp, m in (("1F1B", 2, 4), ("1F1B", 4, 8), ("1F1B", 2, 2), ("Interleaved1F1B", 2, 4),
                     ("GPipe", 2, 4))
    for r in range(pp)
    for rc in ("none", "selective", "full", "selective:2")
    for w in (1, 2)
]  # fmt: skip


@pytest.mark.parametrize(("schedule", "pp", "rank", "n_mb", "recompute", "world"), SAMPLE)
def test_rank_equals_fake_profile(reference, schedule, pp, rank, n_mb, recompute, world):
    _check(reference, schedule, pp, rank, n_mb, recompute, world)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "pp", "rank", "n_mb", "recompute", "world"), SWEEP)
def test_rank_equals_fake_profile_sweep(reference, schedule, pp, rank, n_mb, recompute, world):
    _check(reference, schedule, pp, rank, n_mb, recompute, world)
