"""torchtitan's pipeline parallelism: what one pipeline rank holds, stage by stage, moment by
moment of its schedule's order (``titan_schedules``), as the peak terms of each rank.

- **FSDP under PP** (``apply_fsdp_to_decoder(pp_enabled=True)``; ``PipelineStage``'s
  ``backward_maybe_with_nosync``): no unit reshards after forward or after backward until the
  stage's ``perform_reduce_grad``, so every unit of the rank stays gathered in bf16 from its first
  forward to the end of backward, and gradients accumulate unsharded in fp32
  (``reduce_dtype != param_dtype``) from a stage's first backward on; the reduce-scatter comes
  once, at the end.
- **What a stage keeps** (``PipelineStage``): a recv buffer per micro-batch for its input (all but
  the first stage) and for its output's gradient (all but the last), allocated once; per
  micro-batch in flight the blocks' saved tensors (``torchtitan.layer_saved`` under the policy,
  layer SAC counted within each stage, as ``_apply_ac`` numbers a part's blocks) and its output
  (the forward cache), the last stage its bf16 logits as well (the trainer's ``del pred`` does
  not reach the schedule's cache). The trainer moves every micro-batch's ids and labels to the
  device on every rank for the whole step.

Checked against one pipeline rank of torchtitan's model driven through torch's ``PipelineStage``
in its schedule's order under fake tensors (``benchmarks/published/torchtitan_pp_reference.py``).

Not modelled: ZBV / DualPipeV / zero-bubble schedules (the weight-gradient split), a CSV schedule,
``pipeline_parallel_layers_per_stage`` and explicit ``module_fqns_per_model_part``, PP with TP or
CP, the chunked loss, float8, the compiled loss and CUDA-graph-kept gradients under PP.
"""

from __future__ import annotations

from gpumem.estimator import peak
from gpumem.estimator.frameworks.titan_schedules import (
    StagePart,
    rank_order,
    stage_parts,
    stages_per_rank,
)
from gpumem.estimator.frameworks.torchtitan import (
    Shapes,
    TorchtitanKnobs,
    block_checkpointed,
    block_params,
    block_saved,
    head_saved,
    layer_saved,
)
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec

_BF16 = 2


class StageBytes:
    """What one local stage of a rank costs, per micro-batch and for the step (bytes)."""

    def __init__(self, spec: ModelSpec, sh: Shapes, part: StagePart, recompute: str) -> None:
        h, n = spec.hidden, sh.n
        self.part, self.blk = part, block_params(spec, 1)
        self.embed = spec.vocab * h if part.embed else 0
        self.head = spec.vocab * h + h if part.head else 0
        self.params = part.blocks * self.blk + self.embed + self.head
        # per micro-batch in flight: the blocks' saved tensors (layer SAC numbered within the
        # stage) and the output in the forward cache (the last stage: its bf16 logits, and the
        # head's saved tensors)
        self.saved = [block_saved(sh, recompute, j) for j in range(part.blocks)]
        # a checkpointed first block of a later stage saves its input: the recv buffer
        recv_in = not part.embed and part.blocks and block_checkpointed(recompute, 0)
        if recv_in:
            self.saved[0] -= sh.n_sp * h * _BF16
        self.out = n * sh.v * _BF16 if part.head else n * h * _BF16
        self.head_saved = sum(head_saved(sh).values()) if part.head else 0
        self.acts = sum(self.saved) + self.out + self.head_saved
        # recv buffers of every micro-batch: the input (not the first stage), the output's
        # gradient (not the last)
        self.recv_per_mb = n * h * _BF16 * ((not part.embed) + (not part.head))
        self.rope = part.blocks * sh.s * (spec.dhead // 2) * 8
        self.loss = 2 * n * sh.v * 4  # the loss backward's two fp32 logits-sized gradients
        # a block's backward moment beyond its saved set: a checkpointed block recomputes its
        # whole set beside its saved input; SwiGLU's gradients and w2's bf16 gradient
        none = sum(layer_saved(sh, "none").values())
        swiglu = sh.n_sp * h * _BF16 + 2 * n * sh.f * _BF16 + h * sh.f * _BF16
        self.temp = []
        for j in range(part.blocks):
            own = none
            if block_checkpointed(recompute, j) and not (j == 0 and recv_in):
                own += sh.n_sp * h * _BF16
            self.temp.append(own - self.saved[j] + swiglu)
        if part.blocks and not part.head:
            # the top block's incoming gradient is the stage's recv buffer (counted once)
            self.temp[-1] -= sh.n_sp * h * _BF16

    def backward_moments(self, accumulated: bool) -> list[tuple[float, float, float]]:
        """(this micro-batch's tensors still held, the stage's fp32 accumulators, the moment's
        temporaries) at each moment of one micro-batch's backward on this stage: the loss's
        (last stage), each block's from the top, the embedding's (first stage).
        ``accumulated``: the stage already ran a backward (every accumulator exists);
        otherwise a unit's accumulator appears once its backward is done."""
        out: list[tuple[float, float, float]] = []
        done = self.head  # units whose accumulator exists on a first backward
        acc = 4.0 * self.params
        if self.part.head:
            out.append((self.acts, acc if accumulated else 0.0, self.loss))
        for j in reversed(range(self.part.blocks)):
            held = sum(self.saved[: j + 1]) + self.out
            out.append((held, acc if accumulated else 4.0 * done, self.temp[j]))
            done += self.blk
        if self.part.embed:
            # the embedding's bf16 gradient beside every accumulator (on a first backward its
            # own is made from it: .to(float32) while the bf16 one lives)
            out.append((self.out, acc, 2.0 * self.embed))
        return [(float(a), g, float(t)) for a, g, t in out]


Moment = tuple[float, float, float]


def reduce_moment(st: StageBytes, n_shard: float) -> tuple[float, float]:
    """(fp32 gradients, temporaries) at the widest moment of a stage's ``perform_reduce_grad``:
    unit by unit (the embedding, the blocks, the head, in registration order) FSDP reshards the
    bf16 parameters, then reduce-scatters a copy of the unsharded fp32 accumulator into the
    sharded gradient; the accumulators of the units not yet reduced are still there."""
    units = [u for u in (st.embed, *[st.blk] * st.part.blocks, st.head) if u]
    best, freed, done = (4.0 * st.params, 0.0), 0.0, 0.0
    for u in units:
        grads = 4.0 * st.params - freed + done + 4.0 * u / n_shard
        temp = 4.0 * u - 2.0 * u  # the reduce-scatter input; its bf16 parameters resharded
        if grads + temp > sum(best):
            best = (grads, temp)
        freed += 4.0 * u + 2.0 * u  # its accumulator and its bf16 parameters
        done += 4.0 * u / n_shard
    return best


def rank_peak(
    stages: list[StageBytes], order: list[tuple[str, int, int]], n_shard: float
) -> Moment:
    """(activations, fp32 gradients, temporaries) at the widest moment of ``order``: the end of
    a forward, a moment of a backward (``StageBytes.backward_moments``) or of a stage's reduce
    after its last backward (``reduce_moment``), beside every other micro-batch in flight on
    each stage and the accumulators of the stages that have run a backward (the sharded
    gradients of those already reduced)."""
    by_index = {st.part.index: st for st in stages}
    inflight = dict.fromkeys(by_index, 0)
    accum = dict.fromkeys(by_index, 0.0)
    backwards = dict.fromkeys(by_index, 0)
    n_mb = sum(kind == "F" for kind, i, _ in order if i == stages[0].part.index)
    best: Moment = (0.0, 0.0, 0.0)
    for kind, i, _mb in order:
        st = by_index[i]
        if kind == "F":
            inflight[i] += 1
        acts = sum(inflight[j] * by_index[j].acts for j in by_index) - (kind == "B") * st.acts
        grads = sum(accum[j] for j in by_index if j != i)
        if kind == "F":
            own = [(0.0, accum[i], 0.0)]
        else:
            own = st.backward_moments(accum[i] > 0)
            inflight[i] -= 1
            accum[i] = 4.0 * st.params
            backwards[i] += 1
            if backwards[i] == n_mb:  # REDUCE_GRAD after the stage's last backward
                g, t = reduce_moment(st, n_shard)
                own.append((0.0, g, t))
                # its sharded gradients made, its bf16 parameters resharded
                accum[i] = 4.0 * st.params / n_shard - 2.0 * st.params
        for a, g, t in own:
            if acts + a + grads + g + t > sum(best):
                best = (acts + a, grads + g, t)
    return best


def check_pipeline(layout: Layout, batch: int, knobs: TorchtitanKnobs, persistent: bool) -> int:
    """The micro-batches of a pipelined torchtitan job, its knobs checked.

    Raises:
        ValueError: one line naming the knob that does not apply and the choices.
    """
    m, sched = knobs.pp_microbatch_size, knobs.pp_schedule
    if batch % m:
        raise ValueError(
            f"batch_size={batch} must be a multiple of pp_microbatch_size={m} (torchtitan "
            "splits the local batch into micro-batches of that size)"
        )
    per_rank = stages_per_rank(sched)
    if sched == "1F1B" and batch // m < layout.pp:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages (torch's Schedule1F1B): "
            f"batch_size={batch} / pp_microbatch_size={m} = {batch // m} < pp={layout.pp}; "
            "raise batch_size or use pp_schedule='GPipe'"
        )
    if layout.vpp not in (1, per_rank):
        raise ValueError(
            f"vpp={layout.vpp}: torchtitan's {sched} runs {per_rank} stage(s) per rank; leave "
            "vpp unset and pick pp_schedule (1F1B, GPipe: 1; Interleaved1F1B: 2)"
        )
    given = [
        name
        for name, on in (
            ("tp", layout.tp > 1),
            ("cp", layout.cp > 1),
            ("loss_chunks", knobs.loss_chunks > 0),
            ("fp8_recipe", knobs.fp8_recipe is not None),
            ("compiled_loss", knobs.compiled_loss),
            ("persistent_grads", persistent),
        )
        if on
    ]
    if given:
        raise ValueError(
            f"framework='torchtitan' with pp={layout.pp}: {', '.join(given)} under pipeline "
            "parallelism is not modelled yet; drop it or use pp=1"
        )
    return batch // m


def rank_stages(spec: ModelSpec, sh: Shapes, layout: Layout, sched: str, recompute: str):
    """Each pipeline rank's local stages (``StageBytes``), in rank order."""
    per_rank = stages_per_rank(sched)
    parts = stage_parts(spec.n_layers, layout.pp * per_rank)
    return [
        [StageBytes(spec, sh, parts[r + k * layout.pp], recompute) for k in range(per_rank)]
        for r in range(layout.pp)
    ]


def pipeline_terms(
    spec: ModelSpec,
    layout: Layout,
    gpu: GPU,
    *,
    batch: int,
    seq: int,
    recompute: str,
    cuda: bool,
    knobs: TorchtitanKnobs,
    persistent_grads: bool = False,
) -> list[list[float]]:
    """The peak terms (``peak.py``) of each pipeline rank of a torchtitan job: its stages'
    fp32 sharded states, the rope caches, every unit gathered in bf16, the recv buffers, the
    trainer's ids and labels (``IDS``), and the widest moment of its order (``rank_peak``): its
    activations, its fp32 unsharded accumulators (as gradients) and its temporaries."""
    n_mb = check_pipeline(layout, batch, knobs, persistent_grads)
    sched = knobs.pp_schedule
    sh = Shapes(spec, layout, knobs.pp_microbatch_size, seq)
    rows = []
    for r, stages in enumerate(rank_stages(spec, sh, layout, sched, recompute)):
        order = rank_order(sched, r, layout.pp, n_mb)
        acts, accum, temp = rank_peak(stages, order, layout.shard_degree(gpu.gpus_per_node))
        params = sum(st.params for st in stages)
        x = [0.0] * peak.N_TERMS
        x[peak.P_TRAIN], x[peak.P_PEND] = params, params  # no sharded gradient before the reduce
        x[peak.W_BYTES], x[peak.W_FROZEN_BYTES], x[peak.G_BYTES], x[peak.O_BYTES] = 4, 4, 4, 8
        x[peak.N_SHARD] = x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node)
        x[peak.STAGE] = 3
        x[peak.W_BUFFERS] = sum(st.rope for st in stages)
        x[peak.COMM] = n_mb * sum(st.recv_per_mb for st in stages)
        x[peak.IDS] = 2 * n_mb * sh.n * 8  # every micro-batch's ids and labels
        x[peak.A_FIRST], x[peak.N_LAYERS], x[peak.INFLIGHT] = x[peak.IDS], 1.0, 1.0
        x[peak.A_LAYER] = acts
        x[peak.G_START] = accum
        x[peak.T_BWD0] = temp
        x[peak.GATHER] = 2 * params  # every unit gathered (bf16) until the stage's reduce
        if cuda:
            x[peak.CONTEXT] = gpu.context_bytes
            x[peak.NCCL] = gpu.nccl_bytes
            x[peak.FRAG] = gpu.fragmentation
        rows.append(x)
    return rows


def pipeline_label(knobs: TorchtitanKnobs, pp: int, batch: int) -> str:
    """The bill's pipeline input: ``1F1B over 4 ranks, 8 micro-batches of 1``."""
    m = knobs.pp_microbatch_size
    per = stages_per_rank(knobs.pp_schedule)
    stages = f", {per * pp} stages" if per > 1 else ""
    return f"{knobs.pp_schedule} over {pp} ranks{stages}, {batch // m} micro-batches of {m}"


def pipeline_source(knobs: TorchtitanKnobs) -> str:
    """Where the bill's pipeline input came from: torchtitan's defaults, or given."""
    if (knobs.pp_schedule, knobs.pp_microbatch_size) == ("1F1B", 1):
        return "default: torchtitan's pipeline_parallel_schedule 1F1B, microbatch_size 1"
    return "given"
