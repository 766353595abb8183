"""The estimate checked against measurement: run a built-in model for real (CPU), profile it
with ``gpumem.profile``, estimate the same job with ``gpumem.estimate``, compare.

Shared by ``benchmarks/bench_estimator_accuracy.py`` (the committed table) and
``tests/estimator/test_vs_profiler.py`` (the CI guard), so both run the very same loop:

    for step in range(steps):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(ids)                      # held by the loop through backward
            loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

Example:
    >>> from gpumem.estimator.accuracy import Case, compare
    >>> c = compare(Case("llama-gqa", "llama", {"num_kv_heads": 2}, batch=2, seq=64))
    >>> c.error_pct, c.measured_phase, c.estimated["total"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator.api import estimate
from gpumem.estimator.bill import Bill
from gpumem.estimator.gpus import find_gpu
from gpumem.estimator.knobs import ActivationKnobs, TrainingKnobs
from gpumem.estimator.param_count import MLM_ENCODERS
from gpumem.estimator.resolver import from_model_config

PROFILER_CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporary", "inputs")


@dataclass(frozen=True)
class Case:
    """One small training configuration of a built-in model (``gpumem.models``).

    Attributes:
        name: label for tables.
        arch: gpt2, llama or mixtral; ``overrides`` change the ``tiny`` preset's fields.
        batch, seq: micro-batch and sequence length.
        optimizer: adamw, sgd or sgd-momentum (torch.optim, lr 1e-3).
        autocast: torch.autocast(bfloat16) around forward and loss (fp32 parameters).
        recompute: torch.utils.checkpoint around every layer.
        steps: optimizer steps profiled (the first creates the optimizer state).
        foreach: the optimizer's ``foreach`` flag (None: torch's default, per-tensor on CPU).
    """

    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    batch: int = 2
    seq: int = 64
    optimizer: str = "adamw"
    autocast: bool = False
    recompute: bool = False
    steps: int = 2
    foreach: bool | None = None

    @property
    def precision(self) -> str:
        return "bf16-autocast" if self.autocast else "fp32"


@dataclass
class Comparison:
    """Measured vs estimated peak of one :class:`Case`, in the profiler's categories."""

    case: Case
    measured_peak: int
    measured: dict[str, int]
    measured_phase: str
    measured_step: int
    bill: Bill
    estimated: dict[str, int]
    measured_reserved: int | None = None
    """The profile's simulated reserved peak (its logged allocations through the simulator)."""
    routing_imbalance: float | None = None
    """MoE only: tokens per expert, max / mean over experts and layers (1.0 = balanced)."""
    assumptions: list[str] = field(default_factory=list)

    @property
    def error_pct(self) -> float:
        """(estimate - measured) / measured, in percent."""
        return 100.0 * (self.estimated["total"] - self.measured_peak) / self.measured_peak


def estimate_case(case: Case, device: str = "cpu") -> Bill:
    """The estimator's bill for ``case`` (on the CPU: no CUDA context, allocator or NCCL)."""
    from gpumem.models import get_config

    cfg = get_config(case.arch, "tiny", **case.overrides)
    return estimate(
        from_model_config(cfg),
        batch_size=case.batch,
        seq_len=case.seq,
        precision=case.precision,
        optimizer=case.optimizer,
        device=device,
        activations=ActivationKnobs(attention="sdpa", keep_logits=True),
        training=TrainingKnobs(persistent_grads=False, foreach=case.foreach),
        recompute="full" if case.recompute else "none",
        gpu=find_gpu("H100-80GB", 2**40),
    )


def compare(case: Case, seed: int = 0, device: str = "cpu") -> Comparison:
    """Train ``case`` for real (on the CPU, or ``device="cuda"``) under ``gpumem.profile`` and
    estimate it."""
    import torch
    import torch.nn.functional as F

    from gpumem import profiler
    from gpumem.models import build_model, example_batch, get_config

    torch.manual_seed(seed)
    cfg = get_config(case.arch, "tiny", **case.overrides)
    model = build_model(cfg).train().to(device)
    model.gradient_checkpointing = case.recompute
    opt = _optimizer(case, model.parameters())
    ids, targets = (t.to(device) for t in example_batch(cfg, case.batch, case.seq))
    imbalance = _routing_imbalance(model, ids) if cfg.num_experts else None
    with profiler.profile(model, optimizer=opt) as prof:
        for _ in range(case.steps):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=case.autocast):
                logits = model(ids)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rep = prof.report()
    if cfg.num_experts:  # routing after the steps too: report the worse of the two
        imbalance = max(imbalance or 0.0, _routing_imbalance(model, ids))
    bill = estimate_case(case, device)
    return Comparison(
        case=case,
        measured_peak=rep.peak_bytes,
        measured=dict(rep.at_peak),
        measured_phase=rep.peak_phase,
        measured_step=rep.peak_step,
        bill=bill,
        estimated=bill.profiler_categories(),
        measured_reserved=rep.peak_reserved_bytes,
        routing_imbalance=imbalance,
        assumptions=list(rep.assumptions),
    )


def _optimizer(case: Case, params: Any) -> Any:
    import torch

    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=case.foreach)
    if case.optimizer in ("sgd", "sgd-momentum"):
        momentum = 0.9 if case.optimizer == "sgd-momentum" else 0.0
        return torch.optim.SGD(params, lr=1e-3, momentum=momentum, foreach=case.foreach)
    raise ValueError(f"Case.optimizer must be adamw, sgd or sgd-momentum, got {case.optimizer!r}")


def _routing_imbalance(model: Any, ids: Any) -> float:
    """Max / mean tokens per expert of gpumem.models.MoE layers, from the router's top-k on the
    real batch (a no-grad forward outside any profile region)."""
    import torch

    from gpumem.models.transformer import MoE

    counts: list[torch.Tensor] = []

    def hook(mod: Any, args: Any) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        chosen = mod.router(x).float().softmax(-1).topk(mod.top_k, dim=-1).indices
        counts.append(torch.bincount(chosen.flatten(), minlength=len(mod.experts)).float())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return max(float(c.max() / c.mean()) for c in counts)


# --- Hugging Face models from config.json, under fake tensors --------------------------------

HF_PRECISIONS = ("fp32", "bf16-autocast", "bf16")
_TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_SWEEP: dict[str, dict[str, Any]] = {
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 256,
        "n_positions": 256,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama": {"model_type": "llama", **_TINY},
    "mistral": {"model_type": "mistral", **_TINY},
    "qwen2": {"model_type": "qwen2", **_TINY},
    "gemma": {"model_type": "gemma", **_TINY, "head_dim": 16},
    "gemma2": {"model_type": "gemma2", **_TINY, "head_dim": 16},
    "gemma3": {"model_type": "gemma3_text", **_TINY, "head_dim": 16},
    "phi3": {"model_type": "phi3", **_TINY},
    "mixtral": {"model_type": "mixtral", **_TINY, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2-moe": {
        "model_type": "qwen2_moe",
        **_TINY,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        **_TINY,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    },
    # the encoders (*ForMaskedLM); dropout off as for gpt2 (tests/estimator/test_hf_sweep.py
    # checks the checkpoints' 0.1 too)
    "bert": {
        "model_type": "bert",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "roberta": {
        "model_type": "roberta",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 258,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
}
"""Small random-init configs of every family the estimator reads from config.json (the sweep
of tests/estimator/test_hf_sweep.py and benchmarks/bench_hf_sweep.py)."""


def within_tolerance(measured: int, estimated: int) -> bool:
    """The sweep's bound: 3 % of the measured bytes or 64 KiB, whichever is larger."""
    return abs(estimated - measured) <= max(65536, 0.03 * measured)


@dataclass(frozen=True)
class HFCase:
    """A transformers model built from a (small) ``config.json`` dict, one training step pair
    profiled under ``gpumem.fake()`` and estimated from the same dict.

    Attributes:
        name: label for tables.
        config: the config.json fields (``model_type`` included).
        precision: ``fp32``, ``bf16-autocast`` (fp32 weights, torch.autocast) or ``bf16``.
        recompute: ``model.gradient_checkpointing_enable()`` (every layer; ``recompute="full"``).
    """

    name: str
    config: dict[str, Any]
    precision: str = "fp32"
    recompute: bool = False
    batch: int = 2
    seq: int = 64
    reference: str = "fake"
    """``fake``: profiled under fake tensors; ``real``: trained for real on the CPU (the same
    numbers to the byte: tests/estimator/test_hf_sweep.py::test_fake_equals_real)."""
    attention: str = "sdpa"
    """``sdpa`` (where transformers offers it) or ``eager`` (``attn_implementation``)."""
    kernels: str = "cpu"
    """``cuda``: a CUDA job, estimated for CUDA and profiled on the CPU with CUDA's kernels
    where they save other tensors (``profiler.fake.cuda_kernels_on_cpu``)."""
    loop: str = "logits"
    """``logits``: ``logits = model(ids).logits`` held through backward, ``F.cross_entropy``
    in the loop (estimated on the ``torch`` convention, which holds them); ``trainer``: the
    model's own loss as ``Trainer`` runs it, ``loss = model(ids, labels=ids).loss`` (estimated
    on the default ``transformers`` convention)."""


def estimate_hf_case(case: HFCase, device: str = "cpu") -> Bill:
    """The estimator's bill for ``case``, from the config dict alone."""
    return estimate(
        dict(case.config),
        batch_size=case.batch,
        seq_len=case.seq,
        precision=case.precision,
        optimizer="adamw",
        device="cuda" if case.kernels == "cuda" else device,
        activations=ActivationKnobs(attention=case.attention),
        # the logits loop computes the loss itself, on the logits' dtype: torch's convention
        framework="torch" if case.loop == "logits" else None,
        # the reference's AdamW: torch's CPU default (a CUDA job's would be foreach)
        training=TrainingKnobs(persistent_grads=False, foreach=False),
        recompute="full" if case.recompute else "none",
        gpu=find_gpu("H100-80GB", 2**40),
    )


def compare_hf(case: HFCase, device: str = "cpu") -> Comparison:
    """Build ``case``'s transformers model under fake tensors (for real with
    ``device="cuda"``), profile two AdamW steps of the loop above, and estimate the same job
    from the config."""
    import contextlib

    import torch
    import torch.nn.functional as F
    import transformers

    from gpumem import profiler
    from gpumem.profiler.fake import cuda_kernels_on_cpu

    cfg = dict(case.config)
    mtype = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mtype, **cfg)
    # the head a checkpoint of the family has: a causal LM, or the encoders' masked LM; an
    # encoder's architectures may name another
    auto = "MASKED_LM" if mtype in MLM_ENCODERS else "CAUSAL_LM"
    mapping = getattr(transformers.models.auto.modeling_auto, f"MODEL_FOR_{auto}_MAPPING")
    arch = mapping[type(config)]
    named = [a for a in cfg.get("architectures") or [] if hasattr(transformers, a)]
    if mtype in MLM_ENCODERS and named:
        arch = getattr(transformers, named[0])
    # SDPA where transformers offers it (Gemma2 refuses it: eager, soft-capped attention)
    sdpa = case.attention == "sdpa" and getattr(arch, "_supports_sdpa", True)
    config._attn_implementation = "sdpa" if sdpa else "eager"
    kwargs = {"experts_implementation": "grouped_mm"} if _is_moe_config(mtype) else {}
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    use_fake = device == "cpu" and case.reference == "fake"
    fake = profiler.fake() if use_fake else contextlib.nullcontext()
    kernels = cuda_kernels_on_cpu() if case.kernels == "cuda" else contextlib.nullcontext()
    torch.manual_seed(0)
    with fake, kernels, _grouped_mm_any_dtype():
        model = arch._from_config(config, dtype=dtype, **kwargs)
        if device != "cpu":
            model = model.to(device)
        model.train()
        if case.recompute:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, config.vocab_size, (case.batch, case.seq), device=device)
        targets = _head_targets(arch.__name__, ids, config)
        autocast = case.precision.endswith("-autocast")
        amp = torch.float16 if case.precision.startswith("fp16") else torch.bfloat16
        with profiler.profile(model, optimizer=opt) as prof:
            for _ in range(2):
                with torch.autocast(device, dtype=amp, enabled=autocast):
                    if case.loop == "trainer":
                        loss = model(input_ids=ids, **targets).loss
                    else:
                        logits = model(ids).logits
                        loss = F.cross_entropy(
                            logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
                        )
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        rep = prof.report()
    return profile_comparison(case, rep, estimate_hf_case(case, device))


def _head_targets(arch: str, ids: Any, config: Any) -> dict[str, Any]:
    """The loss's keyword targets of a model's head: the tokens (language models), a label
    per sample or per token (classification), start and end positions (question answering)."""
    import torch

    b, s = ids.shape
    if arch.endswith("ForSequenceClassification"):
        return {"labels": torch.randint(0, config.num_labels, (b,), device=ids.device)}
    if arch.endswith("ForTokenClassification"):
        return {"labels": torch.randint(0, config.num_labels, (b, s), device=ids.device)}
    if arch.endswith("ForQuestionAnswering"):
        pos = torch.randint(0, s, (b,), device=ids.device)
        return {"start_positions": pos, "end_positions": pos.clone()}
    return {"labels": ids}


def profile_comparison(case: Any, rep: Any, bill: Bill) -> Comparison:
    """A fake profile's report against a bill, in the profile's categories."""
    return Comparison(
        case=case,
        measured_peak=rep.peak_bytes,
        measured=dict(rep.at_peak),
        measured_phase=rep.peak_phase,
        measured_step=rep.peak_step,
        bill=bill,
        estimated=bill.profiler_categories(tuple(rep.at_peak)),
        assumptions=list(rep.assumptions),
    )


def _is_moe_config(mtype: str) -> bool:
    return mtype in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def _grouped_mm_any_dtype() -> Any:
    """transformers picks ``torch._grouped_mm`` for experts on CPU, whose fake kernel accepts
    bf16 only; its own fallback op (same saved tensors: the input and the weights) runs any
    dtype. Patched for the duration of the pass."""
    import contextlib
    from unittest import mock

    import torch

    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return contextlib.nullcontext()
    original = moe._can_use_grouped_mm
    return mock.patch.object(
        moe,
        "_can_use_grouped_mm",
        lambda i, w, o: w.dtype == torch.bfloat16 and original(i, w, o),
    )


# --- PEFT-wrapped transformers models (fine-tuning recipes), under fake tensors ----------------


@dataclass(frozen=True)
class PeftCase:
    """A transformers model from a config dict wrapped by PEFT (``get_peft_model`` with a
    ``LoraConfig``), two AdamW steps of its adapters profiled under ``gpumem.fake()`` (the
    adapters keep PEFT's own dtype: fp32 on a 16-bit base), and the same job estimated from the
    dict and a ``FineTune`` recipe.

    Attributes:
        target_modules: PEFT's (names, a regex string or ``"all-linear"``).
        method: ``lora`` or ``dora``; rank, dropout: ``r``, ``lora_dropout``.
    """

    name: str
    config: dict[str, Any]
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    precision: str = "bf16"
    method: str = "lora"
    rank: int = 8
    dropout: float = 0.0
    recompute: bool = False
    batch: int = 2
    seq: int = 256

    def recipe(self) -> Any:
        from gpumem.estimator.finetune import FineTune

        return FineTune(
            method=self.method, rank=self.rank, target_modules=self.target_modules,
            dropout=self.dropout,
        )  # fmt: skip


def peft_model(case: PeftCase) -> Any:
    """``case``'s PEFT-wrapped transformers model on the meta device (PEFT moves its adapters
    with ``.to()``, which fake tensors refuse); the adapters in PEFT's own dtype."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg = dict(case.config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    targets = case.target_modules
    lora = LoraConfig(
        r=case.rank, target_modules=targets if isinstance(targets, str) else list(targets),
        lora_dropout=case.dropout, use_dora=case.method == "dora",
    )  # fmt: skip
    with torch.device("meta"):
        return get_peft_model(
            transformers.AutoModelForCausalLM.from_config(config, dtype=dtype), lora
        )


def estimate_peft_module(case: PeftCase) -> Bill:
    """The nn.Module path's bill of ``case``'s PEFT-wrapped model (its own fake pass)."""
    import torch

    return estimate(
        peft_model(case), batch_size=case.batch, seq_len=case.seq, precision=case.precision,
        device="cpu", framework="torch", training=TrainingKnobs(persistent_grads=False),
        recompute="full" if case.recompute else "none", gpu=find_gpu("H100-80GB", 2**40),
        example_input=lambda b, s: {"input_ids": torch.zeros(b, s, dtype=torch.long)},
    )  # fmt: skip


def compare_peft(case: PeftCase) -> Comparison:
    """Profile ``case`` (the loop of ``compare_hf``, ``logits`` held) and estimate it."""
    import torch
    import torch.nn.functional as F

    from gpumem import profiler
    from gpumem.estimator.module_inputs import fake_copy

    model = peft_model(case)
    vocab = case.config["vocab_size"]
    with profiler.fake():
        net = fake_copy(model, "cpu", None)
        if case.recompute:
            net.gradient_checkpointing_enable({"use_reentrant": False})
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, vocab, (case.batch, case.seq))
        autocast = case.precision == "bf16-autocast"
        with profiler.profile(net, optimizer=opt) as prof:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = net(input_ids=ids).logits
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        rep = prof.report()
    bill = estimate(
        dict(case.config),
        batch_size=case.batch,
        seq_len=case.seq,
        precision=case.precision,
        optimizer="adamw",
        device="cpu",
        framework="torch",
        activations=ActivationKnobs(attention="sdpa"),
        training=TrainingKnobs(persistent_grads=False, finetune=case.recipe()),
        recompute="full" if case.recompute else "none",
        gpu=find_gpu("H100-80GB", 2**40),
    )
    return profile_comparison(case, rep, bill)


PEFT_BASE = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The PEFT sweep's model: proportions of a real one (vocabulary 125x the width), so that the
loss weighs as it does in a real run."""
PEFT_SWEEP: tuple[PeftCase, ...] = tuple(
    PeftCase(f"{prec} {label}", {**PEFT_BASE, **shape}, targets, prec, **kw)
    for prec in ("bf16", "fp32", "bf16-autocast")
    for label, shape, targets, kw in (
        ("q,v r8", {}, ("q_proj", "v_proj"), {}),
        ("all-linear r64", {}, "all-linear", {"rank": 64}),
        ("all-linear ckpt", {}, "all-linear", {"recompute": True}),
        ("attn dora", {}, ("q_proj", "k_proj", "v_proj", "o_proj"), {"method": "dora"}),
        ("mlp dropout", {}, ("gate_proj", "up_proj", "down_proj"), {"dropout": 0.05}),
        ("regex late layers", {"model_type": "qwen2"}, r".*layers\.[23]\..*(q|v)_proj", {}),
        (
            "mistral k,o",
            {"model_type": "mistral", "num_key_value_heads": 1},
            ("k_proj", "o_proj"),
            {},
        ),
        ("qwen3 v", {"model_type": "qwen3", "head_dim": 64}, ("v_proj",), {}),
        ("gemma q,v", {"model_type": "gemma", "head_dim": 64}, ("q_proj", "v_proj"), {}),
        (
            "qwen3 all-linear ckpt",
            {"model_type": "qwen3", "head_dim": 64},
            "all-linear",
            {"recompute": True},
        ),
    )
)
"""Model shapes x target sets x rank x precision: the held-out style sweep of
benchmarks/bench_published.py (``--only finetune``); tests/estimator/test_finetune.py runs a
sample (all behind ``--runslow``)."""


LLAMA_3_2_3B = {
    "model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "head_dim": 128,
}  # fmt: skip
"""Llama 3.2 3B's config.json fields (meta-llama/Llama-3.2-3B; torchtune's ``llama3_2_3b``):
the model of torchtune's published "Optimization flags" table."""
