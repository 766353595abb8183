"""Decoder-only language models (gpt2, llama, mixtral) and the ViT encoder, from one set of blocks.

Written for readable memory profiles, not for speed: every sub-block is its own module so the
profiler's per-layer table names what people reason about (attention, MLP, norms, experts).

- gpt2: learned positions, LayerNorm, GELU MLP, multi-head attention.
- llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention (``num_kv_heads``).
- mixtral: llama with a top-k routed mixture of SwiGLU experts instead of the MLP.
- vit: patch embedding, class token, learned positions, pre-norm encoder blocks, linear head.

Attention is ``F.scaled_dot_product_attention`` (whichever backend PyTorch picks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpumem._assumptions import note_assumption
from gpumem.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) as in Llama, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch in ("llama", "mixtral"):
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021); the cos/sin cache is a non-persistent buffer."""

    def __init__(self, head_dim: int, seq_len: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, S, D)
        s = x.shape[-2]
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        bias = cfg.arch in ("gpt2", "vit")
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)
        self.rotary = (
            Rotary(d, cfg.seq_len, cfg.rope_theta) if cfg.arch in ("llama", "mixtral") else None
        )
        self.causal = causal
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.num_kv_heads != self.num_heads:
            # explicit repeat instead of enable_gqa: same bytes on every torch >= 2.5 backend
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU MLP (gpt2, vit)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020) as in Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts (Mixtral).

    Routing is data dependent (which tokens go to which expert). Under fake tensors the token
    counts are unknown, so the layer assumes uniform routing (each expert receives
    ``tokens * top_k / num_experts`` tokens, the balanced case load-balancing losses aim for) and
    tells the active profiler, which labels its report as an estimate.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size) for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        fake = _is_fake(x)
        if fake:
            note_assumption(
                "MoE routing assumed uniform: each expert gets tokens*top_k/num_experts"
            )
        n_tokens, n_exp = x.shape[0], len(self.experts)
        for e, expert in enumerate(self.experts):
            if fake:
                n = (n_tokens * self.top_k) // n_exp + (e < (n_tokens * self.top_k) % n_exp)
                tok = torch.arange(n, device=x.device) % n_tokens
                slot = torch.zeros_like(tok)
            else:
                tok, slot = torch.where(chosen == e)
                if tok.numel() == 0:
                    continue
            y = expert(x[tok]) * weights[tok, slot].unsqueeze(-1)
            out.index_add_(0, tok, y)
        return out.view(shape)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg, causal)
        self.mlp_norm = _norm(cfg)
        if cfg.arch == "mixtral":
            self.mlp: nn.Module = MoE(cfg)
        elif cfg.arch == "llama":
            self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """gpt2 / llama / mixtral: token ids (batch, seq) -> logits (batch, seq, vocab).

    Example:
        >>> from gpumem.models import build_model
        >>> model = build_model("llama", "tiny")
        >>> model(torch.randint(0, 512, (2, 16))).shape
        torch.Size([2, 16, 512])
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.hidden_size) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.gradient_checkpointing = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[-1] > self.config.seq_len:
            raise ValueError(
                f"sequence length {ids.shape[-1]} exceeds the model's seq_len "
                f"{self.config.seq_len}; build it with seq_len >= {ids.shape[-1]}"
            )
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(ids.shape[-1], device=ids.device))
        for layer in self.layers:
            x = _maybe_checkpoint(layer, x, self.gradient_checkpointing and self.training)
        return self.lm_head(self.norm(x))


class ViT(nn.Module):
    """Vision transformer (Dosovitskiy et al. 2021): images (batch, C, H, W) -> logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(
                f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}"
            )
        self.config = cfg
        n = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.num_layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.num_classes)
        self.gradient_checkpointing = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for layer in self.layers:
            x = _maybe_checkpoint(layer, x, self.gradient_checkpointing and self.training)
        return self.head(self.norm(x[:, 0]))


def _maybe_checkpoint(layer: nn.Module, x: torch.Tensor, enabled: bool) -> torch.Tensor:
    if not enabled:
        return layer(x)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(layer, x, use_reentrant=False)
