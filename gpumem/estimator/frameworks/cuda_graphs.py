"""Megatron-LM's per-layer CUDA graphs (``--cuda-graph-impl transformer_engine
--cuda-graph-scope ...``): what their capture and their replays leave the allocator to count.

Megatron's ``TECudaGraphHelper`` (``megatron/core/transformer/cuda_graphs.py``) hands every
graphable layer of each model chunk (a decoder or MTP layer with a part in the scope,
``_layer_is_graphable``) to Transformer Engine's ``make_graphed_callables``
(``transformer_engine/pytorch/graph.py``): one forward and one backward graph per layer and
micro-batch (``get_num_microbatches()`` of them under pipelining, one without), captured once,
in the pipeline schedule's order (``_order``), into one private memory pool. Three things follow
for ``torch.cuda.max_memory_allocated`` (the CI's ``mem-max-allocated-bytes``):

- **Replay** (every training step): a graphed part's saved tensors live in the pool, whose
  blocks the caching allocator counts as free once the capture ended; a step's allocated bytes
  hold only the eager parts' saved tensors (``split_items``: each scope's items).
- **Capture** (once, at the start of iteration ``--cuda-graph-warmup-steps``, Megatron's
  default 3; ``megatron/training/training.py``): the schedule runs once with the graphed parts
  alone, their saved tensors allocated in the pool as they are made: its peak is the in-flight
  micro-batches of the graphed parts, without the embedding, the head and the loss
  (``PresetTerms`` ``graph_capture``). With 0 warm-up steps it comes before the first optimizer
  step: the optimizer has made its fp32 master weights (at construction) but not its state
  (Adam's moments, made by the first ``step``), so that view bills the master weights alone
  (``before_first_step``). The bill's peak is the larger of the capture's and a step's, and
  says which (phase ``CUDA-graph capture``); its steady figures are always a step's.
- **Static buffers** (TE >= 2.7, which Megatron asks to ``_reuse_graph_input_output_buffers``,
  and Megatron's own reuse in ``_get_sample_arguments``), what stays allocated for the
  replays (``static_bytes``):

  - the static inputs Megatron makes (``get_layer_static_inputs``): the hidden states
    ``[s·b/(tp·cp), h]`` and, when ``attn`` is in the scope, a bool attention mask
    ``[b, 1, s/cp, s]`` (``TransformerLayer``); a (layer, micro-batch) whose backward has run
    hands its inputs on to the next forward of the same signature, so there are as many as
    graphed layer forwards in flight at the first backward (``megatron.inflight_layers``
    over the graphed layers: every graphed layer with one micro-batch, without pipelining);
  - the static output gradients TE makes outside the pool, one set per output signature
    (a whole layer or part: the hidden states; ``moe_router`` without ``moe``: the residual,
    the pre-MLP norm's output, the shared experts' output and the fp32 routing probabilities);
  - the static outputs and input gradients live in the pool: TE drops its references to an
    output once its backward is captured, and to an input gradient once the next backward of
    the chunk is, which leaves the last backward's input gradient.

Scopes (``--cuda-graph-scope``, ``transformer/enums.py`` ``CudaGraphScope``): ``attn`` (the
input norm, self-attention and its residual), ``mlp`` (a dense layer's norm and MLP), ``moe``
(an MoE layer whole), ``moe_router`` (its norm, router and shared experts), ``moe_preprocess``
(the dispatcher's routing metadata: no saved tensors of note).
"""

from __future__ import annotations

from gpumem.estimator import peak
from gpumem.estimator.activations import Item

CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
"""``--cuda-graph-scope`` values priced (with ``--cuda-graph-impl transformer_engine``)."""

# the items (``megatron.layer_items`` names) each scope captures; a name ending in "." is a
# prefix, any other an exact name; (dense layers, MoE layers)
_ATTN = (
    *("attn_norm.", "qkv.", "q_norm.", "q_up.", "kv_norm.", "kv_up."),
    *("attn.", "proj.", "dropout.mask"),
)
_SCOPE_ITEMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attn": (_ATTN, _ATTN),
    "mlp": (("mlp_norm.", "mlp.", "dropout.mask2"), ()),
    "moe": ((), ("mlp_norm.", "router.", "dispatch.", "experts.", "shared.", "dropout.mask2")),
    "moe_router": ((), ("mlp_norm.", "router.", "shared.")),
    "moe_preprocess": ((), ()),
}


def check_scope(scope: object) -> tuple[str, ...]:
    """The scope as a tuple of known names.

    Raises:
        ValueError: a string, an unknown name or ``full_iteration`` (the ``local``
            implementation's whole step), in one line.
    """
    if isinstance(scope, str) or not isinstance(scope, (tuple, list)):
        raise ValueError(
            f"cuda_graph_scope must be a tuple of names from {', '.join(CUDA_GRAPH_SCOPES)}, "
            f"got {scope!r}"
        )
    for name in scope:
        if name not in CUDA_GRAPH_SCOPES:
            why = (
                " (full_iteration is --cuda-graph-impl local's whole step: not modelled)"
                if name == "full_iteration"
                else ""
            )
            raise ValueError(
                f"unknown cuda_graph_scope {name!r}; choose from {', '.join(CUDA_GRAPH_SCOPES)}"
                f"{why}"
            )
    return tuple(scope)


def _captured(name: str, names: tuple[str, ...]) -> bool:
    return any(name == n or (n.endswith(".") and name.startswith(n)) for n in names)


def split_items(items: list[Item], scope: tuple[str, ...], capture: bool) -> list[Item]:
    """A layer's items as a step's allocator sees them (``capture=False``: the graphed ones at
    0 bytes, in the pool) or as the capture does (``capture=True``: the eager ones at 0)."""
    moe = any(i.name.startswith("router.") for i in items)
    names = tuple(n for s in scope for n in _SCOPE_ITEMS[s][moe])
    return [
        Item(i.name, i.nbytes if _captured(i.name, names) == capture else 0, i.saved, i.core)
        for i in items
    ]


def graphed_layers(scope: tuple[str, ...], n_dense: int, n_moe: int) -> int:
    """Layers of a rank that get graphs: every layer under ``attn``, the dense ones under
    ``mlp``, the MoE ones under the MoE scopes."""
    if "attn" in scope:
        return n_dense + n_moe
    dense = n_dense if "mlp" in scope else 0
    return dense + (n_moe if any(s.startswith("moe") for s in scope) else 0)


def graph_outputs(
    scope: tuple[str, ...], moe: bool, shared: bool, boundary: float, probs: float
) -> float:
    """The output gradients one graph's backward reads (TE's static output gradients): the
    hidden states, or under ``moe_router`` without ``moe`` (an MoE layer captured up to its
    router) the residual, the pre-MLP norm's output and (``shared``) the shared experts'
    output (``boundary`` each; TransformerLayer's ``_te_cuda_graph_capture``) and the routing
    probabilities (``probs``)."""
    if moe and "moe" not in scope and ("moe_router" in scope or "moe_preprocess" in scope):
        return (3 if shared else 2) * boundary + probs
    return boundary


def static_bytes(
    scope: tuple[str, ...],
    inflight: float,
    boundary: float,
    mask: float,
    outputs: tuple[float, ...],
) -> float:
    """The static buffers of a rank's graphs (module docstring): a static input (the hidden
    states, ``boundary``, and the attention mask, ``mask``, under ``attn``) per graphed layer
    forward in flight (``inflight``), one set of output gradients per output signature
    (``outputs``: ``graph_outputs`` of each kind of layer graphed) and the last backward's
    input gradient."""
    if not scope or not inflight:
        return 0.0
    per_input = boundary + (mask if "attn" in scope else 0.0)
    return inflight * per_input + sum(set(outputs)) + boundary


def before_first_step(x: list[float], master_bytes: float) -> None:
    """The capture's terms ``x`` when it runs before the first optimizer step (0 warm-up
    steps): the optimizer holds its master weights, not yet its state."""
    x[peak.O_BYTES] = min(x[peak.O_BYTES], master_bytes)


def larger(replay: list[list[float]], capture: list[list[float]]) -> list[list[float]]:
    """Per rank, the terms of the view whose peak is the larger (the capture's or a step's):
    the planner's peak; the bill keeps both (``bill.make_bill``'s ``capture_by_stage``)."""
    return [
        c if peak.assemble(c)[peak.OUT_TOTAL] > peak.assemble(r)[peak.OUT_TOTAL] else r
        for r, c in zip(replay, capture, strict=True)
    ]
