"""torchtitan's pipeline schedules: how its stages are cut and in what order a rank runs
their forwards and backwards (torchtitan 0.3.0 on torch 2.13's ``torch.distributed.pipelining``).

- **The split** (``distributed/pipeline_parallel.py``, ``_generate_llm_fqn_per_model_part``): the
  model's ``L`` blocks plus the embedding and ``[norm, lm_head]`` (one layer each:
  ``pipeline_parallel_first/last_stage_less_layers = 1``) spread over the stages, the first
  ``(L + 2) % stages`` stages one layer more; a single-stage schedule (1F1B, GPipe) has one stage
  per rank, a looped one (Interleaved1F1B) two, rank ``r`` holding stages ``r`` and ``r + pp``
  (``_get_pp_rank_to_stage_indices_mapping``).
- **The order** (``torch.distributed.pipelining.schedules``): 1F1B's ``_step_microbatches`` runs
  ``min(M, stages - stage)`` warm-up forwards, then a backward and a forward in turn, then the
  cool-down backwards; GPipe every forward, then every backward; Interleaved1F1B the action list
  of ``_get_1f1b_rank_ops`` (``_get_warmup_ops`` with ``multiply_factor=2``), transcribed in
  ``rank_order`` (tests/estimator/test_titan_pipeline.py checks it against torch's own).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""torchtitan's ``pipeline_parallel_schedule`` values modelled (1F1B is its default)."""
LOOPED = ("Interleaved1F1B",)
_ELSEWHERE = ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble", "LoopedBFS")


def check_schedule(schedule: str) -> None:
    """One line naming the schedules modelled when ``schedule`` is not one of them.

    Raises:
        ValueError: an unknown or not modelled schedule.
    """
    if schedule in SCHEDULES:
        return
    why = " (torch has it; not modelled yet)" if schedule in _ELSEWHERE else ""
    raise ValueError(
        f"pp_schedule={schedule!r}{why} is not a torchtitan schedule gpumem models; "
        f"framework='torchtitan' takes {', '.join(SCHEDULES)} (torchtitan's default: 1F1B)"
    )


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage's modules: whether it holds the embedding, its blocks, the head."""

    index: int
    embed: bool
    blocks: int
    head: bool


def stage_parts(n_layers: int, n_stages: int) -> list[StagePart]:
    """The stages as ``_generate_llm_fqn_per_model_part(n_stages, n_layers, 1, 1)`` splits them.

    Raises:
        ValueError: more stages than layers to give them (torchtitan's own checks).
    """
    if n_stages == 1:
        return [StagePart(0, True, n_layers, True)]
    effective = n_layers + 2
    per, extra = divmod(effective, n_stages)
    if n_stages > effective or per < 1:
        raise ValueError(
            f"{n_stages} pipeline stages need at least {n_stages - 2} blocks (torchtitan counts "
            f"the embedding and the head as one layer each); the model has {n_layers}"
        )
    parts, done = [], 0
    for i in range(n_stages):
        n = per + (1 if i < extra else 0)
        n -= (i == 0) + (i == n_stages - 1)
        n = max(0, min(n, n_layers - done))
        done += n
        parts.append(StagePart(i, i == 0, n, i == n_stages - 1))
    return parts


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds by default: 2 under a looped schedule, else 1."""
    return 2 if schedule in LOOPED else 1


def rank_order(schedule: str, rank: int, pp: int, n_mb: int) -> list[tuple[str, int, int]]:
    """(``F`` or ``B``, stage index, micro-batch) in the order ``schedule`` runs them on
    ``rank``.

    Raises:
        ValueError: Interleaved1F1B with micro-batches that are not a multiple of its rounds.
    """
    if schedule == "GPipe":
        return [("F", rank, i) for i in range(n_mb)] + [("B", rank, i) for i in range(n_mb)]
    if schedule == "1F1B":
        warm = min(n_mb, pp - rank)
        out, f = [("F", rank, i) for i in range(warm)], warm
        for b in range(n_mb):
            out.append(("B", rank, b))
            if f < n_mb:
                out.append(("F", rank, f))
                f += 1
        return out
    return _interleaved_order(rank, pp, n_mb)


def _interleaved_order(rank: int, pp: int, n_mb: int) -> list[tuple[str, int, int]]:
    """torch's ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (two local
    stages), its padding dropped."""
    local = 2
    rounds = max(1, n_mb // pp)
    per_round = n_mb // rounds
    if n_mb % rounds:
        raise ValueError(
            f"Interleaved1F1B needs micro-batches ({n_mb}) a multiple of its rounds "
            f"(max(1, {n_mb} // pp={pp}) = {rounds}): change batch_size or pp_microbatch_size"
        )
    warmup = min((local - 1) * per_round + 2 * (pp - 1 - rank), n_mb * local)
    total = local * n_mb
    fwd_bwd = total - warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % local) * pp + rank

    def bwd_stage(step: int) -> int:
        return (local - 1 - ((step - warmup) // per_round) % local) * pp + rank

    out: list[tuple[str, int, int]] = []
    fmb: dict[int, int] = {}
    bmb: dict[int, int] = {}
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            s = fwd_stage(op)
            out.append(("F", s, fmb.get(s, 0)))
            fmb[s] = fmb.get(s, 0) + 1
        if op >= warmup:
            s = bwd_stage(op)
            out.append(("B", s, bmb.get(s, 0)))
            bmb[s] = bmb.get(s, 0) + 1
    return out
