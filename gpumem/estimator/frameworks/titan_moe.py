"""torchtitan's mixture of experts: its Qwen3-MoE (torchtitan 0.3.0, ``models/qwen3``,
``models/common/moe.py``, ``token_dispatcher.py``) as the peak terms of one FSDP rank.

A block is Qwen3's attention (fused ``wqkv``, an RMSNorm of q and of k per head, cos/sin RoPE,
SDPA with GQA) and an ``MoE``: ``TokenChoiceTopKRouter`` (the gate under
``autocast(float32)``, softmax, top-k, ``route_norm``), ``LocalTokenDispatcher`` (the token ids
sorted by expert, the routed tokens gathered: ``T · K`` rows), ``GroupedExperts``
(``torch._grouped_mm`` of w1, w3 and w2 over the routed rows, SwiGLU between), the combine (the
expert outputs scaled in fp32 by their scores, ``scatter_add``). Per block and token, without
AC, autograd keeps (bytes; ``D`` dim, ``E`` experts, ``K`` top-k, ``F`` expert hidden, ``Hq`` /
``Hk`` query / kv heads of ``hd``):

- the two composite RMSNorms' fp32 input, fp32 product and rstd (``8 D + 4`` each), the
  attention norm's bf16 output (``wqkv``'s input, ``2 D``); the ffn norm's output is not kept
  (the gate keeps its fp32 copy, the dispatch its indices);
- q and k norms per head (``8 hd + 4`` per head), the attention's q, k, v (``2 hd`` per head),
  its output and fp32 log-sum-exp (as the dense block);
- the router: the gate's fp32 input (``4 D``), the softmax output (``4 E``), the top-k ids
  (``8 K``) and scores (``4 K``), the route-norm denominator (4); the dispatch's two int64 index
  vectors (``16 K``);
- the experts: the routed input (``2 D K``), w1's output, SiLU's output, w3's output and their
  product (``8 F K``); the combine's sorted scores (``4 K``) and its fp32 expert outputs
  (``4 D K``);
- per block: the gate's fp32 weight copy (``4 E D``), the expert offsets (``4 E``), the
  attention's RNG state (24 B).

Full AC keeps a block's input only; layer SAC (``selective:N``) mixes the two. The buffers: a
cos/sin RoPE cache per block (``seq · 2 hd`` fp32) and the load-balancing ``expert_bias_E`` and
``tokens_per_expert_E`` (fp32, ``E`` each). FSDP (``apply_fsdp_to_decoder``, ep = 1): a block
with its experts is one unit, the states fp32 over the shard degree as in the dense recipe.

The peak priced is the wider of the loss's moment (every block's saved set, the head's, the loss
backward's fp32 logits gradients, the ``[norm, lm_head]`` unit gathered) and a block's backward
(``block_moment``: the combine's fp32 backward), checked against the fake profile of
torchtitan's model (``benchmarks/published/torchtitan_moe_reference.py``); the block's moment
decides only when the logits are small beside a block (a small vocabulary or few tokens).

Not modelled: per-op SAC under MoE (its save list keeps ``topk`` and the linears), expert
parallelism, shared experts and dense first layers (DeepSeek-V3), other routers (sigmoid,
node-limited), PP / TP / CP with MoE, the load-balancing hook's step-time temporaries.
"""

from __future__ import annotations

from gpumem.estimator import peak
from gpumem.estimator.activations import Item
from gpumem.estimator.frameworks.torchtitan import Shapes, head_saved, layer_sac_every
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.model_spec import ModelSpec

_BF16 = 2


def check_moe(spec: ModelSpec, layout: Layout, recompute: str, unsupported: list[str]) -> None:
    """What torchtitan's MoE path prices, checked; ``unsupported``: the knobs given that it
    does not take (named in the error).

    Raises:
        ValueError: one line naming the problem and the choices.
    """
    dense_layers = spec.first_k_dense or (spec.moe_layer_freq and not all(spec.moe_layer_freq))
    if not spec.qk_norm or spec.n_shared_experts or dense_layers or spec.kv_lora_rank:
        raise ValueError(
            f"framework='torchtitan' models its Qwen3-MoE (q/k norms, no shared experts, no "
            f"dense first layers); {spec.name!r} is another mixture of experts (DeepSeek-V3 and "
            "Mixtral-style models are not modelled under torchtitan)"
        )
    if recompute in ("selective", "selective:op"):
        raise ValueError(
            f"recompute={recompute!r} (per-op SAC) with torchtitan's MoE is not modelled yet; "
            "use none, full or selective:N"
        )
    given = [n for n, on in (("pp", layout.pp > 1), ("tp", layout.tp > 1), ("cp", layout.cp > 1),
                             ("ep", layout.ep > 1)) if on] + unsupported  # fmt: skip
    if given:
        raise ValueError(
            f"framework='torchtitan' with a mixture of experts: {', '.join(given)} not modelled "
            "yet (FSDP over data-parallel ranks only); drop it"
        )


def moe_block_params(spec: ModelSpec) -> int:
    """A Qwen3-MoE block's parameters: attention, q/k norms, two norms, gate, experts."""
    d, hd, e = spec.hidden, spec.dhead, spec.n_experts
    attn = (spec.n_heads + 2 * spec.kv_heads) * hd * d + spec.n_heads * hd * d
    return attn + 2 * hd + 2 * d + d * e + 3 * e * d * spec.ffn


def moe_layer_saved(spec: ModelSpec, sh: Shapes, policy: str) -> dict[str, int]:
    """What one block keeps between forward and backward under ``policy`` (``none``, ``full``),
    by tensor (the module docstring's list)."""
    n, d, hd, e, k, f = sh.n, spec.hidden, spec.dhead, spec.n_experts, spec.top_k, spec.ffn
    if policy == "full":
        return {"block_input": n * d * _BF16}
    hq, hk = spec.n_heads, spec.kv_heads
    return {
        "norms": 2 * (8 * n * d + 4 * n),
        "attention_norm_out": n * d * _BF16,
        "qk_norms": n * (8 * hd + 4) * (hq + hk),
        "q_k_v": n * (hq + 2 * hk) * hd * _BF16,
        "attn_out": n * hq * hd * _BF16,
        "attn_lse": n * hq * 4 + 24,
        "router": n * (4 * d + 4 * e + 12 * k + 4) + 4 * e * d,
        "dispatch": n * 16 * k + 4 * e,
        "routed_input": n * k * d * _BF16,
        "experts_swiglu": 4 * n * k * f * _BF16,
        "combine": n * k * (4 + 4 * d),
    }


def block_moment(
    spec: ModelSpec, sh: Shapes, saved: list[int], checkpointed: list[bool], n_shard: float
) -> float:
    """The widest moment of a block's backward (L-1, L-2, 1 or 0: across the stack the saved
    sets fall and the sharded gradients grow linearly), everything held: the combine's
    backward (the expert outputs' gradient and the scores' in fp32 beside the saved fp32
    outputs, ``3 · N · D · 4`` new, and the block's incoming gradient), with the blocks
    below's saved sets, the block's own (recomputed under AC, beside its saved input), the
    block gathered (bf16) with the next unit prefetched on more than one rank, the previous
    unit's fp32 reduce-scatter input and the sharded gradients done."""
    L, d, n = spec.n_layers, spec.hidden, sh.n
    blk = moe_block_params(spec)
    head = spec.vocab * d + d
    none = sum(moe_layer_saved(spec, sh, "none").values())
    rows = n * spec.top_k
    temp = 3 * rows * d * 4 + n * d * _BF16
    best = 0.0
    for i in {L - 1, max(L - 2, 0), min(1, L - 1), 0}:  # the widest is at an end of the stack
        grads = 4 * (head + (L - 1 - i) * blk) / n_shard
        own = none + (n * d * _BF16 if checkpointed[i] else 0)
        fetch = (2 * blk if i > 0 else 2 * spec.vocab * d) if n_shard > 1 else 0
        prev = head if i == L - 1 else blk
        comm = 2 * blk + fetch + 4 * prev
        best = max(best, grads + sum(saved[:i]) + own + temp + comm)
    return best


def moe_terms(
    spec: ModelSpec, layout: Layout, gpu: GPU, *, batch: int, seq: int, recompute: str, cuda: bool
) -> list[float]:
    """The peak terms (``peak.py``) of one torchtitan FSDP rank training a Qwen3-MoE."""
    sh = Shapes(spec, layout, batch, seq)
    L, d, v, n = spec.n_layers, spec.hidden, spec.vocab, sh.n
    head_params = v * d + d
    every = layer_sac_every(recompute)
    policies = [
        "full" if (every and (i + 1) % every == 0) or recompute == "full" else "none"
        for i in range(L)
    ]
    saved = [sum(moe_layer_saved(spec, sh, p).values()) for p in policies]
    x = [0.0] * peak.N_TERMS
    x[peak.P_TRAIN] = L * moe_block_params(spec) + head_params + v * d
    x[peak.W_BYTES], x[peak.W_FROZEN_BYTES], x[peak.G_BYTES], x[peak.O_BYTES] = 4, 4, 4, 8
    x[peak.N_SHARD] = x[peak.N_SHARD_EXP] = layout.shard_degree(gpu.gpus_per_node)
    x[peak.STAGE] = 3
    # per block: the cos/sin RoPE cache (fp32, seq x 2 hd), expert_bias_E, tokens_per_expert_E
    x[peak.W_BUFFERS] = L * (seq * 2 * spec.dhead * 4 + 8 * spec.n_experts)
    x[peak.A_LAYER], x[peak.N_LAYERS], x[peak.INFLIGHT] = sum(saved) / L, L, 1.0
    x[peak.IDS] = x[peak.A_FIRST] = n * 8
    x[peak.A_LAST] = sum(head_saved(sh).values())
    x[peak.T_BWD0] = 2 * n * v * 4  # the loss backward's two fp32 logits-sized gradients
    x[peak.GATHER] = head_params * _BF16  # [norm, lm_head] gathered from forward to backward
    # a block's backward instead, when wider (the head's saved tensors gone but the labels)
    start = L * x[peak.A_LAYER] + x[peak.A_LAST] + x[peak.T_BWD0] + x[peak.GATHER]
    full = [p == "full" for p in policies]
    blocks = block_moment(spec, sh, saved, full, x[peak.N_SHARD]) + n * 8
    if blocks > start:
        x[peak.A_GONE] = x[peak.A_LAST] + L * x[peak.A_LAYER]
        x[peak.T_BWD0] = blocks - x[peak.GATHER]
    # the end of backward and the step are narrower: every gradient counted pending
    x[peak.P_PEND] = x[peak.P_TRAIN]
    if cuda:
        x[peak.CONTEXT] = gpu.context_bytes
        x[peak.NCCL] = gpu.nccl_bytes if layout.n_gpus > 1 else 0
        x[peak.FRAG] = gpu.fragmentation
    return x


def layer_items(spec: ModelSpec, layout: Layout, batch: int, seq: int, recompute: str) -> list:
    """The tensors one block keeps (the bill's itemised layer); under layer SAC those of a
    block that is not checkpointed."""
    sh = Shapes(spec, layout, batch, seq)
    policy = "full" if recompute == "full" else "none"
    return [Item(k, v) for k, v in moe_layer_saved(spec, sh, policy).items()]
