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

from gpumem.estimator.activations import expert_tokens
from gpumem.estimator.specs import ModelSpec


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
    ) -> None:
        """A Linear's backward: grad of its input and of its weight, then its saved input and
        the incoming gradient go; under autocast the 16-bit weight grad is cast to the fp32
        parameter by the next node."""
        wn = fin * fout + (fout if bias else 0)
        self.alloc(t=n * fin * A + (wn * A if cast else 0), g=0 if cast else wn * grad_bytes)
        self.free(t=consumed, a=saved)
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


def mlp_moment(spec: ModelSpec, s: Shape, ffn: int) -> Moment:
    """The widest moment of the MLP's backward (it runs first in a pre-norm layer)."""
    n, h, A = s.tokens, spec.hidden, s.compute
    # the layer's output gradient (residual dtype); under autocast the branch's 16-bit output
    # needs its own cast copy of it
    wk = _Walk(s.tokens_sp * h * s.residual)
    copy = n * h * A if s.autocast and s.residual != A else 0
    wk.alloc(t=copy)
    cast = s.autocast
    in_cast = n * h * A if s.autocast else 0  # the per-Linear 16-bit copy of the norm output
    if spec.is_moe and not s.dense:
        if s.grouped:
            return _grouped_moe(spec, s, ffn, wk)
        return _moe(spec, s, ffn, wk, copy, in_cast)
    f = ffn
    if spec.arch == "llama":  # down(silu(gate(x)) * up(x))
        wk.linear(n, f, h, False, A, s.grad_bytes, cast, saved=n * f * A, consumed=copy)
        _swiglu_rest(wk, n, h, f, A, s.grad_bytes, cast, in_cast)
    else:  # proj(gelu(fc(x)))
        wk.linear(n, f, h, True, A, s.grad_bytes, cast, saved=n * f * A, consumed=copy)
        if spec.is_hf:
            _gelu_new(wk, n * f * A)
        else:  # one fused GELU kernel
            wk.alloc(t=n * f * A)
            wk.free(t=n * f * A, a=n * f * A)
        wk.linear(n, h, f, True, A, s.grad_bytes, cast, saved=in_cast, consumed=n * f * A)
    return wk.best


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
    wk: _Walk, n: int, h: int, f: int, A: int, gb: int, cast: bool, in_cast: int
) -> None:
    """SwiGLU after its down projection: mul (2 ffn-wide grads), up, silu, gate."""
    wk.alloc(t=2 * n * f * A)
    wk.free(t=n * f * A, a=2 * n * f * A)  # grad of down's input; silu_out and up_out
    wk.linear(n, h, f, False, A, gb, cast, saved=in_cast, consumed=n * f * A)  # up (created last)
    wk.alloc(t=n * f * A)  # silu backward
    wk.free(t=n * f * A, a=n * f * A)
    wk.linear(n, h, f, False, A, gb, cast, saved=in_cast, consumed=n * f * A)  # gate


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


def _grouped_moe(spec: ModelSpec, s: Shape, f: int, wk: _Walk) -> Moment:
    """Grouped experts (transformers' grouped_mm, Megatron's TEGroupedMLP) backward, node by
    node: the reorder's scatter, the routing-weight product, the down GEMM (all experts' weight
    gradients at once), the gated activation, the up GEMM, and the scatter back to the tokens;
    every intermediate is ``expert_tokens`` rows in the experts' dtype."""
    n, h, R = s.tokens, spec.hidden, s.residual
    nk, E_A, gb, E = s.expert_tokens, s.expert_bytes, s.grad_bytes, s.n_experts
    weighted = max(E_A, 4)  # the product with the fp32 routing weights is fp32
    wk.alloc(t=nk * h * weighted)  # the reorder's (index) gradient
    wk.alloc(t=nk * h * E_A + nk * 4)  # gradients of the expert output and routing weights
    wk.free(t=nk * h * weighted, a=nk * h * E_A + nk * 4)
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
    wk.alloc(t=n * h * R)  # the gather's backward into the tokens
    wk.free(t=nk * h * E_A)
    return wk.best


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
) -> Moment:
    """The attention core's backward, after the MLP's: the MLP's activations are gone and its
    weight gradients (and the output projection's) exist; in flight are the residual gradient,
    the gradient of the attention output, and the backend's own: q/k/v gradients (fused
    kernels) or two s x s score gradients (the math backend)."""
    n, h, A, d = s.tokens, spec.hidden, s.compute, spec.dhead
    q = n * heads * d * A
    t = s.tokens_sp * h * s.residual + q
    t += 2 * batch * heads * seq * seq * math_bytes if backend == "math" else 3 * q
    return Moment(temporary=t, grads=mlp_params * s.grad_bytes, freed=mlp_saved)


def layer_moment(spec: ModelSpec, w, items, grad_bytes: int, recompute: str = "none") -> Moment:
    """The widest moment of one layer's backward: the MLP's replay or the attention core's,
    whichever holds more. ``w`` is an activations.Workload, ``items`` its layer items."""
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
    )
    f = (spec.moe_ffn // w.etp) if moe else spec.dense_layer_ffn // t
    mlp = mlp_moment(spec, s, f)
    # the MLP half of the layer's items: everything from its pre-norm on (autocast's cached
    # weight copies stay until their own matmul's backward)
    cut = next(k for k, i in enumerate(items) if i.name.startswith("mlp_norm."))
    mlp_saved = sum(i.nbytes for i in items[cut:] if not i.name.startswith("autocast."))
    h, qd = spec.hidden, spec.n_heads * spec.dhead // t
    per_mlp = (3 if spec.arch == "llama" else 2) * h * f + (0 if spec.arch == "llama" else f + h)
    n_mlps = max(spec.n_experts, 1) if moe else 1
    mlp_params = per_mlp * n_mlps + (h * spec.n_experts if moe else 0) + qd * h + 2 * h
    att = attention_moment(
        spec,
        s,
        mlp_saved,
        mlp_params,
        spec.n_heads // t,
        w.seq,
        w.batch,
        w.attention,
        w.compute if w.cuda else 4,
    )
    if recompute == "selective":  # the attention core comes back before its backward
        core = sum(i.nbytes for i in items if i.core)
        att = Moment(att.temporary + core, att.grads, att.freed)
    return mlp if mlp.excess >= att.excess else att
