"""HF's training-anatomy bert-large rows under fp16 AMP (issue #42): what CUDA runs that a
fake pass on the CPU's kernels did not see, on a small BERT through the nn.Module path.

- CUDA autocast runs softmax in fp32 (the CPU's autocast leaves it in 16 bits): eager
  attention keeps the fp32 probabilities and the 16-bit copy the probabilities-times-v matmul
  casts, 4 B per score more than the CPU's one 16-bit tensor (derived by hand below);
- with gradient checkpointing under autocast, autocast's cache holds a 16-bit copy of every
  Linear weight until the forward ends (nothing saved keeps them): 2 B per Linear weight,
  the step's peak when gradients persist (``peak.py``'s forward end).

The references are hand counts and ``gpumem.profile`` of a training loop under fake tensors
with the same CUDA kernels (``profiler.fake.cuda_kernels_on_cpu``).
"""

import pytest

pytest.importorskip("transformers")

import torch

import gpumem
from gpumem.estimator.knobs import TrainingKnobs

H, LAYERS, HEADS, FFN, SEQ, BATCH, VOCAB = 256, 4, 4, 1024, 256, 2, 1024


def _bert(dropout: float):
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=2,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _estimate(cfg, precision: str, recompute: str, device: str = "cuda", seq: int = SEQ):
    import transformers

    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(cfg)
    ids = torch.zeros(BATCH, seq, dtype=torch.long)
    return gpumem.estimate(
        model, example_input={"input_ids": ids, "labels": torch.zeros(BATCH, dtype=torch.long)},
        precision=precision, recompute=recompute, device=device, alloc_conf=False,
        training=TrainingKnobs(persistent_grads=True, foreach=False),
    )  # fmt: skip


def _profile(cfg, precision: str, recompute: bool) -> int:
    """Two Trainer-like steps (loss inside the model, clipping, AdamW one parameter at a time,
    gradients kept by ``zero_grad(set_to_none=False)``) profiled under fake tensors."""
    import transformers

    from gpumem import profiler
    from gpumem.profiler.fake import cuda_kernels_on_cpu

    with profiler.fake(), cuda_kernels_on_cpu():
        model = transformers.BertForSequenceClassification(cfg)
        model.train()
        if recompute:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        labels = torch.zeros(BATCH, dtype=torch.long)
        with profiler.profile(model, optimizer=opt) as prof:
            for _ in range(2):
                amp = precision == "fp16-autocast"
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=False)
        return prof.report().peak_bytes


def test_cuda_softmax_is_fp32_under_autocast():
    """Dropout off: on CUDA each layer saves the fp32 softmax output (4 B a score) and the
    matmul's fp16 cast of it (2 B); the CPU's autocast saves one fp16 tensor (2 B)."""
    cfg = _bert(0.0)
    cuda = _estimate(cfg, "fp16-autocast", "none", "cuda")
    cpu = _estimate(cfg, "fp16-autocast", "none", "cpu")
    scores = BATCH * HEADS * SEQ * SEQ
    diff = cuda.per_gpu["activations"] - cpu.per_gpu["activations"]
    assert diff == LAYERS * scores * (4 + 2 - 2)


def test_autocast_cache_under_checkpointing_is_the_forward_end():
    cfg = _bert(0.1)
    bill = _estimate(cfg, "fp16-autocast", "full", seq=64)  # short: the copies dominate
    # the checkpointed layers' Linear weights and biases (q, k, v, o, intermediate, output);
    # the pooler's and classifier's copies are saved by their matmuls (activations)
    linear = LAYERS * (4 * H * H + 2 * H * FFN + 5 * H + FFN)
    assert bill.phase == "forward end"
    assert abs(bill.per_gpu["temporary"] - 2 * linear) <= 0.01 * 2 * linear
    fp32 = _estimate(cfg, "fp32", "full", seq=64)
    assert fp32.phase != "forward end"


@pytest.mark.parametrize(
    ("precision", "recompute"),
    [("fp32", False), ("fp16-autocast", False), ("fp16-autocast", True)],
)
def test_module_path_matches_a_fake_profile_with_cuda_kernels(precision, recompute):
    cfg = _bert(0.1)
    bill = _estimate(cfg, precision, "full" if recompute else "none")
    measured = _profile(cfg, precision, recompute)
    # under checkpointing the recomputed layer's own moment is the sweep's 3 % (-2.1 % here);
    # the CPU's kernels were +8.2 %, -2.6 % and -4.8 %
    bound = 0.03 if recompute else 0.01
    assert abs(bill.allocated_bytes / measured - 1) < bound, (bill.per_gpu, measured)


@pytest.mark.parametrize(
    ("precision", "kernels", "dropout"),
    [("fp16-autocast", "cuda", 0.1), ("fp16-autocast", "cuda", 0.0), ("fp32", "cuda", 0.1),
     ("bf16-autocast", "cpu", 0.1), ("fp32", "cpu", 0.0)],
)  # fmt: skip
def test_config_eager_attention_matches_its_fake_profile(precision, kernels, dropout):
    """A BERT config.json with ``attention="eager"`` (transformers' ``eager_attention_forward``)
    against the fake profile of the model transformers builds, per category within the
    sweep's bound; ``kernels="cuda"``: a CUDA job (fp32 softmax under autocast, bool dropout
    masks), profiled with CUDA's kernels on the CPU."""
    from gpumem.estimator.accuracy import (
        HF_SWEEP,
        PROFILER_CATEGORIES,
        HFCase,
        compare_hf,
        within_tolerance,
    )

    cfg = {**HF_SWEEP["bert"], "hidden_dropout_prob": dropout}
    cfg["attention_probs_dropout_prob"] = dropout
    case = HFCase("bert-eager", cfg, precision, False, attention="eager", kernels=kernels)
    c = compare_hf(case)
    for k in PROFILER_CATEGORIES:
        assert within_tolerance(c.measured.get(k, 0), c.estimated.get(k, 0)), k
    assert abs(c.error_pct) < 1.0


def test_config_path_has_the_forward_end_too():
    """The described model's bill (a BERT config.json) under fp16 AMP and full recompute with
    persistent gradients: the forward's end, autocast's copies of every layer's Linear weights
    (hand count), and the nn.Module path's measured bill of the same BertForMaskedLM within 1 %."""
    import transformers

    cfg = {
        "model_type": "bert", "hidden_size": H, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "intermediate_size": FFN, "vocab_size": VOCAB,
        "max_position_embeddings": SEQ, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
    }  # fmt: skip
    knobs = TrainingKnobs(persistent_grads=True, foreach=False)
    kw = {"precision": "fp16-autocast", "recompute": "full", "alloc_conf": False}
    kw["training"] = knobs
    bill = gpumem.estimate(dict(cfg), batch_size=1, seq_len=64, **kw)
    assert bill.phase == "forward end"
    assert bill.per_gpu["temporary"] == LAYERS * (4 * H * H + 2 * H * FFN) * 2
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(transformers.BertConfig(**fields))
    ids = torch.zeros(1, 64, dtype=torch.long)
    measured = gpumem.estimate(model, example_input={"input_ids": ids, "labels": ids}, **kw)
    assert measured.phase == "forward end"
    assert abs(bill.allocated_bytes / measured.allocated_bytes - 1) < 0.01
