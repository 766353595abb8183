"""Activation memory: what autograd keeps between forward and backward.

Two models:

* ``"ops"`` (default) walks the built-in architectures (``gpumem.models``) op by op and lists
  every tensor autograd saves, deduplicated by storage the way the allocator sees it: a Linear
  saves its input, GELU/SiLU their input, LayerNorm input + mean + rstd (fp32), the float32
  RMSNorm its fp32 input, rstd and normalised output, SDPA q, k, v, out and the fp32
  log-sum-exp (the math backend instead its scaled q/k copies and the s² softmax, plus the
  dropout mask and output), MoE the routing tensors and each expert's share of tokens, and the
  loss its fp32 log-softmax. Under autocast every Linear re-casts its fp32 input to 16 bits (the
  cast is what gets saved) and the cached 16-bit weight copies live until the forward ends.
  Checked exactly against ``torch.autograd.graph.saved_tensors_hooks`` in tests/estimator.
* ``"korthikanti"``: Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, for comparison:
  sbh(34 + 5as/h) per layer, with its tensor-parallel, sequence-parallel, selective- and
  full-recompute forms.

All sizes are for one micro-batch on one tensor-parallel rank, in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.param_count import resnet_stages

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FUSED_OPS = ("norm", "swiglu", "rope", "ce")
"""Fused kernels the rules know (Transformer Engine / Apex / Liger): a fused norm saves its
input and rstd (no fp32 copy, no normalised output); fused SwiGLU saves the gate/up projection's
output (2·ffn) instead of four ffn-wide tensors; fused RoPE saves nothing besides its input's
consumers; fused cross-entropy saves a per-token log-sum-exp instead of the vocabulary-wide
log-probabilities, and its backward writes one logits-sized gradient."""


@dataclass(frozen=True)
class Item:
    """One saved (or live) tensor: ``core`` marks the attention core that selective recompute
    drops; ``saved=False`` marks tensors that are live but not saved by autograd (logits held by
    the caller, autocast's cached weight copies)."""

    name: str
    nbytes: int
    saved: bool = True
    core: bool = False


@dataclass(frozen=True)
class Workload:
    """What the activations of one micro-batch depend on besides the model.

    Attributes:
        batch, seq: micro-batch size and sequence length (tokens per sample for vision).
        compute: bytes of the matmul dtype (fp32 4, bf16/fp16 2).
        residual: bytes of the residual stream (fp32 under autocast, else = compute).
        autocast: torch.autocast is on (inputs re-cast per Linear, weight copies cached).
        attention: ``"flash"`` (CUDA flash / mem-efficient), ``"cpu-flash"`` (CPU SDPA), or
            ``"math"`` (eager: s² scores).
        dropout: attention dropout probability.
        cuda: a CUDA device (dropout masks are bool; on CPU they are float).
        tp, sp: tensor-parallel degree and sequence parallelism.
        keep_logits: the caller holds the logits until backward (a model returning logits).
        upcast_logits: the loss runs on ``logits.float()`` (transformers' ``ForCausalLMLoss``):
            the log-probabilities are fp32 whatever the logits' dtype.
        cp: context-parallel degree (each rank holds ``seq / cp`` tokens of every sequence).
        dense: price an MoE model's dense layer (its first-k dense MLP) instead of an MoE one.
        ep, etp: expert-parallel and expert-tensor-parallel degrees.
        moe_imbalance: tokens of the most loaded expert-parallel rank over the mean (applies
            only when experts are spread over ranks, ep > 1).
        grouped_gemm: experts run as one grouped GEMM over all routed tokens (Megatron's
            TEGroupedMLP, transformers' ``grouped_mm``) rather than a loop over experts.
        fused: which of ``FUSED_OPS`` run as fused kernels.
        eager: transformers' eager attention (``attn_implementation="eager"``) rather than
            SDPA's math path: the softmax is a module op, which CUDA autocast runs in fp32.
        kv_cache: a transformers model builds its KV cache in forward (its default in training;
            gradient checkpointing turns it off); GPT-2's attention then saves the cache's
            contiguous copies of k and v.
    """

    batch: int
    seq: int
    compute: int = 2
    residual: int = 2
    autocast: bool = False
    attention: str = "flash"
    dropout: float = 0.0
    cuda: bool = True
    tp: int = 1
    sp: bool = False
    keep_logits: bool = True
    upcast_logits: bool = False
    cp: int = 1
    dense: bool = False
    ep: int = 1
    etp: int = 1
    moe_imbalance: float = 1.0
    grouped_gemm: bool = False
    fused: frozenset[str] = frozenset()
    kv_cache: bool = True
    eager: bool = False

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (context parallelism splits the sequence)."""
        return self.batch * self.seq // self.cp

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp


def _norm_items(spec: ModelSpec, w: Workload, tag: str, n: int) -> list[Item]:
    """A pre-norm: LayerNorm (input, fp32 mean, rstd) or the float32 RMSNorm of gpumem.models."""
    h, R = spec.hidden, w.residual
    if "norm" in w.fused:  # one kernel: its input and the per-row statistics
        stats = [Item(f"{tag}.rstd", n * 4)]
        if spec.norm == "layernorm":
            stats.append(Item(f"{tag}.mean", n * 4))
        return [Item(f"{tag}.input", n * h * R), *stats]
    if spec.norm == "layernorm":
        return [
            Item(f"{tag}.input", n * h * R),
            Item(f"{tag}.mean", n * 4),
            Item(f"{tag}.rstd", n * 4),
        ]
    return [
        Item(f"{tag}.input_fp32", n * h * 4),  # x.float() (x itself when fp32)
        Item(f"{tag}.rstd", n * 4),
        Item(f"{tag}.normalized", n * h * R),  # (x32 * rstd).to(x.dtype), saved by weight *
    ]


def _norm_out_bytes(spec: ModelSpec, w: Workload) -> int:
    """Bytes per element of a norm's output: weight (param dtype) * normalized (x dtype)."""
    return w.residual if spec.norm == "rmsnorm" or not w.autocast else 4


def _linear_inputs(
    w: Workload, tag: str, n_consumers: int, numel: int, norm_out: int
) -> list[Item]:
    """What the Linears reading one tensor save: under autocast one 16-bit cast per Linear (the
    cache only holds leaves), else the (shared) input itself."""
    if w.autocast and norm_out != w.compute:
        return [Item(f"{tag}.cast{i}", numel * w.compute) for i in range(n_consumers)]
    return [Item(f"{tag}.input", numel * norm_out)]


def _proj_inputs(
    w: Workload, tag: str, consumers: int, n: int, n_sp: int, h: int, nout: int
) -> list[Item]:
    """Inputs saved by the Linears after a norm. Under SP, Megatron saves the sequence shard
    and all-gathers it again in backward."""
    if w.sp:
        return [Item(f"{tag}.input_shard", n_sp * h * w.compute)]
    return _linear_inputs(w, tag, consumers, n * h, nout)


def layer_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Everything one transformer layer keeps for backward (one micro-batch, one TP rank)."""
    t, n, A = w.tp, w.tokens, w.compute
    n_sp = n // t if w.sp else n  # norms and their outputs are sequence-sharded under SP
    h, d = spec.hidden, spec.dhead
    a = spec.n_heads // t
    rotary, b, s = spec.arch == "llama", w.batch, w.seq
    sq = w.local_seq  # queries on this rank (keys: the whole sequence, exchanged under cp)
    nout = _norm_out_bytes(spec, w)
    items = _norm_items(spec, w, "attn_norm", n_sp)
    # q, k, v projections read the gathered norm output (n tokens under SP as well)
    items += _proj_inputs(w, "qkv", 3, n, n_sp, h, nout)
    q = n * a * d * A  # rotated q, and k/v after repeat_interleave: all carry `a` heads
    if rotary and w.autocast and "rope" not in w.fused:  # cos/sin cast to 16 bits for q and k
        items.append(Item("rope.cos_sin_casts", 4 * s * (d // 2) * A))
    if w.attention == "math":
        items += math_attention_items(w, n, a, d)
        o_copy = True  # math output is (b, a, s, d): transpose + reshape copies
    else:
        lse = b * a * (sq if w.attention != "efficient" else -(-sq // 32) * 32) * 4
        # k and v carry `a` heads: repeated (GQA), rotated (new tensor), or views of MHA proj
        items += [
            Item("attn.q", q),
            Item("attn.k", q),
            Item("attn.v", q),
            Item("attn.out", q, core=True),
            Item("attn.lse", lse, core=True),
        ]
        o_copy = w.attention == "cpu-flash" and rotary  # CPU output follows q's (contiguous) layout
    if o_copy:
        items.append(Item("o_proj.input", q))
    items += _norm_items(spec, w, "mlp_norm", n_sp)
    if spec.is_moe and not w.dense:
        items += _moe_items(spec, w, n, nout)
    else:
        f = spec.dense_layer_ffn // t
        if spec.arch == "llama":
            items += _proj_inputs(w, "gate_up", 2, n, n_sp, h, nout)
            items += swiglu_items(w, "mlp", n, f)
        else:
            items += _proj_inputs(w, "fc", 1, n, n_sp, h, nout)
            items += [Item("mlp.fc_out", n * f * A), Item("mlp.gelu_out", n * f * A)]
    if w.autocast:  # cached 16-bit copies of this layer's Linear weights (saved by mm) and biases
        weights, biases = _layer_linear_params(spec, t)
        items += [
            Item("autocast.weight_casts", weights * A),
            Item("autocast.bias_casts", biases * A, saved=False),
        ]
    return items


def math_attention_items(w: Workload, n: int, a: int, d: int) -> list[Item]:
    """SDPA's math backend (eager attention, or the CPU with dropout): the scaled q and k, v,
    the s × s softmax and, with dropout, its mask and output; on the CPU in fp32 whatever the
    inputs (it upcasts 16-bit ones)."""
    M = w.compute if w.cuda else 4
    qm, s2 = n * a * d * M, w.batch * a * w.local_seq * w.seq
    items = [
        Item("attn.q_scaled", qm, core=True),
        Item("attn.k_scaled", qm, core=True),
        Item("attn.v", qm),
        Item("attn.softmax", s2 * M, core=True),
    ]
    if w.dropout > 0:
        mask = s2 * (1 if w.cuda else M)  # bool on CUDA, float noise on CPU
        items += [
            Item("attn.dropout_mask", mask, core=True),
            Item("attn.dropout_out", s2 * M, core=True),
        ]
    return items


def expert_tokens(spec: ModelSpec, w: Workload, n: int) -> int:
    """Token copies the local experts of this rank process: ``n · top_k`` on one rank (whatever
    the routing); under expert parallelism the most loaded rank receives ``moe_imbalance``
    times the mean, which is again ``n · top_k`` (every rank sends its n·k copies out and
    receives its share of everyone's)."""
    nk = n * spec.top_k
    return int(nk * w.moe_imbalance) if w.ep > 1 else nk


def routing_weight_bytes(spec: ModelSpec, w: Workload) -> int:
    """Bytes per element of an MoE's top-k routing weights in transformers: fp32 where the
    router computes in fp32 (Mixtral's softmax of ``logits.float()``; DeepSeek's fp32 linear,
    a 16-bit one under autocast), the router logits' dtype where the weights are cast back to
    it (Qwen2-MoE, Qwen3-MoE)."""
    if spec.family in ("qwen2_moe", "qwen3_moe"):
        return w.compute
    if spec.family.startswith("deepseek") and w.autocast:
        return w.compute
    return 4


def router_copies_input(spec: ModelSpec, w: Workload) -> bool:
    """DeepSeek's router runs ``F.linear(x.float(), w.float())``: on a 16-bit stream (pure
    bf16, no sequence parallelism) it saves an fp32 copy, and the MoE input itself is then
    saved by the shared expert's Linears alone (released after their backward)."""
    return spec.family.startswith("deepseek") and not w.autocast and w.residual != 4 and not w.sp


def swiglu_items(w: Workload, tag: str, n: int, f: int) -> list[Item]:
    """down(act(gate(x)) * up(x)): unfused, the gate output (the activation's input), the
    activation's and the up output (the product's) and the product (down's input); fused, the
    gate/up output (2·ffn) and the product."""
    A = w.compute
    if "swiglu" in w.fused:
        return [Item(f"{tag}.gate_up_out", n * 2 * f * A), Item(f"{tag}.down_input", n * f * A)]
    return [
        Item(f"{tag}.gate_out", n * f * A),
        Item(f"{tag}.act_out", n * f * A),
        Item(f"{tag}.up_out", n * f * A),
        Item(f"{tag}.down_input", n * f * A),
    ]


def _moe_items(spec: ModelSpec, w: Workload, n: int, nout: int) -> list[Item]:
    """gpumem.models.MoE: router, fp32 softmax, top-k, and each expert's tokens (sum = n·k).

    The sum over experts is n·top_k tokens whatever the routing, so the total is exact for a
    single device; under expert parallelism the most loaded rank's share is scaled by
    ``moe_imbalance`` (``expert_tokens``).
    """
    h, E, k, A = spec.hidden, spec.n_experts, spec.top_k, w.compute
    f = spec.ffn // w.etp
    nk = expert_tokens(spec, w, n)
    items = _proj_inputs(w, "router", 1, n, n // w.tp if w.sp else n, h, nout)
    items += [
        Item("moe.probs_fp32", n * E * 4),
        Item("moe.topk_indices", n * k * 8),
        Item("moe.topk_weights", n * k * 4),
        Item("moe.weight_sum", n * 4),
    ]
    wdt = nout  # routing weights are cast to x.dtype
    items += [Item("moe.token_indices", nk * 8), Item("moe.slot_indices", nk * 8)]
    items += _linear_inputs(w, "expert_in", 2, nk * h, nout)
    items += [
        Item("moe.gate_out", nk * f * A),
        Item("moe.silu_out", nk * f * A),
        Item("moe.up_out", nk * f * A),
        Item("moe.down_input", nk * f * A),
        Item("moe.expert_out", nk * h * A),
        Item("moe.route_weight", nk * wdt),
        # index_add_'s derivative names `source` (expand_as), so the weighted output is kept
        Item("moe.weighted_out", nk * h * max(A, wdt)),
    ]
    return items


def _layer_linear_params(spec: ModelSpec, t: int) -> tuple[int, int]:
    """(weights, biases) of one layer's Linears on one TP rank: what autocast casts and caches."""
    h, d, a, g = spec.hidden, spec.dhead, spec.n_heads, spec.kv_heads
    qd, kvd = a * d // t, 2 * g * d // min(t, g)  # kv heads replicate when tp > kv heads
    weights = h * (qd + kvd) + qd * h
    biases = 0
    if spec.arch != "llama":
        biases += qd + kvd + h
    elif spec.qkv_bias:
        biases += qd + kvd
    f = spec.ffn // t
    if spec.arch == "llama":
        weights += 3 * h * f
        if spec.is_moe:
            weights += (spec.n_experts - 1) * 3 * h * f + h * spec.n_experts
    else:
        weights += 2 * h * f
        biases += f + h
    return weights, biases


def embed_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Token ids (int64, saved by the embedding) and gpt2's position ids."""
    items = [Item("embed.ids", w.tokens * 8)]
    if spec.arch == "gpt2":
        items.append(Item("pos_embed.ids", w.local_seq * 8))
    return items


def head_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Final norm, LM head input, logits, and the loss's fp32 log-softmax and targets."""
    n, t = w.tokens, w.tp
    n_sp = n // t if w.sp else n
    v = spec.vocab // t
    nout = _norm_out_bytes(spec, w)
    items = _norm_items(spec, w, "final_norm", n_sp)
    items += _linear_inputs(w, "lm_head", 1, n * spec.hidden, nout)
    logit_bytes = w.compute if (w.autocast or w.compute == w.residual) else w.residual
    if w.keep_logits:
        items.append(Item("logits", n * v * logit_bytes, saved=False))
    # cross_entropy is fp32 under autocast and on upcast logits
    lsm = 4 if (w.autocast or w.upcast_logits or logit_bytes == 4) else logit_bytes
    if "ce" in w.fused:  # a per-token log-sum-exp and its input, not the log-probabilities
        items.append(Item("loss.lse", n * 4))
        if not w.keep_logits:  # else the held logits are that input (one storage)
            items.append(Item("loss.logits_input", n * v * logit_bytes))
    else:
        items.append(Item("loss.log_softmax", n * v * lsm))
    items += [Item("loss.targets", n * 8), Item("loss.total_weight", 4)]
    if w.autocast:
        items.append(Item("autocast.lm_head_cast", spec.vocab * spec.hidden // t * w.compute))
    return items


def ce_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    """Transient at the start of backward: nll_loss's grad and log_softmax's grad, both the
    size of the fp32 log-probabilities (what makes large-vocabulary losses peak here); a fused
    cross-entropy writes one logits-sized gradient."""
    if "ce" in w.fused:
        logit_bytes = w.compute if (w.autocast or w.compute == w.residual) else w.residual
        return w.tokens * (spec.vocab // w.tp) * logit_bytes
    items = head_items(spec, w)
    return 2 * next(i.nbytes for i in items if i.name == "loss.log_softmax")


def sum_items(items: list[Item], saved_only: bool = False, drop_core: bool = False) -> int:
    return sum(
        i.nbytes for i in items if (i.saved or not saved_only) and not (drop_core and i.core)
    )


# --- vision ------------------------------------------------------------------------------


def resnet_bytes(spec: ModelSpec, batch: int, image: int, A: int) -> int:
    """torchvision-style ResNet (bottleneck): conv inputs, BN inputs + per-channel stats, ReLU
    outputs (in place), maxpool input + int64 indices, pooled features, fc input."""
    hw = (image // 2) ** 2
    total = batch * spec.channels * image * image * A  # stem conv input (the images)
    total += batch * spec.width * hw * A * 2 + 2 * spec.width * 4  # conv out (BN in), relu out
    total += batch * spec.width * (image // 4) ** 2 * 8  # maxpool indices (int64)
    res = image // 4
    for cin, mid, cout, stride in resnet_stages(spec):
        out_res = res // stride
        total += batch * mid * res * res * A * 2  # conv1 out, relu1 out
        total += batch * mid * out_res**2 * A * 2 + batch * cout * out_res**2 * A  # conv2/3 outs
        if stride != 1 or cin != cout:
            total += batch * cout * out_res**2 * A  # downsample conv out
        total += batch * cout * out_res**2 * A  # residual add -> relu_ (saved result)
        total += 2 * 4 * (2 * mid + cout)  # BN save_mean / save_invstd
        res = out_res
    cfinal = spec.width * 2 ** (len(spec.blocks) - 1) * 4
    return total + batch * cfinal * A + batch * 8  # pooled features (fc input) + targets


# --- Korthikanti et al. 2022 -------------------------------------------------------------


def korthikanti_layer_bytes(
    spec: ModelSpec,
    batch: int,
    seq: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    flash: bool = False,
) -> int:
    """Per-layer activation bytes from Korthikanti et al. 2022, Table 2 (16-bit activations,
    1-byte dropout masks, GPT layer with f = 4h). ``flash`` drops the 5as/h attention term
    (FlashAttention keeps no s² matrix).

    =========================  =================================
    none, t = 1                 sbh(34 + 5as/h)
    tensor parallel             sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel  sbh/t · (34 + 5as/h)
    selective recompute         sbh(10 + 24/t)  ·  with SP: 34 sbh/t
    full recompute              2sbh
    =========================  =================================
    """
    s, b, h, a, t = seq, batch, spec.hidden, spec.n_heads, tp
    sbh = s * b * h
    attn_num, attn_den = (0, 1) if (flash or recompute == "selective") else (5 * a * s, h)
    if recompute == "full":
        return 2 * sbh // (t if sp else 1)
    if sp:  # everything sharded by t
        return sbh * (34 * attn_den + attn_num) // (attn_den * t)
    # sbh(10 + 24/t + 5as/(ht)) as one exact fraction
    return sbh * (10 * t * attn_den + 24 * attn_den + attn_num) // (t * attn_den)
