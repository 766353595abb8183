"""What transformers' T5 (``T5ForConditionalGeneration``, mT5 alike) saves for backward, op by
op: an encoder over the source (``seq`` tokens) and a decoder over the target
(``Workload.target_seq`` tokens), read from transformers 5's ``modeling_t5.py`` and checked
against ``gpumem.profile`` under fake tensors (tests/estimator/test_t5.py):

- **T5LayerNorm** (RMS, no bias, variance in fp32): ``x.to(float32)`` (x itself in fp32, else a
  copy), the fp32 ``rsqrt``, x again (the product with it keeps the 16-bit input), the
  normalised value in the weight's dtype (what ``weight *`` saves) and the product, which the
  Linears after it save; under autocast the weight is fp32, the normalised value stays fp32 and
  every Linear after it saves its own 16-bit cast.
- **self-attention**: the relative position bias (an ``nn.Embedding`` of the bucketed distances,
  computed in the first layer of each stack and passed on: its int64 bucket indices saved once,
  its ``1 x heads x q x k`` values once) is the attention mask, and it needs a gradient: the
  CPU's SDPA takes its math path (q, k, v and the s x s softmax in fp32, the output's copy for
  ``o``), CUDA's memory-efficient kernel saves q, k, v, output, log-sum-exp and the bias.
- **cross-attention** (decoder): q from the target, k and v from the encoder's output, which
  every decoder layer's k and v projections save: one tensor (under autocast each layer's two
  16-bit casts of it); its mask (zeros, no gradient) lets the CPU take the flash kernel, which
  saves it once, with q, k, v, output and log-sum-exp.
- **MLP**: ``relu`` saves its output (``wo``'s input); v1.1's ``gelu_new`` of ``wi_0`` as
  Python ops (x, tanh, 0.5·x, 1 + tanh), the product with ``wi_1`` (both factors) and the
  product itself; under autocast ``wo`` reads an fp32 copy (``.to(wo.weight.dtype)``) and saves
  its own 16-bit cast of it.
- **dropout** (``dropout_rate``) after the embeddings, on every sub-layer's output, inside the
  MLP, on the attention probabilities (the CPU's math path then for cross-attention too) and
  after each final norm: a bool mask on CUDA, the scaled noise on the CPU.
- **head**: the decoder's final norm, the LM head's input (the output scaled by
  ``d_model**-0.5`` when the config ties the head: the same size), the logits and
  ``CrossEntropyLoss`` on the logits' dtype over the target.

A layer's items are the mean over both stacks (``n_layers`` counts both), so that the layer
count times them is the stacks' sum.
"""

from __future__ import annotations

from gpumem.estimator.activations import Item, Workload
from gpumem.estimator.model_spec import ModelSpec


def layer_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """A layer's saved tensors, the mean of an encoder and a decoder layer (the decoder's
    first: the backward starts there)."""
    enc, dec = _encoder_layer(spec, w), _decoder_layer(spec, w)
    n, ne, nd = spec.n_layers, spec.enc_layers, spec.dec_layers
    return [Item(i.name, i.nbytes * nd // n, i.saved, i.core) for i in dec] + [
        Item(i.name, i.nbytes * ne // n, i.saved, i.core) for i in enc
    ]


def embed_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """Both stacks' token ids, their relative position buckets and biases, the decoder's causal
    mask, the cross-attention's mask, the embeddings' dropout."""
    b, s, t, a = w.batch, w.seq, target_seq(w), spec.n_heads // w.tp
    n, m, h = b * s, b * t, spec.hidden
    items = [
        Item("embed.ids", n * 8),
        Item("embed.decoder_ids", m * 8),
        Item("rel_bias.encoder_buckets", s * s * 8),
        Item("rel_bias.decoder_buckets", t * t * 8),
        Item("decoder.causal_mask", t * t),
        # flash (CPU, no dropout) or memory-efficient (CUDA) kernel: the additive mask, once
        Item("cross.mask", a * t * s * w.compute),
    ]
    if w.cuda:  # the memory-efficient kernel keeps each stack's bias (the decoder's: masked)
        items += [Item("rel_bias.encoder", a * s * s * w.residual)]
        items += [Item("rel_bias.decoder", a * t * t * w.residual)]
    p = spec.pdrop
    items += _dropout(w, "embed.encoder", n * h, p, w.residual)
    return items + _dropout(w, "embed.decoder", m * h, p, w.residual)


def head_items(spec: ModelSpec, w: Workload) -> list[Item]:
    """The encoder's final norm and its output (saved once by every decoder layer's k and v),
    the decoder's final norm, the LM head's input, the logits and the loss."""
    n, m, h, V = w.tokens, w.batch * target_seq(w), spec.hidden, spec.vocab // w.tp
    A, R = w.compute, w.residual
    p = spec.pdrop
    items = _norm(w, "encoder.final_norm", n, h, 0)
    items += _dropout(w, "encoder.final", n * h, p, R)
    if not w.autocast:  # else each decoder layer's k and v save their casts (layer items)
        items.append(Item("encoder.output", n * h * R))
    items += _norm(w, "final_norm", m, h, 0)
    items += _dropout(w, "decoder.final", m * h, p, R)
    items.append(Item("lm_head.input", m * h * (A if w.autocast else R)))
    out = A if w.autocast else R
    if w.keep_logits:
        items.append(Item("logits", m * V * out, saved=False))
    lsm = 4 if w.autocast else out
    items += [Item("loss.log_softmax", m * V * lsm), Item("loss.targets", m * 8)]
    if w.autocast:
        items.append(Item("autocast.lm_head_cast", V * h * A))
    return items


def ce_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    """The loss's gradient and its log-softmax's: twice the log-probabilities."""
    return 2 * sum(i.nbytes for i in head_items(spec, w) if i.name == "loss.log_softmax")


def target_seq(w: Workload) -> int:
    """The decoder's tokens per sample (the source's when not given)."""
    return w.target_seq or w.seq


def checkpointed(spec: ModelSpec, w: Workload, grad_bytes: int) -> tuple[float, ...]:
    """Under gradient checkpointing (every ``T5Block``): (what a layer keeps, the mean over
    both stacks; the temporaries and the weight-gradient bytes at the widest moment of the
    backward's start; the temporaries at its end, the encoder's first layer recomputed).

    A checkpointed layer keeps its inputs: the hidden states, and once per stack the position
    bias the first layer made (the decoder's also the cross-attention's zeros, which
    checkpointing makes require a gradient); the encoder output is the head's. The widest
    moment is the recomputation of the decoder's first layer (measured: every later decoder
    layer's weight gradients exist): its recomputed activations (cross-attention on the CPU's
    math path: its mask needs a gradient now; the first layer also remakes the biases), the
    incoming gradient, the gradients of both biases and of the encoder output collected from
    the later layer."""
    b, s, t, h, a = w.batch, w.seq, target_seq(w), spec.hidden, spec.n_heads // w.tp
    n, m, R, A = b * s, b * t, w.residual, w.compute
    n_enc, n_dec = spec.enc_layers, spec.dec_layers
    biases = (a * s * s * R if n_enc > 1 else 0) + (a * t * (t * R + s * A) if n_dec > 1 else 0)
    # less the cross-attention's mask, which the flash kernel no longer saves (embed_items)
    saved = (n_enc * n * h * R + n_dec * m * h * R + biases - a * t * s * A) / spec.n_layers
    layer = _decoder_layer(spec, w, checkpointed=True)
    recomputed = sum(i.nbytes for i in layer)  # autocast: its weights cast again
    recomputed -= m * h * R  # the first norm's input is the checkpoint's
    remade = t * t * 8 + a * t * (t * R * 2 + s * A)  # buckets, bias, its masked form, zeros
    in_flight = m * h * R + n * h * R + a * t * (t + s) * 4
    grads = (n_dec - 1) * (_weights(spec, w, True) + 3 * h)
    # the end: the encoder's first layer recomputed (its bias remade), the incoming gradient
    # and the bias's, collected from every later encoder layer
    enc = sum(i.nbytes for i in _encoder_layer(spec, w))
    end = enc - n * h * R + s * s * 8 + a * s * s * R + n * h * R + a * s * s * 4
    return saved, float(recomputed + remade + in_flight), float(grads * grad_bytes), float(end)


# --- the pieces ----------------------------------------------------------------------------


def _norm(w: Workload, tag: str, n: int, h: int, consumers: int) -> list[Item]:
    """A T5LayerNorm over ``n`` rows whose output ``consumers`` Linears read (see the module
    docstring); 0 consumers: the output is not saved (a dropout or an fp32 product reads it)."""
    R, A = w.residual, w.compute
    items = [Item(f"{tag}.input", n * h * R), Item(f"{tag}.rstd", n * 4)]
    if R != 4:  # x.to(float32) copies a 16-bit input
        items.append(Item(f"{tag}.input_fp32", n * h * 4))
    items.append(Item(f"{tag}.normalized", n * h * R))
    if w.autocast:
        return items + [Item(f"{tag}.cast{i}", n * h * A) for i in range(consumers)]
    return items + ([Item(f"{tag}.output", n * h * R)] if consumers else [])


def _dropout(w: Workload, tag: str, numel: int, p: float, nbytes: int) -> list[Item]:
    """A dropout's mask (CUDA: bool; the CPU: the scaled noise) and its output, which the next
    op saves (a residual add saves nothing: the output is then not counted here)."""
    if p <= 0:
        return []
    return [Item(f"{tag}.dropout_mask", numel * (1 if w.cuda else nbytes))]


def _self_attention(spec: ModelSpec, w: Workload, tag: str, rows: int, seq: int) -> list[Item]:
    """Self-attention over ``seq`` tokens with the relative position bias as its mask."""
    a, d, A = spec.n_heads // w.tp, spec.dhead, w.compute
    q = rows * a * d
    if w.cuda:  # memory-efficient attention with a bias: q, k, v, out, lse (padded to 32)
        lse = w.batch * a * -(-seq // 32) * 32 * 4
        return [
            Item(f"{tag}.q", q * A),
            Item(f"{tag}.k", q * A),
            Item(f"{tag}.v", q * A),
            Item(f"{tag}.out", q * A, core=True),
            Item(f"{tag}.lse", lse, core=True),
        ]
    return _math(w, tag, rows, seq, seq, a, d)


def _math(w: Workload, tag: str, rows: int, sq: int, sk: int, a: int, d: int) -> list[Item]:
    """SDPA's math path on the CPU (fp32 whatever the inputs): q, k, v, the softmax, with
    dropout its noise and output, and the output's copy that ``o`` reads."""
    b, kv = w.batch, w.batch * sk * a * d
    s2 = b * a * sq * sk
    items = [
        Item(f"{tag}.q", rows * a * d * 4),
        Item(f"{tag}.k", kv * 4),
        Item(f"{tag}.v", kv * 4),
        Item(f"{tag}.softmax", s2 * 4, core=True),
    ]
    if w.dropout > 0:
        items += [Item(f"{tag}.dropout_mask", s2 * 4, core=True)]
        items += [Item(f"{tag}.dropout_out", s2 * 4, core=True)]
    return [*items, Item(f"{tag}.o_input", rows * a * d * w.compute)]


def _cross_attention(
    spec: ModelSpec, w: Workload, m: int, n: int, checkpointed: bool = False
) -> list[Item]:
    """Cross-attention: ``m`` target queries over the ``n`` encoder outputs (checkpointed: its
    zeros bias requires a gradient, so the CPU takes the math path)."""
    a, d, A = spec.n_heads // w.tp, spec.dhead, w.compute
    items = []
    if w.autocast:  # k and v cast the (fp32) encoder output, each its own copy
        items += [Item("cross.k_input_cast", n * spec.hidden * A)]
        items += [Item("cross.v_input_cast", n * spec.hidden * A)]
    if not w.cuda and (w.dropout > 0 or checkpointed):
        return items + _math(w, "cross", m, target_seq(w), w.seq, a, d)
    return [
        *items,
        Item("cross.q", m * a * d * A),
        Item("cross.k", n * a * d * A),
        Item("cross.v", n * a * d * A),
        Item("cross.out", m * a * d * A, core=True),
        Item("cross.lse", w.batch * a * target_seq(w) * 4, core=True),
    ]


def _mlp(spec: ModelSpec, w: Workload, rows: int) -> list[Item]:
    """The feed-forward block after its norm (``wi``'s input is the norm's)."""
    f, A, p = spec.ffn // w.tp, w.compute, spec.pdrop
    x = rows * f * A
    if spec.gated:  # gelu_new(wi_0) * wi_1
        items = [Item(f"mlp.gelu_{k}", x) for k in ("x", "tanh", "half_x", "one_plus_tanh")]
        items += [Item("mlp.gelu_out", x), Item("mlp.linear_out", x)]
        product_saved = not w.autocast and not p
    else:
        items = [Item("mlp.relu_out", x)]
        product_saved = False
    if p:
        items += _dropout(w, "mlp.inner", rows * f, p, A)
        product_saved = not w.autocast
    if product_saved:
        items.append(Item("mlp.wo_input", x))
    if w.autocast:  # wo reads an fp32 copy and saves its 16-bit cast
        items.append(Item("mlp.wo_input_cast", x))
    return items


def _sublayer_end(spec: ModelSpec, w: Workload, tag: str, rows: int) -> list[Item]:
    """The dropout before a sub-layer's residual add."""
    return _dropout(w, tag, rows * spec.hidden, spec.pdrop, w.compute)


def _encoder_layer(spec: ModelSpec, w: Workload) -> list[Item]:
    return _layer(spec, w, False)


def _decoder_layer(spec: ModelSpec, w: Workload, checkpointed: bool = False) -> list[Item]:
    return _layer(spec, w, True, checkpointed)


def _layer(spec: ModelSpec, w: Workload, decoder: bool, checkpointed: bool = False) -> list[Item]:
    """An encoder layer (self-attention, MLP) or a decoder layer (causal self-attention,
    cross-attention over the encoder output, MLP), each sub-layer after its norm."""
    seq = target_seq(w) if decoder else w.seq
    rows, h, pre = w.batch * seq, spec.hidden, "dec." if decoder else ""
    items = _norm(w, f"{pre}attn_norm", rows, h, 3)
    items += _self_attention(spec, w, f"{pre}attn", rows, seq)
    items += _sublayer_end(spec, w, f"{pre}attn_out", rows)
    if decoder:
        items += _norm(w, "cross_norm", rows, h, 1)
        items += _cross_attention(spec, w, rows, w.tokens, checkpointed)
        items += _sublayer_end(spec, w, "cross_out", rows)
    items += _norm(w, f"{pre}mlp_norm", rows, h, 2 if spec.gated else 1)
    items += _mlp(spec, w, rows) + _sublayer_end(spec, w, f"{pre}mlp_out", rows)
    if w.autocast:
        items.append(Item("autocast.weight_casts", _weights(spec, w, decoder) * w.compute))
    return items


def _weights(spec: ModelSpec, w: Workload, decoder: bool) -> int:
    """Elements of a layer's Linear weights on a TP rank (autocast's cached casts)."""
    h, hq, f = spec.hidden, spec.n_heads * spec.dhead // w.tp, spec.ffn // w.tp
    return (8 if decoder else 4) * h * hq + (3 if spec.gated else 2) * h * f
