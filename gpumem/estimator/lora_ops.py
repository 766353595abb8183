"""What an adapted (LoRA / DoRA / QLoRA) transformers decoder layer saves for backward.

A frozen base changes what autograd keeps, not only what trains: a Linear whose weight does not
train saves no input (its weight gradient is not needed), a norm with a frozen weight saves no
normalised output, and nothing before the first adapter of the model carries a gradient, so the
layers (and parts of a layer) before it save nothing at all. Read from PEFT's ``LoraLayer``
(``peft/tuners/lora/layer.py``, ``dora.py``) on transformers' ``LlamaDecoderLayer``, and
checked against the fake-tensor pass of the PEFT-wrapped model (tests/estimator/
test_finetune.py, benchmarks/bench_finetune.py):

- **an adapted Linear** (``result + lora_B(lora_A(dropout(x))) * scaling``): the input cast to
  the adapters' dtype (PEFT's fp32 on a 16-bit base; torchtune: none, the input itself), with
  dropout its mask (only where the input carries a gradient) and the dropped copy instead,
  ``lora_A``'s output; under autocast the 16-bit casts of the input and of both adapter weights;
- **DoRA** besides: the base output and the adapter output (the magnitude's two products),
  the weight norm, the magnitude's scale (and ``scale - 1`` where the base output carries a
  gradient); the ``fin x fin`` identity ``get_lora_weight`` pushes through the adapter and the
  dequantized weight ``get_weight_norm`` reads are forward temporaries (their graph is
  detached, so nothing of them outlives the call);
- **the rest of the layer** where a gradient flows: the norms' fp32 input and rstd; RoPE's cos
  and sin (once); SDPA's q, k, v, output and log-sum-exp; the MLP's gate and up outputs and the
  activation's output (down's input only as an adapter's); under autocast the 16-bit weight
  copies of the frozen Linears whose input carries a gradient;
- **torchtune's modules** besides: k and v expanded to every head (copies) and the attention
  output made contiguous for ``output_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator import hf_ops, peak, tune_compiled
from gpumem.estimator.activations import Item, Workload
from gpumem.estimator.backward import Moment, Shape, attention_moment
from gpumem.estimator.finetune import LINEARS, AdapterPlan, FineTune, linear_shapes
from gpumem.estimator.model_spec import ModelSpec
from gpumem.estimator.states import Training
from gpumem.estimator.terms import own_dtype_states


def adapter_items(
    tag: str, fin: int, fout: int, w: Workload, ft: FineTune, x_bytes: int, grad: bool
) -> tuple[list[Item], bool]:
    """One adapted Linear's saved tensors, and whether ``lora_A`` saves the input itself (the
    caller counts that storage once, shared with its other consumers)."""
    n, A, r = w.tokens, w.compute, ft.rank
    ab = ft.adapter_bytes(A, w.autocast)
    items: list[Item] = []
    shared = x_bytes == ab and not ft.dropout and not w.autocast
    x1 = 0 if x_bytes == ab else n * fin * ab  # the cast to the adapters' dtype
    if ft.dropout:
        if grad:  # the mask: bool on CUDA, the input's dtype on the CPU
            items.append(Item(f"{tag}.dropout_mask", n * fin * (1 if w.cuda else ab)))
        x1 = n * fin * ab  # the dropped copy replaces the cast as what lora_A reads
    if w.autocast:  # lora_A reads its own 16-bit cast; both adapter weights are cast too
        items.append(Item(f"{tag}.lora_a.input", n * fin * A))
        items.append(Item(f"{tag}.lora.weight_casts", r * (fin + fout) * A))
    elif x1:
        items.append(Item(f"{tag}.lora_a.input", x1))
    la = A if w.autocast else ab
    items.append(Item(f"{tag}.lora_b.input", n * r * la))
    if ft.method == "dora":  # magnitude / norm, (scale - 1) * base, scale * lora(x)
        items += [
            Item(f"{tag}.dora.weight_norm", fout * ab),
            Item(f"{tag}.dora.base_out", n * fout * A),
            Item(f"{tag}.dora.lora_out", n * fout * ab),
            Item(f"{tag}.dora.scale", fout * ab),
        ]
        if grad:  # the base output carries a gradient: its product saves (scale - 1) too
            items.append(Item(f"{tag}.dora.scale_minus_one", fout * ab))
    return items, shared


def layer_items(
    spec: ModelSpec, w: Workload, adapted: frozenset[str], grad_in: bool, ft: FineTune
) -> list[Item]:
    """Everything one adapted layer keeps for backward; ``grad_in``: its input carries a
    gradient (an adapter ran in an earlier layer). Compiled (``compile_layers``): what
    Inductor's partition keeps (``tune_compiled``)."""
    if ft.compile_layers:
        return tune_compiled.compiled_layer_items(spec, w, adapted, grad_in, ft.rank)
    n, A, R = w.tokens, w.compute, w.residual
    shapes = linear_shapes(spec, w.tp)
    h = spec.hidden
    items: list[Item] = []
    grad = grad_in
    if grad:
        items += _frozen_norm(spec, "attn_norm", n, h)
    items += _adapters(("q", "k", "v"), adapted, shapes, w, ft, R, grad, h)
    grad = grad or bool(adapted & {"q", "k", "v"})
    if grad:
        items += _attention(spec, w, ft, grad_in or "q" in adapted, grad_in or "k" in adapted)
    if "o" in adapted:
        qd = shapes["o"][0]
        o_items, shared = adapter_items("o", qd, h, w, ft, A, grad)
        items += o_items
        if shared and not grad:  # SDPA saved no output: the adapter's input is its own
            items.append(Item("o.input", n * qd * A))
    grad = grad or "o" in adapted
    if grad:
        items += _frozen_norm(spec, "mlp_norm", n, h)
    items += _adapters(("gate", "up"), adapted, shapes, w, ft, R, grad, h)
    items += _mlp(spec, w, adapted, grad)
    mlp_grad = grad or bool(adapted & {"gate", "up"})
    if "down" in adapted:
        f = shapes["down"][0]
        d_items, shared = adapter_items("down", f, h, w, ft, A, mlp_grad)
        items += d_items
        if shared:  # the product is saved by down's adapter alone
            items.append(Item("down.input", n * f * A))
    if w.autocast:
        items.append(Item("autocast.weight_casts", _frozen_casts(shapes, adapted, grad_in) * A))
    return items


def _adapters(
    keys: tuple[str, ...],
    adapted: frozenset[str],
    shapes: dict[str, tuple[int, int]],
    w: Workload,
    ft: FineTune,
    x_bytes: int,
    grad: bool,
    h: int,
) -> list[Item]:
    """The adapters of Linears reading one tensor (a norm's output): their items, and that
    tensor once when an adapter saves it as it is."""
    items: list[Item] = []
    shared = False
    for k in keys:
        if k in adapted:
            got, s = adapter_items(k, shapes[k][0], shapes[k][1], w, ft, x_bytes, grad)
            items += got
            shared = shared or s
    if shared:
        items.append(Item(f"{keys[0]}.input", w.tokens * h * x_bytes))
    return items


def _frozen_norm(spec: ModelSpec, tag: str, n: int, h: int) -> list[Item]:
    """transformers' RMSNorm with a frozen weight: the fp32 input (x itself when fp32) and
    rstd; ``weight *`` saves no normalised output (it only needs the weight). Gemma's
    ``* (1 + weight.float())`` saves its fp32 ``1 + w`` (a new vector each call)."""
    items = [Item(f"{tag}.input_fp32", n * h * 4), Item(f"{tag}.rstd", n * 4)]
    if spec.family in hf_ops.GEMMA:
        items.append(Item(f"{tag}.one_plus_w", h * 4))
    return items


def _attention(
    spec: ModelSpec, w: Workload, ft: FineTune, q_grad: bool = True, k_grad: bool = True
) -> list[Item]:
    """SDPA's saved tensors (``hf_ops.attention_items``), and torchtune's copies: k and v
    expanded to every head, the output made contiguous for ``output_proj``. Qwen3's per-head
    q and k norms have frozen weights: their fp32 input and rstd, where q (k) carries a
    gradient, and no normalised output."""
    items = [
        i
        for i in hf_ops.attention_items(spec, w)
        if not i.name.endswith("_norm.normalized")
        and (q_grad or not i.name.startswith("q_norm."))
        and (k_grad or not i.name.startswith("k_norm."))
    ]
    if ft.source != "torchtune":
        return items
    n, A, t = w.tokens, w.compute, w.tp
    a, g, d = spec.n_heads // t, max(1, spec.kv_heads // t), spec.dhead
    if g < a:  # k and v, expanded and flattened: copies of every head
        extra = 2 * n * (a - g) * d * A
        items.append(Item("attn.kv_expanded", extra))
    items.append(Item("attn.out_contiguous", n * a * d * A))
    return items


def _mlp(spec: ModelSpec, w: Workload, adapted: frozenset[str], grad: bool) -> list[Item]:
    """down(act(gate(x)) * up(x)) with frozen weights: the activation saves its input (gate's
    output) where gate's output carries a gradient, the product saves each factor where the
    other one does."""
    nf = w.tokens * spec.dense_layer_ffn // w.tp * w.compute
    g_gate = grad or "gate" in adapted
    g_up = grad or "up" in adapted
    items = []
    if g_gate:
        items.append(Item("mlp.gate_out", nf))
        items.append(Item("mlp.up_out", nf))  # saved by the product for the gate branch
    if g_up:
        items.append(Item("mlp.act_out", nf))
    return items


def _frozen_casts(
    shapes: dict[str, tuple[int, int]], adapted: frozenset[str], grad_in: bool
) -> int:
    """Elements of the frozen Linears' 16-bit weight copies autocast keeps for backward: those
    whose input carries a gradient (each one past the first adapter)."""
    g_o = grad_in or bool(adapted & {"q", "k", "v"})
    g_mlp = g_o or "o" in adapted
    g_down = g_mlp or bool(adapted & {"gate", "up"})
    flags = {"q": grad_in, "k": grad_in, "v": grad_in, "o": g_o, "gate": g_mlp, "up": g_mlp}
    flags["down"] = g_down
    return sum(fin * fout for k, (fin, fout) in shapes.items() if flags[k])


def plan_items(spec: ModelSpec, w: Workload, plan: AdapterPlan) -> list[list[Item]]:
    """Every layer's items under ``plan`` (a layer before the first adapter saves nothing)."""
    first = plan.first_grad_layer()
    return [
        layer_items(spec, w, adapted, i > first, plan.recipe) if i >= first else []
        for i, adapted in enumerate(plan.layers)
    ]


def head_items(spec: ModelSpec, w: Workload, plan: AdapterPlan) -> list[Item]:
    """The final norm, head and loss with a frozen head: transformers' head items without the
    norm's normalised output and the head's saved input, the head's adapter instead."""
    items = [
        i
        for i in hf_ops.head_items(spec, w)
        if i.name != "final_norm.normalized" and not i.name.startswith("lm_head.")
    ]
    if plan.head:
        v = spec.vocab // w.tp
        got, shared = adapter_items("lm_head", spec.hidden, v, w, plan.recipe, w.residual, True)
        items += got
        if shared:
            items.append(Item("lm_head.input", w.tokens * spec.hidden * w.residual))
    return items


def torchtune_copies(spec: ModelSpec, w: Workload) -> list[Item]:
    """torchtune's attention copies beside transformers' saved tensors (a full fine-tune)."""
    return [i for i in _attention(spec, w, FineTune(source="torchtune", method="full"))
            if i.name in ("attn.kv_expanded", "attn.out_contiguous")]  # fmt: skip


def layer_moment(
    spec: ModelSpec, w: Workload, items: list[Item], ft: FineTune, adapted: frozenset[str]
) -> Moment:
    """The widest moment of an adapted layer's backward: no base weight gradient anywhere.

    The MLP runs first: down's input gradient (and its adapter's, in the adapters' dtype,
    beside the output gradient cast to it), then the product's two factor gradients beside
    the first while down's saved input (an adapter's) is gone; else the attention core's
    (``backward.attention_moment`` with no weight gradients)."""
    n, h, A, R = w.tokens, spec.hidden, w.compute, w.residual
    f = spec.dense_layer_ffn // w.tp
    n_sp = n // w.tp if w.sp else n
    t0 = n_sp * h * R  # the layer's output gradient, kept for the residual path
    ab = ft.adapter_bytes(A, w.autocast)
    nf = n * f * A
    down_in = sum(i.nbytes for i in items if i.name in ("down.lora_a.input", "down.input"))
    lora = n * f * ab + n * h * ab if "down" in adapted else 0
    candidates = [
        Moment(temporary=t0 + nf + lora),
        Moment(temporary=t0 + 3 * nf, freed=down_in),
    ]
    s = Shape(tokens=n, tokens_sp=n_sp, compute=A, residual=R, autocast=w.autocast, grad_bytes=0)
    cut = next(k for k, i in enumerate(items) if i.name.startswith(("mlp_norm.", "gate.", "mlp.")))
    mlp_saved = sum(i.nbytes for i in items[cut:] if not i.name.startswith("autocast."))
    backend = "math" if spec.eager_attention else w.attention
    candidates.append(
        attention_moment(
            spec,
            s,
            mlp_saved,
            0,
            spec.n_heads // w.tp,
            w.seq,
            w.batch,
            backend,
            w.compute if w.cuda else 4,
        )
    )
    return max(candidates, key=lambda m: m.excess)


@dataclass(frozen=True)
class RecipeStage:
    """What ``fill_recipe`` needs of one pipeline rank (``preset.recipe_stage``)."""

    layers: list[int]
    first: bool
    last: bool
    recompute: str
    typical: float  # the saved bytes of one typical adapted layer (the rank's A_LAYER)
    layer_input: float  # a checkpointed layer's input
    largest: float  # the largest parameter tensor on the rank
    precision: Training
    scratch: float
    cuda: bool


def fill_recipe(
    plan: AdapterPlan, spec: ModelSpec, w: Workload, x: list[float], st: RecipeStage
) -> None:
    """A recipe's corrections to a rank's peak terms (after ``terms.job_terms``): the adapters'
    own dtype (PEFT's fp32 weights, gradients and optimizer state), the layers whose saved
    tensors differ from the typical one's (before the first adapter: none), QLoRA's
    dequantized weight, torchtune's activation offloading and optimizer-in-backward."""
    ft, tr = plan.recipe, st.precision
    if st.last and (ft.loss_chunks > 1 or ft.compile_loss):
        _chunked_loss(ft, spec, w, x)
    if ft.adapters:
        ab = ft.adapter_bytes(w.compute, w.autocast)
        r_max = ft.rank * max(spec.hidden, spec.dense_layer_ffn // w.tp)
        own_dtype_states(x, tr, ab, 3 * r_max, st.cuda)
        x[peak.A_FIRST] += _layer_correction(plan, spec, w, st)
        if ft.method == "qlora":  # one base Linear dequantized while it runs
            shapes = linear_shapes(spec, w.tp)
            widest = max(fin * fout for fin, fout in shapes.values()) * w.compute
            x[peak.T_LAYER] += widest
            x[peak.T_BWD0] += widest
    if ft.offload_activations:  # one layer's saved tensors back on the GPU at a time
        moved = x[peak.N_LAYERS] * x[peak.A_LAYER]
        x[peak.A_FIRST] -= moved - x[peak.A_LAYER]
    if ft.optimizer_in_bwd:  # each gradient steps and goes as soon as it exists: the
        # largest one (a tied head's, at the start of backward) is alive at either moment
        x[peak.T_LAYER] += st.largest * x[peak.G_BYTES]
        x[peak.T_BWD0] += st.largest * x[peak.G_BYTES]
        x[peak.G_BYTES] = x[peak.T_STEP] = x[peak.G_PERSIST] = 0.0


def _chunked_loss(ft: FineTune, spec: ModelSpec, w: Workload, x: list[float]) -> None:
    """torchtune's loss in ``k`` chunks (``CEWithChunkedOutputLoss``), compiled or not, instead
    of one ``cross_entropy`` on ``output(h).float()``: eager, each chunk's fp32 log-probabilities
    stay saved (the same bytes in all) but backward runs one chunk at a time (its two
    log-probability-sized gradients); compiled, a chunk keeps its 16-bit logits (the model no
    longer upcasts them) and its backward writes one 16-bit chunk gradient."""
    nv = w.tokens * (spec.vocab // w.tp)
    k = ft.loss_chunks
    old_ce = 2 * nv * 4
    saved, ce = nv * 4, 2 * nv * 4 / k
    if ft.compile_loss:
        saved = nv * (w.compute if k > 1 else 4)
        ce = nv * (w.compute if k > 1 else 4) / k
    x[peak.A_LAST] += saved - nv * 4
    if x[peak.A_GONE]:
        x[peak.A_GONE] += saved - nv * 4
    if x[peak.T_BWD0] == old_ce:
        x[peak.T_BWD0] = ce


def _layer_correction(plan: AdapterPlan, spec: ModelSpec, w: Workload, st: RecipeStage) -> float:
    """The rank's layers' saved bytes beyond ``len(layers)`` typical layers: the layers before
    the first adapter save nothing (checkpointed: no input either), an adapted set other than
    the typical one its own."""
    first = plan.first_grad_layer()
    if st.recompute not in ("none", "selective"):
        return -sum(1 for i in st.layers if i < first) * st.layer_input
    drop_core = st.recompute == "selective"
    actual = sum(
        sum(
            it.nbytes
            for it in layer_items(spec, w, plan.layers[i], i > first, plan.recipe)
            if not (drop_core and it.core)
        )
        for i in st.layers
        if i >= first
    )
    return actual - len(st.layers) * st.typical


def recipe_label(plan: AdapterPlan | None) -> str:
    """The recipe as the bill's inputs line states it."""
    if plan is None:
        return ""
    ft = plan.recipe
    extra = [k for k in ("packed", "offload_activations", "optimizer_in_bwd") if getattr(ft, k)]
    extra += [f"loss_chunks={ft.loss_chunks}"] if ft.loss_chunks > 1 else []
    extra += [k for k in ("compile_loss", "compile_layers") if getattr(ft, k)]
    tail = f" ({', '.join(extra)})" if extra else ""
    if not ft.adapters:
        return f"{ft.source} full fine-tune{tail}"
    mods = ",".join(sorted(plan.typical, key=LINEARS.index)) + (",head" if plan.head else "")
    drop = f" dropout={ft.dropout}" if ft.dropout else ""
    return f"{ft.source} {ft.method} r={ft.rank}{drop} on {mods}{tail}"
