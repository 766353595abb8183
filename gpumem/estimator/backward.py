"""What one transformer layer's backward holds at its widest moment.

A layer's backward is not one allocation: autograd runs its nodes one at a time, each creating
the gradients of its inputs (and of its weights) and then releasing the tensors it had saved.
The peak inside a layer is therefore at a specific node, and what is live there is a mix of
still-saved activations, gradients in flight and the weight gradients already produced. This
module replays that sequence node by node for the MLP of each built-in architecture (the widest
part of a layer: its transients are ffn-wide) and takes a coarser moment for attention; the
result is the layer's *excess* over "all its activations saved, none of its weight gradients
present yet".

Node order follows autograd's engine: the most recently created node first, a weight's
``AccumulateGrad`` (and under autocast the ``ToCopyBackward`` of its cached 16-bit cast) as soon
as the weight gradient exists, saved tensors released right after their node ran. Checked
against gpumem's profiler on CPU (benchmarks/bench_estimator_accuracy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.estimator.activations import expert_tokens, router_copies_input, routing_weight_bytes
from gpumem.estimator.model_spec import ModelSpec


@dataclass(frozen=True)
class Moment:
    """Bytes live at the widest moment of a layer's backward, relative to its start.

    Attributes:
        temporary: gradients in flight (of activations, and 16-bit weight grads before their cast).
        grads: parameter gradients this layer has already produced.
        freed: saved activations of this layer already released.
    """

    temporary: int = 0
    grads: int = 0
    freed: int = 0

    @property
    def excess(self) -> int:
        return self.temporary + self.grads - self.freed


class _Walk:
    """Running totals of a node-by-node replay; remembers the widest moment."""

    def __init__(self, temporary: int) -> None:
        self.t, self.g, self.a = temporary, 0, 0
        self.best = Moment(self.t, self.g, self.a)

    def alloc(self, t: int = 0, g: int = 0) -> None:
        self.t += t
        self.g += g
        if self.t + self.g - self.a > self.best.excess:
            self.best = Moment(self.t, self.g, self.a)

    def free(self, t: int = 0, a: int = 0) -> None:
        self.t -= t
        self.a += a

    def linear(
        self,
        n: int,
        fin: int,
        fout: int,
        bias: bool,
        A: int,
        grad_bytes: int,
        cast: bool,
        saved: int,
        consumed: int,
        copies: float = 1.0,
    ) -> None:
        """A Linear's backward: grad of its input and of its weight, then its saved input and
        the incoming gradient go; under autocast the 16-bit weight grad is cast to the fp32
        parameter by the next node, and the weight's cached 16-bit copy (a saved tensor of
        this node only: autocast's cache is cleared when its context exits) goes with the
        node's other saved tensors (``copies`` of it: a fused weight replayed as two Linears
        releases its copy once, with the second)."""
        wn = fin * fout + (fout if bias else 0)
        self.alloc(t=n * fin * A + (wn * A if cast else 0), g=0 if cast else wn * grad_bytes)
        self.free(t=consumed, a=saved + (int(wn * A * copies) if cast else 0))
        if cast:
            self.alloc(g=wn * grad_bytes)
            self.free(t=wn * A)


@dataclass(frozen=True)
class Shape:
    """What the replay needs about one micro-batch on one TP rank."""

    tokens: int  # tokens through the MLP (all of them under SP: the input is gathered)
    tokens_sp: int  # tokens of the residual stream on this rank
    compute: int  # bytes of the matmul dtype
    residual: int  # bytes of the residual stream
    autocast: bool
    grad_bytes: int  # bytes per element of a parameter gradient
    dense: bool = False  # an MoE model's dense layer
    grouped: bool = False  # experts as one grouped GEMM
    expert_tokens: int = 0  # token copies the local experts process (n·k, imbalance applied)
    expert_bytes: int = 0  # bytes of the experts' dtype (transformers: the weights')
    n_experts: int = 0  # experts on this rank
    tp: int = 1
    routing_bytes: int = 4  # bytes of the routing weights (transformers: fp32 or the router's)
    shared_holds_input: bool = False  # only the shared expert's Linears save the MoE input
    recompute: bool = False  # the layer's activations come back from a checkpoint
    cuda: bool = True  # dropout masks are bool (the CPU's: the input's dtype)


def mlp_moment(spec: ModelSpec, s: Shape, ffn: int) -> Moment:
    """The widest moment of the MLP's backward (it runs first in a pre-norm layer)."""
    n, h, A = s.tokens, spec.hidden, s.compute
    # the layer's output gradient (residual dtype); under autocast the branch's 16-bit output
    # needs its own cast copy of it
    wk = _Walk(s.tokens_sp * h * s.residual)
    copy = n * h * A if s.autocast and s.residual != A else 0
    wk.alloc(t=copy)
    if spec.is_hf and spec.norms_per_layer == 4:  # Gemma2/3: the post-feedforward norm first
        copy = _gemma_norm_backward(wk, s.tokens_sp, h, A, s.grad_bytes, copy)
    cast = s.autocast
    in_cast = n * h * A if s.autocast else 0  # the per-Linear 16-bit copy of the norm output
    if spec.is_moe and not s.dense:
        if s.grouped:
            return _grouped_moe(spec, s, ffn, wk, copy)
        return _moe(spec, s, ffn, wk, copy, in_cast)
    f = ffn
    if spec.encoder_head:  # (the masked LM keeps the pre-LN replay: see _post_ln_mlp)
        return _post_ln_mlp(spec, s, f, wk, in_cast)
    if spec.arch == "llama":  # down(silu(gate(x)) * up(x))
        wk.linear(n, f, h, False, A, s.grad_bytes, cast, saved=n * f * A, consumed=copy)
        _swiglu_rest(wk, n, h, f, A, s.grad_bytes, cast, in_cast, spec.family == "phi3")
    else:  # proj(gelu(fc(x)))
        wk.linear(n, f, h, True, A, s.grad_bytes, cast, saved=n * f * A, consumed=copy)
        if spec.is_hf and not spec.is_encoder:  # GPT-2's gelu_new, as Python ops
            _gelu_new(wk, n * f * A)
        else:  # one fused GELU kernel
            wk.alloc(t=n * f * A)
            wk.free(t=n * f * A, a=n * f * A)
        wk.linear(n, h, f, True, A, s.grad_bytes, cast, saved=in_cast, consumed=n * f * A)
    return wk.best


def _post_ln_mlp(spec: ModelSpec, s: Shape, f: int, wk: _Walk, in_cast: int) -> Moment:
    """A post-LN encoder's MLP half, ``LayerNorm(dropout(out(gelu(inter(x)))) + x)``, whose
    backward starts with the norm: its gradient of the sum (the residual's too, held until
    the intermediate dense's input gradient joins it), the norm's saved sum and statistics
    released; then the branch's own copy (16-bit under autocast) or dropout's product, the
    output dense, GELU, the intermediate dense.

    Used for the classification heads, whose small loss puts the step's peak here (node by
    node as measured, fp32 and pure bf16 within the sweep's bound). The masked LM keeps the
    pre-LN replay: this one prices its fp32 / bf16 recompute rows closer (+1.5 % to 0.0 %) but
    its bf16-autocast recompute row at -3.2 % with the temporaries 66 KB short, just past the
    sweep's bound (-2.4 % and within it with the pre-LN replay); not settled."""
    n, h, A, R = s.tokens, spec.hidden, s.compute, s.residual
    wk.free(t=-n * h * R, a=0)  # the sum's gradient, while the output gradient is still read
    wk.alloc()
    wk.free(t=s.tokens_sp * h * R, a=n * h * R + 2 * n * 4)  # the output gradient, the norm's
    wk.alloc(g=2 * h * s.grad_bytes)
    branch = n * h * A if (s.autocast and R != A) or spec.pdrop > 0 else 0
    wk.alloc(t=branch)
    if spec.pdrop > 0:  # the mask goes with dropout's node
        wk.free(a=n * h * (1 if s.cuda else A))
    wk.linear(n, f, h, True, A, s.grad_bytes, s.autocast, saved=n * f * A, consumed=branch)
    # GELU's input gradient; the output dense's input gradient it read stays until the
    # intermediate dense's backward has run (measured: both ffn-wide gradients live there)
    wk.alloc(t=n * f * A)
    wk.free(a=n * f * A)
    saved = in_cast or n * h * R  # the intermediate dense's input (the attention's norm output)
    # its weight gradient is a temporary until AccumulateGrad runs, after the node
    wn, wb = h * f + f, (A if s.autocast else s.grad_bytes)
    wk.alloc(t=n * h * A + wn * wb)
    wk.free(t=2 * n * f * A, a=saved + (wn * A if s.autocast else 0))
    if s.autocast:  # cast to the fp32 parameter by the next node, then released
        wk.alloc(g=wn * s.grad_bytes)
        wk.free(t=wn * wb)
    else:
        wk.free(t=wn * wb)
        wk.alloc(g=wn * s.grad_bytes)
    return wk.best


def _gemma_norm_backward(
    wk: _Walk, rows: int, width: int, x_bytes: int, grad_bytes: int, incoming: int
) -> int:
    """transformers' Gemma RMSNorm, ``(xf * rsqrt(mean(xf²) + eps) * (1 + w.float()))
    .type_as(x)`` with ``xf = x.float()``, run backward from its output's gradient
    (``incoming`` bytes in flight, 0 when it is the layer's own, kept for the residual path):
    every intermediate is fp32 (``X`` bytes), and pow's backward makes three of them at once
    while the product's and the mean's gradients wait (five in flight). Returns the bytes of
    the input gradient it hands on (consumed by the next node)."""
    X, w4 = rows * width * 4, width * 4
    g_in = incoming
    if x_bytes != 4:  # ``type_as``'s backward: the gradient cast to fp32
        wk.alloc(t=X)
        wk.free(t=incoming)
        g_in = X
    wk.alloc(t=2 * X + w4)  # ·(1 + w): both factors' gradients, the weight's summed
    wk.free(t=X + w4 + g_in, a=X + w4)  # the summed product, the incoming; xn and 1 + w
    wk.alloc(g=width * grad_bytes)  # the weight gradient (cast back by ``float()``'s backward)
    wk.alloc(t=2 * X)  # xf · rstd: both factors' gradients, rstd's summed to rows
    wk.free(t=2 * X, a=rows * 4)  # that product, the gradient of xn; rstd (after rsqrt's)
    wk.alloc(t=X)  # mean's backward: the expanded gradient / width
    wk.alloc(t=3 * X)  # pow's backward: x, 2·x, their product with the gradient
    wk.free(t=3 * X, a=X)  # x, 2·x, the mean's gradient; xf (saved by pow and the product)
    wk.alloc(t=X)  # both gradients of xf summed
    wk.free(t=2 * X)
    if x_bytes != 4:  # ``float()``'s backward: cast to the input's dtype
        wk.alloc(t=rows * width * x_bytes)
        wk.free(t=X)
        return rows * width * x_bytes
    return X


def _gelu_new(wk: _Walk, x: int) -> None:
    """transformers' ``gelu_new``, 0.5·x·(1 + tanh(c·(x + 0.044715·x³))) as Python ops, run
    backward from its output's gradient (``x`` bytes each; saved: x, 0.5·x, tanh, 1 + tanh):
    the product's two factor gradients, tanh's, the scalar products', pow's three (x², 3·x²,
    their product with the gradient) at once, then 0.5·x's, summed into one gradient of x."""
    wk.alloc(t=2 * x)  # mul(0.5x, 1 + tanh): both factors' gradients
    wk.free(t=x, a=2 * x)  # the incoming gradient; 0.5·x and 1 + tanh
    wk.alloc(t=x)  # tanh backward
    wk.free(t=x, a=x)  # its input gradient consumed; tanh's output
    wk.alloc(t=x)  # the product with c
    wk.free(t=x)
    wk.alloc(t=x)  # the product with 0.044715
    wk.alloc(t=3 * x)  # pow backward: x², 3·x², and their product with the gradient
    wk.free(t=3 * x, a=x)  # x², 3·x², the incoming gradient; x (saved by pow)
    wk.alloc(t=x)  # 0.5·x's gradient, then everything sums into one gradient of x
    wk.free(t=2 * x)


def _swiglu_rest(
    wk: _Walk,
    n: int,
    h: int,
    f: int,
    A: int,
    gb: int,
    cast: bool,
    in_cast: int,
    fused: bool = False,
) -> None:
    """SwiGLU after its down projection: mul (2 ffn-wide grads), up, silu, gate (``fused``:
    Phi-3's one gate_up weight, whose 16-bit copy goes with the second)."""
    up, gate = (0.0, 2.0) if fused else (1.0, 1.0)
    wk.alloc(t=2 * n * f * A)
    wk.free(t=n * f * A, a=2 * n * f * A)  # grad of down's input; silu_out and up_out
    # up (created last)
    wk.linear(n, h, f, False, A, gb, cast, saved=in_cast, consumed=n * f * A, copies=up)
    wk.alloc(t=n * f * A)  # silu backward
    wk.free(t=n * f * A, a=n * f * A)
    wk.linear(n, h, f, False, A, gb, cast, saved=in_cast, consumed=n * f * A, copies=gate)


def _moe(spec: ModelSpec, s: Shape, ffn: int, wk: _Walk, copy: int, in_cast: int) -> Moment:
    """gpumem.models.MoE, experts in reverse order (balanced routing): each expert's
    index_add_ hands it a gathered slice of the output gradient, the routing-weight product
    and the SwiGLU run backward, and ``x[tok]``'s backward scatters into an n x h buffer."""
    n, h, A, E = s.tokens, spec.hidden, s.compute, spec.n_experts
    f = ffn
    nk = n * spec.top_k
    wk.free(t=copy)  # the output gradient reaches index_add_ in x's dtype
    x_buffer = 0
    for e in reversed(range(E)):
        ne = nk // E + (e < nk % E)
        wk.alloc(t=ne * h * A)  # index_add_: the gathered output gradient
        wk.free(a=ne * h * A)  # the weighted output it kept
        wk.alloc(t=ne * h * A + ne * A)  # mul by the routing weight: grads of both factors
        wk.free(t=ne * h * A + ne * A, a=ne * h * A + ne * A)  # expert_out, routing weight
        wk.linear(ne, f, h, False, A, s.grad_bytes, s.autocast, saved=ne * f * A, consumed=0)
        wk.free(t=ne * h * A)  # the expert output's gradient, consumed by down
        cast_in = ne * h * A if s.autocast else 0
        _swiglu_rest(wk, ne, h, f, A, s.grad_bytes, s.autocast, cast_in)
        wk.alloc(t=n * h * A)  # x[tok] backward: a zero-filled n x h gradient
        # the two projections' input grads go; the n x h grads accumulate in place
        wk.free(
            t=2 * ne * h * A + (n * h * A if x_buffer else 0), a=0 if s.autocast else ne * h * A
        )
        x_buffer = n * h * A
    return wk.best


def _grouped_moe(spec: ModelSpec, s: Shape, f: int, wk: _Walk, copy: int = 0) -> Moment:
    """Grouped experts (transformers' grouped_mm, Megatron's TEGroupedMLP) and a shared expert,
    backward node by node as autograd runs them (the most recently created node first).

    transformers' experts end in ``(proj_out * weights)[inv_perm].view(n, k, h).sum(1)``: the
    sum's expanded gradient is copied to ``n·k`` rows by the view's backward, the reorder's
    backward scatters it into a zero-filled ``n·k`` buffer out of place (three ``n·k`` rows
    wide gradients at once), then the routing-weight product, the down GEMM (all experts'
    weight gradients at once), the gated activation, the up GEMM, and the gather's scatter
    back to the tokens; every intermediate is ``expert_tokens`` rows in the experts' dtype.

    A shared expert is a dense gated MLP beside them whose backward runs by forward order:
    DeepSeek's (called after the experts) runs first, its input gradient then waits for the
    experts'; Qwen2-MoE's (called first) waits, its output's gradient pending, until the
    experts and the router are done; its sigmoid gate, created last, runs first.
    """
    n, h, R, A, gb = s.tokens, spec.hidden, s.residual, s.compute, s.grad_bytes
    cast = s.autocast
    in_cast = n * h * A if cast else 0  # a Linear's 16-bit copy of the MoE input
    fs = spec.shared_ffn // s.tp if spec.n_shared_experts else 0
    pending = 0  # the MoE input's gradient, accumulated from its consumers

    def accumulate(grad: int) -> None:
        nonlocal pending
        if pending:  # the input buffer adds the new gradient out of place
            wk.alloc(t=n * h * R)
            wk.free(t=pending + grad)
            pending = n * h * R
        else:
            pending = grad

    shared_out_grad = 0
    if fs and spec.shared_gate:  # Qwen2-MoE: sigmoid(gate(x)) * shared(x), created last
        wk.alloc(t=2 * n * h * A)  # the shared output's gradient (kept) and grad * shared
        wk.free(t=n * h * A + copy, a=n * h * A)  # that product; the shared output saved
        wk.alloc(t=n * A)  # its sum, then the sigmoid's backward
        wk.free(a=n * A)
        wk.linear(n, h, 1, False, A, gb, cast, saved=0, consumed=n * A)
        accumulate(n * h * A)
        shared_out_grad = n * h * A
    elif fs:  # DeepSeek: the shared expert, called after the experts, runs backward first
        wk.linear(n, fs, h, False, A, gb, cast, saved=n * fs * A, consumed=copy)
        _swiglu_rest(wk, n, h, fs, A, gb, cast, in_cast)
        if s.shared_holds_input:  # no other consumer saved the MoE input
            wk.free(a=n * h * R)
        accumulate(n * h * A)  # up's input gradient, then gate's
        accumulate(n * h * A)
    elif copy:
        wk.free(t=copy)
    _experts_backward(spec, s, f, wk)
    accumulate(n * h * R)
    if shared_out_grad:  # Qwen2-MoE's shared expert, after the experts and the router
        wk.linear(n, fs, h, False, A, gb, cast, saved=n * fs * A, consumed=shared_out_grad)
        _swiglu_rest(wk, n, h, fs, A, gb, cast, in_cast)
        accumulate(n * h * A)
        accumulate(n * h * A)
    return wk.best


def _experts_backward(spec: ModelSpec, s: Shape, f: int, wk: _Walk) -> None:
    """The routed experts' backward (``_grouped_moe``), from the routing-weight product to the
    gather's scatter back to the tokens; the tokens' gradient is then allocated."""
    n, h, R = s.tokens, spec.hidden, s.residual
    nk, E_A, gb, E = s.expert_tokens, s.expert_bytes, s.grad_bytes, s.n_experts
    # the product with the routing weights is in the wider of the two dtypes (fp32 weights:
    # Mixtral, DeepSeek; Qwen-MoE casts them to the router's dtype), cast back to the tokens'
    Wt = max(E_A, s.routing_bytes)
    back = n * h * Wt if Wt != R else 0  # ``.to(hidden dtype)``'s backward: a Wt copy
    wk.alloc(t=back)
    wk.alloc(t=nk * h * Wt)  # the view's backward: the expanded gradient copied to n·k rows
    wk.free(t=back)
    wk.alloc(t=2 * nk * h * Wt)  # the reorder's backward: zeros, and the scatter into them
    wk.free(t=2 * nk * h * Wt, a=nk * 8)  # zeros and the copy; inv_perm
    wk.alloc(t=2 * nk * h * Wt)  # grad * expert output (for the weights), grad * weights
    saved = nk * h * E_A + nk * s.routing_bytes  # the expert output and routing weights
    if s.recompute:  # unpacked from the checkpoint, they go when the node returns
        wk.free(a=saved)
    if Wt != E_A:  # the engine casts the latter to the experts' dtype after the node ran
        wk.alloc(t=nk * h * E_A)
        wk.free(t=nk * h * Wt)
    if not s.recompute:  # saved variables are released after the casts
        wk.free(a=saved)
    wk.free(t=nk * h * Wt + nk * h * Wt)  # the first product (summed), the incoming gradient
    wk.alloc(t=nk * f * E_A, g=E * h * f * gb)  # down GEMM: input and weight gradients
    wk.free(t=nk * h * E_A, a=nk * f * E_A)
    wk.alloc(t=2 * nk * f * E_A)  # act * up: both factors' gradients
    wk.free(t=nk * f * E_A, a=nk * f * E_A)
    wk.alloc(t=nk * f * E_A)  # the activation's backward
    wk.free(t=nk * f * E_A, a=2 * nk * f * E_A)  # gate_up output released
    wk.alloc(t=2 * nk * f * E_A)  # chunk's backward: the concatenated gradient
    wk.free(t=2 * nk * f * E_A)
    wk.alloc(t=nk * h * E_A, g=E * 2 * f * h * gb)  # up GEMM
    wk.free(t=2 * nk * f * E_A, a=nk * h * E_A)
    wk.alloc(t=2 * n * h * R)  # the gather's backward: zeros, and the scatter into them
    wk.free(t=n * h * R + nk * h * E_A, a=2 * nk * 8)  # zeros, the up GEMM's input gradient


def attention_moment(
    spec: ModelSpec,
    s: Shape,
    mlp_saved: int,
    mlp_params: int,
    heads: int,
    seq: int,
    batch: int,
    backend: str,
    math_bytes: int,
    score_grads: int = 2,
) -> Moment:
    """The attention core's backward, after the MLP's: the MLP's activations are gone and its
    weight gradients (and the output projection's) exist; in flight are the residual gradient,
    the gradient of the attention output, and the backend's own: q/k/v gradients (fused
    kernels) or ``score_grads`` s x s score gradients (the math backend: two, the
    probabilities' and the softmax's own; one where the softmax's backward writes its
    gradient into the incoming one, Transformer Engine's fused scaled-masked softmax with no
    attention dropout between)."""
    n, h, A, d = s.tokens, spec.hidden, s.compute, spec.dhead
    q = n * heads * d * A
    t = s.tokens_sp * h * s.residual + q
    t += score_grads * batch * heads * seq * seq * math_bytes if backend == "math" else 3 * q
    return Moment(temporary=t, grads=mlp_params * s.grad_bytes, freed=mlp_saved)


def layer_moment(
    spec: ModelSpec,
    w,
    items,
    grad_bytes: int,
    recompute: str = "none",
    score_grads: int = 2,
) -> Moment:
    """The widest moment of one layer's backward: the MLP's replay or the attention core's,
    whichever holds more. ``w`` is an activations.Workload, ``items`` its layer items;
    ``score_grads``: the s x s gradients the math backend holds at once (``attention_moment``)."""
    t = w.tp
    moe = spec.is_moe and not w.dense
    s = Shape(
        tokens=w.tokens,
        tokens_sp=w.tokens // t if w.sp else w.tokens,
        compute=w.compute,
        residual=w.residual,
        autocast=w.autocast,
        grad_bytes=grad_bytes,
        dense=w.dense,
        grouped=w.grouped_gemm,
        expert_tokens=expert_tokens(spec, w, w.tokens) if moe else 0,
        expert_bytes=w.residual if spec.is_hf else w.compute,
        n_experts=spec.n_experts // w.ep if moe else 0,
        tp=t,
        routing_bytes=routing_weight_bytes(spec, w),
        shared_holds_input=moe and router_copies_input(spec, w),
        recompute=recompute != "none",
        cuda=w.cuda,
    )
    f = (spec.moe_ffn // w.etp) if moe else spec.dense_layer_ffn // t
    mlp = mlp_moment(spec, s, f)
    # the MLP half of the layer's items: everything from its pre-norm on (autocast's cached
    # weight copies stay until their own matmul's backward)
    # (a post-LN encoder's MLP half starts at the intermediate dense's input)
    cut = next(k for k, i in enumerate(items) if i.name.startswith(("mlp_norm.", "intermediate.")))
    mlp_saved = sum(i.nbytes for i in items[cut:] if not i.name.startswith("autocast."))
    h, qd = spec.hidden, spec.n_heads * spec.dhead // t
    per_mlp = (3 if spec.arch == "llama" else 2) * h * f + (0 if spec.arch == "llama" else f + h)
    # the rank's own experts (``s.n_experts``: n_experts / ep) made their weight gradients;
    # the router's (h x n_experts) is replicated
    n_mlps = max(s.n_experts, 1) if moe else 1
    mlp_params = per_mlp * n_mlps + (h * spec.n_experts if moe else 0) + qd * h + 2 * h
    att = attention_moment(
        spec,
        s,
        mlp_saved,
        mlp_params,
        spec.n_heads // t,
        w.seq,
        w.batch,
        "math" if spec.eager_attention or (w.eager and spec.is_encoder) else w.attention,
        _score_grad_bytes(w, w.eager and spec.is_encoder),
        score_grads,
    )
    if recompute == "selective":  # the attention core comes back before its backward
        core = sum(i.nbytes for i in items if i.core)
        att = Moment(att.temporary + core, att.grads, att.freed)
    best = mlp if mlp.excess >= att.excess else att
    if recompute not in ("none", "selective"):
        fwd = recompute_forward_moment(spec, w, items, s)
        if fwd.excess > best.excess:
            best = fwd
    return best


def recompute_forward_moment(spec: ModelSpec, w, items, s: Shape) -> Moment:
    """The widest moment of a layer's recomputed forward (under recompute, the first thing its
    backward does): the end of the attention core, whose transients (tensors the forward makes
    and drops, not saved for backward) are live beside the activations recomputed so far and
    the layer's output gradient; no weight gradient of the layer exists yet, and what comes
    after the core (the output projection's input, the MLP half, the MLP's and the output
    projection's cached 16-bit weights) is not recomputed yet (``freed``)."""
    n, h, A, R = s.tokens, spec.hidden, s.compute, s.residual
    t = w.tp
    a = spec.n_heads // t
    # not recomputed yet: everything from the output projection's input on
    cut = next(
        (k for k, i in enumerate(items) if i.name == "o_proj.input"),
        next(
            k
            for k, i in enumerate(items)
            if i.name.startswith(("post_attn_norm.", "mlp_norm.", "attn_out.", "attn_ln."))
        ),
    )
    freed = sum(i.nbytes for i in items[cut:] if not i.name.startswith("autocast."))
    if w.autocast:  # cached 16-bit weights of the MLP and the output projection: not made yet
        casts = sum(i.nbytes for i in items if i.name.startswith("autocast."))
        freed += casts - _attention_in_weights(spec, t) * A
    # the layer's output gradient; under autocast the residual add's backward has also made
    # its 16-bit copy for the MLP branch (as in mlp_moment) before the first saved tensor's
    # unpack triggered the recomputation, and the norm's output the caller holds through
    # attention is not the Linears' saved input (their 16-bit casts are)
    temp = s.tokens_sp * h * R
    if s.autocast:
        temp += s.tokens_sp * h * R + (n * h * A if R != A else 0)
    if spec.is_mla and w.attention == "cpu-flash":
        qk, v, rope = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim, spec.qk_rope_dim
        kvr = spec.kv_lora_rank
        q, sq = n * a * qk, w.local_seq
        s2 = w.batch * a * sq * w.seq
        temp += q * A + n * a * (spec.qk_nope_dim + v) * A  # q_b's and kv_b's outputs
        # kv_a's output (``compressed_kv``: RoPE's k part is a view of it) and, under
        # autocast, its normed latent (``kv_nope``, in the norm weight's dtype; otherwise it
        # is kv_b's saved input), both held by the forward's locals
        temp += n * (kvr + rope) * A + (n * kvr * R if s.autocast else 0)
        temp += (n * a * rope + n * rope) * R  # RoPE's q and k parts (the cos/sin dtype)
        # the query: a cat of q_b's part and RoPE's (the wider dtype), cast back to 16 bits
        # for SDPA under autocast; the key, a 16-bit tensor filled from both
        temp += q * max(A, R) + (q * A if R != A else 0) + q * A
        if A != 4:  # the math path's fp32 copies of q, k and v (the contiguous clone of v it
            # saves is a layer item), the 16-bit softmax
            temp += 2 * q * 4 + n * a * v * 4 + s2 * A
        temp += sq * w.seq * 4  # the causal mask's additive float form (the bool one is gone)
        temp += n * a * v * 4 + n * a * v * A  # the fp32 output and its cast
    return Moment(temporary=temp, grads=0, freed=freed)


def _attention_in_weights(spec: ModelSpec, t: int) -> int:
    """Elements of the Linear weights that run before the attention core (cached in 16 bits
    under autocast by then): all attention projections but the output one."""
    h, d, a, g = spec.hidden, spec.dhead, spec.n_heads, spec.kv_heads
    if spec.is_mla:
        qk, kvr, rope = spec.qk_nope_dim + spec.qk_rope_dim, spec.kv_lora_rank, spec.qk_rope_dim
        qr = spec.q_lora_rank
        q = h * qr + qr * a * qk // t if qr else h * a * qk // t
        return q + h * (kvr + rope) + kvr * a * (spec.qk_nope_dim + spec.v_head_dim) // t
    return h * (a * d // t + 2 * g * d // min(t, g))


def _score_grad_bytes(w, eager: bool) -> int:
    """Bytes of a score gradient in the attention's backward: the compute dtype on CUDA, fp32
    for the CPU's SDPA math path; for an encoder's eager attention fp32 under CUDA autocast (its
    softmax ran in fp32), else the compute dtype."""
    if eager:
        return 4 if w.autocast and w.cuda else w.compute
    return w.compute if w.cuda else 4
