"""The reference for torchtitan's pipeline parallelism: one pipeline rank of the job, its stage
(or stages) built with torchtitan's own splitting code, driven through one step in the order
torch's schedule runs it, profiled under fake tensors (``gpumem.profile``).

What is torchtitan's or torch's (torchtitan 0.3.0, torch 2.13, read in site-packages):

- the split: ``_generate_llm_fqn_per_model_part`` (``distributed/pipeline_parallel.py``; the
  embedding and ``[norm, lm_head]`` each weigh one layer: ``first/last_stage_less_layers=1``),
  ``_get_pp_rank_to_stage_indices_mapping`` (loop style: rank r holds stages r, r + pp, ...) and
  ``_split_module`` (a deep copy with the other modules set to None), as ``pipeline_llm`` does;
- each part then goes through what ``parallelize_llama`` applies: activation checkpointing and
  ``apply_fsdp_to_decoder(..., pp_enabled=True)``: no unit reshards after forward;
- the stage: torch's ``PipelineStage`` with static metadata (``input_args`` / ``output_args``), its
  own ``forward_one_chunk`` / ``backward_one_chunk`` / ``perform_reduce_grad``: the recv buffers of
  every micro-batch (activations and, but for the last stage, gradients), the forward cache of
  each micro-batch in flight (its output, the last stage's logits), FSDP's gradient accumulation
  without sync (``set_requires_gradient_sync(False)``: an unsharded fp32 gradient per parameter)
  until the stage's reduce, the loss through the schedule's ``_maybe_compute_loss``;
- the order: what the schedule's ``_step_microbatches`` runs on this rank. 1F1B and GPipe
  (``PipelineScheduleSingle``): their loop, transcribed (``schedule_actions``); Interleaved1F1B
  (a ``_PipelineScheduleRuntime``): its own lowered ``pipeline_order_with_comms[rank]``, with its
  UNSHARD / RESHARD / REDUCE_GRAD actions.

What is emulated (one process cannot run the other ranks): the send and receive operations are
not issued, so a received activation or gradient is whatever its recv buffer holds (fake tensors:
no values; the shapes are the schedule's); the first step's metadata inference is skipped (the
shapes are given, torch's static mode). The deviations of ``torchtitan_reference`` hold too
(flash attention called directly, the whole-logits ``CrossEntropyLoss``, no compile).

    python benchmarks/published/torchtitan_pp_reference.py --pp 4 --rank 0 --schedule 1F1B
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from typing import Any

import torch
from torchtitan_reference import (
    VOCAB,
    Result,
    ac_and_fsdp,
    adamw,
    fake_job,
    flash_forward,
    model_config,
    run_profiled,
)

import gpumem

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def schedule_actions(schedule: Any, rank: int, single: bool) -> list[tuple[str, int, int]]:
    """(kind, stage index, micro-batch) in the order the schedule runs them on ``rank``: kind F,
    B, UNSHARD, RESHARD or REDUCE_GRAD. A single-stage schedule's order is its
    ``_step_microbatches`` loop (1F1B: ``min(M, stages - index)`` warm-up forwards, then one
    backward and one forward, then the cool-down backwards; GPipe: every forward, then every
    backward), then the stage's reduce; a runtime schedule's is its lowered action list."""
    if not single:
        out = []
        for a in schedule.pipeline_order_with_comms[rank]:
            kind = a.computation_type.name
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B"}.get(kind, kind)
            if kind in ("F", "B", "UNSHARD", "RESHARD", "REDUCE_GRAD"):
                out.append((kind, a.stage_index, a.microbatch_index or 0))
        return out
    stage, m = schedule._stage.stage_index, schedule._n_microbatches
    if type(schedule).__name__ == "ScheduleGPipe":
        seq = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    else:
        warm = min(m, schedule._num_stages - stage)
        seq = [("F", i) for i in range(warm)]
        f = warm
        for b in range(m):
            seq.append(("B", b))
            if f < m:
                seq.append(("F", f))
                f += 1
    return [(k, stage, i) for k, i in seq] + [("REDUCE_GRAD", stage, 0)]


def _build_parts(cfg: Any, dims: Any, n_stages: int, idx: tuple[int, ...], ac: str) -> list:
    """The rank's model parts, as ``pipeline_llm`` builds them, each parallelized."""
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _split_module,
    )
    from torchtitan.models.llama3.model import Llama3Model

    fqns = _generate_llm_fqn_per_model_part(n_stages, len(cfg.layers), 1, 1)
    # _split_module deep-copies the whole model, which under fake tensors makes the copy's
    # tensors in another fake mode: each part is cut from a whole model of its own instead
    copy = pipeline_parallel.copy
    pipeline_parallel.copy = types.SimpleNamespace(deepcopy=lambda m: m)  # type: ignore[assignment]
    try:
        parts = [_split_module(Llama3Model(cfg), fqns[i]) for i in idx]
    finally:
        pipeline_parallel.copy = copy  # type: ignore[assignment]
    for part in parts:
        for block in part.layers.values():
            inner = block.attention.inner_attention
            inner.forward = types.MethodType(flash_forward, inner)
        ac_and_fsdp(part, dims.get_mesh(["fsdp"]), ac, pp_enabled=True)
    return parts


def _stages(parts: list, idx: tuple[int, ...], n_stages: int, dims: Any, mb: int, seq: int):
    """torch's PipelineStage for each part, its shapes given (static mode: a micro-batch of
    token ids into the first stage, bf16 hidden states between stages, bf16 logits out of the
    last)."""
    from torch.distributed.pipelining import PipelineStage

    group = dims.get_mesh("pp").get_group()
    out = []
    for part, i in zip(parts, idx, strict=True):
        hidden = torch.empty(mb, seq, _dim(part), dtype=torch.bfloat16)
        tokens = torch.zeros(mb, seq, dtype=torch.long)
        inp = tokens if i == 0 else hidden.requires_grad_()
        if i == n_stages - 1:
            vocab = part.lm_head.weight.shape[0]
            outp = torch.empty(mb, seq, vocab, dtype=torch.bfloat16, requires_grad=True)
        else:
            outp = torch.empty(mb, seq, _dim(part), dtype=torch.bfloat16, requires_grad=True)
        out.append(
            PipelineStage(
                part, i, n_stages, torch.device("cpu"), input_args=inp, output_args=outp,
                group=group,
            )
        )  # fmt: skip
    return out


def _dim(part: Any) -> int:
    block = next(iter(part.layers.values()), None)
    if block is not None:
        return int(block.attention_norm.weight.shape[0])
    return int(part.norm.weight.shape[0])


def _prepare(stages: list, n_mb: int) -> None:
    """What a step's first call sets up, in torch's static mode: the recv buffers."""
    from torch.distributed.pipelining.stage import InferenceMode

    for st in stages:
        st._inference_mode = InferenceMode.STATIC
        st.has_backward = True  # what the schedule's step sets (it has a loss_fn)
        st._prepare_forward_infra(n_mb, None, has_backward=True)
        st._prepare_backward_infra(n_mb)


def _run(schedule: Any, stages: dict, actions: list, tokens: list, labels: list, kw: dict):
    """One step: the actions as ``_PipelineScheduleRuntime._perform_action`` runs them, without
    the sends and receives."""
    from torch.distributed.fsdp import FSDPModule

    schedule._internal_losses.clear()
    counter: dict[int, int] = {}
    pending: dict[int, list] = {}
    for kind, i, mb in actions:
        st = stages[i]
        fsdp = [m for m in st.submod.modules() if isinstance(m, FSDPModule)]
        if kind == "UNSHARD":
            pending[i] = [m.unshard(async_op=True) for m in fsdp]
        elif kind == "RESHARD":
            for m in fsdp:
                m.reshard()
        elif kind == "F":
            for h in pending.pop(i, []):
                h.wait()
            out = st.forward_one_chunk(mb, (tokens[mb],), {}, save_forward_output=False)
            schedule._maybe_compute_loss(st, out, labels, mb, kw)
            st.get_fwd_send_ops(mb)
            del out
        elif kind == "B":
            counter[i] = counter.get(i, 0) + 1
            loss = schedule._maybe_get_loss(st, mb)
            st.backward_one_chunk(mb, loss=loss, last_backward=counter[i] == len(tokens))
            del loss
            st.get_bwd_send_ops(mb)
        elif kind == "REDUCE_GRAD":
            st.perform_reduce_grad(1)
    schedule._internal_losses.clear()
    for st in stages.values():
        st.output_chunks.clear()


def profile_pp_step(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim_multiplier: float | None,
    multiple_of: int,
    vocab: int = VOCAB,
    world: int,
    pp: int,
    pp_rank: int,
    schedule: str = "1F1B",
    n_microbatches: int,
    microbatch: int = 1,
    seq: int,
    ac: str,
    steps: int = 2,
) -> Result:
    """Peak allocated bytes of pipeline rank ``pp_rank`` (of ``pp``; ``world`` FSDP ranks per
    stage) over ``steps`` steps of ``n_microbatches`` micro-batches of ``microbatch`` x ``seq``
    tokens under ``schedule``, on fake CPU tensors."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
    cfg = model_config(
        dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab, seq
    )
    set_llama3_sharding_config(cfg, enable_sp=True)
    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    n_stages = pp * (1 if single else 2)
    idx = _get_pp_rank_to_stage_indices_mapping(pp_rank, pp, schedule, n_stages)
    with fake_job(world, pp=pp, pp_rank=pp_rank) as dims, gpumem.fake():
        parts = _build_parts(cfg, dims, n_stages, idx, ac)
        params = [p for part in parts for p in part.parameters()]
        opt = adamw(params)
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab).build()

        def scalar_loss(*a: Any, **k: Any) -> torch.Tensor:
            return loss_fn(*a, **k)[0]

        stages = _stages(parts, idx, n_stages, dims, microbatch, seq)
        sched = cls(
            stages[0] if single else stages,
            n_microbatches=n_microbatches,
            loss_fn=scalar_loss,
            scale_grads=False,
        )
        actions = schedule_actions(sched, pp_rank, single)
        by_index = {st.stage_index: st for st in stages}
        kw = {"global_valid_tokens": torch.tensor(n_microbatches * microbatch * seq * world)}
        shape = (microbatch, seq)

        def step(first: bool) -> None:
            opt.zero_grad(set_to_none=True)
            # the trainer moves every micro-batch's input ids and labels to the device on every
            # pipeline rank, for the whole step
            tokens = [torch.randint(0, vocab, shape) for _ in range(n_microbatches)]
            labels = [torch.randint(0, vocab, shape) for _ in range(n_microbatches)]
            if first:
                _prepare(stages, n_microbatches)
            _run(sched, by_index, actions, tokens, labels, kw)
            clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=dims.get_mesh("pp"))
            opt.step()

        return run_profiled(torch.nn.ModuleList(parts), opt, lambda i: step(i == 0), steps)


def main() -> None:
    from torchtitan_reference import FLAVORS

    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="8B", choices=sorted(FLAVORS))
    ap.add_argument("--world", type=int, default=8, help="FSDP ranks per stage")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--rank", type=int, default=0, help="the pipeline rank profiled")
    ap.add_argument("--schedule", default="1F1B", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ac", default="selective")
    args = ap.parse_args()
    d, n_layers, n_heads, n_kv, mult, multiple_of = FLAVORS[args.flavor]
    r = profile_pp_step(
        dim=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, ffn_dim_multiplier=mult,
        multiple_of=multiple_of, world=args.world, pp=args.pp, pp_rank=args.rank,
        schedule=args.schedule, n_microbatches=args.microbatches, seq=args.seq, ac=args.ac,
    )  # fmt: skip
    print(json.dumps(dataclasses.asdict(r), indent=1))


if __name__ == "__main__":
    main()
