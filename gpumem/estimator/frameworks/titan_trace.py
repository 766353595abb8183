"""Reserved memory of a torchtitan rank: its training steps' allocations, in the order torchtitan
and FSDP2 make them and on the streams they make them on, run through the caching allocator
simulator (``gpumem.allocator``); the figure ``torchtitan.terms`` leaves as ``peak.FRAG_BYTES``
and ``peak.RESERVED_FRAG`` when an alloc conf is set.

What each allocation is and where it comes from (torch's ``distributed/fsdp/_fully_shard/``,
torchtitan 0.3.0; sizes per rank, ``torchtitan.py`` gives the saved tensors):

- **Streams** (``_fsdp_param_group.py``, ``FSDPCommContext.lazy_init``): the caching allocator
  keeps one pool per stream, so what FSDP2 allocates off the default stream can never be reused
  by the step's tensors. ``foreach_all_gather`` (``_fsdp_collectives.py``) allocates the flat
  bf16 all-gather output (and the flat bf16 copy of the shard it sends) inside
  ``all_gather_copy_in_stream``; ``foreach_reduce`` allocates the reduce-scatter output — the
  unit's new sharded fp32 gradient, which the parameters then hold until ``zero_grad`` — inside
  ``reduce_scatter_stream``. Everything else is on the default stream.
- **All-gather** (``wait_for_unshard``): ``foreach_all_gather_copy_out`` allocates each
  parameter's unsharded bf16 tensor; in forward the flat output is kept in ``all_gather_state``
  until the next unit's copy-out (so two are alive), in backward freed after its own copy-out;
  ``reshard`` frees the unsharded tensors (every block and the embedding after forward, the
  ``[norm, lm_head]`` unit only after backward: ``reshard_after_forward`` is False for it).
  Backward prefetches one unit: block i-1's all-gather is issued at block i's pre-backward.
- **Reduce-scatter**: autograd's unsharded bf16 weight gradients, copied into one flat fp32
  reduce-scatter input (default stream) and freed; that input is kept in
  ``reduce_scatter_states`` until the next unit's reduce-scatter (one buffer), the last freed
  at the end of backward.
- **The block** under torchtitan's AC: its saved tensors (``torchtitan.layer_saved``), forward's
  widest temporaries (SwiGLU's three ffn-wide tensors at the product), in backward the tensors
  the checkpoint recomputes and the widest moment's temporaries (``torchtitan.terms``).
- **The loss** (``components/loss.py``): the bf16 logits, their fp32 copy (``.float()``),
  log-softmax's fp32 output, the copy freed; ``del pred`` frees the logits; backward allocates
  nll's fp32 gradient, log-softmax's, the bf16 gradient of the logits, each freeing the one
  before. Compiled (``compiled_loss``, ``titan_compile``): the forward keeps the logits and two
  per-row fp32 statistics; the backward allocates a per-row buffer and the bf16 gradient, then
  frees what the forward kept.
- **The optimizer**: fused AdamW allocates ``exp_avg`` and ``exp_avg_sq`` per sharded parameter
  at its first step; ``zero_grad(set_to_none=True)`` frees the sharded gradients before the next
  step's forward.

Three steps are simulated (the first lacks the optimizer states; the reserved figure is steady
from the second on), which is what torchtitan's ``reserved_bytes.all.peak`` reads at its log
steps. Not modelled: the small per-step tensors (the grad-norm's, RoPE's per-step casts),
the compiled blocks (priced as eager) and float8.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator.frameworks.titan_compile import compiled_loss_bwd, compiled_loss_saved
from gpumem.estimator.step_trace import Run, new_run

DEFAULT, COPY_IN, REDUCE_SCATTER = 0, 1, 2
"""The streams: the default one, FSDP2's all-gather copy-in stream, its reduce-scatter stream."""
STEPS = 3


@dataclass(frozen=True)
class TitanShape:
    """One torchtitan rank's tensors, bytes per tensor as asked for (``torchtitan.titan_shape``)."""

    block: tuple[int, ...]
    """A block's parameter tensors, elements each (unsharded)."""
    embed: tuple[int, ...]
    head: tuple[int, ...]
    """The ``[norm, lm_head]`` unit's tensors."""
    shard: int
    saved: tuple[tuple[int, ...], ...]
    """Each block's saved tensors, in forward order."""
    recomputed: tuple[tuple[int, ...], ...]
    """Each block's tensors made again in its backward."""
    fwd_temp: tuple[int, ...]
    bwd_temp: tuple[int, ...]
    first: tuple[int, ...]
    """The step's inputs (token ids, labels) and the embedding's saved tensors."""
    head_saved: tuple[int, ...]
    """The final norm's saved tensors and the lm_head's input."""
    logits: int
    """Elements of the logits (tokens x local vocabulary)."""
    buffers: tuple[int, ...] = ()
    """Long-lived buffers (the RoPE caches)."""
    compiled_loss: bool = False
    """The loss compiled by Inductor (``titan_compile``)."""


class _Unit:
    """One FSDP unit's state in the trace."""

    def __init__(self, params: tuple[int, ...], shard: int) -> None:
        self.params = params
        self.flat = sum(params)
        self.shard = shard
        self.unsharded: list[int] = []


def simulate(conf: AllocConf, s: TitanShape) -> tuple[int, int]:
    """(unreleasable, reserved) bytes over the trace's requested peak (see the module)."""
    return simulated_run(conf, s).result()


@functools.lru_cache(maxsize=256)
def simulated_run(conf: AllocConf, s: TitanShape) -> Run:
    """The allocator after ``STEPS`` steps (its segments, peaks); never mutated."""
    run = new_run(conf)
    ns = s.shard
    units = [_Unit(s.embed, ns)] + [_Unit(s.block, ns) for _ in s.saved]
    head = _Unit(s.head, ns)
    order = [*units, head]
    # the sharded fp32 parameters (FSDP2's master weights), then the model's buffers
    for u in order:
        for n in u.params:
            run.take(-(-n // ns) * 4)
    for b in s.buffers:
        run.take(b)
    sharded_grads: list[int] = []
    states: list[int] = []
    for _ in range(STEPS):
        for h in sharded_grads:  # zero_grad(set_to_none=True)
            run.give(h)
        sharded_grads = []
        _step(run, s, order, sharded_grads)
        if not states:  # fused AdamW: exp_avg and exp_avg_sq at the first step
            for u in order:
                for n in u.params:
                    states += [run.take(-(-n // ns) * 4), run.take(-(-n // ns) * 4)]
    return run


def _all_gather(run: Run, u: _Unit) -> int:
    """``foreach_all_gather``: the shard's flat bf16 copy and the flat output, copy-in stream."""
    send = run.take(2 * -(-u.flat // u.shard), stream=COPY_IN)
    out = run.take(2 * -(-u.flat // u.shard) * u.shard, stream=COPY_IN)
    run.give(send)
    return out


def _copy_out(run: Run, u: _Unit) -> None:
    u.unsharded = [run.take(2 * n) for n in u.params]


def _reshard(run: Run, u: _Unit) -> None:
    for h in u.unsharded:
        run.give(h)
    u.unsharded = []


def _reduce(run: Run, u: _Unit, grads: list[int], rs: list[int], sharded: list[int]) -> None:
    """``foreach_reduce``: the flat fp32 input (kept until the next unit's), the unsharded grads
    freed, the sharded fp32 gradient on the reduce-scatter stream."""
    flat = run.take(4 * -(-u.flat // u.shard) * u.shard)
    for h in grads:
        run.give(h)
    sharded.append(run.take(4 * -(-u.flat // u.shard), stream=REDUCE_SCATTER))
    for h in rs:
        run.give(h)
    rs[:] = [flat]


def _eager_loss(run: Run, s: TitanShape, logits: int) -> int:
    """The eager loss forward and backward; returns the logits' gradient."""
    upcast = run.take(4 * s.logits)
    log_probs = run.take(4 * s.logits)
    run.give(upcast)
    run.give(logits)  # del pred
    g_nll = run.take(4 * s.logits)
    g_lsm = run.take(4 * s.logits)
    run.give(g_nll)
    run.give(log_probs)
    g_logits = run.take(2 * s.logits)
    run.give(g_lsm)
    return g_logits


def _compiled_loss(run: Run, s: TitanShape, logits: int) -> int:
    """Inductor's loss (``titan_compile``): the forward keeps the logits (``del pred`` drops
    only a reference) and per-row statistics, the backward a per-row buffer and the gradient;
    the saved tensors are freed as it returns."""
    n = s.first[0] // 8  # tokens (the int64 token ids)
    v = s.logits // n
    stats = [run.take(b) for k, b in compiled_loss_saved(n, v).items() if k != "logits"]
    row, grad = compiled_loss_bwd(n, v)
    row_buf = run.take(row)
    g_logits = run.take(grad)
    run.give(row_buf)
    for h in (*stats, logits):
        run.give(h)
    return g_logits


def _step(run: Run, s: TitanShape, order: list[_Unit], sharded: list[int]) -> None:
    embed, blocks, head = order[0], order[1:-1], order[-1]
    first = [run.take(n) for n in s.first]
    # forward: each unit gathered (the previous unit's flat output kept until this copy-out)
    held: int | None = None
    saved: list[list[int]] = []
    for u in order:
        out = _all_gather(run, u)
        if held is not None:
            run.give(held)
        _copy_out(run, u)
        held = out
        if u is head:
            break
        if u is not embed:
            saved.append([run.take(n) for n in s.saved[len(saved)]])
            for h in [run.take(n) for n in s.fwd_temp]:
                run.give(h)
        _reshard(run, u)
    hs = [run.take(n) for n in s.head_saved]
    logits = run.take(2 * s.logits)
    if held is not None:  # the root's post-forward frees the last all-gather output
        run.give(held)
    g_logits = (_compiled_loss if s.compiled_loss else _eager_loss)(run, s, logits)
    grads = [run.take(2 * n) for n in head.params]
    run.give(g_logits)
    for h in hs:
        run.give(h)
    rs: list[int] = []
    _reduce(run, head, grads, rs, sharded)
    _reshard(run, head)
    # the blocks from the last, each prefetching the one before (the embedding last)
    fetched = _all_gather(run, blocks[-1])
    for i in range(len(blocks) - 1, -1, -1):
        u = blocks[i]
        out, fetched = fetched, _all_gather(run, blocks[i - 1] if i else embed)
        _copy_out(run, u)
        run.give(out)
        rc = [run.take(n) for n in s.recomputed[i]]
        tmp = [run.take(n) for n in s.bwd_temp]
        grads = [run.take(2 * n) for n in u.params]
        for h in (*tmp, *rc, *reversed(saved[i])):
            run.give(h)
        _reduce(run, u, grads, rs, sharded)
        _reshard(run, u)
    _copy_out(run, embed)
    run.give(fetched)
    grads = [run.take(2 * n) for n in embed.params]
    for h in first[2:]:
        run.give(h)
    _reduce(run, embed, grads, rs, sharded)
    _reshard(run, embed)
    for h in rs:  # the root's post-backward: the last reduce-scatter input
        run.give(h)
    for h in first[:2]:
        run.give(h)


__all__ = [
    "COPY_IN",
    "DEFAULT",
    "REDUCE_SCATTER",
    "STEPS",
    "TitanShape",
    "simulate",
    "simulated_run",
]
