"""The reference for torchtitan's mixture of experts: torchtitan 0.3.0's Qwen3-MoE (its
``Qwen3Model`` with ``MoE`` blocks: ``TokenChoiceTopKRouter`` (softmax, top-k, route_norm),
``LocalTokenDispatcher`` (argsort of the expert ids, the routed tokens gathered), ``GroupedExperts``
(``torch._grouped_mm`` of w1, w3, w2), the combine's fp32 scaling and ``scatter_add``, the
load-balancing buffers ``expert_bias_E`` / ``tokens_per_expert_E``), built as ``_30b_a3b`` builds
its config, one rank of the job on torch's fake process group, two steps profiled under fake
tensors (``gpumem.profile``), as ``torchtitan_reference.py`` does for the dense Llama.

What is torchtitan's: the model and its config builders (``models/qwen3/__init__.py``:
``_build_qwen3_moe_layers``), activation checkpointing and ``apply_fsdp_to_decoder``
(``ac_and_fsdp``; each block one FSDP unit with its experts, ``Shard(0)`` over the experts while
the FSDP degree is at most their number), the loss, the fused AdamW.

Deviations, each to make a CPU fake run save what the CUDA run saves: the attention is the flash
kernel called directly (``torchtitan_reference.flash_forward``); the router's gate runs under
``torch.autocast(dtype=torch.float32)``, which CPU autocast refuses (it warns and computes in
bf16), so its forward is the CUDA autocast's: ``F.linear(x.float(), weight.float())``. No expert
parallelism (ep = 1), no shared experts (Qwen3-MoE has none).

Its rows: ``torchtitan_moe_results.py`` (``bench_published.py --only torchtitan-pp``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan_reference import (
    Result,
    ac_and_fsdp,
    adamw,
    fake_job,
    flash_forward,
    run_profiled,
)

import gpumem

# dim, layers, heads, kv heads, head dim, moe hidden, experts, top-k, vocab
# (models/qwen3/__init__.py: _debugmodel_moe, _30b_a3b)
FLAVORS = {
    "debug": (256, 8, 16, 8, 128, 768, 64, 8, 2048),
    "30B-A3B": (2048, 48, 32, 4, 128, 768, 128, 8, 151936),
}


def moe_config(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, moe_hidden: int,
    experts: int, top_k: int, vocab: int, seq: int,
) -> Any:  # fmt: skip
    """A ``Qwen3Model.Config`` built as ``_30b_a3b`` builds its own, the RoPE cache sized to the
    training sequence (``update_from_config``)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, moe_hidden_dim=moe_hidden, num_experts=experts, top_k=top_k,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1000000.0),
        ),
    )  # fmt: skip


def _gate_fp32(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The router gate under CUDA's ``autocast(dtype=torch.float32)``: input and weight cast."""
    return F.linear(x.float(), self.weight.float())


def profile_moe_step(
    *, world: int, batch: int, seq: int, ac: str, steps: int = 2, **dims: int
) -> Result:
    """Peak allocated bytes of rank 0 of ``world`` FSDP ranks over ``steps`` steps (``dims``:
    ``moe_config``'s model sizes), on fake CPU tensors."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.qwen3.model import Qwen3Model

    cfg = moe_config(**dims, seq=seq)
    vocab = dims["vocab"]
    with fake_job(world) as d, gpumem.fake():
        model = Qwen3Model(cfg)
        for block in model.layers.values():
            inner = block.attention.inner_attention
            inner.forward = types.MethodType(flash_forward, inner)
            gate = block.moe.router.gate
            gate.forward = types.MethodType(_gate_fp32, gate)
        ac_and_fsdp(model, d.get_mesh(["fsdp"]), ac)
        opt = adamw(model.parameters())
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab).build()
        tokens = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        n_tokens = torch.tensor(batch * seq * world)

        def step(_i: int) -> None:
            opt.zero_grad(set_to_none=True)
            pred = model(tokens)
            loss, _ = loss_fn(pred, labels, n_tokens)
            del pred
            loss.backward()
            clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            opt.step()

        return run_profiled(model, opt, step, steps)


def profile_flavor(flavor: str, **kw: Any) -> Result:
    dim, n_layers, n_heads, n_kv, head_dim, hidden, experts, top_k, vocab = FLAVORS[flavor]
    return profile_moe_step(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        moe_hidden=hidden, experts=experts, top_k=top_k, vocab=vocab, **kw,
    )  # fmt: skip
