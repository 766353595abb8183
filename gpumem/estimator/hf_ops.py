"""What Hugging Face transformers' decoder modules save for backward, op by op, and the front
door that picks these rules or ``activations.py``'s (gpumem.models) for a spec.

A ``config.json`` describes a model that transformers builds, and transformers' modules save
different tensors than gpumem.models' (which ``activations.py`` follows). Read from
transformers 5.x (``modeling_llama.py`` and its copies, ``integrations/moe.py``) and checked
against ``gpumem.profile`` under fake tensors (tests/estimator/test_hf_sweep.py):

- **RMSNorm** (Llama family): ``x.to(float32)`` (x itself in fp32), the fp32 ``rstd``, and the
  normalised ``.to(input_dtype)`` that ``weight *`` saves. Gemma's norm keeps the normalised
  value in fp32 (``(x * rstd) * (1 + w)`` is cast after the product) and saves the fp32
  ``1 + w`` of every call.
- **attention** (SDPA): q and k after RoPE (new tensors), v as the projection's view (Phi-3's
  fused ``qkv_proj``: its whole output), output and fp32 log-sum-exp; GQA runs natively
  (``enable_gqa``), so k and v keep their KV heads (gpumem.models repeats them: the ~10 %
  overestimate a config.json used to get); the output is already in ``(b, s, heads, d)`` order,
  so ``o_proj`` reads it without a copy. RoPE's cos/sin, computed once per forward, are saved
  by the first layer's products (the first stage's activations). Qwen3 and Gemma3 normalise q
  and k per head (a norm each).
- **MLP**: SwiGLU / GeGLU unfused: the gate output (the activation's input), the activation's
  output and the up output (the product's), the product (``down_proj``'s input): 4 · ffn per
  token, fused ``gate_up_proj`` (Phi-3) or not.
- **MoE** (``experts_implementation="grouped_mm"``): the router's fp32 probabilities and top-k
  indices (Mixtral also the renormalised weights and their sum), the tokens gathered per
  expert, the grouped up projection's ``2 · ffn`` output, the activation and product, the down
  projection's output and the routing weights it is multiplied by, three index vectors; a
  shared expert is a dense MLP (Qwen2-MoE scales it by a saved sigmoid gate). The routing
  weights are fp32 (Mixtral, DeepSeek; DeepSeek's are 16-bit under autocast) or the router's
  dtype (Qwen-MoE); DeepSeek's router copies a 16-bit stream to fp32 and keeps its scores, one
  copy of the top-k weights and their denominator.
- **eager attention** (Gemma2, which refuses SDPA): k and v repeated to every head, q, the
  soft-capped scores' tanh output, the fp32 softmax and its cast to the query's dtype, the
  output's copy; soft-capped logits keep their tanh output.
- **MLA** (DeepSeek-V2/V3): the down projections' input, their norms (llama RMSNorm), the up
  projections' inputs, q and k of ``nope + rope`` width, the ``kv_b_proj`` output that v views,
  the attention output and the ``o_proj`` copy of it; on the CPU, whose flash kernel needs one
  head dim for q, k and v, SDPA's math path instead (fp32 scaled q, k, the s × s softmax, v).
"""

from __future__ import annotations

from gpumem.estimator import activations as act
from gpumem.estimator.activations import Item, Workload
from gpumem.estimator.model_spec import ModelSpec

GEMMA = ("gemma", "gemma2", "gemma3_text", "gemma3")


def layer_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Everything one layer keeps for backward, by the spec's implementation."""
    if not spec.is_hf:
        return act.layer_items(spec, w)
    if spec.is_encoder:
        return _encoder_layer(spec, w)
    if spec.arch == "gpt2":
        return _gpt2_layer(spec, w)
    t, n, A, R = w.tp, w.tokens, w.compute, w.residual
    n_sp = n // t if w.sp else n
    h = spec.hidden
    items = _norm(spec, w, "attn_norm", n_sp, h, R)
    # the Linears reading the norm's output: q, k, v; Phi-3's fused qkv; MLA's q (or q_a) and
    # kv_a
    consumers = 1 if spec.family == "phi3" else 2 if spec.is_mla else 3
    items += _proj_inputs(w, "qkv", consumers, n, n_sp, h)
    items += _mla(spec, w, n) if spec.is_mla else _attention(spec, w, n)
    if spec.norms_per_layer == 4:  # Gemma2/3: the attention output is normalised (compute dtype)
        items += _norm(spec, w, "post_attn_norm", n_sp, h, A)
    items += _norm(spec, w, "mlp_norm", n_sp, h, R)
    if spec.is_moe and not w.dense:
        items += _moe(spec, w, n)
    else:
        items += _proj_inputs(w, "gate_up", 2 if spec.family != "phi3" else 1, n, n_sp, h)
        items += _gated_mlp(w, "mlp", n, spec.dense_layer_ffn // t)
    if spec.norms_per_layer == 4:
        items += _norm(spec, w, "post_mlp_norm", n_sp, h, A)
    if w.autocast:  # cached 16-bit copies of the layer's Linear weights (saved by mm)
        items.append(Item("autocast.weight_casts", _linear_weights(spec, t, w.dense) * A))
    return items


def embed_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Token ids, and (Hugging Face) RoPE's cos and sin, saved once by the first layer."""
    if spec.is_encoder:
        return _encoder_embed(spec, w)
    items = act.embed_items(spec, w)
    if spec.is_hf and spec.arch == "llama":
        rope = spec.qk_rope_dim if spec.is_mla else spec.dhead
        # position_ids are (1, s): cos and sin are (1, s, rope) in the hidden states' dtype
        if "rope" not in w.fused:
            items.append(Item("rope.cos_sin", 2 * w.local_seq * rope * w.residual))
    return items


def head_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Final norm, LM head input, logits and the loss (``activations.head_items``), with
    transformers' norm for a config.json model."""
    if spec.encoder_head:
        return _classifier_head(spec, w)
    items = act.head_items(spec, w)
    if spec.is_encoder:  # the MLM transform before the final LayerNorm (dense, GELU)
        n = w.tokens
        return [*_proj_inputs(w, "mlm.dense", 1, n, n, spec.hidden),
                Item("mlm.gelu_input", n * spec.hidden * w.compute), *items]  # fmt: skip
    if not spec.is_hf or spec.arch != "llama":
        return items
    n_sp = w.tokens // w.tp if w.sp else w.tokens
    rest = [i for i in items if not i.name.startswith("final_norm.")]
    if spec.logit_softcap:  # logits = tanh(logits / cap) * cap: tanh saves its output
        logit_bytes = w.compute if (w.autocast or w.compute == w.residual) else w.residual
        rest.append(Item("logits.softcap_tanh", w.tokens * (spec.vocab // w.tp) * logit_bytes))
    return _norm(spec, w, "final_norm", n_sp, spec.hidden, w.residual) + rest


def attention_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """What one layer's attention core saves (q/k norms, RoPE'd q and k, v, the output, the
    log-sum-exp; eager attention's scores): the part of a layer an adapter does not change."""
    return _attention(spec, w, w.tokens)


def ce_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    if spec.encoder_head:  # the loss's gradient and its log-softmax's: the logits' size
        return 2 * sum(i.nbytes for i in _classifier_head(spec, w) if i.name == "loss.log_softmax")
    return act.ce_backward_bytes(spec, w)


def dispatch_bytes(spec: ModelSpec, w: Workload, dispatcher: str) -> float:
    """Token dispatch/combine buffers of one MoE layer under expert parallelism (forward and
    backward alike), in the compute dtype.

    All-to-all (Megatron's ``alltoall`` dispatcher): the permuted tokens sent (n · k) and the
    tokens received (``expert_tokens``: n · k, the most loaded rank ``moe_imbalance`` times
    that). All-gather: the hidden states of the whole expert-parallel group gathered (n · ep)
    and the combined output before its reduce-scatter (the same size).
    """
    if w.ep == 1:
        return 0.0
    n, h, A = w.tokens, spec.hidden, w.compute
    if dispatcher == "allgather":
        return float(2 * n * w.ep * h * A)
    return float((n * spec.top_k + act.expert_tokens(spec, w, n)) * h * A)


# --- the pieces ----------------------------------------------------------------------------


def _norm(spec: ModelSpec, w: Workload, tag: str, n: int, width: int, x_bytes: int) -> list[Item]:
    """An RMSNorm over ``n`` rows of ``width`` whose input has ``x_bytes`` per element."""
    if "norm" in w.fused:  # Liger / TE: the input and rstd
        return [Item(f"{tag}.input", n * width * x_bytes), Item(f"{tag}.rstd", n * 4)]
    items = [
        Item(f"{tag}.input_fp32", n * width * 4),  # x.float(): x itself when fp32
        Item(f"{tag}.rstd", n * 4),
    ]
    if spec.family in GEMMA:  # (x * rstd) stays fp32; (1 + w) is a new fp32 tensor per call
        return [
            *items,
            Item(f"{tag}.normalized", n * width * 4),
            Item(f"{tag}.one_plus_w", width * 4),
        ]
    return [*items, Item(f"{tag}.normalized", n * width * x_bytes)]


def _proj_inputs(w: Workload, tag: str, consumers: int, n: int, n_sp: int, h: int) -> list[Item]:
    """Inputs the Linears after a norm save: the norm's output in the residual dtype (Gemma
    casts back to it), one 16-bit cast per Linear under autocast, the sequence shard under SP."""
    if w.sp:
        return [Item(f"{tag}.input_shard", n_sp * h * w.compute)]
    if w.autocast and w.residual != w.compute:
        return [Item(f"{tag}.cast{i}", n * h * w.compute) for i in range(consumers)]
    return [Item(f"{tag}.input", n * h * w.residual)]


def _sdpa(w: Workload, a: int, q: int, k: int, v: int, out: int) -> list[Item]:
    """SDPA's saved tensors: q, k, v, output (bytes given) and the fp32 log-sum-exp."""
    sq = w.local_seq
    lse = w.batch * a * (sq if w.attention != "efficient" else -(-sq // 32) * 32) * 4
    return [
        Item("attn.q", q),
        Item("attn.k", k),
        Item("attn.v", v),
        Item("attn.out", out, core=True),
        Item("attn.lse", lse, core=True),
    ]


def _attention(spec: ModelSpec, w: Workload, n: int) -> list[Item]:
    t, A = w.tp, w.compute
    a, d = spec.n_heads // t, spec.dhead
    g = max(1, spec.kv_heads // t)
    items = []
    if spec.qk_norm:  # per-head RMSNorm of the q and k projections' outputs
        items += _norm(spec, w, "q_norm", n * a, d, A) + _norm(spec, w, "k_norm", n * g, d, A)
    if spec.eager_attention:
        return items + _eager(spec, w, n, a, d)
    v = n * g * d * A
    if spec.family == "phi3":  # v is a view of the fused qkv output: its storage stays
        v = n * (a + 2 * g) * d * A
    return items + _sdpa(w, a, n * a * d * A, n * g * d * A, v, n * a * d * A)


def _eager(spec: ModelSpec, w: Workload, n: int, a: int, d: int) -> list[Item]:
    """transformers' eager attention (Gemma2: SDPA cannot soft-cap): k and v repeated to every
    head (copies), q, the soft-capped scores' tanh output in the query's dtype, the fp32
    softmax and its cast back to the query's dtype (what the product with v saves), and the
    output's contiguous copy for o_proj. Attention dropout 0 (transformers' default) saves no
    mask."""
    A, s2 = w.compute, w.batch * a * w.local_seq * w.seq
    items = [
        Item("attn.q", n * a * d * A),
        Item("attn.k_repeated", n * a * d * A),
        Item("attn.v_repeated", n * a * d * A),
    ]
    if spec.attn_softcap:
        items.append(Item("attn.softcap_tanh", s2 * A, core=True))
    items.append(Item("attn.softmax", s2 * 4, core=True))
    if A != 4:
        items.append(Item("attn.softmax_cast", s2 * A, core=True))
    return [*items, Item("attn.out", n * a * d * A, core=True)]


def _mla(spec: ModelSpec, w: Workload, n: int) -> list[Item]:
    """DeepSeek's multi-head latent attention (see the module docstring)."""
    t, A = w.tp, w.compute
    a = spec.n_heads // t
    qk = spec.qk_nope_dim + spec.qk_rope_dim
    kvr = spec.kv_lora_rank
    items = []
    if spec.q_lora_rank:
        items += _norm(spec, w, "q_a_norm", n, spec.q_lora_rank, A)
        items.append(Item("q_b.input", n * spec.q_lora_rank * A))
    # in fp32 the latent norm's input views kv_a's output (latent + rope key); else the norm
    # copies the latent to fp32
    if A == 4:
        items.append(Item("kv_a.out", n * (kvr + spec.qk_rope_dim) * A))
    else:
        items.append(Item("kv_a_norm.input_fp32", n * kvr * 4))
    items += [
        Item("kv_a_norm.rstd", n * 4),
        Item("kv_a_norm.normalized", n * kvr * A),
        Item("kv_b.input", n * kvr * A),
    ]
    if w.attention == "cpu-flash" and qk != spec.v_head_dim:
        # CPU SDPA's flash kernel needs one head dim for q, k and v: the math path runs, in
        # fp32 (16-bit inputs upcast): scaled q, k, the s x s softmax, v, and o_proj reads a
        # copy of the output
        M, sq = 4, w.local_seq
        items += [
            Item("attn.q_scaled", n * a * qk * M, core=True),
            Item("attn.k", n * a * qk * M, core=True),
            Item("attn.softmax", w.batch * a * sq * w.seq * M, core=True),
            Item("attn.v", n * a * spec.v_head_dim * M),
            Item("o_proj.input", n * a * spec.v_head_dim * A),
        ]
    else:
        items += [
            Item("attn.q", n * a * qk * A),
            Item("attn.k", n * a * qk * A),
            Item("attn.v", n * a * (spec.qk_nope_dim + spec.v_head_dim) * A),  # kv_b's output
            Item("attn.out", n * a * spec.v_head_dim * A, core=True),
            Item("o_proj.input", n * a * spec.v_head_dim * A),
        ]
    return items


def _gated_mlp(w: Workload, tag: str, n: int, f: int) -> list[Item]:
    return act.swiglu_items(w, tag, n, f)


def _moe(spec: ModelSpec, w: Workload, n: int) -> list[Item]:
    """A routed MoE layer with grouped experts (transformers' grouped_mm) and shared experts."""
    h, E, k, A = spec.hidden, spec.n_experts, spec.top_k, w.compute
    n_sp = n // w.tp if w.sp else n
    nk = act.expert_tokens(spec, w, n)
    items = _proj_inputs(w, "router", 1, n, n_sp, h)
    if spec.family.startswith("deepseek"):
        # F.linear(x.float(), w.float()) (16-bit under autocast): a 16-bit stream is copied
        # to fp32, and the shared expert's Linears save the stream itself; the group-limited
        # selection only picks indices (its graph is unreachable from the loss, freed at once)
        L = act.routing_weight_bytes(spec, w)
        if act.router_copies_input(spec, w):
            items = [Item("router.input_fp32", n * h * 4)]
            if spec.n_shared_experts:
                items.append(Item("shared.input", n * h * w.residual))
        items += [
            Item("router.scores", n * E * L),  # sigmoid output
            Item("router.topk_indices", n * k * 8),  # gather's index
            Item("router.topk_weights", n * k * L),  # the in-place division's copy of them
            Item("router.denominator", n * L),
        ]
    else:
        items += [Item("router.probs", n * E * 4), Item("router.topk_indices", n * k * 8)]
        if spec.family == "mixtral" or spec.family == "qwen3_moe":
            items += [Item("router.topk_weights", n * k * 4), Item("router.sum", n * 4)]
    f = spec.moe_ffn // w.etp
    # grouped_mm is not autocast-enabled: transformers casts the tokens to the experts' weight
    # dtype, so under autocast the experts run in fp32 (the residual stream's dtype)
    E_A = w.residual
    items += [
        Item("experts.gathered", nk * h * E_A),
        Item("experts.gate_up_out", nk * 2 * f * E_A),
        Item("experts.act_out", nk * f * E_A),
        Item("experts.down_input", nk * f * E_A),
        Item("experts.down_out", nk * h * E_A),
        Item("experts.routing_weights", nk * act.routing_weight_bytes(spec, w)),
        Item("experts.indices", 3 * nk * 8),
    ]
    if spec.n_shared_experts:
        if w.autocast and w.residual != A and not w.sp:  # each Linear casts the fp32 input
            n_linears = 2 + (1 if spec.shared_gate else 0)
            items += [Item(f"shared.cast{i}", n * h * A) for i in range(n_linears)]
        items += _gated_mlp(w, "shared", n, spec.shared_ffn // w.tp)
        if spec.shared_gate:
            items += [Item("shared.gate_sigmoid", n * A), Item("shared.out", n * h * A)]
    return items


def _gpt2_layer(spec: ModelSpec, w: Workload) -> list[Item]:
    """transformers' GPT-2 block (Conv1D = addmm, SDPA, ``gelu_new`` written as Python ops):
    LayerNorms save input, mean and rstd; attention saves ``c_attn``'s input, its fused q/k/v
    output (q, k and v view it), the KV cache's contiguous copies of k and v when the cache is
    on (transformers' default in training, off under gradient checkpointing), the output
    (``c_proj`` reads it without a copy) and the log-sum-exp; ``gelu_new`` =
    0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³))) saves x (for pow), tanh's output, 0.5·x and
    1 + tanh, and ``c_proj`` its product: 5 ffn-wide
    tensors per token, in the compute dtype under autocast too."""
    t, n, A = w.tp, w.tokens, w.compute
    n_sp = n // t if w.sp else n
    h, f = spec.hidden, spec.ffn // t
    a = spec.n_heads // t
    hq = a * spec.dhead
    items = act._norm_items(spec, w, "attn_norm", n_sp)
    items += _proj_inputs(w, "c_attn", 1, n, n_sp, h)
    items.append(Item("attn.qkv", n * 3 * hq * A))
    kv_copy = n * hq * A if w.kv_cache else 0  # the KV cache's k and v; else views of qkv
    items += _sdpa(w, a, kv_copy, kv_copy, 0, n * hq * A)
    if w.autocast:  # the attention c_proj's autocast input is a copy of the output
        items.append(Item("attn.c_proj_input", n * hq * A))
    items += act._norm_items(spec, w, "mlp_norm", n_sp)
    items += _proj_inputs(w, "c_fc", 1, n, n_sp, h)
    items += [Item(f"gelu.{k}", n * f * A) for k in ("x", "tanh", "half_x", "one_plus_tanh")]
    items.append(Item("c_proj.input", n * f * A))
    if w.autocast:
        weights = h * 3 * hq + hq * h + 2 * h * f
        items.append(Item("autocast.weight_casts", weights * A))
    return items


def _dropout(w: Workload, tag: str, numel: int, p: float) -> list[Item]:
    """A training dropout's saved tensor: a bool mask on CUDA (``native_dropout``), the scaled
    noise in the input's dtype on the CPU (``input * noise``); nothing at p = 0."""
    if p <= 0:
        return []
    return [Item(f"{tag}.dropout_mask", numel * (1 if w.cuda else w.compute))]


def _encoder_layer(spec: ModelSpec, w: Workload) -> list[Item]:
    """transformers' BERT / RoBERTa layer (post-LN): the q, k and v Linears share the layer's
    input (the previous LayerNorm's output), SDPA saves its three projections (views of
    separate outputs), output and log-sum-exp (the CPU's SDPA takes the math path under
    attention dropout); the output dense reads the attention's output, dropout, then
    ``LayerNorm(x + input)`` saves the sum, mean and rstd; the intermediate dense reads that
    norm's output, exact GELU saves its input, the output dense its output; dropout and the
    second LayerNorm as the first."""
    t, n, A = w.tp, w.tokens, w.compute
    n_sp = n // t if w.sp else n
    h, f, a, d = spec.hidden, spec.ffn // t, spec.n_heads // t, spec.dhead
    hq = a * d
    items = _proj_inputs(w, "qkv", 3, n, n_sp, h)
    if w.eager:
        items += _eager_attention(w, n, a, d, spec.attn_pdrop)
    elif w.attention == "math":
        items += act.math_attention_items(w, n, a, d)
        items.append(Item("attn.dense_input", n * hq * A))  # (b, a, s, d) -> a copy
    else:
        items += _sdpa(w, a, n * hq * A, n * hq * A, n * hq * A, n * hq * A)
    items += _dropout(w, "attn_out", n * h, spec.pdrop)
    items += act._norm_items(spec, w, "attn_ln", n_sp)
    items += _proj_inputs(w, "intermediate", 1, n, n_sp, h)
    items += [Item("gelu.input", n * f * A), Item("output_dense.input", n * f * A)]
    items += _dropout(w, "mlp_out", n * h, spec.pdrop)
    items += act._norm_items(spec, w, "mlp_ln", n_sp)
    if w.autocast:
        items.append(Item("autocast.weight_casts", (4 * h * hq + 2 * h * f) * A))
    return items


def _eager_attention(w: Workload, n: int, a: int, d: int, p: float) -> list[Item]:
    """transformers' eager attention (``eager_attention_forward``): the matmuls' q, k and v
    (copies: the transposed heads are not contiguous), the softmax output, with dropout its mask
    and output, the output's contiguous copy for the output dense. CUDA autocast runs softmax in
    fp32 (its fp32 list; the CPU's in 16 bits): the fp32 probabilities, and the 16-bit copy the
    probabilities-times-v matmul casts; 7 B a score with dropout, against SDPA math's 5."""
    A = w.compute
    s2 = w.batch * a * w.local_seq * w.seq
    soft = 4 if w.autocast and w.cuda else A
    items = [Item(f"attn.{k}", n * a * d * A, core=k != "v") for k in ("q", "k", "v")]
    items.append(Item("attn.softmax", s2 * soft, core=True))
    if p > 0:
        items.append(Item("attn.dropout_mask", s2 * (1 if w.cuda else soft), core=True))
    if p > 0 or soft != A:  # the matmul's input: dropout's output, or autocast's copy
        items.append(Item("attn.probs", s2 * A, core=True))
    return [*items, Item("attn.dense_input", n * a * d * A)]


def _classifier_head(spec: ModelSpec, w: Workload) -> list[Item]:
    """An encoder's classification head (``*ForSequenceClassification``: the pooler's dense
    and tanh on the first token, dropout, the classifier; ``*ForTokenClassification``: dropout
    and the classifier on every token; ``*ForQuestionAnswering``: ``qa_outputs`` on every
    token, split into start and end logits) and its loss (``CrossEntropyLoss``; the QA head's
    two, on the start and the end logits; one label: ``MSELoss``).

    The pooler's Linear saves its input, ``hidden[:, 0]``: a view that keeps the last layer's
    whole output alive (under autocast its 16-bit copy of the b rows instead). A Linear's output
    is 16-bit under autocast, else the residual dtype; cross-entropy runs in fp32 under
    autocast."""
    n, b, h, L, head = w.tokens, w.batch, spec.hidden, spec.n_labels, spec.encoder_head
    A, R = w.compute, w.residual
    out = A if w.autocast else R
    items: list[Item] = []
    rows, x_bytes = n, R  # the classifier's input rows and their dtype before it
    if head == "seq_cls":
        items.append(Item("pooler.input", b * h * A if w.autocast else n * h * R))
        items.append(Item("pooler.tanh", b * h * out))
        rows, x_bytes = b, out
    if head != "qa" and spec.head_pdrop > 0:
        items.append(Item("classifier.dropout_mask", rows * h * (1 if w.cuda else x_bytes)))
        items.append(Item("classifier.input", rows * h * (A if w.autocast else x_bytes)))
    elif head != "seq_cls" or (w.autocast and x_bytes != A):
        items.append(Item("classifier.input", rows * h * (A if w.autocast else x_bytes)))
    if w.keep_logits:
        items.append(Item("logits", rows * L * out, saved=False))
    lsm = 4 if w.autocast else out
    if head == "qa":  # start and end: a (b, s) log-softmax and the positions each
        items += [Item("loss.log_softmax", 2 * n * lsm), Item("loss.targets", 2 * b * 8)]
    elif L == 1:  # regression: MSELoss keeps the logits and the labels
        items += [Item("loss.log_softmax", rows * lsm), Item("loss.targets", rows * 4)]
    else:
        items += [Item("loss.log_softmax", rows * L * lsm), Item("loss.targets", rows * 8)]
    if w.autocast:
        weights = (h * h if head == "seq_cls" else 0) + h * L
        items.append(Item("autocast.head_casts", weights * A))
    return items


def _encoder_embed(spec: ModelSpec, w: Workload) -> list[Item]:
    """Token ids; the token-type ids (BERT gathers one row from its buffer, RoBERTa one per
    sample) and RoBERTa's position ids (counted from the tokens past ``padding_idx``: a new
    tensor; BERT slices its buffer); the LayerNorm of the three embeddings' sum and the
    dropout after it."""
    n = w.tokens
    roberta = spec.family == "roberta"
    items = [Item("embed.ids", n * 8), Item("embed.token_type_ids", (n if roberta else w.seq) * 8)]
    if roberta:
        items.append(Item("embed.position_ids", n * 8))
    items += act._norm_items(spec, w, "embed_ln", n)
    return items + _dropout(w, "embed", n * spec.hidden, spec.pdrop)


def _linear_weights(spec: ModelSpec, t: int, dense: bool) -> int:
    """Elements of one layer's Linear weights on a TP rank (what autocast caches in 16 bits):
    attention, and the dense MLP, or the router and shared experts (grouped experts are not
    autocast)."""
    h, d, a, g = spec.hidden, spec.dhead, spec.n_heads, spec.kv_heads
    if spec.is_mla:
        qk, kvr, rope = spec.qk_nope_dim + spec.qk_rope_dim, spec.kv_lora_rank, spec.qk_rope_dim
        qr = spec.q_lora_rank
        q = h * qr + qr * a * qk // t if qr else h * a * qk // t
        kv = h * (kvr + rope) + kvr * a * (spec.qk_nope_dim + spec.v_head_dim) // t
        out = q + kv + a * spec.v_head_dim * h // t
    else:
        qd, kvd = a * d // t, 2 * g * d // min(t, g)
        out = h * (qd + kvd) + qd * h
    if not spec.is_moe or dense:
        return out + 3 * h * spec.dense_layer_ffn // t
    return out + h * spec.n_experts + 3 * h * spec.shared_ffn // t + (h if spec.shared_gate else 0)
