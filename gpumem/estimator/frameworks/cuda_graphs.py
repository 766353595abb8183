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
- **Capture** (once, before the step that follows ``--cuda-graph-warmup-steps``): the schedule
  runs once with the graphed parts alone, their saved tensors allocated in the pool as they are
  made: its peak is the in-flight micro-batches of the graphed parts, without the embedding, the
  head and the loss (``PresetTerms`` ``graph_view="capture"``); the bill takes the larger view.
- **Static buffers**: each graph's boundary tensors stay allocated for replays: the static
  input Megatron makes per graph (``_get_sample_arguments``), the static outputs captured in the
  pool and the static input gradients of the backward graph (``Graphed`` holds both), and the
  output gradients (shared by every graph since TE 2.7's ``_reuse_graph_input_output_buffers``).
  ``STATIC_PER_GRAPH`` boundary tensors (a micro-batch's hidden states, ``[s·b/tp, h]`` under
  sequence parallelism) per graph: TE 2.7 also drops its references to the outputs and input
  gradients once captured, which would leave one, but the three CI cases' steady figures keep
  2.6-4.9 per graph above everything else (``benchmarks/results/published_megatron_named.md``).

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

STATIC_PER_GRAPH = 3
"""Boundary tensors a captured (layer, micro-batch) graph keeps allocated (module docstring)."""

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


def static_bytes(
    scope: tuple[str, ...], n_dense: int, n_moe: int, microbatches: int, boundary: float
) -> float:
    """The static buffers of a rank's graphs: ``STATIC_PER_GRAPH`` boundary tensors for each
    graphed layer and micro-batch (``microbatches``: the step's, under pipelining; else 1)."""
    if not scope:
        return 0.0
    return STATIC_PER_GRAPH * graphed_layers(scope, n_dense, n_moe) * microbatches * boundary


def larger(replay: list[list[float]], capture: list[list[float]]) -> list[list[float]]:
    """Per rank, the terms of the view whose peak is the larger (the capture's or a step's)."""
    return [
        c if peak.assemble(c)[peak.OUT_TOTAL] > peak.assemble(r)[peak.OUT_TOTAL] else r
        for r, c in zip(replay, capture, strict=True)
    ]
