"""torchtune's compiled decoder layer (``estimator.tune_compiled``) against Inductor itself.

The reference: torchtune's ``TransformerSelfAttentionLayer`` (its ``RMSNorm``,
``RotaryPositionalEmbeddings``, ``MultiHeadAttention`` with GQA's ``expand(...).flatten(1, 2)``,
SDPA, ``FeedForward`` with SiLU), transcribed below (torchtune is not a dependency), compiled by
``torch.compile`` with Inductor on the CPU; what its forward keeps is the input list of the
backward graph that Inductor's own partition hands to ``compile_fx_inner`` (recorded there, the
graphs are not code-generated). The formula must equal it to the byte, tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpumem
from gpumem.estimator import activations as act
from gpumem.estimator import hf_ops, lora_ops
from gpumem.estimator.accuracy import LLAMA_3_2_3B
from gpumem.estimator.finetune import FineTune
from gpumem.estimator.knobs import TrainingKnobs
from gpumem.estimator.resolver import resolve_model
from gpumem.estimator.tune_compiled import compiled_layer_bytes_per_token, compiled_layer_items


class TuneRMSNorm(nn.Module):
    """torchtune/modules/rms_norm.py: fp32 statistics, ``type_as(x)``, then ``* scale``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.scale = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        rms = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_fp32 * rms).type_as(x) * self.scale


class TuneRope(nn.Module):
    """torchtune/modules/position_embeddings.py ``RotaryPositionalEmbeddings``."""

    def __init__(self, dim: int, max_seq: int = 256, base: int = 10000) -> None:
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        freqs = torch.outer(torch.arange(max_seq).float(), theta)
        cache = torch.stack([freqs.cos(), freqs.sin()], -1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rc = self.cache[: x.size(1)]
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        rc = rc.view(-1, xs.size(1), 1, xs.size(3), 2)
        out = torch.stack(
            [
                xs[..., 0] * rc[..., 0] - xs[..., 1] * rc[..., 1],
                xs[..., 1] * rc[..., 0] + xs[..., 0] * rc[..., 1],
            ],
            -1,
        )
        return out.flatten(3).type_as(x)


class TuneAttention(nn.Module):
    """torchtune/modules/attention.py ``MultiHeadAttention`` (no KV cache, causal SDPA)."""

    def __init__(self, h: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.q_proj = nn.Linear(h, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.output_proj = nn.Linear(heads * self.hd, h, bias=False)
        self.pos_embeddings = TuneRope(self.hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.pos_embeddings(self.q_proj(x).view(b, s, self.heads, self.hd)).transpose(1, 2)
        k = self.pos_embeddings(self.k_proj(x).view(b, s, -1, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        if self.heads != self.kv_heads:
            shape = (b, self.kv_heads, self.heads // self.kv_heads, -1, self.hd)
            k = k.unsqueeze(2).expand(shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class TuneLayer(nn.Module):
    """torchtune/modules/transformer.py ``TransformerSelfAttentionLayer`` with
    torchtune/modules/feed_forward.py ``FeedForward`` (``w2(silu(w1(x)) * w3(x))``)."""

    def __init__(self, h: int, heads: int, kv_heads: int, f: int) -> None:
        super().__init__()
        self.sa_norm, self.mlp_norm = TuneRMSNorm(h), TuneRMSNorm(h)
        self.attn = TuneAttention(h, heads, kv_heads)
        self.w1, self.w2, self.w3 = (nn.Linear(*d, bias=False) for d in ((h, f), (f, h), (h, f)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.sa_norm(x)) + x
        m = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))


class TuneLoRALinear(nn.Module):
    """torchtune/modules/peft/lora.py ``LoRALinear`` (no dropout, no quantized base): a frozen
    ``linear(x, W)`` plus ``lora_b(lora_a(x)) * (alpha / rank)``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


_PATHS = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.output_proj",
          "gate": "w1", "up": "w3", "down": "w2"}  # fmt: skip


def lora_layer(layer: TuneLayer, adapted: frozenset[str], rank: int) -> TuneLayer:
    """torchtune's ``lora_llama3_2``: the base frozen, ``LoRALinear`` on the adapted Linears."""
    layer.requires_grad_(False)
    for key in adapted:
        parent, _, name = _PATHS[key].rpartition(".")
        owner = layer.get_submodule(parent) if parent else layer
        setattr(owner, name, TuneLoRALinear(getattr(owner, name), rank))
    return layer


def inductor_saved(layer: nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes of each tensor the compiled layer's forward keeps for backward (its parameters and
    RoPE's cache left out: the backward inputs of the layer input's shape or made in forward)."""
    from functorch.compile import make_boxed_func
    from torch._inductor import compile_fx as cfx

    saved: list[int] = []

    def inner(gm: torch.fx.GraphModule, _inputs: object, **kw: object) -> object:
        if kw.get("is_backward"):
            for node in gm.graph.find_nodes(op="placeholder"):
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor) or node.name.startswith("tangents"):
                    continue
                if node.name.startswith("primals") and tuple(val.shape) != tuple(x.shape):
                    continue  # a parameter or the RoPE cache
                saved.append(val.numel() * val.element_size())
        return make_boxed_func(gm)

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        return cfx.compile_fx(gm, inputs, inner_compile=inner)

    torch._dynamo.reset()
    torch.compile(layer, backend=backend, dynamic=False)(x).sum().backward()
    torch._dynamo.reset()
    return saved


def _spec(h: int, heads: int, kv: int, f: int):
    return resolve_model(
        {"model_type": "llama", "hidden_size": h, "num_hidden_layers": 2,
         "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": f,
         "vocab_size": 1024, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    )  # fmt: skip


CONFIGS = [
    # (hidden, heads, kv heads, ffn, batch, seq, dtype)
    pytest.param(256, 8, 2, 688, 2, 64, torch.bfloat16, id="gqa4-bf16"),
    pytest.param(192, 6, 6, 512, 2, 64, torch.bfloat16, id="mha-bf16"),
    pytest.param(256, 4, 1, 640, 2, 32, torch.bfloat16, id="mqa-bf16"),
    pytest.param(384, 24, 8, 1024, 2, 64, torch.bfloat16, id="gqa3-bf16", marks=pytest.mark.slow),
    pytest.param(320, 10, 2, 864, 2, 48, torch.bfloat16, id="gqa5-bf16", marks=pytest.mark.slow),
    pytest.param(256, 8, 2, 688, 2, 64, torch.float32, id="gqa4-fp32", marks=pytest.mark.slow),
    # Llama 3.2 3B's and Llama 3.1 8B's widths at 128 tokens: the partition's choice is by
    # tensor sizes, and every saved tensor scales with the tokens
    pytest.param(3072, 24, 8, 8192, 2, 64, torch.bfloat16, id="3b-widths", marks=pytest.mark.slow),
    pytest.param(
        4096, 32, 8, 14336, 1, 128, torch.bfloat16, id="8b-widths", marks=pytest.mark.slow
    ),
]


LORA = [
    # (adapted Linears, the layer input carries a gradient)
    pytest.param("q,v", True, id="qv"),
    pytest.param("q,v,o,gate,up,down", True, id="all"),
    pytest.param("q,v", False, id="qv-first"),
    pytest.param("q,v,o", True, id="qvo", marks=pytest.mark.slow),
    pytest.param("q,v,o,gate,up,down", False, id="all-first", marks=pytest.mark.slow),
    pytest.param("gate,up", False, id="mlp-first", marks=pytest.mark.slow),
    pytest.param("down", True, id="down", marks=pytest.mark.slow),
    pytest.param("k,o", False, id="ko-first", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mods", "grad_in"), LORA)
def test_lora_formula_equals_inductors_saved_tensors(mods: str, grad_in: bool) -> None:
    torch.manual_seed(0)
    h, heads, kv, f, b, s, rank = 256, 8, 2, 688, 2, 64, 8
    adapted = frozenset(mods.split(","))
    layer = lora_layer(TuneLayer(h, heads, kv, f), adapted, rank).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=grad_in)
    measured = inductor_saved(layer, x)
    w = act.Workload(batch=b, seq=s, cuda=False, attention="cpu-flash")
    items = compiled_layer_items(_spec(h, heads, kv, f), w, adapted, grad_in, rank)
    assert sorted(measured) == sorted(i.nbytes for i in items)


@pytest.mark.parametrize(("h", "heads", "kv", "f", "b", "s", "dtype"), CONFIGS)
def test_formula_equals_inductors_saved_tensors(h, heads, kv, f, b, s, dtype) -> None:
    torch.manual_seed(0)
    layer = TuneLayer(h, heads, kv, f).to(dtype)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    measured = inductor_saved(layer, x)
    spec = _spec(h, heads, kv, f)
    A = torch.empty((), dtype=dtype).element_size()
    w = act.Workload(batch=b, seq=s, compute=A, residual=A, cuda=False, attention="cpu-flash")
    items = compiled_layer_items(spec, w)
    assert sorted(measured) == sorted(i.nbytes for i in items)
    assert sum(measured) == b * s * compiled_layer_bytes_per_token(spec, A)


def test_llama_3_2_3b_by_hand() -> None:
    """h 3072, 24 heads of 128, 8 KV heads (expanded: a copy), f 8192, bf16:
    2·(4·3072 + 2·3072 + 2·3072 + 3·8192) + 4·24 + 8 = 98,408 B a token."""
    spec = resolve_model(dict(LLAMA_3_2_3B))
    assert compiled_layer_bytes_per_token(spec, 2) == 98408


def _full(recompute: str, **fields: object) -> gpumem.Bill:
    ft = FineTune(method="full", source="torchtune", loss_chunks=8, compile_loss=True, **fields)
    return gpumem.estimate(
        dict(LLAMA_3_2_3B), batch_size=2, seq_len=4096, precision="bf16", gpu="A100-80GB",
        alloc_conf=False, recompute=recompute, training=TrainingKnobs(fused=True, finetune=ft),
    )  # fmt: skip


def test_compiled_layers_change_only_the_layers_saved_bytes() -> None:
    """Without checkpointing every one of the 28 layers keeps the compiled set instead of the
    eager one; with full checkpointing both keep the layer input only."""
    n, layers = 2 * 4096, 28
    spec = resolve_model(dict(LLAMA_3_2_3B))
    w = act.Workload(batch=1, seq=1)
    eager_tok = act.sum_items(hf_ops.layer_items(spec, w) + lora_ops.torchtune_copies(spec, w))
    eager, compiled = _full("none"), _full("none", compile_layers=True)
    assert eager.phase == compiled.phase == "backward start"
    saved = eager.per_gpu["activations"] - compiled.per_gpu["activations"]
    assert saved == layers * n * (eager_tok - 98408)
    ckpt, ckpt_c = _full("full"), _full("full", compile_layers=True)
    assert ckpt.per_gpu["activations"] == ckpt_c.per_gpu["activations"]
    assert "compile_layers" in compiled.inputs["finetune"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"method": "qlora", "source": "torchtune", "compile_layers": True},
            "'qlora''s compiled layers are not",
        ),
        (
            {"method": "dora", "source": "torchtune", "compile_layers": True},
            "'dora''s compiled layers are not",
        ),
        ({"method": "lora", "source": "peft", "compile_layers": True}, "torchtune's recipe"),
    ],
)
def test_compile_layers_where_not_modelled_is_one_line(fields, match) -> None:
    with pytest.raises(ValueError, match=match) as err:
        FineTune(**fields)
    assert "\n" not in str(err.value)


def test_cli_compile_flags(tmp_path, capsys) -> None:
    """``--compile-layers --compile-loss``: the Python API's recipe; with QLoRA, one line."""
    import json

    from gpumem.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA_3_2_3B)))
    args = ["estimate", str(cfg), "--batch-size", "2", "--seq-len", "4096", "--precision", "bf16"]
    flags = ["--finetune", "full", "--packed", "--compile-layers", "--compile-loss"]
    assert main([*args, *flags]) == 0
    out = capsys.readouterr().out
    ft = FineTune(method="full", packed=True, compile_layers=True, compile_loss=True)
    want = gpumem.estimate(
        dict(LLAMA_3_2_3B), batch_size=2, seq_len=4096, precision="bf16",
        training=TrainingKnobs(finetune=ft),
    )  # fmt: skip
    assert "compile_loss, compile_layers" in out and f"{want.per_gpu['total']:,}" in out
    qlora = ["--finetune", "qlora", "--lora-attn-modules", "q_proj", "--compile-layers"]
    assert main([*args, *qlora]) == 2
    err = capsys.readouterr().err.strip()
    assert "compiled layers are not modelled" in err and "\n" not in err


def test_compiled_unchunked_loss_keeps_the_fp32_logits() -> None:
    """torchtune's ``compile=True`` with the plain ``CrossEntropyLoss``: the compiled loss takes
    ``output(h).float()`` and keeps that fp32 input and two fp32 per-row statistics (Inductor's
    partition, read as for the layers), no log-probabilities: what ``compile_loss`` with one
    chunk prices (4 B a logit kept; one fp32 gradient, not eager's two, in its backward)."""
    from functorch.compile import make_boxed_func
    from torch._inductor import compile_fx as cfx

    n, v = 512, 1000
    saved: list[int] = []

    def inner(gm: torch.fx.GraphModule, _inputs: object, **kw: object) -> object:
        if kw.get("is_backward"):
            for node in gm.graph.find_nodes(op="placeholder"):
                val = node.meta.get("val")
                floating = isinstance(val, torch.Tensor) and val.is_floating_point()
                if floating and val.dim() and not node.name.startswith("tangents"):
                    saved.append(val.numel() * val.element_size())
        return make_boxed_func(gm)

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        return cfx.compile_fx(gm, inputs, inner_compile=inner)

    torch._dynamo.reset()
    loss_fn = torch.compile(nn.CrossEntropyLoss(), backend=backend)
    h = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    loss_fn(h.float(), torch.randint(0, v, (n,))).backward()
    torch._dynamo.reset()
    assert sorted(saved) == [n * 4, n * 4, n * v * 4]
    tokens, vocab = 2 * 4096, 128256
    bill = gpumem.estimate(
        dict(LLAMA_3_2_3B), batch_size=2, seq_len=4096, precision="bf16", gpu="A100-80GB",
        alloc_conf=False, recompute="none",
        training=TrainingKnobs(fused=True, finetune=FineTune(method="full", compile_loss=True)),
    )  # fmt: skip
    assert bill.phase == "backward start"
    assert bill.per_gpu["temporary"] == tokens * vocab * 4
