"""gpumem.estimate against Megatron-LM's CI golden values (``megatron_golden.json``).

Each case's ``model_config.yaml`` arguments become one ``gpumem.estimate`` call
(``estimate_kwargs``); arguments with no counterpart are listed per case, never dropped
silently. Compared on the last pipeline stage (the logging rank, world_size - 1):

- peak: ``mem-max-allocated-bytes`` vs the bill's allocated total (total - overhead);
- steady: ``mem-allocated-bytes`` after the optimizer step vs the rank's weights + gradients +
  optimizer (``Bill.model_states``, which carry the library workspace as weights).

    python benchmarks/published/megatron_check.py            # table, medians, shares
    python benchmarks/published/megatron_check.py --workspace # the workspace calibration
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import gpumem
from gpumem.estimator.frameworks.megatron import layer_pattern, layout_chunks

DATA = Path(__file__).with_name("megatron_golden.json")
PLATFORM_GPU = {"dgx_h100": "H100-80GB", "dgx_a100": "A100-80GB"}
GPT2_BPE = 50257  # the GPT-2 BPE vocabulary the CI's --vocab-file names
# arguments that change no memory the estimate models (speed, determinism, fusions of kernels
# that save the same tensors, data and logging)
NEUTRAL = {
    "--transformer-impl",
    "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--vocab-file",
    "--tokenizer-type",
    "--tokenizer-model",
    "--use-flash-attn",
    "--max-position-embeddings",
    "--no-bias-gelu-fusion",
    "--no-rope-fusion",
    "--moe-router-load-balancing-type",
    "--moe-router-dtype",
    "--moe-router-score-function",
    "--moe-router-pre-softmax",
    "--moe-router-group-topk",
    "--moe-router-num-groups",
    "--moe-router-enable-expert-bias",
    "--moe-permute-fusion",
    "--cross-entropy-fusion-impl",
    "--megatron-fsdp-version",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--apply-query-key-layer-scaling",
    "--overlap-moe-expert-parallel-comm",
    "--fp8-format",
    "--kv-channels",
}


def padded_vocab(args: dict[str, Any], tp: int, tokenizer_vocab: int | None = None) -> int:
    """Megatron's ``vocab_size_with_padding``: the tokenizer's size (NullTokenizer adds EOD;
    ``tokenizer_vocab``: a case's SentencePiece model, whose size no argument states) rounded
    up to ``make_vocab_size_divisible_by`` (128) x TP."""
    if tokenizer_vocab is not None:
        v = tokenizer_vocab
    elif "--vocab-size" in args:
        v = int(args["--vocab-size"]) + (
            1 if args.get("--tokenizer-type") == "NullTokenizer" else 0
        )
    else:
        v = GPT2_BPE
    m = int(args.get("--make-vocab-size-divisible-by", 128)) * tp
    return -(-v // m) * m


def estimate_kwargs(
    args: dict[str, Any], gpus: int, tokenizer_vocab: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """One case's arguments as ``gpumem.estimate`` keyword arguments (``model`` a ModelSpec
    dict), and the arguments it could not express."""
    a = dict(args)
    used: set[str] = set()

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        return a.get(key, default)

    tp, pp = get("--tensor-model-parallel-size", 1), get("--pipeline-model-parallel-size", 1)
    cp, ep = get("--context-parallel-size", 1), get("--expert-model-parallel-size", 1)
    etp = get("--expert-tensor-parallel-size")
    dp = gpus // (tp * pp * cp)
    L, h = get("--num-layers"), get("--hidden-size")
    heads = get("--num-attention-heads")
    swiglu = get("--swiglu", False)
    ffn = get("--ffn-hidden-size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    rope = get("--position-embedding-type", "learned_absolute") == "rope"
    rms = get("--normalization", "LayerNorm") == "RMSNorm"
    spec: dict[str, Any] = {
        "name": "megatron-gpt",
        "arch": "llama" if (rope or rms) else "gpt2",
        "n_layers": L,
        "hidden": h,
        "n_heads": heads,
        "ffn": ffn,
        "vocab": padded_vocab(a, tp, tokenizer_vocab),
        "max_seq": get("--seq-length"),
        "tied_embeddings": not get("--untie-embeddings-and-output-weights", False),
        "mlp_act": "swiglu" if swiglu else ("squared_relu" if get("--squared-relu") else "gelu"),
        "bias": not get("--disable-bias-linear", False),
        "qkv_bias": not get("--disable-bias-linear", False),
    }
    used |= {"--make-vocab-size-divisible-by", "--vocab-size"}
    if get("--group-query-attention", False):
        spec["n_kv_heads"] = get("--num-query-groups")
    if get("--kv-channels") and not get("--multi-latent-attention"):
        spec["head_dim"] = get("--kv-channels")
    if get("--qk-layernorm", False):
        spec["qk_norm"] = True
    if get("--multi-latent-attention", False):
        spec.update(
            q_lora_rank=get("--q-lora-rank", 0) or 0,
            kv_lora_rank=get("--kv-lora-rank"),
            qk_nope_dim=get("--qk-head-dim"),
            qk_rope_dim=get("--qk-pos-emb-head-dim"),
            v_head_dim=get("--v-head-dim"),
        )
    if get("--num-experts"):
        spec.update(
            n_experts=get("--num-experts"),
            top_k=get("--moe-router-topk", 2),
            ffn=get("--moe-ffn-hidden-size") or ffn,
            dense_ffn=ffn,
        )
        if get("--moe-shared-expert-intermediate-size"):
            spec.update(n_shared_experts=1, shared_ffn=get("--moe-shared-expert-intermediate-size"))
        if get("--moe-layer-freq") is not None:
            spec["moe_layer_freq"] = layer_pattern(get("--moe-layer-freq"), L)
    if get("--mtp-num-layers"):
        spec["mtp_layers"] = get("--mtp-num-layers")
    vpp = 1
    if get("--num-layers-per-virtual-pipeline-stage"):
        vpp = L // pp // get("--num-layers-per-virtual-pipeline-stage")
    if get("--num-virtual-stages-per-pipeline-rank"):
        vpp = get("--num-virtual-stages-per-pipeline-rank")
    pipeline_layout = get("--pipeline-model-parallel-layout")
    if pipeline_layout:  # its chunks over pp ranks: the virtual stages
        vpp = len(layout_chunks(pipeline_layout)) // pp
    fsdp = get("--use-megatron-fsdp", False)
    strategy = get("--data-parallel-sharding-strategy", "optim_grads_params")
    zero = (
        {"optim_grads_params": 3, "optim_grads": 2, "optim": 1}.get(strategy, 0)
        if fsdp
        else (1 if get("--use-distributed-optimizer", False) else 0)
    )
    layout = gpumem.Layout(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, zero=zero,
        sp=bool(get("--sequence-parallel", False)),
    )  # fmt: skip
    mb, gbs = get("--micro-batch-size"), get("--global-batch-size")
    granularity = get("--recompute-granularity")
    recompute = "none"
    if granularity == "full":
        n = get("--recompute-num-layers", 1)
        recompute = "full" if n == 1 or get("--recompute-method") == "block" else f"every-{n}"
        used.add("--recompute-method")
    elif granularity == "selective":
        recompute = "selective"
    unfused = get("--attention-backend", "auto") == "unfused"
    fused_ops = ["norm", "swiglu", "rope"]
    if get("--cross-entropy-loss-fusion", False):
        fused_ops.append("ce")
    optimizer = get("--optimizer", "adam")
    kw: dict[str, Any] = {
        "model": spec,
        "batch_size": mb,
        "seq_len": get("--seq-length"),
        "precision": "fp16-mixed" if get("--fp16", False) else "bf16-mixed",
        "optimizer": optimizer,
        "framework": "megatron",
        "layout": layout,
        "grad_accum": gbs // (mb * dp),
        "recompute": recompute,
        "attention": "eager" if unfused else "flash",
        "dropout": get("--attention-dropout", 0.1),
        "hidden_dropout": get("--hidden-dropout", 0.1),
        "fused_ops": tuple(fused_ops),
        "gpu": "H100-80GB",
    }
    used |= {"--bf16", "--fp16", "--use-mcore-models"}
    if get("--num-experts"):
        kw["moe_dispatcher"] = get("--moe-token-dispatcher-type", "allgather")
        if kw["moe_dispatcher"] == "flex":  # DeepEP's buffers are its own cudaMalloc (and
            # NVSHMEM), outside the caching allocator; what it saves is alltoall's
            kw["moe_dispatcher"] = "alltoall"
            used.add("--moe-enable-deepep")
        kw["moe_grouped_gemm"] = bool(get("--moe-grouped-gemm", False))
        kw["moe_imbalance"] = 1.0 if ep == 1 else gpumem.estimator.preset.MOE_IMBALANCE
    if get("--fp8-format"):
        kw["fp8_recipe"] = get("--fp8-recipe", "delayed")
        kw["fp8_param_gather"] = bool(get("--fp8-param-gather", False))
    if get("--defer-embedding-wgrad-compute", False):
        kw["defer_embedding_wgrad"] = True
        kw["wgrad_deferral_limit"] = get("--wgrad-deferral-limit", 0)
    if get("--decoder-first-pipeline-num-layers") is not None:
        kw["pipeline_first_layers"] = get("--decoder-first-pipeline-num-layers")
    if get("--decoder-last-pipeline-num-layers") is not None:
        kw["pipeline_last_layers"] = get("--decoder-last-pipeline-num-layers")
    if get("--account-for-embedding-in-pipeline-split", False):
        kw["pipeline_split_embedding"] = True
    if get("--account-for-loss-in-pipeline-split", False):
        kw["pipeline_split_loss"] = True
    if pipeline_layout:
        kw["pipeline_layout"] = pipeline_layout
    if get("--recompute-modules"):
        kw["recompute_modules"] = tuple(get("--recompute-modules"))
    if get("--fine-grained-activation-offloading", False):
        kw["offload_modules"] = tuple(get("--offload-modules", ["core_attn"]))
    if get("--cuda-graph-impl") == "transformer_engine":
        scope = get("--cuda-graph-scope") or ["attn", "mlp", "moe"]  # empty: the whole layer
        kw["cuda_graph_scope"] = tuple([scope] if isinstance(scope, str) else scope)
        if get("--cuda-graph-warmup-steps") is not None:
            kw["cuda_graph_warmup_steps"] = get("--cuda-graph-warmup-steps")
    if get("--num-distributed-optimizer-instances", 1) > 1:
        kw["dist_opt_instances"] = get("--num-distributed-optimizer-instances")
    unsupported = sorted(k for k in a if k not in used and k not in NEUTRAL)
    return kw, unsupported


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    kw, unsupported = estimate_kwargs(case["args"], case["gpus"], case.get("tokenizer_vocab"))
    kw["gpu"] = PLATFORM_GPU[case["platform"]]
    name = case["name"] + ("" if case["platform"] == "dgx_h100" else f" ({case['platform']})")
    row: dict[str, Any] = {"name": name, "split": case["split"], "unsupported": unsupported}
    try:
        bill = gpumem.estimate(kw.pop("model"), **kw)
    except (ValueError, LookupError) as exc:
        row["error"] = str(exc)
        return row
    last = bill.pipeline_ranks[-1] if bill.pipeline_ranks else bill
    p = last.per_gpu
    row["peak_est"] = p["total"] - p["overhead"]
    row["steady_est"] = last.model_states["total"]
    # everything but the calibrated constant (what --workspace takes the median of)
    row["states_est"] = row["steady_est"] - int(
        gpumem.estimator.frameworks.megatron.WORKSPACE_BYTES
    )
    row["phase"] = last.phase
    for what in ("peak", "steady"):
        row[what] = case[what]
        row[f"{what}_err"] = row[f"{what}_est"] / case[what] - 1
    return row


def summary(rows: list[dict[str, Any]]) -> str:
    """Median |error| and the share within 5 %: peak and steady together, then each."""
    ok = [r for r in rows if "error" not in r]

    def stats(whats: tuple[str, ...]) -> str:
        errs = [abs(r[f"{w}_err"]) for r in ok for w in whats]
        if not errs:
            return "none"
        within = sum(e <= 0.05 for e in errs) / len(errs)
        return (
            f"median |error| {100 * statistics.median(errs):.1f} %, within 5 % {100 * within:.0f} %"
        )

    refused = [r["name"] for r in rows if "error" in r]
    return (
        f"{len(ok)}/{len(rows)} estimated{f' (refused: {refused})' if refused else ''}; "
        f"both: {stats(('peak', 'steady'))}; peak: {stats(('peak',))}; "
        f"steady: {stats(('steady',))}"
    )


def main(argv: list[str]) -> int:
    data = json.loads(DATA.read_text())
    rows = [run_case(c) for c in data["cases"]]
    gib = 2**30
    print(f"{'case':<78}{'split':>8}{'peak GiB':>10}{'est':>8}{'err':>7}"
          f"{'steady':>8}{'est':>8}{'err':>7}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<78}{r['split']:>8}  REFUSED: {r['error']}")
            continue
        print(
            f"{r['name']:<78}{r['split']:>8}{r['peak'] / gib:>10.2f}{r['peak_est'] / gib:>8.2f}"
            f"{100 * r['peak_err']:>+6.1f}%{r['steady'] / gib:>8.2f}{r['steady_est'] / gib:>8.2f}"
            f"{100 * r['steady_err']:>+6.1f}%"
        )
        if r["unsupported"]:
            print(f"{'':<8}not modelled: {', '.join(r['unsupported'])}")
    for split in ("tune", "holdout"):
        print(f"{split:>8}: {summary([r for r in rows if r['split'] == split])}")
    print(f"{'all':>8}: {summary(rows)}")
    if "--workspace" in argv:
        tuned = [r for r in rows if r["split"] == "tune" and "error" not in r]
        gaps = sorted(r["steady"] - r["states_est"] for r in tuned)
        print(f"steady - the rest over the tuned half (MiB): {[round(g / 2**20) for g in gaps]}")
        print(f"median: {int(statistics.median(gaps))} B")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
