"""torchtitan's conventions: what its Llama training step keeps, as peak terms.

torchtitan (0.3.0, ``torchtitan/``) differs from what ``hf_ops.py`` follows (transformers'
modules, Megatron's recompute) in every part that decides the peak:

- **Modules** (``models/common/``): ``nn.RMSNorm`` on the bf16 stream runs the composite
  ``rms_norm`` (``x.float()``, ``pow``, ``mean``, ``rsqrt``, two ``mul``, a cast back), which
  saves the fp32 input, the fp32 rstd and the fp32 normalised product (8 B per element, plus 4 B
  per row); one fused ``wqkv`` matmul (``attention.py``: ``FusedQKVLinear``) whose q, k and v
  are copies; complex RoPE (``rope.py``: ``view_as_complex(x.float()) * freqs_cis``) saves
  nothing (the cache needs no grad) and casts q and k back; SDPA with ``enable_gqa`` (no repeated
  K/V) saves q, k, v, the output and the fp32 log-sum-exp; SwiGLU ``w2(silu(w1 x) * w3 x)``
  (``feed_forward.py``) saves four ffn-wide tensors. The RoPE cache is a complex64 buffer per
  layer, ``seq · head_dim / 2`` entries (the trainer sizes it to the training sequence).
- **Activation checkpointing** (``distributed/activation_checkpoint.py``), by torchtitan's own
  names: ``selective`` = per-op SAC (``selective:op``): every op of a block is recomputed except
  those in its save list, whose outputs are cached: of the five matmuls (``wqkv``, ``wo``,
  ``w1``, ``w3``, ``w2``) every second one is recomputed (``wqkv``, ``w1``, ``w2`` saved), the
  flash attention's outputs are saved, and so is the block's input (the checkpoint's argument);
  ``selective:N`` = layer SAC (torchtitan before 0.3, ``selective_ac_option=N``): every N-th
  block fully recomputed, the others not at all; ``full``: only block inputs; ``none``.
- **The loss** (``components/loss.py``, ``trainer.py``): ``cross_entropy(pred.flatten(0, 1)
  .float(), sum)``; the trainer drops ``pred`` before ``backward`` (``del pred``), so only
  log-softmax's fp32 output is held; its backward holds that, nll's fp32 gradient and
  log-softmax's fp32 gradient at once (12 B per logit: the start-of-backward peak).
- **FSDP2** (``distributed/fsdp.py``, ``apply_fsdp_to_decoder``): fp32 sharded parameters are
  the master weights (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), so a rank
  keeps 4 B weights + 4 B gradients + 8 B AdamW state per parameter over the shard degree; the
  embedding and every block reshard after forward, the ``[norm, lm_head]`` unit does not
  (``reshard_after_forward_policy == "always"`` only), so its bf16 copy stays gathered from its
  forward to its backward. The fused AdamW (``implementation="fused"``) allocates nothing.

- **Tensor parallelism** (``models/llama3/sharding.py``, sequence parallel): norms and block
  inputs sequence-sharded, heads and ffn split; under per-op SAC the row-wise matmuls' partial
  sums and the reduce-scatter outputs (in the save list) are saved; the vocab-parallel embedding
  saves its local indices and a bf16 mask; loss parallel (``_LossParallelCrossEntropy``) holds
  three fp32 logits-sized tensors in its backward beside the saved log-probabilities.
- **Context parallelism** (``distributed/context_parallel/api.py``, FlexAttention's CP): each rank
  holds ``seq / cp`` tokens; the attention saves the all-gathered K and V; FSDP shards over
  ``dp · cp``; the RoPE cache holds the whole sequence.

- **The chunked loss** of 0.3.0's llama3 recipes (``ChunkedLossWrapper``): ``loss_chunks``.

- **Float8** (``components/quantization/float8.py``: ``Float8LinearConverter``, recipes
  ``rowwise`` and ``rowwise_with_gw_hp``; torchao's ``tensorwise`` with
  ``enable_fsdp_float8_all_gather``, the recipe of the published Dec-2024 runs): see
  ``float8_moment`` and ``float8_sac_saved``. torchao's ``Float8Linear`` saves its
  *high-precision* input and weight (``matmul_with_hp_or_float8_args``) and casts again in
  backward, so the saved activations are the bf16 ones; SAC's policy sees the ``aten.mm`` of the
  float8 tensors (a dispatch mode runs before the tensor subclass) and saves every second one as
  in bf16, plus the outputs of ``aten.max`` (tensorwise amax, a 16-bit scalar per cast) from its
  save list. What float8 adds is the casts' temporaries in a block's backward, and FSDP's float8
  all-gather gathers 1-byte weights.

- **torch.compile** of the loss (``compiled_loss``, ``titan_compile``). The compiled blocks are
  not modelled (priced as eager; docs/estimator.md, "torch.compile").

Float8 with tensor parallelism: torchtitan 0.3.0's rowwise recipes under its own TP plan (the
Float8Linear casts its local shards; the same moments with the rank's shapes, the sequence
shards kept beside the all-gathered tensors). Not modelled (left for later): tensorwise float8
with TP (torchao's float8 TP styles, which 0.3.0 does not apply), the chunked loss under TP
(loss parallel per chunk), FlexAttention's block masks and the RoPE cache gathered by explicit
positions (0.3.0's default backend: small),
HSDP's replicate all-reduce buffers. Pipeline parallelism: ``titan_schedules`` and
``titan_pipeline``. Under TP a block's widest backward
moment is the sequence-parallel all-gather's backward, approximated here by SwiGLU's (within 1 %
on the tests' model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator import peak
from gpumem.estimator.activations import Item
from gpumem.estimator.frameworks import titan_trace
from gpumem.estimator.frameworks.titan_compile import (
    check_compiled_loss,
    compiled_loss_bwd,
    compiled_loss_saved,
)
from gpumem.estimator.frameworks.titan_schedules import check_schedule
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.states import Training

RECOMPUTE = ("none", "selective", "selective:op", "selective:N", "full")
"""torchtitan's activation checkpointing, by its names (``selective:N``: N an integer >= 1)."""
_BF16 = 2


def layer_sac_every(recompute: str) -> int:
    """N of a torchtitan policy: 0 for per-op SAC / none / full, N for ``selective:N``.

    Raises:
        ValueError: a policy torchtitan does not have, naming the valid ones.
    """
    if recompute in ("none", "full", "selective", "selective:op"):
        return 0
    if recompute.startswith("selective:"):
        tail = recompute.split(":", 1)[1]
        if tail.isdigit() and int(tail) >= 1:
            return int(tail)
    raise ValueError(
        f"recompute={recompute!r} is not a torchtitan policy; framework='torchtitan' takes "
        f"{', '.join(RECOMPUTE)}"
    )


def check_recompute(recompute: str, framework: str) -> None:
    """A policy of torchtitan's under another framework, or another's under torchtitan: one
    line naming both and the valid choices."""
    if framework == "torchtitan":
        layer_sac_every(recompute)
    elif isinstance(recompute, str) and recompute.startswith("selective:"):
        raise ValueError(
            f"recompute={recompute!r} is torchtitan's SAC; framework={framework!r} takes none, "
            "selective, full or every-K (use framework='torchtitan' for torchtitan's policies)"
        )


def _norm_saved(rows: int, h: int) -> int:
    """Composite ``rms_norm`` on a 16-bit input: fp32 input, fp32 normalised, fp32 rstd."""
    return 8 * rows * h + 4 * rows


class Shapes:
    """The per-rank sizes of one micro-batch (``n`` tokens on this rank, TP degree ``t``)."""

    def __init__(self, spec: ModelSpec, layout: Layout, batch: int, seq: int) -> None:
        t = layout.tp
        self.t, self.b = t, batch
        self.s = seq // layout.cp
        self.n = batch * self.s
        self.n_sp = self.n // t  # sequence-parallel rows (norms, block inputs) under TP
        self.h, self.f, self.v = spec.hidden, spec.ffn // t, spec.vocab // t
        self.q = spec.n_heads * spec.dhead // t
        self.kv = spec.kv_heads * spec.dhead // t
        self.heads = spec.n_heads // t
        self.cp = layout.cp

    @property
    def lse(self) -> int:
        """Flash attention's fp32 log-sum-exp (b, heads, s) and its 16-byte RNG state."""
        return self.b * self.heads * self.s * 4 + 16


def layer_saved(sh: Shapes, policy: str) -> dict[str, int]:
    """What one block keeps between its forward and its backward under ``policy`` (``none``,
    ``op``, ``full``), by tensor."""
    n, h, A = sh.n, sh.h, _BF16
    block_in = sh.n_sp * h * A
    if policy == "full":
        return {"block_input": block_in}
    if policy == "op":
        # SAC's cache: wqkv (mm 1), w1 (mm 3), w2 (mm 5), flash out + lse; wo and w3 recomputed.
        # Under TP the row-wise w2's partial sums are saved whole, and the reduce-scatter
        # outputs of wo and w2 (reduce_scatter_tensor is in the save list) as well.
        out = {
            "block_input": block_in,
            "wqkv_out": n * (sh.q + 2 * sh.kv) * A,
            "w1_out": n * sh.f * A,
            "w2_out": n * h * A,
            "attn_out": n * sh.q * A,
            "attn_lse": sh.lse,
        }
        if sh.t > 1:
            out["reduce_scatter_outs"] = 2 * sh.n_sp * h * A
        return out
    return {
        "norms": 2 * _norm_saved(sh.n_sp, h),
        # the matmuls' inputs: the (gathered) norm outputs, read by wqkv and by w1/w3
        "norm_outs": 2 * n * h * A,
        # under CP the attention saves the all-gathered K and V (context_parallel/api.py:
        # flex_cp_allgather along the sequence), the local q
        "q_k_v": n * (sh.q + 2 * sh.kv * sh.cp) * A,
        "attn_out": n * sh.q * A,
        "attn_lse": sh.lse,
        # silu's input, its output, w3's output (the product's inputs), the product (w2's input)
        "swiglu": 4 * n * sh.f * A,
    }


def block_checkpointed(recompute: str, i: int) -> bool:
    """Whether block i runs under a checkpoint (and so keeps its input)."""
    every = layer_sac_every(recompute)
    if every:
        return (i + 1) % every == 0
    return recompute != "none"


def block_saved(sh: Shapes, recompute: str, i: int) -> int:
    """Bytes block i keeps between forward and backward."""
    every = layer_sac_every(recompute)
    if every:
        policy = "full" if (i + 1) % every == 0 else "none"
    else:
        policy = {"selective": "op", "selective:op": "op"}.get(recompute, recompute)
    return sum(layer_saved(sh, policy).values())


def layer_items(
    spec: ModelSpec, layout: Layout, batch: int, seq: int, recompute: str
) -> list[Item]:
    """The tensors one block keeps under ``recompute`` (the bill's itemised layer); under layer
    SAC those of a block that is not checkpointed."""
    sh = Shapes(spec, layout, batch, seq)
    policy = {"selective": "op", "selective:op": "op"}.get(recompute, recompute)
    if layer_sac_every(recompute):
        policy = "none"
    return [Item(name, nbytes) for name, nbytes in layer_saved(sh, policy).items()]


def mean_layer_saved(sh: Shapes, recompute: str, n_layers: int) -> float:
    """Bytes per block averaged over the stage's blocks."""
    every = layer_sac_every(recompute)
    if every:
        full = n_layers // every  # blocks i with (i + 1) % N == 0
        none = sum(layer_saved(sh, "none").values())
        inp = sum(layer_saved(sh, "full").values())
        return ((n_layers - full) * none + full * inp) / n_layers
    policy = {"selective": "op", "selective:op": "op"}.get(recompute, recompute)
    return float(sum(layer_saved(sh, policy).values()))


def head_saved(sh: Shapes, compiled_loss: bool = False) -> dict[str, int]:
    """The final norm, the lm_head's input, log-softmax's fp32 output and nll's targets (the
    compiled loss: the logits and per-row statistics instead, ``titan_compile``)."""
    head = {"final_norm": _norm_saved(sh.n_sp, sh.h), "lm_head_input": sh.n * sh.h * _BF16}
    if compiled_loss:
        return {**head, **compiled_loss_saved(sh.n, sh.v), "targets": sh.n * 8}
    return {**head, "log_softmax": sh.n * sh.v * 4, "targets": sh.n * 8 + 4}


def block_params(spec: ModelSpec, t: int) -> int:
    h, f = spec.hidden, spec.ffn
    qkv = h * (spec.n_heads + 2 * spec.kv_heads) * spec.dhead
    return (qkv + spec.n_heads * spec.dhead * h + 3 * h * f) // t + 2 * h


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchtitan's float8 recipes (``fp8_recipe``): 0.3.0's ``Float8LinearConverter`` has
``rowwise`` and ``rowwise_with_gw_hp``; ``tensorwise`` is torchao's dynamic per-tensor scaling
that torchtitan ran before 0.3 (the published runs), the only one with FSDP float8 all-gather."""


def check_float8(recipe: str | None, all_gather: bool, tp: int) -> None:
    """torchtitan's float8 knobs, checked.

    Raises:
        ValueError: one line naming the problem and the valid choices.
    """
    if recipe is None:
        if all_gather:
            raise ValueError(
                "fsdp_float8_all_gather needs fp8_recipe='tensorwise' (torchao's "
                "enable_fsdp_float8_all_gather gathers tensorwise-scaled float8 weights)"
            )
        return
    if recipe not in FLOAT8_RECIPES:
        megatron = " (Transformer Engine's, as precision='fp8' is)" if recipe == "delayed" else ""
        raise ValueError(
            f"fp8_recipe={recipe!r}{megatron} is not a torchtitan float8 recipe; "
            f"framework='torchtitan' takes {', '.join(FLOAT8_RECIPES)}"
        )
    if all_gather and recipe != "tensorwise":
        raise ValueError(
            f"fsdp_float8_all_gather is tensorwise only (torchao), got fp8_recipe={recipe!r}; "
            "use fp8_recipe='tensorwise' or drop fsdp_float8_all_gather"
        )
    if tp > 1 and recipe == "tensorwise":
        raise ValueError(
            "framework='torchtitan': tensorwise float8 with tensor parallelism needs torchao's "
            "float8 TP styles (Float8ColwiseParallel, ...), which torchtitan 0.3.0 does not "
            "apply: use fp8_recipe='rowwise' or 'rowwise_with_gw_hp' (its converter's, which "
            "run under its TP plan), or tp=1"
        )


@dataclass(frozen=True)
class TorchtitanKnobs:
    """torchtitan's options the estimate takes (``gpumem.estimate(torchtitan=...)``), checked
    when made (those that depend on the layout: when estimated).

    Attributes:
        fp8_recipe: float8 training of the blocks' Linears (``FLOAT8_RECIPES``).
        fsdp_float8_all_gather: torchao's ``enable_fsdp_float8_all_gather`` (tensorwise only).
        loss_chunks: 0: the loss on the whole logits; N: ``ChunkedLossWrapper(num_chunks=N)``.
        compiled_loss: the loss compiled by Inductor (``--training.compile``; ``titan_compile``).
        pp_schedule: ``parallelism.pipeline_parallel_schedule`` under ``pp > 1`` (1F1B, GPipe,
            Interleaved1F1B; ``titan_pipeline``).
        pp_microbatch_size: ``parallelism.pipeline_parallel_microbatch_size``: the local batch
            runs as ``batch_size / pp_microbatch_size`` micro-batches.

    Raises:
        ValueError: one line naming the problem and the valid choices.
    """

    fp8_recipe: str | None = None
    fsdp_float8_all_gather: bool = False
    loss_chunks: int = 0
    compiled_loss: bool = False
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1

    def __post_init__(self) -> None:
        check_float8(self.fp8_recipe, self.fsdp_float8_all_gather, tp=1)
        check_schedule(self.pp_schedule)
        m = self.pp_microbatch_size
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"pp_microbatch_size must be an integer >= 1, got {m!r}")
        n = self.loss_chunks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"loss_chunks must be an integer >= 0, got {n!r}")
        check_compiled_loss(self.compiled_loss, n, tp=1)


_ELSEWHERE = {
    "fsdp_float8_all_gather": "torchtitan's (torchao's FSDP float8 all-gather); framework={fw!r} "
    "has no such knob (use framework='torchtitan' with fp8_recipe='tensorwise'; Megatron's "
    "counterpart is fp8_param_gather)",
    "compiled_loss": "torchtitan's (--training.compile compiles its loss); framework={fw!r} does "
    "not model torch.compile",
    "loss_chunks": "torchtitan's ChunkedLossWrapper; framework={fw!r} has none (use "
    "framework='torchtitan', or loss_chunks=0)",
    "pp_schedule": "torchtitan's pipeline_parallel_schedule; framework={fw!r} has no such knob "
    "(use framework='torchtitan'; Megatron's interleaving is the layout's vpp)",
    "pp_microbatch_size": "torchtitan's pipeline_parallel_microbatch_size; framework={fw!r} has "
    "no such knob (use framework='torchtitan'; elsewhere batch_size is the micro-batch)",
}


def titan_knobs(framework: str, **given: object) -> TorchtitanKnobs:
    """The torchtitan knobs, checked; one given to another framework is an error (named before
    its value is checked: the framework is the first thing wrong)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TorchtitanKnobs)}
    for name, why in _ELSEWHERE.items():
        if framework != "torchtitan" and name in given and given[name] != defaults[name]:
            raise ValueError(f"{name} is " + why.format(fw=framework))
    return TorchtitanKnobs(**given)  # type: ignore[arg-type]


SHARDING_DEFAULT = "default: torchtitan's dp_shard=-1 shards over every data-parallel rank"


def titan_layout(layout: Layout) -> tuple[Layout, str]:
    """(the layout torchtitan runs, where its sharding came from): torchtitan applies FSDP2 over
    every data-parallel rank unless told otherwise (``parallelism.data_parallel_shard_degree``
    defaults to -1, ``data_parallel_replicate_degree`` to 1: ``config/job_config.py``), so a
    layout without ``fsdp`` is ``fsdp="full"`` (``zero=3`` says the same); ``fsdp="hybrid"``
    is its HSDP (``dp_replicate > 1``)."""
    if layout.fsdp:
        return layout, "given"
    full = dataclasses.replace(layout, fsdp="full", zero=0)
    return full, "zero=3 given" if layout.zero == 3 else SHARDING_DEFAULT


def float8_label(recipe: str | None, all_gather: bool) -> str:
    """The bill's float8 input: ``tensorwise, FSDP float8 all-gather``."""
    return f"{recipe}, FSDP float8 all-gather" if all_gather else str(recipe)


def float8_linears(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) of a block's Linears that torchtitan converts to Float8Linear: every one whose
    dims are multiples of 16 (``module_filter_fn``); the lm_head is filtered out
    (``filter_fqns=["lm_head"]``, as 0.3.0's 405B recipe and torchtitan before 0.3)."""
    h, f = spec.hidden, spec.ffn
    q, kv = spec.n_heads * spec.dhead, spec.kv_heads * spec.dhead
    shapes = [(h, q + 2 * kv), (q, h), (h, f), (h, f), (f, h)]  # wqkv, wo, w1, w3, w2
    return [(i, o) for i, o in shapes if i % 16 == 0 and o % 16 == 0]


def float8_sac_saved(spec: ModelSpec, recipe: str, all_gather: bool) -> int:
    """Bytes per-op SAC saves per block beyond bf16: tensorwise casts compute their amax with
    ``aten.max`` (in torchtitan's save list), a 16-bit scalar per cast of a bf16 input and of a
    bf16 weight (none for a weight FSDP gathered in float8); rowwise uses ``aten.amax`` (not
    in the list, recomputed)."""
    if recipe != "tensorwise":
        return 0
    return len(float8_linears(spec)) * (1 if all_gather else 2) * _BF16


def w2_converted(spec: ModelSpec) -> bool:
    """Whether ``w2`` is a Float8Linear: the converter filters the model's Linears by their
    whole (unsharded) dims, before tensor parallelism splits them."""
    return (spec.ffn, spec.hidden) in float8_linears(spec)


def float8_gathered(spec: ModelSpec, t: int, all_gather: bool) -> int:
    """Bytes of one block's parameters gathered by FSDP: bf16, or under float8 all-gather 1 B
    for the converted Linears' weights."""
    blk = block_params(spec, t)
    if not all_gather:
        return blk * _BF16
    f8 = sum(i * o for i, o in float8_linears(spec)) // t
    return f8 + (blk - f8) * _BF16


def float8_moment(sh: Shapes, spec: ModelSpec, recipe: str, all_gather: bool) -> int | None:
    """The widest moment of a block's backward under float8, as temporaries beyond the block's
    saved set (None when w2 is not converted: the bf16 moment stands).

    ``w2``'s backward (``matmul_with_hp_or_float8_args.backward``): the incoming gradient
    (bf16), w2's input gradient (n · ffn, bf16; before its weight gradient, so w2's unsharded
    gradient does not exist yet), the gradient's two fp8 casts (dim 0 for the input gradient,
    dim 1 for the weight's) and the weight's fp8 cast (none when FSDP gathered it in float8),
    then the cast of w2's saved bf16 input for the weight gradient: ``x.float() * scale``,
    its ``clamp`` and the fp8 result alive at once (9 B per element: ``_ToFloat8ConstrFunc``,
    ``to_fp8_saturated``), beside the fp32 scales (rowwise: one per row or column; tensorwise:
    scalars). ``rowwise_with_gw_hp`` computes the weight gradient in bf16 (no dim-1 casts).
    Under tensor parallelism (sequence parallel) ``h`` stays whole and ``ffn`` is the rank's
    share; each of these moments is checked against a fake profile of torchtitan's model at
    tp 2 and 4 (``tests/estimator/test_torchtitan.py``).
    """
    h, f = sh.h, sh.f
    if not w2_converted(spec):
        return None
    n = sh.n
    weight_cast = 0 if all_gather else h * f
    # under TP the incoming gradient is w2's reduce-scatter output's: its sequence-parallel
    # shard stays beside the all-gathered copy w2's backward reads
    shard = sh.n_sp * h * _BF16 if sh.t > 1 else 0
    if recipe == "rowwise_with_gw_hp":
        # no ffn-wide cast for w2's weight gradient: the widest moment is w1's backward, whose
        # incoming gradient (n · ffn) is cast rowwise for the input gradient: its fp32 scaled
        # copy and the fp8 result (5 B per element), one fp32 scale per row; the incoming
        # gradient's two fp8 copies of w2 still held (the reference's accounting)
        return n * h * _BF16 + shard + n * f * _BF16 + 2 * n * h + 5 * n * f + 4 * n
    # rowwise: one fp32 per row or column; tensorwise: scalars (a float8-gathered weight
    # carries its own)
    scales = 4 * (n + h + f + f) if recipe == "rowwise" else 4 * (3 if all_gather else 4)
    return n * h * _BF16 + shard + n * f * _BF16 + 2 * n * h + weight_cast + 9 * n * f + scales


def float8_forward_moment(
    sh: Shapes,
    spec: ModelSpec,
    recipe: str,
    recompute: str,
    n_layers: int,
    gathered: int,
    n_shard: float,
) -> tuple[float, float, float, float] | None:
    """The last block's forward under float8 when it is not checkpointed, as (grads,
    activations, temporaries, communication) of ``terms``' moments: every block's saved set
    (its own whole: w2's input is the last), the block's input (the decoder's loop variable)
    and its residual stream, the cast of w2's input with its scale, the block gathered twice
    on more than one rank (FSDP2 keeps the all-gather's flat output beside the unsharded
    parameters until the next unit's all-gather). No gradient exists yet
    (``zero_grad(set_to_none=True)``). The peak of ``rowwise_with_gw_hp`` without AC, whose
    backward casts no ffn-wide tensor for the weight gradient (None when the block is
    checkpointed or w2 not converted)."""
    i = n_layers - 1
    h, f, n = sh.h, sh.f, sh.n
    if block_checkpointed(recompute, i) or not w2_converted(spec):
        return None
    acts = sum(block_saved(sh, recompute, j) for j in range(n_layers))
    scale = 4 * n if recipe.startswith("rowwise") else 4
    comm = gathered * (2 if n_shard > 1 else 1)
    # the block input and the residual stream: the latter a sequence-parallel shard under TP
    streams = (n + sh.n_sp) * h * _BF16
    return 0.0, float(acts), float(streams + 9 * n * f + scale), float(comm)


def float8_recompute_moment(sh: Shapes, spec: ModelSpec, recipe: str, per_op: bool) -> int | None:
    """The widest moment of a checkpointed block's recomputed forward under float8, as
    temporaries beyond the block's saved set (None when w2 is not converted): the cast of w2's
    input (9 B per element, as in ``float8_moment``) with its scale (rowwise: one fp32 per
    row), the incoming gradient and the residual stream (alive until the block's output), and
    under per-op SAC w2's cached output, not yet replayed. It is the widest for
    ``rowwise_with_gw_hp``, whose backward casts no ffn-wide tensor for the weight gradient."""
    h, f, n = sh.h, sh.f, sh.n
    if not w2_converted(spec):
        return None
    scale = 4 * n if recipe.startswith("rowwise") else 4
    # under TP (sequence parallel) the incoming gradient, the residual stream and the block's
    # checkpointed input are shards of their own, beside the all-gathered norm output that the
    # column-parallel w1/w3 read; SAC caches w2's partial sums and their reduce-scatter output
    streams = (n + 3 * sh.n_sp if sh.t > 1 else 2 * n) * h * _BF16
    cached = (n + (sh.n_sp if sh.t > 1 else 0)) * h * _BF16 if per_op else 0
    return streams + 9 * n * f + scale + cached


def _check_terms(
    training: Training,
    tp: int,
    loss_chunks: int,
    fp8_recipe: str | None,
    all_gather: bool,
    compiled_loss: bool,
) -> None:
    """The options of ``terms``, checked before any shape is made."""
    check_float8(fp8_recipe, all_gather, tp)
    check_compiled_loss(compiled_loss, loss_chunks, tp)
    if training.precision != "bf16-mixed":
        raise ValueError(
            f"framework='torchtitan' models its FSDP2 mixed precision (bf16 params, fp32 "
            f"master/reduce): precision='bf16-mixed', got {training.precision!r}"
        )
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 0:
        raise ValueError(f"loss_chunks must be an integer >= 0, got {loss_chunks!r}")


def _saved_terms(
    spec: ModelSpec,
    layout: Layout,
    gpu: GPU,
    sh: Shapes,
    seq: int,
    recompute: str,
    loss_chunks: int,
    fp8: tuple[str | None, bool],
    compiled_loss: bool,
) -> tuple[list[float], float]:
    """(the states, buffers, saved activations and loss moment of ``terms``; per-op SAC's
    extra saved bytes per block under float8)."""
    fp8_recipe, fsdp_float8_all_gather = fp8
    t, L, h = layout.tp, spec.n_layers, spec.hidden
    head_params = (spec.vocab * h) // t + h
    embed_params = 0 if spec.tied_embeddings else (spec.vocab * h) // t
    blk = block_params(spec, t)
    x = [0.0] * peak.N_TERMS
    # FSDP2 mixed precision: the fp32 sharded parameter is the master; fp32 grads, AdamW m, v
    x[peak.P_TRAIN] = L * blk + head_params + embed_params
    x[peak.W_BYTES], x[peak.W_FROZEN_BYTES], x[peak.G_BYTES], x[peak.O_BYTES] = 4, 4, 4, 8
    x[peak.N_SHARD] = x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node)
    x[peak.STAGE] = 3
    # the per-layer complex64 RoPE cache (seq · head_dim/2 · 8 B), not sharded
    x[peak.W_BUFFERS] = L * seq * (spec.dhead // 2) * 8
    if fsdp_float8_all_gather:  # the precomputed scales, one stacked fp32 tensor
        x[peak.W_BUFFERS] += 4 * L * len(float8_linears(spec))
    # per-op SAC's extra saved bytes per block under float8 (tensorwise amax scalars)
    sac8 = 0
    if fp8_recipe is not None and recompute in ("selective", "selective:op"):
        sac8 = float8_sac_saved(spec, fp8_recipe, fsdp_float8_all_gather)
    x[peak.A_LAYER], x[peak.N_LAYERS], x[peak.INFLIGHT] = (
        mean_layer_saved(sh, recompute, L) + sac8,
        L,
        1.0,
    )
    x[peak.IDS] = sh.n * 8
    # under TP the vocab-parallel embedding saves its local indices and a bf16 mask
    # (embedding.py: ``(input - offset).clamp(...)``, ``mask.to(out.dtype)``)
    x[peak.A_FIRST] = x[peak.IDS] + (sh.n * 10 if t > 1 else 0)
    head = head_saved(sh, compiled_loss)
    x[peak.A_LAST] = sum(head.values())
    # loss backward: nll_loss's fp32 gradient and log_softmax's, beside its saved output
    x[peak.T_BWD0] = 2 * sh.n * sh.v * 4
    if compiled_loss:  # Inductor's: a per-row buffer and the bf16 logits' gradient
        x[peak.T_BWD0] = sum(compiled_loss_bwd(sh.n, sh.v))
    if t > 1:
        # loss parallel (_LossParallelCrossEntropy.backward): zeros_like(log_probs), exp of it
        # and their sum at once, and its int64/fp32/bool per-token bookkeeping
        x[peak.T_BWD0] = 3 * sh.n * sh.v * 4 + 33 * sh.n
    # the [norm, lm_head] unit is not resharded after forward: gathered (bf16) until backward
    x[peak.GATHER] = head_params * _BF16
    if loss_chunks:
        m, n = sh.n // loss_chunks, sh.n
        x[peak.A_LAST] = (
            head["final_norm"]
            + 2 * n * 8  # the labels and their chunk copies
            + 4
            + 2 * n * h * _BF16  # the final norm's output and its chunk copies
            + 4 * n * h  # GradAccumulator's fp32 buffer
            + 4 * m * sh.v  # this chunk's log-softmax
        )
        # the lm_head's unsharded fp32 gradient, accumulated across the chunks
        x[peak.GATHER] += 4 * (spec.vocab * h)
        # the wider of: a chunk's log-softmax backward (nll's and log-softmax's fp32 gradients
        # beside the chunk's bf16 logits), and the last chunk's reduce-scatter of the head unit
        # (its fp32 input and output; the chunk's logits and input gradient, log-softmax gone)
        n_shard = x[peak.N_SHARD]
        x[peak.T_BWD0] = max(
            8 * m * sh.v + 2 * m * sh.v,
            2 * m * sh.v + 2 * m * h + 4 * head_params * (1 + 1 / n_shard) - 4 * m * sh.v,
        )
    return x, sac8


class _Blocks:
    """The blocks' backward moments of ``terms``.

    Inside a block's backward the widest moment is SwiGLU's product backward (``mul``): the
    block's whole saved set (recomputed under AC: temporaries in the profiler's view) less the
    product (released with w2's backward), the incoming gradient, w2's input gradient and the
    two ffn-wide gradients of the product's inputs. FSDP then holds the block's bf16 params,
    the next unit's in backward order (block i-1, or the embedding) prefetched (not on a single
    rank), w2's unsharded bf16 gradient and the previous unit's fp32 reduce-scatter input (kept
    until the next unit reduces). Across the stack the saved bytes fall and the sharded
    gradients grow linearly, so the widest block is one of the ends: L-1 or L-2, 1 or 0.
    """

    def __init__(
        self,
        spec: ModelSpec,
        sh: Shapes,
        x: list[float],
        recompute: str,
        persistent_grads: bool,
        loss_chunks: int,
        fp8: tuple[str | None, bool],
        sac8: float,
    ) -> None:
        fp8_recipe, fsdp_float8_all_gather = fp8
        t, h = sh.t, spec.hidden
        self.spec, self.sh, self.recompute, self.fp8_recipe = spec, sh, recompute, fp8_recipe
        self.persistent_grads, self.sac8 = persistent_grads, sac8
        self.L = spec.n_layers
        self.head_params = (spec.vocab * h) // t + h
        self.embed_params = 0 if spec.tied_embeddings else (spec.vocab * h) // t
        self.blk = block_params(spec, t)
        self.n_shard = x[peak.N_SHARD]
        self.none = sum(layer_saved(sh, "none").values())
        widest = sh.n_sp * h * _BF16 + 2 * sh.n * sh.f * _BF16
        w2_grad = h * sh.f * _BF16  # w2's unsharded bf16 gradient, there at SwiGLU's moment
        f8 = float8_moment(sh, spec, fp8_recipe, fsdp_float8_all_gather) if fp8_recipe else None
        if f8 is not None and f8 > widest + w2_grad:
            widest, w2_grad = f8, 0
        self.widest, self.w2_grad = widest, w2_grad
        self.gathered = float8_gathered(spec, t, fsdp_float8_all_gather)
        self.rec8 = (
            float8_recompute_moment(
                sh, spec, fp8_recipe, recompute in ("selective", "selective:op")
            )
            if fp8_recipe
            else None
        )
        labels = sh.n * 8  # the step's label tensor, alive until the step ends
        if loss_chunks:
            # ChunkedLossWrapper leaves a reference cycle holding one hidden-state-sized bf16
            # tensor per step, which torchtitan's GarbageCollection (automatic gc off, a
            # collection every gc_freq steps) frees only then: counted once, as in the step
            # after a collection
            labels += sh.n * h * _BF16
        self.labels = labels

    def moment(self, i: int) -> tuple[float, float, float, float]:
        """Block i's widest backward moment: (sharded grads done, activations held by the
        blocks below and by block i outside the moment's temporaries, block i's temporaries,
        communication); with persistent gradients none are new (all are counted as kept)."""
        sh, h, L, blk, n_shard = self.sh, self.spec.hidden, self.L, self.blk, self.n_shard
        grads = (
            0.0 if self.persistent_grads else 4 * (self.head_params + (L - 1 - i) * blk) / n_shard
        )
        below = sum(block_saved(sh, self.recompute, j) for j in range(i)) + i * self.sac8
        checkpointed = block_checkpointed(self.recompute, i)
        own = (sh.n_sp * h * _BF16 if checkpointed else 0) + self.none
        prev = self.head_params if i == L - 1 else blk
        fetch = (self.gathered if i > 0 else self.embed_params * _BF16) if n_shard > 1 else 0
        temp, w2g = self.widest, self.w2_grad
        if self.rec8 is not None and checkpointed and self.rec8 > temp + w2g:
            temp, w2g = self.rec8, 0  # the recomputed forward's cast of w2's input
        comm = self.gathered + fetch + prev * 4 + w2g
        return grads, below + own, temp, comm

    def fill(self, x: list[float]) -> None:
        """The start of backward (the loss's moment or the last blocks') and its end."""
        L, labels = self.L, self.labels
        # start, the alternative to the loss: the last blocks' backward (the head's saved
        # tensors gone but the labels, its sharded grads done, its unit resharded)
        loss_moment = L * x[peak.A_LAYER] + x[peak.A_LAST] + x[peak.T_BWD0] + x[peak.GATHER]
        g, acts, temp, comm = max((self.moment(i) for i in {L - 1, max(L - 2, 0)}), key=sum)
        if self.fp8_recipe is not None:  # the last block's forward, this moment's rival
            fwd = float8_forward_moment(
                self.sh, self.spec, self.fp8_recipe, self.recompute, L, self.gathered,
                self.n_shard,
            )  # fmt: skip
            if fwd is not None and sum(fwd) > g + acts + temp + comm:
                g, acts, temp, comm = fwd
        if g + acts + labels + temp + comm > loss_moment:
            x[peak.G_START], x[peak.A_GONE] = g, x[peak.A_LAST] - labels
            x[peak.T_BWD0] = acts + temp + comm - L * x[peak.A_LAYER] - x[peak.GATHER]
        # end of backward: block 0 or 1 (every gradient but theirs and the embedding's)
        i = max((0, min(1, L - 1)), key=lambda j: sum(self.moment(j)))
        g, acts, temp, comm = self.moment(i)
        pend = self.embed_params + (i + 1) * self.blk
        x[peak.P_PEND] = 0 if self.persistent_grads else pend
        x[peak.G_PERSIST] = 1.0 if self.persistent_grads else 0.0
        x[peak.A_END] = acts + labels
        x[peak.T_LAYER] = temp + comm - x[peak.GATHER]
        x[peak.T_STEP] = labels


def titan_shape(
    spec: ModelSpec,
    layout: Layout,
    gpu: GPU,
    *,
    batch: int,
    seq: int,
    recompute: str,
    compiled: bool = False,
) -> titan_trace.TitanShape:
    """The rank's tensors as ``titan_trace`` allocates them: FSDP units' parameter tensors
    (the fused ``wqkv``, ``wo``, ``w1``, ``w3``, ``w2`` and the two norms of a block), each
    block's saved tensors under ``recompute``, its forward and backward temporaries."""
    sh = Shapes(spec, layout, batch, seq)
    t, h, n, f = layout.tp, spec.hidden, sh.n, sh.f
    qkv = h * (spec.n_heads + 2 * spec.kv_heads) * spec.dhead // t
    block = (h, qkv, spec.n_heads * spec.dhead * h // t, h, h * f, h * f, f * h)
    every = layer_sac_every(recompute)
    none = tuple(layer_saved(sh, "none").values())
    saved, recomputed = [], []
    for i in range(spec.n_layers):
        if every:
            policy = "full" if (i + 1) % every == 0 else "none"
        else:
            policy = {"selective": "op", "selective:op": "op"}.get(recompute, recompute)
        kept = tuple(layer_saved(sh, policy).values())
        if policy == "full":
            rc: tuple[int, ...] = none
        elif policy == "op":
            # the checkpoint recomputes what SAC did not keep: the norms' fp32 tensors, a
            # norm's bf16 output, SwiGLU's silu, w3 and product tensors (the rest of ``none``)
            rc = (4 * sh.n_sp * h,) * 4 + (2 * n * f,) * 3
            rest = sum(none) - (sum(kept) - kept[0]) - sum(rc)
            rc += (rest,) if rest > 0 else ()
        else:
            rc = ()
        saved.append(kept)
        recomputed.append(rc)
    return titan_trace.TitanShape(
        block=block,
        embed=((spec.vocab * h) // t,),
        head=(h, (spec.vocab * h) // t),
        shard=layout.shard_degree(gpu.gpus_per_node),
        saved=tuple(saved),
        recomputed=tuple(recomputed),
        fwd_temp=(2 * n * f,) * 3 if recompute != "none" else (),
        bwd_temp=(2 * sh.n_sp * h, 2 * n * f, 2 * n * f),
        first=(n * 8, n * 8),
        head_saved=(_norm_saved(sh.n_sp, h), n * h * _BF16),
        logits=n * sh.v,
        buffers=(seq * (spec.dhead // 2) * 8,) * spec.n_layers,
        compiled_loss=compiled,
    )


def terms(
    spec: ModelSpec,
    training: Training,
    layout: Layout,
    gpu: GPU,
    *,
    batch: int,
    seq: int,
    recompute: str,
    cuda: bool,
    persistent_grads: bool = False,
    loss_chunks: int = 0,
    fp8_recipe: str | None = None,
    fsdp_float8_all_gather: bool = False,
    alloc_conf: AllocConf | None = None,
    compiled_loss: bool = False,
) -> list[float]:
    """The peak terms (``peak.py``) of one torchtitan rank.

    The moments: the start of backward, the wider of the loss's backward (every block's saved
    tensors, the head's, and the loss backward's two fp32 logits-sized gradients beside
    log-softmax's output, with the ``[norm, lm_head]`` unit still gathered) and the widest
    moment of block L-1 or L-2; the end of backward (block 1 or 0, with every other gradient);
    the optimizer step (all states). Checked to a few hundred bytes against the fake profile of
    torchtitan's model (tests/estimator/test_torchtitan.py).

    ``persistent_grads``: the sharded gradients live across steps. torchtitan's train step runs
    ``zero_grad(set_to_none=disable_cuda_graphs)``: 0.3.0's default CUDA-graph capture keeps
    them (True); the published runs and ``--training.disable_cuda_graphs`` free them (False,
    the default here).

    ``loss_chunks`` (N > 0): ``ChunkedLossWrapper`` (``components/loss.py``). The model returns
    the final norm's output; the wrapper keeps it, N contiguous chunk copies of it and of the
    labels, an fp32 gradient accumulator of the hidden states, and the lm_head gathered with
    its unsharded fp32 gradient accumulated over the chunks (``set_requires_gradient_sync(False)``
    until the last); each chunk runs lm_head, the loss and its backward at once, so the loss
    moment holds one chunk's bf16 logits, log-softmax output and its two fp32 gradients, or the
    last chunk's reduce-scatter of the head unit. A reference cycle in the wrapper keeps one
    hidden-state-sized tensor per step until torchtitan's periodic gc (``gc_freq``, 50): counted
    once (the step right after a collection; each step since adds ``b · s · dim · 2`` bytes).

    ``fp8_recipe`` (``FLOAT8_RECIPES``) / ``fsdp_float8_all_gather``: float8 training of the
    blocks' Linears (``float8_moment``, ``float8_sac_saved``, ``float8_gathered``); with the
    all-gather, ``precompute_float8_dynamic_scale_for_fsdp`` keeps one fp32 scale per
    converted weight across steps.

    ``compiled_loss``: the loss compiled by Inductor (``--training.compile`` at e7c0cae,
    ``titan_compile``): the logits stay saved, nothing fp32 logits-sized is made.
    """
    _check_terms(
        training, layout.tp, loss_chunks, fp8_recipe, fsdp_float8_all_gather, compiled_loss
    )
    sh = Shapes(spec, layout, batch, seq)
    if loss_chunks and layout.tp > 1:
        raise ValueError(
            "framework='torchtitan': loss_chunks with tensor parallelism is not modelled yet "
            "(loss parallel per chunk); use loss_chunks=0 or tp=1"
        )
    if loss_chunks and sh.s % loss_chunks:
        raise ValueError(
            f"loss_chunks={loss_chunks} must divide the local sequence {sh.s} "
            "(ChunkedLossWrapper splits it evenly)"
        )
    fp8 = (fp8_recipe, fsdp_float8_all_gather)
    x, sac8 = _saved_terms(spec, layout, gpu, sh, seq, recompute, loss_chunks, fp8, compiled_loss)
    _Blocks(spec, sh, x, recompute, persistent_grads, loss_chunks, fp8, sac8).fill(x)
    if cuda:
        x[peak.CONTEXT] = gpu.context_bytes
        x[peak.NCCL] = gpu.nccl_bytes if layout.n_gpus > 1 else 0
        x[peak.FRAG] = gpu.fragmentation
    if simulated(alloc_conf, loss_chunks, persistent_grads, fp8_recipe):
        assert alloc_conf is not None
        shape = titan_shape(
            spec, layout, gpu, batch=batch, seq=seq, recompute=recompute, compiled=compiled_loss
        )
        unreleasable, reserved = titan_trace.simulate(alloc_conf, shape)
        x[peak.FRAG_BYTES] = float(unreleasable) if cuda else 0.0
        x[peak.RESERVED_FRAG] = float(reserved)
        x[peak.FRAG] = 0.0
    return x


def simulated(
    alloc_conf: AllocConf | None,
    loss_chunks: int,
    persistent_grads: bool,
    fp8_recipe: str | None = None,
) -> bool:
    """Whether the rank's step is simulated (``titan_trace``): an alloc conf, the whole-logits
    loss, gradients freed by ``zero_grad`` and bf16 linears (the chunked loss, CUDA-graph-kept
    gradients and float8's casts and fp8-gathered weights, which ``titan_trace`` does not
    allocate, keep the flat share)."""
    return (
        alloc_conf is not None and not loss_chunks and not persistent_grads and fp8_recipe is None
    )
