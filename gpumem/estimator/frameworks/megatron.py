"""Megatron-LM's conventions: Megatron-core with Transformer Engine, as its CI runs it.

Each rule names the Megatron-core (or Transformer Engine) source it follows; the check against
the CI's golden values is ``benchmarks/published/megatron_check.py``.

- **Saved tensors of a layer** (``megatron/core/transformer/transformer_layer.py`` with the TE
  spec of ``models/gpt/gpt_layer_specs.py``): the input norm is fused into the q/k/v Linear
  (TE ``LayerNormLinear``: the norm's input and statistics, and its output for the weight
  gradient), the attention (TE ``DotProductAttention``: fused kernels keep q, k, v, the output
  and the fp32 softmax statistics; the unfused backend keeps q, k, the s x s softmax output,
  the attention-dropout mask and output, v and the output's contiguous copy), the output
  projection reads the attention output, ``bias_dropout_add`` keeps a 1-byte mask per hidden
  element when ``--hidden-dropout`` > 0 (Megatron's default is 0.1), the MLP norm is fused into
  fc1 the same way, the activation keeps fc1's output (SwiGLU's 2·ffn) and fc2 its input.
  Under sequence parallelism TE saves the local shard of a norm's output and all-gathers it
  again in backward. GeLU and squared-ReLU MLPs (``--squared-relu``) keep two ffn-wide tensors,
  SwiGLU three (its input is 2·ffn wide), experts included (``transformer/moe/experts.py``
  ``TEGroupedMLP`` prices its experts by the model's own activation).
- **MoE layer** (``transformer/moe/moe_layer.py``, ``router.py``, ``token_dispatcher.py``): the
  router's bf16 input (``RouterGatingLinearFunction``) and fp32 logits, scores and top-k, the
  tokens the local experts receive (``n_local · top_k``, times ``moe_imbalance`` under expert
  parallelism, gathered over the expert-TP group), the grouped fc1's input, output and fc2's
  input, and the expert output with its fp32 routing probabilities for the combine; shared
  experts as a dense MLP.
- **Loss inside forward** (``models/gpt/gpt_model.py``, ``compute_language_model_loss``): no
  logits held by the loop. ``tensor_parallel/cross_entropy.py`` upcasts the vocab-parallel
  logits to fp32 and keeps that copy (exponentiated in place) for backward; at its widest the
  bf16 logits (forward) or the bf16 gradient (backward) sit beside it: 4 B saved + 2 B
  transient per logit. ``--cross-entropy-loss-fusion`` (``fusions/fused_cross_entropy.py``,
  the jit-fused version the CI golden values were measured with) computes ``exp`` and the
  gradient out of place: one more fp32 logits-sized tensor at its widest moment, which is why
  the measured peak goes *up* with the fusion (the in-place rewrite of 2026 removes it).
- **Deferred embedding wgrad** (``--defer-embedding-wgrad-compute``,
  ``tensor_parallel/layers.py``): the output layer's weight gradient waits for the pipeline's
  cool-down; its logits-sized gradient and its input of up to ``--wgrad-deferral-limit``
  earlier micro-batches stay (``deferred_wgrad_bytes``); on the last stage of a pipeline.
- **Allocator-visible workspaces** (cuBLAS ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` per handle and
  stream, Transformer Engine's cuBLASLt workspace): allocated through PyTorch's caching
  allocator, present in both golden figures; grouped experts add TE's four multi-stream
  workspaces (``GROUPED_GEMM_WORKSPACE``). One constant, ``WORKSPACE_BYTES``, calibrated as
  the median over the tuned half of the golden values of (steady measured − weights − grads −
  optimizer), see ``benchmarks/published/megatron_check.py``.
- **FP8** (``fp8_utils.py``, TE ``module/linear.py`` / ``layernorm_linear.py``): a Linear saves
  its fp8 input (the column-wise copy the weight gradient needs): 1 B per element for
  ``delayed`` and ``tensorwise`` (current) scaling, plus one E8M0 scale per 32 for ``mxfp8`` and
  one fp32 scale per 128 for ``blockwise``; the norm fused into a Linear emits fp8 directly.
  The bf16 weights get fp8 row- and column-wise copies cached for the step (2 B per Linear
  weight, scales as above) unless ``--fp8-param-gather`` keeps the primary weights in fp8
  (then the fp8 copy replaces the bf16 one). Attention, norms, the activation's input and the
  output layer stay in bf16.
- **Pipeline split** (``transformer/transformer_block.py`` ``get_num_layers_to_build``):
  ``--decoder-first/last-pipeline-num-layers`` give the first and last stage their own layer
  counts and split the rest evenly; ``--account-for-embedding/loss-in-pipeline-split`` count
  the embedding and the loss as one layer each in an even split (the first and the last
  virtual chunk build one layer less).
- **MTP** (``transformer/multi_token_prediction.py``): each of ``--mtp-num-layers`` runs on the
  last stage a norm of the hidden state and of the next token's embedding, their concatenation
  through ``eh_proj`` (2h → h), a transformer layer of the model's last kind, the final norm
  and the shared output layer with its own cross-entropy; under pipelining the last stage keeps
  its own copy of the word embedding.
- **Pipeline inputs** (``pipeline_parallel/schedules.py``): every chunk that receives its input
  from the previous stage keeps the last one, and its retained gradient, after the step
  (``pipeline_input_bytes``); with the workspaces they are counted as the rank's buffers
  (weights), present in every phase.
- **Megatron-FSDP** (``distributed/fsdp/``, ``--use-megatron-fsdp`` with
  ``--data-parallel-sharding-strategy optim_grads_params``): ``zero=3`` under
  ``framework="megatron"``: bf16 weights, fp32 main grads and the optimizer sharded over
  ``dp · cp``; a layer's unsharded weights (and the next one's, prefetched) and its unsharded
  fp32 gradient live during forward and backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpumem.estimator import peak
from gpumem.estimator.activations import Item, Workload, expert_tokens
from gpumem.estimator.frameworks import cuda_graphs, torchtitan
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""TE's fp8 recipes as Megatron names them (``--fp8-recipe``; ``tensorwise`` is current
scaling)."""

WORKSPACE_BYTES = 104_852_736
"""Allocator-visible library workspaces of one rank (cuBLAS, Transformer Engine), bytes: the
median over the tuned half of ``benchmarks/published/megatron_golden.json`` (14 H100 runs) of
the measured steady figure minus everything else the estimate puts there (weights, gradients,
optimizer, grouped-GEMM workspaces, pipeline inputs); ``megatron_check.py --workspace`` prints
the residuals (80-129 MiB for 12 of the 14; the two MLA/MoE runs keep more)."""

GROUPED_GEMM_WORKSPACE = 4 * 32 * 2**20
"""TE's grouped GEMM (``TEGroupedMLP``) runs on ``num_streams = 4`` compute streams
(``common/include/transformer_engine/multi_streams.h``), each with its own cuBLAS workspace of
``get_cublas_workspace_size_bytes()`` = 32 MiB on Hopper (``pytorch/module/base.py``)."""


RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
"""``--recompute-modules`` (``transformer_config.py``: ``recompute_modules``; default core_attn)."""
OFFLOAD_MODULES = (
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
)  # fmt: skip
"""``--offload-modules`` of ``--fine-grained-activation-offloading``."""
# what a layer no longer keeps when a module is recomputed (Megatron discards the checkpointed
# module's output after its consumer ran: ``CheckpointWithoutOutput``) ...
_RECOMPUTED = {
    "moe_act": ("experts.fc2_input",),
    "layernorm": (
        *("attn_norm.stats", "qkv.input", "mlp_norm.stats", "mlp.fc1_input"),
        *("router.input", "shared.fc1_input"),
    ),
    "mla_up_proj": (
        *("q_norm.stats", "q_up.input", "kv_norm.stats", "kv_up.input"),
        *("attn.q", "attn.k", "attn.v"),
    ),
    "mlp": ("mlp.fc1_out", "mlp.fc2_input"),
    "moe": (
        *("router.logits_scores_probs", "router.topk", "dispatch.", "experts."),
        *("shared.fc1_out", "shared.fc2_input"),
    ),
    "shared_experts": ("shared.fc1_out", "shared.fc2_input"),
}
# ... and when a module is offloaded: every tensor saved inside it goes to the host (its
# saved-tensor hooks), reloaded for its backward
_OFFLOADED = {
    "attn_norm": ("attn_norm.",),
    "qkv_linear": ("qkv.input",),
    "core_attn": ("attn.",),
    "attn_proj": ("proj.input_fp8",),
    "mlp_norm": ("mlp_norm.",),
    "expert_fc1": ("experts.fc1_input",),
    "moe_act": ("experts.fc1_out",),
}


def module_items(items: list[Item], k: MegatronKnobs) -> list[Item]:
    """A layer's items under ``recompute_modules`` and ``offload_modules``: what those modules
    no longer keep at 0 bytes (kept by name: the backward replay finds its places), the
    attention core's ``core`` mark dropped when ``core_attn`` is not recomputed."""
    if not k.recompute_modules and not k.offload_modules:
        return items
    gone = tuple(n for m in k.recompute_modules for n in _RECOMPUTED.get(m, ()))
    gone += tuple(n for m in k.offload_modules for n in _OFFLOADED[m])
    core = not k.recompute_modules or "core_attn" in k.recompute_modules
    return [
        Item(i.name, 0 if i.name.startswith(gone) else i.nbytes, i.saved, i.core and core)
        for i in items
    ]


@dataclass(frozen=True)
class MegatronKnobs:
    """Megatron-LM arguments the estimate takes (``gpumem.estimate(megatron=...)``), checked
    when made: ``--fp8-recipe`` (``delayed``, ``tensorwise``, ``mxfp8``, ``blockwise``;
    ``precision="fp8"`` is delayed), ``--fp8-param-gather``, ``--hidden-dropout`` (Megatron's
    default 0.1; the attention's dropout is ``ActivationKnobs.dropout``),
    ``--defer-embedding-wgrad-compute``, ``--wgrad-deferral-limit``,
    ``--decoder-first/last-pipeline-num-layers``,
    ``--account-for-embedding/loss-in-pipeline-split`` and
    ``--pipeline-model-parallel-layout`` (``pipeline_layout``, ``layout_chunks``),
    ``--recompute-modules`` (with ``recompute="selective"``) and ``--fine-grained-activation-
    offloading --offload-modules`` (``recompute_modules``, ``offload_modules``: what each
    module then no longer keeps on the GPU, ``_RECOMPUTED`` / ``_OFFLOADED``), and
    ``--num-distributed-optimizer-instances`` (``dist_opt_instances``: the distributed
    optimizer is replicated that many times over the data-parallel group, each copy sharded
    over ``dp · cp / instances`` ranks: ``distributed_data_parallel_config``'s
    ``num_distributed_optimizer_instances``, the intra-instance group of
    ``parallel_state.initialize_model_parallel``), and ``--cuda-graph-impl transformer_engine
    --cuda-graph-scope`` (``cuda_graph_scope``: per-layer CUDA graphs of those parts, priced by
    ``cuda_graphs.py``; empty: none) with ``--cuda-graph-warmup-steps``
    (``cuda_graph_warmup_steps``, Megatron's default 3: with 0 the capture runs before the
    first optimizer step has made the optimizer's state).

    Raises:
        ValueError: one line naming the knob and the valid choices.
    """

    fp8_recipe: str | None = None
    fp8_param_gather: bool = False
    hidden_dropout: float = 0.0
    defer_embedding_wgrad: bool = False
    wgrad_deferral_limit: int = 0
    pipeline_first_layers: int | None = None
    pipeline_last_layers: int | None = None
    pipeline_split_embedding: bool = False
    pipeline_split_loss: bool = False
    dist_opt_instances: int = 1
    pipeline_layout: str | None = None
    recompute_modules: tuple[str, ...] = ()
    offload_modules: tuple[str, ...] = ()
    cuda_graph_scope: tuple[str, ...] = ()
    cuda_graph_warmup_steps: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_graph_scope", cuda_graphs.check_scope(self.cuda_graph_scope))
        n = self.cuda_graph_warmup_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cuda_graph_warmup_steps must be an integer >= 0, got {n!r}")
        if n != 3 and not self.cuda_graph_scope:
            raise ValueError(
                f"cuda_graph_warmup_steps={n} times the CUDA graphs' capture; no "
                "cuda_graph_scope is given (give one of "
                f"{', '.join(cuda_graphs.CUDA_GRAPH_SCOPES)}, or leave the warm-up at 3)"
            )
        for name, known in (
            ("recompute_modules", RECOMPUTE_MODULES),
            ("offload_modules", OFFLOAD_MODULES),
        ):
            given = getattr(self, name)
            if isinstance(given, str) or not all(m in known for m in given):
                raise ValueError(
                    f"{name} must be a tuple of names from {', '.join(known)}, got {given!r}"
                )
            object.__setattr__(self, name, tuple(given))
        if self.pipeline_layout is not None:
            layout_chunks(self.pipeline_layout)  # its grammar, checked when made
            if self.pipeline_first_layers is not None or self.pipeline_last_layers is not None:
                raise ValueError(
                    "pipeline_layout places every layer itself: drop pipeline_first_layers/"
                    "pipeline_last_layers (Megatron refuses both)"
                )
        n = self.dist_opt_instances
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"dist_opt_instances must be an integer >= 1, got {n!r}")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(
                f"unknown fp8 recipe {self.fp8_recipe!r}; choose one of {', '.join(FP8_RECIPES)}"
            )
        if self.fp8_param_gather and self.fp8_recipe is None:
            raise ValueError("fp8_param_gather keeps fp8 primary weights: it needs an fp8_recipe")
        if not 0.0 <= self.hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout must be in [0, 1), got {self.hidden_dropout!r}")
        for name in ("pipeline_first_layers", "pipeline_last_layers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if (self.pipeline_first_layers is not None or self.pipeline_last_layers is not None) and (
            self.pipeline_split_embedding or self.pipeline_split_loss
        ):
            raise ValueError(
                "pipeline_first_layers/pipeline_last_layers and pipeline_split_embedding/loss "
                "are two ways to split the pipeline unevenly: give one (Megatron refuses both)"
            )
        if self.wgrad_deferral_limit < 0:
            raise ValueError(
                f"wgrad_deferral_limit must be >= 0, got {self.wgrad_deferral_limit!r}"
            )


_DEFAULTS = MegatronKnobs()


def check_knobs(framework: str, **given: object) -> MegatronKnobs:
    """The Megatron knobs, checked; a knob given to another framework is an error (named
    before its value is checked: the framework is the first thing wrong).

    Raises:
        ValueError: one line naming the knob, the framework and the valid choices.
    """
    for name, value in given.items():
        if framework != "megatron" and value != getattr(_DEFAULTS, name):
            also = (
                f"; torchtitan's are {', '.join(torchtitan.FLOAT8_RECIPES)}"
                if name == "fp8_recipe"
                else ""
            )
            raise ValueError(
                f"{name} is a Megatron-LM option; framework={framework!r} has no such knob "
                f"(use framework='megatron' or leave it at its default{also})"
            )
    return MegatronKnobs(**given)  # type: ignore[arg-type]


def optimizer_shards(knobs: MegatronKnobs, layout: Layout, x: list[float]) -> None:
    """The distributed optimizer's shard degrees in the terms ``x`` under
    ``dist_opt_instances`` copies: ``dp · cp / instances`` (the experts' data parallelism
    over the same number).

    Raises:
        ValueError: instances that do not divide the data-parallel group, in one line.
    """
    n = knobs.dist_opt_instances
    if n == 1:
        return
    if (layout.dp * layout.cp) % n or layout.expert_dp % n:
        raise ValueError(
            f"dist_opt_instances={n} must divide the data-parallel group dp*cp = "
            f"{layout.dp * layout.cp} (and the experts' {layout.expert_dp}): Megatron splits "
            "it into that many optimizer instances"
        )
    x[peak.N_SHARD] = max(1.0, x[peak.N_SHARD] / n)
    x[peak.N_SHARD_EXP] = max(1.0, x[peak.N_SHARD_EXP] / n)


def fp8_saved_bytes(recipe: str | None, compute: int) -> float:
    """Bytes per element of a Linear's saved input: its fp8 column-wise copy (with the
    recipe's scales), or the compute dtype without fp8."""
    if recipe is None:
        return float(compute)
    return {"delayed": 1.0, "tensorwise": 1.0, "mxfp8": 1 + 1 / 32, "blockwise": 1 + 4 / 128}[
        recipe
    ]


def fp8_weight_cache_bytes(k: MegatronKnobs) -> float:
    """Extra bytes per Linear weight element that fp8 keeps for the step: row- and column-wise
    fp8 copies of a bf16 weight; none with fp8 primary weights (the copy replaces it)."""
    if k.fp8_recipe is None or k.fp8_param_gather:
        return 0.0
    return 2 * fp8_saved_bytes(k.fp8_recipe, 2)


def layer_pattern(value: object, n_layers: int) -> tuple[int, ...]:
    """``--moe-layer-freq`` as one 0/1 per layer (``transformer_config.py``): an int k makes
    every k-th layer MoE (layer 0 first), a list gives the pattern, and a string may be
    Megatron's list expression such as ``([0]*1+[1]*15)`` (lists, integers, ``+``, ``*``).

    Raises:
        ValueError: anything else, or a pattern of the wrong length.
    """
    if isinstance(value, str):
        value = _list_expression(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return tuple(1 if i % value == 0 else 0 for i in range(n_layers))
    if isinstance(value, (list, tuple)) and all(v in (0, 1) for v in value):
        if len(value) != n_layers:
            raise ValueError(f"moe_layer_freq has {len(value)} entries for {n_layers} layers")
        return tuple(int(v) for v in value)
    raise ValueError(
        f"moe_layer_freq must be a positive int or a 0/1 list per layer, got {value!r}"
    )


def _list_expression(text: str) -> object:
    import ast

    def value(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right  # type: ignore[operator]
        raise ValueError(f"moe_layer_freq {text!r}: only lists, integers, + and * are understood")

    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"moe_layer_freq {text!r} is not a list expression") from None


# --- pipeline split -------------------------------------------------------------------------


def layout_chunks(text: str) -> list[str]:
    """``--pipeline-model-parallel-layout`` as one string of items per virtual chunk, in model
    order (``pipeline_parallel/utils.py``'s grammar: ``E`` the embedding, ``t`` a transformer
    layer, ``m`` an MTP layer, ``L`` the loss; ``X*N`` and ``(...)*N`` repeat, ``|`` ends a
    chunk): ``"Et*3|(tt|)*6mL"`` is ``["Ettt", "tt", "tt", "tt", "tt", "tt", "tt", "mL"]``.

    Raises:
        ValueError: a character outside the grammar, or the embedding / loss not in the
            first / last chunk, in one line.
    """
    if not isinstance(text, str):
        raise ValueError(f"pipeline_layout must be a string such as 'Et*3|(tt|)*6L', got {text!r}")
    flat = text.replace(" ", "").replace("\\", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(flat):
        flat = group.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    flat = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    if not flat or set(flat) - set("EtmL|"):
        raise ValueError(
            f"pipeline_layout {text!r}: use E (embedding), t (layer), m (MTP layer), L (loss), "
            "X*N and (...)*N repeats and | between chunks, e.g. 'Et*3|(tt|)*6L'"
        )
    chunks = flat.split("|")
    if "E" not in chunks[0] or "L" not in chunks[-1] or flat.count("E") + flat.count("L") != 2:
        raise ValueError(
            f"pipeline_layout {text!r}: the estimate models the embedding (E) in the first "
            "chunk and the loss (L) in the last, once each"
        )
    return chunks


def stage_chunks(n_layers: int, pp: int, vpp: int, k: MegatronKnobs) -> list[list[range]]:
    """The layers each pipeline rank builds, as one range per virtual chunk (rank r holds the
    chunks r, r + pp, ... of the model order), by ``get_num_layers_to_build`` (or the
    ``pipeline_layout``'s chunks).

    Raises:
        ValueError: a split Megatron refuses (counts that do not divide, a layout of another
            number of layers or chunks).
    """
    first, last = k.pipeline_first_layers, k.pipeline_last_layers
    counts: list[int] = []  # layers per chunk in model order (chunk c = v * pp + r)
    if k.pipeline_layout is not None:
        counts = [c.count("t") for c in layout_chunks(k.pipeline_layout)]
        if sum(counts) != n_layers:
            raise ValueError(
                f"pipeline_layout {k.pipeline_layout!r} places {sum(counts)} layers (t); the "
                f"model has {n_layers}"
            )
        if len(counts) != pp * vpp:
            raise ValueError(
                f"pipeline_layout {k.pipeline_layout!r} has {len(counts)} chunks, not pp*vpp = "
                f"{pp}*{vpp} (give vpp = chunks / pp = {len(counts) / pp:g})"
            )
    elif first is not None or last is not None:
        rest, stages = n_layers, pp
        for v in (first, last):
            if v is not None:
                rest, stages = rest - v, stages - 1
        if rest < 0 or (stages and rest % stages) or (not stages and rest):
            raise ValueError(
                f"pipeline_first_layers={first}, pipeline_last_layers={last}: the other "
                f"{max(rest, 0)} of {n_layers} layers do not split evenly over {stages} stages"
            )
        per = rest // stages if stages else 0
        by_rank = [per] * pp
        if first is not None:
            by_rank[0] = first
        if last is not None:
            by_rank[-1] = last
        for r, n in enumerate(by_rank):
            if n % vpp:
                raise ValueError(f"stage {r}'s {n} layers do not split into vpp={vpp} chunks")
        counts = [by_rank[c % pp] // vpp for c in range(pp * vpp)]
    else:
        total = n_layers + k.pipeline_split_embedding + k.pipeline_split_loss
        if total % (pp * vpp):
            if k.pipeline_split_embedding or k.pipeline_split_loss:
                raise ValueError(
                    f"{n_layers} layers + embedding/loss = {total} do not split over "
                    f"pp*vpp = {pp * vpp} chunks"
                )
            return []  # the default split (terms.stage_chunks) applies
        counts = [total // (pp * vpp)] * (pp * vpp)
        if k.pipeline_split_embedding:
            counts[0] -= 1
        if k.pipeline_split_loss:
            counts[-1] -= 1
    starts, pos = [], 0
    for n in counts:
        starts.append(pos)
        pos += n
    return [
        [range(starts[c], starts[c] + counts[c]) for c in range(r, pp * vpp, pp)] for r in range(pp)
    ]


def inflight_layers(chunks: list[range], pp: int, vpp: int, grad_accum: int, stage: int) -> int:
    """Layer forwards a rank has run when its first backward starts: 1F1B runs
    ``pp - stage - 1`` warm-up forwards; the interleaved schedule (``pipeline_parallel/
    schedules.py``) ``(pp - stage - 1) · 2 + (vpp - 1) · pp``, forward k on the chunk
    ``(k mod pp·vpp) // pp`` (``get_model_chunk_id``), so chunks of unequal size weigh by what
    they hold."""
    if vpp == 1:
        return min(grad_accum, pp - stage) * sum(len(c) for c in chunks)
    n_fwd = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, grad_accum * vpp)
    return sum(len(chunks[(k % (pp * vpp)) // pp]) for k in range(n_fwd))


def uneven(k: MegatronKnobs) -> bool:
    return (
        k.pipeline_layout is not None
        or k.pipeline_first_layers is not None
        or k.pipeline_last_layers is not None
        or k.pipeline_split_embedding
        or k.pipeline_split_loss
    )


# --- saved tensors ----------------------------------------------------------------------------


def _stats(spec: ModelSpec, n: int) -> int:
    """TE norm statistics: mean and rsigma (LayerNorm) or rsigma (RMSNorm), fp32 per row."""
    return n * 4 * (2 if spec.norm == "layernorm" else 1)


def _norm(spec: ModelSpec, tag: str, n: int, width: int, A: int) -> list[Item]:
    return [Item(f"{tag}.input", n * width * A), Item(f"{tag}.stats", _stats(spec, n))]


def _mlp(spec: ModelSpec, tag: str, n: int, n_in: int, f: int, A: int, L: float) -> list[Item]:
    """fc1 (norm fused, or a plain input) -> activation -> fc2: fc1's output (the activation's
    input: 2·f for SwiGLU) and fc2's input; the squared ReLU keeps relu's output and the
    square, the same two f-wide tensors."""
    up = 2 * f if spec.gated else f
    return [
        Item(f"{tag}.fc1_input", int(n_in * spec.hidden * L)),
        Item(f"{tag}.fc1_out", n * up * A),
        Item(f"{tag}.fc2_input", int(n * f * L)),
    ]


def _attention(spec: ModelSpec, w: Workload, n: int, n_sp: int, L: float) -> list[Item]:
    t, A, h = w.tp, w.compute, spec.hidden
    a = spec.n_heads // t
    g = max(1, spec.kv_heads // t)
    if spec.is_mla:
        qk, vd = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
        qr, kvr = spec.q_lora_rank, spec.kv_lora_rank
        # the replicated down projections read the gathered norm output
        items = [Item("qkv.input", int(n * h * L))]
        if qr:
            items += _norm(spec, "q_norm", n, qr, A)
            items.append(Item("q_up.input", int(n * qr * L)))
        items += _norm(spec, "kv_norm", n, kvr, A)
        items.append(Item("kv_up.input", int(n * kvr * L)))
        q, k, v, o = n * a * qk * A, n * a * qk * A, n * a * vd * A, n * a * vd * A
        d_core = qk
    else:
        d = spec.dhead
        items = [Item("qkv.input", int(n_sp * h * L))]
        q, k, v, o = n * a * d * A, n * g * d * A, n * g * d * A, n * a * d * A
        d_core = d
    b, sq, sk = w.batch, w.local_seq, w.seq
    if w.attention == "math":  # TE UnfusedDotProductAttention: GQA keys/values expanded
        k = v = n * a * d_core * A
        s2 = b * a * sq * sk
        items += [Item("attn.q", q), Item("attn.k", k), Item("attn.softmax", s2 * A, core=True)]
        if w.dropout > 0:
            items += [
                Item("attn.dropout_mask", s2, core=True),
                Item("attn.dropout_out", s2 * A, core=True),
            ]
        items += [Item("attn.v", v), Item("attn.out", o, core=True)]
    else:
        lse = b * a * sq * 4
        items += [
            Item("attn.q", q),
            Item("attn.k", k),
            Item("attn.v", v),
            Item("attn.out", o, core=True),
            Item("attn.lse", lse, core=True),
        ]
    if L != A:  # the output projection's own fp8 copy of its input
        items.append(Item("proj.input_fp8", int(o // A * L)))
    return items


def _moe(spec: ModelSpec, w: Workload, n_sp: int, A: int, L: float) -> list[Item]:
    """Router, dispatch and grouped experts of one MoE layer; shared experts as a dense MLP."""
    h, E = spec.hidden, spec.n_experts
    f = spec.moe_ffn // w.etp
    nk = expert_tokens(spec, w, n_sp) * w.etp  # the expert-TP group's tokens are gathered
    items = [
        Item("router.input", n_sp * h * A),
        Item("router.logits_scores_probs", 3 * n_sp * E * 4),
        Item("router.topk", n_sp * spec.top_k * 8),
        Item("dispatch.row_map", nk * 4),
    ]
    up = 2 * f if spec.gated else f
    items += [
        Item("experts.fc1_input", int(nk * h * L)),
        Item("experts.fc1_out", nk * up * A),
        Item("experts.fc2_input", int(nk * f * L)),
        Item("experts.out", nk * h * A),
        Item("experts.probs", nk * 4),
    ]
    if spec.n_shared_experts or spec.shared_ffn:
        sf = spec.shared_ffn // w.tp
        items += _mlp(spec, "shared", w.tokens, n_sp, sf, A, L)
    return items


def layer_items(
    spec: ModelSpec, w: Workload, k: MegatronKnobs, capture: bool = False
) -> list[Item]:
    """What one Megatron-core TE transformer layer keeps for backward (one micro-batch, one
    TP rank); under ``cuda_graph_scope`` what a step's allocator sees of it, or (``capture``)
    what the graphs' capture does (``cuda_graphs.split_items``)."""
    t, n, A = w.tp, w.tokens, w.compute
    n_sp = n // t if w.sp else n
    h = spec.hidden
    L = fp8_saved_bytes(k.fp8_recipe, A)
    mask = [Item("dropout.mask", n_sp * h)] if k.hidden_dropout > 0 else []
    items = _norm(spec, "attn_norm", n_sp, h, A)
    items += _attention(spec, w, n, n_sp, L)
    items += mask + _norm(spec, "mlp_norm", n_sp, h, A)
    if spec.is_moe and not w.dense:
        items += _moe(spec, w, n_sp, A, L)
    else:
        items += _mlp(spec, "mlp", n, n_sp, spec.dense_layer_ffn // t, A, L)
    items = module_items(items + [Item("dropout.mask2", n_sp * h)] * bool(mask), k)
    if k.cuda_graph_scope:
        items = cuda_graphs.split_items(items, k.cuda_graph_scope, capture)
    return items


def score_grads(w: Workload) -> int:
    """The s x s gradients TE's unfused attention holds at once in backward: its fused
    scaled-masked softmax produces its gradient in place (``scaled_masked_softmax_backward``,
    ``transformer_engine/pytorch/csrc/extensions/softmax.cpp``), so one, unless attention
    dropout's backward makes a second before it."""
    return 2 if w.dropout > 0 else 1


def embed_items(spec: ModelSpec, w: Workload, k: MegatronKnobs) -> list[Item]:
    """Token ids, and the embedding dropout's mask (``--hidden-dropout`` applies there too)."""
    n_sp = w.tokens // w.tp if w.sp else w.tokens
    items = [Item("embed.ids", w.tokens * 8)]
    if k.hidden_dropout > 0:
        items.append(Item("embed.dropout_mask", n_sp * spec.hidden))
    return items


def head_items(spec: ModelSpec, w: Workload, k: MegatronKnobs) -> list[Item]:
    """Final norm, the output layer's input, the loss's fp32 softmax, targets and mask, and
    per MTP layer its norms, ``eh_proj`` input, layer and second loss (the layer's own saved
    tensors are added by the caller)."""
    n, t, A, h = w.tokens, w.tp, w.compute, spec.hidden
    n_sp = n // t if w.sp else n
    v = spec.vocab // t
    one = [
        *_norm(spec, "final_norm", n_sp, h, A),
        Item("output_layer.input", n_sp * h * A),
        Item("loss.softmax_fp32", n * v * 4),
        Item("loss.target_mask", n),
        Item("loss.masked_target", n * 8),
    ]
    items = list(one)
    for m in range(spec.mtp_layers):
        items += [
            *_norm(spec, f"mtp{m}.enorm", n_sp, h, A),
            *_norm(spec, f"mtp{m}.hnorm", n_sp, h, A),
            Item(f"mtp{m}.eh_proj_input", n_sp * 2 * h * A),
            Item(f"mtp{m}.ids", n * 8),
        ]
        items += [Item(f"mtp{m}.{i.name}", i.nbytes) for i in one]
    return items


def deferred_wgrad_bytes(spec: ModelSpec, w: Workload, k: MegatronKnobs, grad_accum: int) -> int:
    """``--defer-embedding-wgrad-compute`` (``tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication``): the output layer's backward appends
    its gradient (``n · vocab/tp``) to ``grad_output_buffer`` and the model its gathered input
    (``n · h``) to ``embedding_activation_buffer`` instead of computing the weight gradient,
    for up to ``wgrad_deferral_limit`` micro-batches (0: all); the cool-down
    (``finish_embedding_wgrad_compute``) drains them. At the last micro-batch's loss the
    earlier ones are held."""
    if not k.defer_embedding_wgrad:
        return 0
    held = grad_accum - 1
    if k.wgrad_deferral_limit:
        held = min(held, k.wgrad_deferral_limit)
    return held * w.tokens * (spec.hidden + spec.vocab // w.tp) * w.compute


def loss_transient(spec: ModelSpec, w: Workload, fused: bool) -> int:
    """Beside the saved fp32 softmax at the loss's widest moment: the bf16 logits (forward) or
    the bf16 gradient (backward), and under the jit-fused loss one more fp32 logits-sized
    tensor (its out-of-place ``exp`` and gradient)."""
    nv = w.tokens * (spec.vocab // w.tp)
    return nv * (w.compute + (4 if fused else 0))


def mtp_params(spec: ModelSpec, layer_tp: float, layer_rep: float, t: int) -> tuple[float, float]:
    """(TP-split, replicated) parameters of the MTP block: per layer ``eh_proj`` (2h x h), two
    norms and a transformer layer (given, already split), and the final norm."""
    h, m = spec.hidden, spec.mtp_layers
    norm = 2 * h if spec.norm == "layernorm" else h
    return m * (2 * h * h / t + layer_tp), m * (3 * norm + layer_rep)


def pipeline_input_bytes(w: Workload, hidden: int, pp: int, vpp: int, stage: int) -> float:
    """The received activation each model chunk keeps after the step, with its gradient:
    ``forward_step`` hands it to ``model.set_input_tensor`` (the decoder keeps the reference
    until the next micro-batch replaces it) and ``backward_step`` calls ``retain_grad()`` on
    it (``pipeline_parallel/schedules.py``), so the last micro-batch's input and its gradient
    stay on every chunk that receives one: all chunks but the first stage's first."""
    if pp == 1:
        return 0.0
    chunks = vpp if stage > 0 else vpp - 1
    tokens = w.tokens // w.tp if w.sp else w.tokens
    return float(chunks * 2 * tokens * hidden * w.compute)


def workspace_bytes(cuda: bool, grouped_experts: bool) -> float:
    """The rank's library workspaces: the calibrated constant, and TE's multi-stream
    workspaces when the rank runs grouped experts."""
    if not cuda:
        return 0.0
    return float(WORKSPACE_BYTES + (GROUPED_GEMM_WORKSPACE if grouped_experts else 0))
