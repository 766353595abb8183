"""The estimate against what others measured or published, source by source (issue #19):

- **Megatron-LM CI golden values** (real H100/A100 runs,
  `benchmarks/published/megatron_golden.json`): peak allocated and steady allocated of the last
  pipeline stage, `framework="megatron"`;
- **torchtitan** (Tables 1-4, the Trainy rows): the `"torchtitan"` estimate's peak *allocated*
  against the fake-tensor profile of torchtitan's own model with its own parallelize function
  (`benchmarks/published/torchtitan_reference.py`), and its peak *reserved* against that
  run's recorded allocations replayed through the simulator and against the published
  figures (torchtitan's `max_reserved_gib`);
- **transformers** the way `Trainer` trains (`loss = model(**batch, labels=).loss`), measured for
  real on this CPU by `gpumem.profile`, against the default (`transformers`) convention;
- **DeepSpeed**'s published `estimate_zero{2,3}_model_states_mem_needs` outputs (formulas, not
  measurements): reproduced, and gpumem's training-time bill beside them.

    python benchmarks/bench_published.py        # writes benchmarks/results/published.md
    python benchmarks/bench_published.py --only torchtitan   # reruns that section alone
    python benchmarks/bench_published.py --only torchtitan --rows "Trainy FSDP 32,Trainy FSDP 64"
    python benchmarks/bench_published.py --only finetune   # writes results/published_finetune.md
    python benchmarks/bench_published.py --only torchtitan-pp   # pp and MoE: their section

- **fine-tuning** (``--only finetune``, its own results file): torchtune's published "Optimization
  flags" table (Llama 3.2 3B, README) row by row with the recipe's settings, and PEFT-wrapped
  transformers models (``accuracy.PEFT_SWEEP``) against their fake-tensor profile.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from _report import machine_info, value_figure, write_results

sys.path.insert(0, str(Path(__file__).parent / "published"))

GiB = 2**30
MiB = 2**20


ERROR_COLS = [
    "peak GiB (measured)",
    "peak GiB (estimate)",
    "peak error",
    "steady GiB (measured)",
    "steady GiB (estimate)",
    "steady error",
]


def error_cells(r: dict[str, Any]) -> list[str]:
    """A Megatron case's peak and steady figures: measured, estimated, error (GiB, %)."""
    return [
        f"{r['peak'] / GiB:.2f}",
        f"{r['peak_est'] / GiB:.2f}",
        f"{100 * r['peak_err']:+.1f} %",
        f"{r['steady'] / GiB:.2f}",
        f"{r['steady_est'] / GiB:.2f}",
        f"{100 * r['steady_err']:+.1f} %",
    ]


def megatron_rows() -> tuple[list[list[object]], list[float]]:
    import json

    import megatron_check

    cases = json.loads(megatron_check.DATA.read_text())["cases"]
    rows, errors = [], []
    for case in cases:
        r = megatron_check.run_case(case)
        if "error" in r:
            rows.append([r["name"], r["split"], "-", "-", "-", "-", "-", "-", r["error"][:80]])
            continue
        errors += [abs(r["peak_err"]), abs(r["steady_err"])]
        rows.append(
            [
                r["name"],
                r["split"],
                *error_cells(r),
                ", ".join(r["unsupported"])[:60] or "-",
            ]
        )
    return rows, errors


TRAINER_FAMILIES = ("llama", "qwen2", "gemma", "mistral", "qwen2-moe", "gpt2")


def transformers_rows() -> tuple[list[list[object]], list[float]]:
    """Trainer-style training of small transformers models, for real on the CPU, vocabulary and
    width large enough that the loss path matters (as in a real run's proportions)."""
    from gpumem.estimator.accuracy import HF_SWEEP, HFCase, compare_hf

    rows, errors = [], []
    for name in TRAINER_FAMILIES:
        base = dict(HF_SWEEP[name])
        wide = (
            {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 32000}
            if name == "gpt2"
            else {
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 4,
                "vocab_size": 32000,
            }
        )
        config = {**base, **wide}
        for precision in ("fp32", "bf16", "bf16-autocast"):
            case = HFCase(name, config, precision, False, 4, 256, reference="real", loop="trainer")
            c = compare_hf(case)
            errors.append(abs(c.error_pct) / 100)
            rows.append(
                [
                    f"{name} {precision}",
                    c.measured_peak,
                    c.estimated["total"],
                    f"{c.error_pct:+.2f} %",
                    f"{c.measured_phase} / {c.bill.phase}",
                ]
            )
            print(rows[-1], flush=True)
    return rows, errors


def deepspeed_rows() -> list[list[object]]:
    """DeepSpeed's printed t5-3b numbers (docs/code-docs/source/memory.rst) reproduced by
    ``published_estimate``; the counts are DeepSpeed's own (2851M total, 32M largest layer)."""
    from gpumem.estimator.frameworks.deepspeed import published_estimate

    t5 = 2_851_598_336, 32_899_072
    out = []
    for stage, offload, printed in ((2, True, (127.48, 5.31)), (2, False, (127.48, 15.93))):
        cpu, gpu = published_estimate(
            t5[0], stage=stage, num_gpus_per_node=8, offload_optimizer=offload
        )
        out.append(
            [
                f"ZeRO-{stage} offload_optimizer={'cpu' if offload else 'none'}",
                f"{printed[0]:.2f} / {printed[1]:.2f}",
                f"{cpu / GiB:.2f} / {gpu / GiB:.2f}",
            ]
        )
    for offload_param, offload_opt, zero_init, printed in (
        (True, True, True, (71.71, 0.12)),
        (False, True, True, (63.74, 0.79)),
        (False, False, True, (1.47, 6.10)),
        (False, False, False, (127.48, 6.10)),
    ):
        cpu, gpu = published_estimate(
            t5[0],
            stage=3,
            largest_layer_params=t5[1],
            num_gpus_per_node=8,
            offload_optimizer=offload_opt,
            offload_param=offload_param,
            zero_init=zero_init,
        )
        out.append(
            [
                f"ZeRO-3 param={'cpu' if offload_param else 'none'} "
                f"optimizer={'cpu' if offload_opt else 'none'} zero_init={int(zero_init)}",
                f"{printed[0]:.2f} / {printed[1]:.2f}",
                f"{cpu / GiB:.2f} / {gpu / GiB:.2f}",
            ]
        )
    return out


def torchtitan_rows(
    only: str | None = None,
) -> tuple[list[list[object]], list[float], list[tuple[str, float]]]:
    """Each published torchtitan row: the estimate's allocated peak against the fake profile of
    torchtitan's own model under the same settings (``torchtitan_results``; needs the
    ``[published]`` extra and torchao for the float8 rows), and its reserved peak against the
    reference's recorded allocations replayed through the simulator on FSDP2's streams and
    against the published figure; the same runs write ``torchtitan_reference.md``.
    ``only``: the rows so named (comma-separated; ``torchtitan_reference.md`` is then left
    as it is). Returns (rows, allocated errors, (row, reserved error vs published))."""
    try:
        import torchtitan_results
    except ImportError as exc:  # torchtitan is an optional extra
        return [["torchtitan not installed", str(exc)[:80], *["-"] * 7]], [], []
    measured = torchtitan_results.run(names=[n.strip() for n in only.split(",")] if only else ())
    if not only:
        torchtitan_results.write(measured)
    rows, errors, reserved_errors = [], [], []
    for m in measured:
        row = m.row
        errors.append(abs(m.error))
        est_res = m.reserved_estimate
        settings = f"{row.flavor}, {row.batch} x {row.seq}, AC {row.ac}, {row.note or 'eager'}"
        vs_pub = est_res / GiB / row.published - 1 if est_res else 0.0
        if est_res and not row.loss_chunks:
            reserved_errors.append((row.name, vs_pub))
        rows.append(
            [
                row.name,
                f"{m.reference / GiB:.2f}",
                f"{m.estimate / GiB:.2f}",
                f"{100 * m.error:+.4f} %",
                f"{m.reserved_one_stream / GiB:.2f} / {m.reserved_streams / GiB:.2f}",
                f"{est_res / GiB:.2f}" if est_res else "flat share (not simulated)",
                row.published,
                f"{100 * vs_pub:+.1f} %" if est_res else "-",
                settings,
            ]
        )
    return rows, errors, reserved_errors


def titan_section(
    titan: list[list[object]],
    titan_err: list[float],
    titan_res: list[tuple[str, float]],
    rerun: str = "",
) -> str:
    """The torchtitan section of published.md (its own, so that ``--only torchtitan`` can
    replace it alone; ``rerun``: when and at which commit that happened)."""
    from _report import markdown_table

    heading = (
        "## torchtitan (peak allocated: estimate vs fake profile of torchtitan's own model; "
        "peak reserved)"
    )
    return f"""{heading}

{rerun}Allocated: {_share(titan_err)}.

Reserved (`peak_reserved_bytes`, default `PYTORCH_CUDA_ALLOC_CONF`): the estimate simulates
the caching allocator over torchtitan's step in its own allocation order
(`gpumem.estimator.frameworks.titan_trace`: FSDP2's all-gather outputs on its copy-in stream,
the sharded gradients on its reduce-scatter stream, the rest on the default stream; three
steps). The independent check is the reference run's own recorded allocations and frees (two
steps of torchtitan's model on fake tensors), each tagged with the stream FSDP2 entered, replayed
through the same simulator. Published figures are torchtitan's `max_reserved_gib`.
{_reserved_verdict(titan_res)}

Settings assumed (not stated by the tables; torchtitan's train_configs at 9dec370 / e7c0cae):
AdamW (fused), FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, per-op SAC
(`selective`/`op`) for 8B and full AC for Table 2 and 4, `CrossEntropyLoss` on the whole fp32
logits, `zero_grad(set_to_none=True)`, flash SDPA, default allocator settings, no
`empty_cache`; the GPU's capacity does not enter (no row comes near it, so no release-and-retry).
Table 2's CP rows are torchtitan 0.3.0's FlexAttention CP (K/V all-gathered), not the published
ring-attention SDPA. **torch.compile**: Tables 2 and 4 and the Trainy rows were run with
compile and float8. The Trainy rows' torchtitan (e7c0cae, torch 2.8, June 2025) compiles the
loss under `--training.compile` (`build_cross_entropy_loss`): their reserved estimate prices it
compiled (`compiled_loss=True`, `gpumem/estimator/frameworks/titan_compile.py`: the bf16 logits stay
saved, no fp32 logits-sized tensor is made; checked against Inductor's own buffer plan), which
takes the eager estimate's +42 % / +43 % to the figures below; their compiled blocks and
float8 are priced as eager bf16 (not modelled), and their allocated columns are eager (the
fake profile does not compile). Tables 2 and 4 (the paper-era torchtitan, whose `train.py`
`loss_fn` is not compiled; only the blocks are) are priced eager.

{markdown_table(TITAN_COLS, titan)}
"""


TITAN_FIGURE = "torchtitan median |error|"
RESERVED_FIGURE = "torchtitan reserved |error| vs published"


def titan_figures(titan_err: list[float], titan_res: list[tuple[str, float]]) -> list[Any]:
    if not titan_err:
        return []
    figures = [value_figure(TITAN_FIGURE, "%", 100 * statistics.median(titan_err))]
    for name, e in titan_res:
        figures.append(value_figure(f"{RESERVED_FIGURE}, {name}", "%", 100 * abs(e)))
    return figures


def _merge_rows(
    section: str, new: list[list[object]]
) -> tuple[list[list[object]], list[float], list[tuple[str, float]]]:
    """The section's table with the rows of ``new`` (by name) replacing the recorded ones, and
    the errors read back from it (allocated error, reserved vs published columns)."""
    head = "| " + " | ".join(TITAN_COLS) + " |"
    lines = section[section.index(head) :].splitlines()[2:]
    fresh = {str(r[0]): r for r in new}
    rows: list[list[object]] = []
    for line in lines:
        if not line.startswith("| "):
            break
        cells: list[object] = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append(fresh.pop(str(cells[0]), cells))
    if fresh:
        raise SystemExit(f"--rows: no recorded row named {sorted(fresh)} to replace")
    errors = [abs(float(str(r[3]).rstrip(" %")) / 100) for r in rows]
    res = [(str(r[0]), float(str(r[7]).rstrip(" %")) / 100) for r in rows if str(r[7]) != "-"]
    return rows, errors, res


# why a named Megatron-LM case (megatron_named.json, the cases issue #42 names) is not within
# 5 %, per case; a case within 5 % needs none
NAMED_REASONS = {
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading": (
        "under: the estimate moves every offloaded module's saved tensors to the host for "
        "every layer; not modelled, and the likely gap: what offloading still holds on the GPU "
        "(the next module's reload prefetched in backward, a chunk whose offload has not "
        "finished) and the transients of the MTP layer and of the a2a-overlapped "
        "(--overlap-moe-expert-parallel-comm) second micro-batch; the twin case without the "
        "two is within 5 %"
    ),
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph": (
        "steady under by 0.24 GiB: the derived static buffers are 1.0 GiB (14 static inputs "
        "in flight, each 8 MiB of hidden states and the 64 MiB [4, 1, 4096, 4096] attention "
        "mask, and two 8 MiB gradients), and the MLA/MoE runs' steady figures are under "
        "without graphs too (the dsv3 fp8 twin of the moe2.0 case: -7.7 %); the peak is the "
        "capture's, before the first optimizer step (--cuda-graph-warmup-steps 0: no Adam "
        "moments yet)"
    ),
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph": (
        "under by the same 0.11-0.13 GiB in both: the derived static buffers of its 112 graphs "
        "(16 micro-batches x 7 layers) are 35 MiB (13 static inputs in flight of 0.5 MiB "
        "hidden states and a 2 MiB mask, the attention and MoE-router graphs' output "
        "gradients), where the run keeps about 165 MiB beside the rest of the estimate, "
        "1.5 MiB per graph; its memory golden values are those of the config version that "
        "still logged memory, likely a Megatron and Transformer Engine older than the buffer "
        "reuse priced (with every graph's static input made before the capture the peak is "
        "-3.7 %, the capture's)"
    ),
    "moe2.0/dsv3_tp2pp2ep4_cudagraph": (
        "peak under at the capture: it is billed with the 15 static inputs in flight "
        "(Megatron's _get_sample_arguments reuse); a Megatron that makes all 36 graphs' "
        "inputs before the capture (Transformer Engine 2.7 drops the extra ones after it) "
        "holds 1.7 GiB more there: +2.9 % (the attn case then +8.2 %)"
    ),
    "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm": (
        "on 64 GPUs (8 nodes: the smallest its ep 16 x tp 2 x pp 4 allows; the release recipe "
        "naming its nodes was not among the files read; 128 would put the steady figure "
        "25 % under); steady under by 2.2 GiB: the last rank's bf16 weights, fp32 gradients "
        "and optimizer (3 MoE layers, the MTP layer, the output layer and the MTP's copy of "
        "the embedding; the experts unsharded at expert-data-parallel 1) are 28.9 GiB of the "
        "31.1 measured, the rest not identified (DeepEP's buffers are outside the caching "
        "allocator); peak over by 2.6 GiB at the start of backward on the last rank (9 "
        "in-flight MoE-layer forwards, 11.8 GiB, beside the MTP layer's backward and the "
        "output layer's 3.5 GiB weight gradient), not attributed: the routed experts' tokens "
        "are priced at the default imbalance 1.25, and the measured peak itself moved by "
        "1.5 GB over the run as the routing changed (50.3 GB at step 5, 51.8 at step 345)"
    ),
}


def named_rows() -> tuple[list[list[object]], list[float]]:
    """The named Megatron-LM cases (``megatron_named.json``): the error and, beyond 5 %, why."""
    import json

    import megatron_check

    cases = json.loads(megatron_check.DATA.with_name("megatron_named.json").read_text())["cases"]
    rows, errors = [], []
    for case in cases:
        r = megatron_check.run_case(case)
        errors += [abs(r["peak_err"]), abs(r["steady_err"])]
        within = abs(r["peak_err"]) <= 0.05 and abs(r["steady_err"]) <= 0.05
        rows.append(
            [
                r["name"],
                *error_cells(r),
                "within 5 %" if within else NAMED_REASONS.get(r["name"], "no reason recorded"),
            ]
        )
    return rows, errors


def only_megatron_named() -> None:
    """The named Megatron-LM cases alone, to ``published_megatron_named.md/.json``."""
    rows, errors = named_rows()
    cols = [
        "Megatron-LM CI case (H100 golden values)",
        *ERROR_COLS,
        "within 5 %, or why not",
    ]
    notes = f"""
The cases issue #42 names (`benchmarks/published/megatron_named.json`: the arguments and the
golden values, transcribed as `megatron_golden.json` does), estimated with the knobs they use:
`--num-distributed-optimizer-instances` (`dist_opt_instances`), `--pipeline-model-parallel-
layout` (`pipeline_layout`), `--recompute-modules` and `--fine-grained-activation-offloading
--offload-modules` (`recompute_modules`, `offload_modules`), `--cuda-graph-impl
transformer_engine --cuda-graph-scope` and `--cuda-graph-warmup-steps` (`cuda_graph_scope`,
`cuda_graph_warmup_steps`). {_share(errors)}. Before these knobs:
multi_dist_optimizer_instances -15.2 % peak / -29.3 % steady, the offloading cases +18.4 % /
+47.8 % peak; the CUDA-graph cases (every H100 case with `--cuda-graph-impl` whose METRICS
include memory, among the moe/ and moe2.0/ cases read; the moe2.0 case's arguments are its
model and runtime configs merged) attn_cudagraph +21.5 % / -27.2 %, scoped_cudagraph -6.2 % /
-18.6 % (its memory golden values are those of the config version that still logged memory),
dsv3_tp2pp2ep4_cudagraph +26.0 % / -18.0 % (peak / steady). Its twin without graphs (moe2.0
dsv3_tp2pp2ep4_fp8, not a named case) is estimated +8.9 % / -7.7 %. Not here:
deepseek_proxy_mfsdp_v2_ep2_bf16_cg (`--cuda-graph-impl full_iteration` under Megatron-FSDP
with a paged MoE stash: not modelled).

The graphs' static buffers are derived from Transformer Engine's `make_graphed_callables`
(>= 2.7, `_reuse_graph_input_output_buffers`) and Megatron's `TECudaGraphHelper`
(`_get_sample_arguments` reuse): a static input (hidden states and, under `attn`, the bool
attention mask) per graphed layer forward in flight, one set of output gradients per output
signature, the last input gradient; the previous run priced 3 hidden-state tensors per graph
(calibrated): attn_cudagraph then +12.7 % / -10.7 %, scoped_cudagraph +1.7 % / +0.3 %,
dsv3_tp2pp2ep4_cudagraph -3.5 % / +2.9 %. The graphs' own share of the steady figure (measured
minus the estimate without graphs) against the derived buffers: attn_cudagraph 1.23 GiB (1.00
derived; 3 per graph: 0.75), dsv3_tp2pp2ep4_cudagraph 1.46 (1.29; 1.69), scoped_cudagraph 0.16
(0.03; 0.16): the attention mask is most of the first two. A peak the capture decides is labelled so
(`CUDA-graph capture`); with `--cuda-graph-warmup-steps 0` the capture comes before the first
optimizer step (no Adam moments; the attn case). TE's unfused attention holds one s x s
gradient in backward (its softmax's backward works in place), and under expert parallelism
the attention moment's weight gradients are the rank's own experts' (they were all
experts'): the offloading cases moved with these two.

The issue's worst case (-55 %, a custom pipeline layout): the DeepSeek-V3 proxy release run
(mixtral/deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm, layout `Et*2|(tt|)*5t|tmL`: 8
chunks of 1-2 layers, the MTP layer and the loss in the last, on pp 4 = vpp 2), config
256f606 with the golden values of 6042300 (steady and peak at step 9535). No file read names
its node count (the release recipes are not among the stored files); 64 GPUs is the smallest
world its arguments allow (ep 16 x etp 1 must divide tp 2 x dp, times pp 4), the size its
name's original tp1 x pp4 x ep16 layout needs, and the one the steady figure supports (128
puts it 25 % under; no term grows back with more GPUs). Its steady figure is -55 % on 128 GPUs
(-40 % on 64) when the layout is ignored (the default split) and the GPT-2 vocabulary stands
in for its 256k SentencePiece one (nemotron_2_256k, 256,000 pieces): the likely origin of the
-55 %; the vocabulary is most of it (-7 % on 64 GPUs with it and no layout).
"""
    write_results(
        "published_megatron_named",
        "The estimate against Megatron-LM's CI cases that issue #42 names",
        cols,
        rows,
        notes,
        machine_info(),
        figures=[
            value_figure("named megatron median |error|", "%", 100 * statistics.median(errors))
        ],
    )


def only_torchtitan(rows: str | None = None) -> None:
    """Rerun the torchtitan rows (``rows``: those named, comma-separated, the others kept as
    recorded) and replace their section and figures in published.md/.json, leaving the other
    sources' figures as their last full run measured them."""
    import dataclasses
    import json

    from _report import RESULTS

    info = machine_info()
    titan, titan_err, titan_res = torchtitan_rows(rows)
    md, js = RESULTS / "published.md", RESULTS / "published.json"
    text = md.read_text()
    start = text.index("## torchtitan")
    end = text.index("\n## ", start + 1) + 1
    rerun = (
        f"Rerun alone (`bench_published.py --only torchtitan`, {info['date']}, git commit "
        f"{info['git commit']}); the other sections are from the run in the header. "
    )
    fresh = titan_figures(titan_err, titan_res)[1:]  # the rerun rows' reserved, unrounded
    if rows:
        titan, titan_err, titan_res = _merge_rows(text[start:end], titan)
        rerun = (
            f"Rows {rows!r} rerun alone (`bench_published.py --only torchtitan "
            f"--rows {rows!r}`, {info['date']}, git commit {info['git commit']}); the other "
            "rows as last recorded. "
        )
    section = titan_section(titan, titan_err, titan_res, rerun)
    md.write_text(text[:start] + section + "\n" + text[end:])
    record = json.loads(js.read_text())
    if rows:  # the other rows' figures stay as recorded (the table rounds them)
        names = {f.name for f in fresh}
        record["figures"] = [f for f in record["figures"] if f["name"] not in names]
        record["figures"] += [dataclasses.asdict(f) for f in fresh]
    else:
        record["figures"] = [
            f
            for f in record["figures"]
            if not f["name"].startswith((TITAN_FIGURE, RESERVED_FIGURE))
        ]
        record["figures"] += [dataclasses.asdict(f) for f in titan_figures(titan_err, titan_res)]
    js.write_text(json.dumps(record, indent=1) + "\n")
    print(section)


PP_HEADING = "## torchtitan with pipeline parallelism and with MoE (estimate vs fake profile)"
PP_FIGURE = "torchtitan pp max |error|"
MOE_FIGURE = "torchtitan moe |error|"


def recorded_pp_section() -> str:
    """The pp / MoE section as last recorded (``--only torchtitan-pp`` reruns it; a full run
    keeps it), or nothing."""
    from _report import RESULTS

    md = RESULTS / "published.md"
    text = md.read_text() if md.exists() else ""
    if PP_HEADING not in text:
        return ""
    start = text.index(PP_HEADING)
    end = text.find("\n## ", start + 1)
    return text[start : end + 1 if end >= 0 else len(text)]


def recorded_pp_figures() -> list[Any]:
    """The pp / MoE figures as last recorded in published.json (a full run keeps them, as it
    keeps their section)."""
    import json

    from _report import RESULTS, Figure

    js = RESULTS / "published.json"
    record = json.loads(js.read_text()) if js.exists() else {"figures": []}
    keep = (PP_FIGURE, MOE_FIGURE)
    return [Figure(**f) for f in record["figures"] if f["name"].startswith(keep)]


def titan_moe_table() -> tuple[str, list[Any]]:
    """The MoE rows (``torchtitan_moe_results``) as a Markdown table, and their figures."""
    import torchtitan_moe_results
    from _report import markdown_table

    rows, figures = [], []
    for m in torchtitan_moe_results.run():
        r = m.row
        rows.append(
            [r.name, f"{m.reference / GiB:.2f}", f"{m.estimate / GiB:.2f}",
             f"{100 * m.error:+.4f} %", m.phase, f"dp_shard {r.dp}, {r.batch} x {r.seq}, AC {r.ac}"]
        )  # fmt: skip
        figures.append(value_figure(f"{MOE_FIGURE}, {r.name}", "%", 100 * abs(m.error)))
    cols = ["layout", "fake profile GiB", "estimate GiB", "error", "phase", "how"]
    return markdown_table(cols, rows), figures


def only_torchtitan_pp() -> None:
    """torchtitan's pipeline-parallel layouts (``torchtitan_pp_results``), every rank, into
    their own section of published.md and figures of published.json (the rest as recorded)."""
    import dataclasses
    import json

    import torchtitan_pp_results
    from _report import RESULTS, markdown_table

    info = machine_info()
    measured = torchtitan_pp_results.run()
    rows, figures = [], []
    for m in measured:
        r, worst = m.row, max(map(abs, m.errors))
        rows.append(
            [r.name, " / ".join(f"{b / GiB:.2f}" for b in m.reference),
             " / ".join(f"{b / GiB:.2f}" for b in m.estimate), f"{100 * worst:.4f} %",
             f"rank {m.worst}: {m.estimate[m.worst] / GiB:.2f}",
             f"dp_shard {r.dp}, {r.batch} x {r.seq}, AC {r.ac}"]
        )  # fmt: skip
        figures.append(value_figure(f"{PP_FIGURE}, {r.name}", "%", 100 * worst))
    cols = ["layout", "fake profile GiB (rank 0 / 1 / ...)", "estimate GiB (rank 0 / 1 / ...)",
            "max |error| over ranks", "the bill (worst rank)", "how"]  # fmt: skip
    section = f"""{PP_HEADING}

Run alone (`bench_published.py --only torchtitan-pp`, {info["date"]}, git commit
{info["git commit"]}, {info["cpu"]}, torch {info["torch"]}, torchtitan 0.3.0). Peak
allocated of every pipeline rank: the estimate (`gpumem/estimator/frameworks/titan_pipeline.py`,
`titan_schedules.py`) against one rank of torchtitan's own Llama split by its own
`pipeline_module_split` code, parallelized with `apply_fsdp_to_decoder(pp_enabled=True)` and
driven through torch's `PipelineStage`
(`forward_one_chunk`, `backward_one_chunk`, `perform_reduce_grad`) in the order its schedule runs on
that rank, two steps under fake tensors on the fake process group
(`benchmarks/published/torchtitan_pp_reference.py`). Emulated: the sends and receives are not
issued (one process holds one rank; the recv buffers keep their shapes, fake tensors carry no
values) and the first step's metadata inference is replaced by the shapes given (torch's static
mode). No published table measures torchtitan's pipeline memory. Max |error| over every rank of
every layout: {max(f.p50 for f in figures):.4f} %. The reserved figure is not
simulated under pp or MoE (the flat fragmentation share).

{markdown_table(cols, rows)}
"""
    moe_table, moe_figures = titan_moe_table()
    section += f"""
**MoE**: torchtitan 0.3.0's Qwen3-30B-A3B (`_30b_a3b`: 48 blocks, 128 experts of 768, top-8,
vocabulary 151936), FSDP over `dp_shard` ranks, ep = 1, the estimate
(`gpumem/estimator/frameworks/titan_moe.py`, the model described as its `config.json` would)
against the fake profile of torchtitan's own `Qwen3Model` with its `MoE` blocks, AC and
`apply_fsdp_to_decoder` (`benchmarks/published/torchtitan_moe_reference.py`; the router's gate
as CUDA's `autocast(float32)` runs it, the attention the flash kernel). The loss's moment is the
peak in every row (a block's backward, the widest when the logits are small, is checked on the
tests' model: tests/estimator/test_titan_moe.py). Per-op SAC, EP and PP/TP/CP with MoE are not
modelled.

{moe_table}
"""
    figures += moe_figures
    md, js = RESULTS / "published.md", RESULTS / "published.json"
    text = md.read_text()
    if PP_HEADING in text:
        start = text.index(PP_HEADING)
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        at = text.index("## transformers")
        text = text[:at] + section + "\n" + text[at:]
    md.write_text(text)
    record = json.loads(js.read_text())
    record["figures"] = [
        f for f in record["figures"] if not f["name"].startswith((PP_FIGURE, MOE_FIGURE))
    ]
    record["figures"] += [dataclasses.asdict(f) for f in figures]
    js.write_text(json.dumps(record, indent=1) + "\n")
    print(section)


TITAN_COLS = [
    "row",
    "fake profile GiB",
    "estimate GiB",
    "error",
    "reference replayed reserved GiB (one stream / FSDP2 streams)",
    "estimate reserved GiB",
    "published reserved GiB",
    "reserved vs published",
    "how",
]
HF_COLS = ["model, precision", "measured peak (B)", "estimated (B)", "error", "phase (meas / est)"]


def _reserved_verdict(res: list[tuple[str, float]]) -> str:
    """Each row's reserved error against the published figure, and the bounds it meets."""
    if not res:
        return "(torchtitan not installed: no rows.)"
    parts = [f"{name} {100 * e:+.1f} %" for name, e in res]
    t13 = [e for name, e in res if name.startswith(("T1 ", "T3 "))]
    return (
        "Estimate vs published: "
        + "; ".join(parts)
        + ". Tables 1 and 3 within 5 %: "
        + ("yes" if t13 and all(abs(e) <= 0.05 for e in t13) else "NO")
        + "."
    )


def _share(errors: list[float]) -> str:
    if not errors:
        return "none"
    within = sum(e <= 0.05 for e in errors) / len(errors)
    return (
        f"median |error| {100 * statistics.median(errors):.2f} %, "
        f"within 5 % {100 * within:.0f} % ({len(errors)} figures)"
    )


_TT = {"source": "torchtune", "packed": True}
_TT_FULL = {**_TT, "method": "full", "compile_layers": True}
_LOSS = {"compile_loss": True, "loss_chunks": 8}
_TT_LORA = {
    **_TT, **_LOSS, "rank": 64, "lora_attn_modules": ("q_proj", "v_proj", "output_proj"),
    "apply_lora_to_mlp": True, "offload_activations": True,
}  # fmt: skip
TORCHTUNE_ROWS: tuple[tuple[str, float, dict[str, Any] | None, str, str, str], ...] = (
    # (row, published GiB, FineTune fields, optimizer, recompute, what differs)
    ("Baseline", 25.5, None, "adamw", "none", "not priced: unpacked alpaca rows are padded to "
     "each batch's longest sample, which the table does not give"),
    ("+ Packed Dataset", 60.0, {**_TT_FULL, "compile_layers": False}, "adamw", "none", "-"),
    ("+ Compile", 51.0, {**_TT_FULL, "compile_loss": True}, "adamw", "none",
     "the published step saves 9.0 GiB, the estimate 14.0: compiled layers 10.1 (the chunked "
     "row bears them out), the compiled loss 3.9 (measured: it keeps the fp32 logits and two "
     "row statistics, its backward writes one fp32 gradient where eager holds two; that loss "
     "priced eager would be -0.2 %); not found"),
    ("+ Chunked Cross Entropy", 42.9, {**_TT_FULL, **_LOSS}, "adamw", "none",
     "compiled layers' backward priced eager (Inductor fuses its temporaries)"),
    ("+ Activation Checkpointing", 24.9, {**_TT_FULL, **_LOSS}, "adamw", "full", "-"),
    ("+ Fuse optimizer step into backward", 23.1,
     {**_TT_FULL, **_LOSS, "optimizer_in_bwd": True}, "adamw", "full",
     "0.7 GiB under; not found"),
    ("+ Activation Offloading", 21.8,
     {**_TT_FULL, **_LOSS, "optimizer_in_bwd": True, "offload_activations": True}, "adamw",
     "full", "offloading keeps one layer's on the GPU"),
    ("+ 8-bit AdamW", 17.6,
     {**_TT_FULL, **_LOSS, "optimizer_in_bwd": True, "offload_activations": True}, "adam8bit",
     "full", "8-bit state counted (6.08 GiB; bitsandbytes' step allocates nothing); "
     "PagedAdamW8bit keeps it in CUDA managed memory, which active bytes never see (without "
     "it 9.16 GiB, -48 %): the published row holds >= 1.7 GiB more than either reading, "
     "not found (notes)"),
    ("LoRA", 8.5, {**_TT_LORA, "method": "lora", "compile_layers": True}, "adamw", "full",
     "compiled layers priced, no change: the peak is at backward start, where checkpointed "
     "layers keep their inputs; 0.3 GiB over, not found"),
    ("QLoRA", 4.6, {**_TT_LORA, "method": "qlora"}, "adamw", "full",
     "compiled layers priced eager (QLoRA's compiled NF4 dequantization not measured)"),
)  # fmt: skip
"""torchtune's README, "Optimization flags" (full_finetune_single_device then
lora_finetune_single_device, Llama 3.2 3B, batch 2, max_seq_len 4096, bf16, A100; each row on
top of the previous one, LoRA and QLoRA without optimizer_in_bwd or 8-bit AdamW): peak memory
active, GiB. The recipes' fused AdamW (``fused: True``), plain ``CrossEntropyLoss`` until
"+ Chunked Cross Entropy", and the final command's settings for LoRA/QLoRA (rank 64 on q, v,
output_proj and the MLP: ``llama3_2/3B_qlora_single_device``)."""
TORCHTUNE_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}  # fmt: skip
"""Llama 3.1 8B (meta-llama/Llama-3.1-8B config.json)."""
_TT_8B = {
    **_TT, **_LOSS, "rank": 8, "lora_attn_modules": ("q_proj", "v_proj", "output_proj"),
    "apply_lora_to_mlp": True,
}  # fmt: skip
TORCHTUNE_8B_ROWS: tuple[tuple[str, float, dict[str, Any] | None, str, str, str], ...] = (
    ("8B LoRA, 1x 4090", 16.2, {**_TT_8B, "method": "lora", "compile_layers": True}, "adamw",
     "full",
     "settings are llama3_1/8B_lora_single_device's (not stated by the table); compiled "
     "layers priced (no change at backward start)"),
    ("8B QLoRA, 1x 4090", 7.4, {**_TT_8B, "method": "qlora"}, "adamw", "full",
     "settings are llama3_1/8B_qlora_single_device's; compiled layers priced eager (QLoRA)"),
    ("8B LoRA, 1x A6000", 30.3, None, "adamw", "full", "not priced: the same recipe as the "
     "4090 row measured 14 GiB more; its changed settings are not stated"),
    ("8B full finetune, 1x 4090", 18.9, None, "adamw", "full", "not priced: "
     "PagedAdamW8bit keeps its state in CUDA managed memory, outside the allocator's active "
     "bytes (the estimate without it, 18.16 GiB, is -3.9 %; the table does not say so)"),
)  # fmt: skip
"""torchtune's README, "Memory and training speed" (batch 2, packed to 2048 tokens, compile):
the rows whose recipe the table's hardware does not change."""
FT_COLS = ["row", "published GiB", "estimate GiB", "error", "recipe", "what differs"]
PEFT_COLS = [
    "case", "fake profile (B)", "estimated (B)", "error", "phase (meas / est)",
    "nn.Module path (B)", "its error",
]  # fmt: skip


def torchtune_rows() -> tuple[list[list[object]], list[tuple[str, float]]]:
    """Each torchtune row: the estimate's allocated peak (``total - overhead``: torchtune logs
    ``active_bytes``) against the published figure."""
    import gpumem
    from gpumem.estimator.finetune import FineTune
    from gpumem.estimator.knobs import TrainingKnobs

    rows: list[list[object]] = []
    errors = []
    from gpumem.estimator.accuracy import LLAMA_3_2_3B

    tables = [(row, LLAMA_3_2_3B, 4096) for row in TORCHTUNE_ROWS]
    tables += [(row, TORCHTUNE_8B, 2048) for row in TORCHTUNE_8B_ROWS]
    for (name, published, fields, optimizer, recompute, differs), model, seq in tables:
        if fields is None:
            rows.append([name, published, "-", "-", "-", differs])
            continue
        ft = FineTune(**fields)
        bill = gpumem.estimate(
            dict(model), batch_size=2, seq_len=seq, precision="bf16",
            optimizer=optimizer, recompute=recompute, gpu="A100-80GB", alloc_conf=False,
            training=TrainingKnobs(fused=True, finetune=ft),
        )  # fmt: skip
        active = (bill.per_gpu["total"] - bill.per_gpu["overhead"]) / GiB
        err = active / published - 1
        errors.append((name, err))
        rows.append(
            [name, published, f"{active:.2f}", f"{100 * err:+.1f} %", bill.inputs["finetune"],
             differs]
        )  # fmt: skip
    return rows, errors


def peft_rows() -> tuple[list[list[object]], list[float]]:
    """``accuracy.PEFT_SWEEP``: the PEFT-wrapped model's fake profile against the estimate."""
    from gpumem.estimator.accuracy import PEFT_SWEEP, compare_peft, estimate_peft_module

    rows: list[list[object]] = []
    errors = []
    for case in PEFT_SWEEP:
        c = compare_peft(case)
        errors.append(abs(c.error_pct) / 100)
        module = estimate_peft_module(case).profiler_categories()["total"]
        rows.append(
            [case.name, c.measured_peak, c.estimated["total"], f"{c.error_pct:+.2f} %",
             f"{c.measured_phase} / {c.bill.phase}", module,
             f"{100 * (module / c.measured_peak - 1):+.2f} %"]
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows, errors


def only_finetune() -> None:
    """The fine-tuning figures, in results/published_finetune.md/.json."""
    from _report import markdown_table

    info = machine_info()
    tt, tt_err = torchtune_rows()
    pf, pf_err = peft_rows()
    notes = f"""
## PEFT-wrapped transformers models (fake profile of the wrapped model vs the estimate)

The estimate from the config dict and a `FineTune` recipe, and the nn.Module path's bill of the
PEFT-wrapped model itself (`gpumem.estimate(peft_model)`, its own fake pass), against the
profile of two training steps of the wrapped model under fake tensors.

{_share(pf_err)}; largest |error| {100 * max(pf_err):.2f} %. Model: `accuracy.PEFT_BASE`
(Llama, hidden 256, ffn 688, 4 layers, GQA 4/2, vocabulary 32000; Qwen2, Qwen3, Gemma and
Mistral variants), batch 2 x 256 tokens, two AdamW steps of the adapters (PEFT's fp32 adapters on a
bf16 base), the logits held by the loop (`framework="torch"`).

{markdown_table(PEFT_COLS, pf)}

Where the vocabulary is small beside the width (hidden 256 with a vocabulary of 1024, tried
while building this), the peak can move into a layer's forward or into DoRA's backward, which
the peak formula does not price: DoRA on q, v at hidden 256 x 256 tokens is -4.4 %, a frozen
model whose loss is small peaks in a layer's forward (-6.6 %). Real vocabularies put the peak at
the start of backward, as above. DoRA's fake profile itself moves by up to 0.5 % from run to
run (205.0 to 206.0 MB for "bf16 attn dora"; on a 2-layer model with a 1024 vocabulary,
8.32 to 8.84 MB): under fake tensors some of the identities DoRA pushes through its adapter
each call are still alive at the peak in some runs (a collection after each DoRA call does
not settle it); a real run (CPU, with or without `gpumem.profile`) frees them when the call
returns, which is what the estimate prices.

## What the torchtune rows assume

Peak memory *active* (torchtune's `log_memory_stats`: `active_bytes.all.peak`), compared with
the estimate's allocated bytes (total minus the CUDA context and fragmentation). torchtune's
modules are priced as what they save (`docs/estimator.md`, "Fine-tuning"): GQA's k and v
expanded to every head, the attention output made contiguous, `output(h).float()` and the
recipe's `del logits`. The "+ Packed Dataset" row was -10 % under the `torch` convention
(53.8 GiB: transformers' modules, 16-bit logits held): the fp32 logits' log-probabilities and
their gradients (+3.9 GiB), the expanded k and v (+1.75 GiB) and the contiguous output (+1.31
GiB) are torchtune's.

`compile=True` is priced as both of its parts: the compiled loss (`compile_loss`: a chunk's
compiled cross-entropy keeps the 16-bit logits) and the compiled decoder layers
(`compile_layers`, `gpumem/estimator/tune_compiled.py`): what Inductor's partition of torchtune's
`TransformerSelfAttentionLayer` keeps, read from the backward graph Inductor compiles and equal
to it tensor by tensor at six small configurations and at the 3B's and 8B's widths
(`tests/estimator/test_tune_compiled.py`):
`A(4h + 2ad + 2kv + 3f) + 4a + 8` bytes a token, 98,408 for Llama 3.2 3B against eager's
145,512 (the layer input instead of the norms' fp32 copies, no RoPE intermediates, k and v
once, no contiguous attention output, no SiLU output). "+ Compile" went from +11.9 % to
-7.9 % and "+ Chunked Cross Entropy" from +19.9 % to -3.6 %; with full checkpointing a
compiled layer keeps its input only, as eager does, so the later rows move only where a
recomputed layer sets the peak ("+ Activation Checkpointing" +1.4 % to -0.0 %). Not modelled:
Inductor's fused backward kernels (a layer's backward moment is eager's) and QLoRA's compiled
layers (`compile_layers` is refused with QLoRA and DoRA; those rows stay eager). The LoRA rows
price their compiled layers too (measured the same way, `tune_compiled`), which moves nothing:
their peak is at the start of backward, where checkpointed layers keep their inputs only.
What still differs in "+ Compile" is in the unchunked compiled loss (its row).

## 8-bit AdamW: what is modelled, what is measured

bitsandbytes' `PagedAdamW8bit` (`bitsandbytes/optim/optimizer.py`, `Optimizer2State`): two
uint8 states per parameter, an fp32 absmax per block of each (256 values since 0.45, 2048
before: 6.08 or 6.00 GiB for the 3.21 B parameters), fp32 states for tensors under
`min_8bit_size` (4,096: the norms, 1.4 MB); its step (`optimizer_update_8bit_blockwise`)
dequantizes and requantizes block by block in registers and allocates nothing, so no step
temporaries. Paged: every state tensor of at least 1e5 elements comes from `cudaMallocManaged`
wrapped by `torch.frombuffer` (`F.get_paged`), outside the caching allocator: torch's active
and reserved bytes never count it. The estimate bills the state (on the device whenever it fits:
the question a bill answers), 15.23 GiB; without it, what `active_bytes` could see, 9.16 GiB.
The published 17.6 GiB is above both. Term by term from the row before (21.8 published,
21.12 estimated): the bf16 AdamW state (11.97 GiB) goes, the 8-bit one (6.08) comes; the
published step is -4.2 GiB, so the measured run holds at least 1.7 GiB that neither
bitsandbytes' optimizer nor anything the estimate prices allocates (not the
32-bit states, not the absmax, not a step temporary). The 8B full fine-tune row (18.9 GiB on a
24 GiB 4090) matches the other reading (-3.9 % without the state, whose 15 GiB could not fit
beside 15 GiB of weights), so the two rows cannot both follow one rule; a GPU run of the
recipe with `memory_stats` is what would settle it.
"""
    figures = [
        value_figure("peft sweep median |error|", "%", 100 * statistics.median(pf_err)),
        value_figure("peft sweep max |error|", "%", 100 * max(pf_err)),
    ]
    figures += [value_figure(f"torchtune {n} error", "%", 100 * e) for n, e in tt_err]
    write_results(
        "published_finetune",
        "Fine-tuning recipes against torchtune's published table and PEFT-wrapped fake profiles",
        FT_COLS,
        tt,
        notes,
        info,
        figures=figures,
    )


# HF "Model training anatomy" / "Efficient training on a single GPU" (perf_train_gpu_one, the
# 2022 pages): bert-large-uncased as BertForSequenceClassification (2 labels), 512 samples of
# 512 random tokens, the Trainer's defaults (AdamW, max_grad_norm 1, dropout 0.1) on a 16 GB
# V100; "GPU memory occupied" (nvidia-smi) after trainer.train(), with the CUDA context alone
# measured by the same page at 1343 MB (MiB: nvidia-smi's unit)
ANATOMY_CONTEXT_MIB = 1343
_BS4 = "reserved beyond the allocated peak (2022 allocator, cuBLAS) not reached"
_ADAFACTOR = "; transformers' own Adafactor of 2022 priced as torch.optim.Adafactor"
ANATOMY_ROWS: tuple[tuple[str, int, str, int, int, bool, str, str], ...] = (
    # (row, published MiB, precision, batch, grad_accum, checkpointing, optimizer, differs)
    ("vanilla, bs 4", 14949, "fp32", 4, 1, False, "adamw", _BS4),
    ("bs 1, grad accum 4", 8681, "fp32", 1, 4, False, "adamw", "-"),
    ("bs 1, accum 4, checkpointing", 6775, "fp32", 1, 4, True, "adamw", "-"),
    ("fp16, bs 4", 13939, "fp16-autocast", 4, 1, False, "adamw", _BS4),
    ("bs 1, accum 4, checkpointing, fp16", 7275, "fp16-autocast", 1, 4, True, "adamw", "-"),
    ("Adafactor, bs 4", 12295, "fp32", 4, 1, False, "adafactor", _BS4 + _ADAFACTOR),
    ("bs 1, accum 4, checkpointing, fp16, Adafactor", 4847, "fp16-autocast", 1, 4, True,
     "adafactor", _ADAFACTOR[2:]),
    ("8-bit Adam, bs 4", 13085, "fp32", 4, 1, False, "adam8bit",
     _BS4 + "; bitsandbytes 2022: blocks of 2048 (gpumem: 256)"),
    ("bs 1, accum 4, checkpointing, fp16, 8-bit Adam", 5363, "fp16-autocast", 1, 4, True,
     "adam8bit", "bitsandbytes 2022: blocks of 2048 (gpumem: 256)"),
)  # fmt: skip
ANATOMY_COLS = [
    "row", "published MiB", "minus context", "estimate reserved MiB", "error",
    "allocated MiB", "phase", "config.json reserved MiB", "its error", "what differs",
]  # fmt: skip
BERT_LARGE = {
    "model_type": "bert", "architectures": ["BertForSequenceClassification"],
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
}  # fmt: skip
"""bert-large-uncased's config.json, with the head the rows train."""


def anatomy_rows() -> tuple[list[list[object]], list[tuple[str, float]]]:
    """Each row through the nn.Module path (BertForSequenceClassification built on the meta
    device from bert-large-uncased's config, eager attention as in 2022): the simulated
    reserved peak against the published figure minus the page's CUDA context."""
    import torch
    import transformers

    import gpumem
    from gpumem.estimator.gpus import find_gpu
    from gpumem.estimator.knobs import ActivationKnobs, TrainingKnobs

    cfg = transformers.BertConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=30522, num_labels=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # BERT had no SDPA path in 2022
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(cfg)
    gpu = find_gpu(memory="16160MiB")  # the page's nvidia-smi: 16160MiB total
    rows: list[list[object]] = []
    errors = []
    for name, published, precision, bs, accum, ckpt, optimizer, differs in ANATOMY_ROWS:
        ids = torch.zeros(bs, 512, dtype=torch.long)
        job = {
            "precision": precision, "optimizer": optimizer, "grad_accum": accum,
            "recompute": "full" if ckpt else "none", "gpu": gpu, "device": "cuda",
            # the 2022 Trainer: model.zero_grad() kept the gradients (set_to_none=False), and
            # transformers' own AdamW stepped one parameter at a time
            "training": TrainingKnobs(persistent_grads=True, foreach=False),
        }  # fmt: skip
        labels = torch.zeros(bs, dtype=torch.long)
        bill = gpumem.estimate(model, example_input={"input_ids": ids, "labels": labels}, **job)
        described = gpumem.estimate(
            dict(BERT_LARGE), batch_size=bs, seq_len=512,
            activations=ActivationKnobs(attention="eager"), **job,
        )  # fmt: skip
        target = published - ANATOMY_CONTEXT_MIB
        cells = []
        for i, b in enumerate((bill, described)):
            reserved = (b.peak_reserved_bytes or b.allocated_bytes) / MiB
            err = reserved / target - 1
            if i == 0:
                errors.append((name, err))
            cells.append((f"{reserved:.0f}", f"{100 * err:+.1f} %"))
        rows.append(
            [name, published, target, *cells[0], f"{bill.allocated_bytes / MiB:.0f}",
             bill.phase, *cells[1], differs]
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows, errors


def only_anatomy() -> None:
    """HF's training-anatomy rows, in results/published_anatomy.md/.json."""
    from _report import markdown_table

    info = machine_info()
    rows, errs = anatomy_rows()
    notes = f"""
Published: the transformers docs' "Efficient Training on a Single GPU" (2022; its first rows
are the "Model training anatomy" page): bert-large-uncased, `AutoModelForSequenceClassification`
(2 labels), batch of 512-token random sequences, `Trainer` defaults, a 16 GB V100, "GPU memory
occupied" from NVML after `trainer.train()`. The page measures the CUDA context alone at
{ANATOMY_CONTEXT_MIB} MiB; the comparison is the estimate's simulated reserved peak against
the published figure minus that context. Estimated through the nn.Module path
(`gpumem.estimate(model on the meta device, example_input=...)`) with the 2022 run's settings:
eager attention (BERT had no SDPA path), dropout 0.1, gradients kept by `model.zero_grad()`
(`persistent_grads=True`), a per-parameter AdamW (`foreach=False`). The "config.json" columns
price the same job from bert-large-uncased's config with `architectures:
["BertForSequenceClassification"]` and `attention="eager"` (the transformers convention's
rules, no pass of the model), within 0.7-4.3 % of the module path.

{markdown_table(ANATOMY_COLS, rows)}

**The fp16-AMP rows** were -8 % to -21 % (fp32 +1 % to +5 %) because the nn.Module path ran its
fake pass on the CPU's kernels when no GPU is present, and those save other tensors than CUDA's
(measured on a fake-profiled bert-large, `gpumem.profile` under `gpumem.fake()`):

1. CUDA autocast runs softmax in fp32 (its fp32 list; the CPU's autocast leaves it in 16 bits):
   each layer keeps the fp32 probabilities, the bool dropout mask and the fp16 copy the
   probabilities-times-v matmul casts, 7 B per score instead of 5 (+32 MiB a layer at batch 4,
   +768 MiB over 24 layers);
2. CUDA's dropout saves a bool mask, the CPU's its float noise: at fp32 4 B per score instead of
   1 (the +1440 MiB that made the fp32 rows look right), at fp16 2 B instead of 1;
3. with gradient checkpointing under autocast, autocast's cache keeps a 16-bit copy of every
   Linear weight (2 B a parameter, 576 MiB) until the forward ends, when nothing saved holds
   them: the step peaks there (fp16 + checkpointing is above fp32 + checkpointing, as
   published: +500 MiB), a moment the estimate did not have (now `peak.py`'s forward end).

The pass now runs CUDA's choices on the CPU (`profiler.fake.cuda_kernels_on_cpu`), and the
allocated peaks equal a fake profile of the same loop under them (fp32 bs 4 11,803 MiB, fp16
10,505 MiB, fp16 + checkpointing 5,768 MiB against 5,743 estimated). GradScaler holds a few
scalars; the Trainer's AdamW and clipping are the same for both precisions. What is left:
the batch-1 rows are within 2.1 % for either precision (the fp16 + checkpointing row, -8 %
before, is -1.7 %); the batch-4 rows are 8-13 % under for both precisions, fp16 (-13.0 %) more
than fp32 (-7.9 %): their published figures stand 15-20 % above the allocated peak, the
simulated reserved memory adds 4-6 %. At batch 4 each layer's 64 MiB fp32 score tensors (32 MiB
fp16) come and go between segments of other sizes, and the 2022 allocator and cuBLAS (its
workspace and kernels, loaded at the first matmul, after the page measured its context) are
not what the simulator models; not settled without a V100 run.
"""
    figures = [value_figure(f"anatomy {n} error", "%", 100 * e) for n, e in errs]
    write_results(
        "published_anatomy",
        "HF's training-anatomy bert-large rows (fp32 and fp16 AMP) against the estimate",
        ANATOMY_COLS,
        rows,
        notes,
        info,
        figures=figures,
    )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only",
        choices=["torchtitan", "torchtitan-pp", "megatron-named", "finetune", "anatomy"],
        help="rerun this source's section alone (megatron-named, finetune: own results files)",
    )
    ap.add_argument(
        "--rows", default=None, help="with --only torchtitan: rerun these rows (comma-separated)"
    )
    args = ap.parse_args()
    if args.rows and not args.only:
        ap.error("--rows needs --only torchtitan")
    if args.only == "megatron-named":
        only_megatron_named()
        return
    if args.only == "finetune":
        only_finetune()
        return
    if args.only == "torchtitan-pp":
        only_torchtitan_pp()
        return
    if args.only == "anatomy":
        only_anatomy()
        return
    if args.only:
        only_torchtitan(args.rows)
        return
    info = machine_info()
    mega, mega_err = megatron_rows()
    titan, titan_err, titan_res = torchtitan_rows()
    hf, hf_err = transformers_rows()
    ds = deepspeed_rows()
    table = mega
    cols = [
        "Megatron-LM CI case",
        "split",
        *ERROR_COLS,
        "arguments without a counterpart",
    ]
    from _report import markdown_table

    pp_section = recorded_pp_section()
    notes = f"""
**Megatron-LM** (`framework="megatron"`, last pipeline stage, `allocated_bytes`):
{_share(mega_err)}.
The split into a tuned half and a held-out half was fixed in `megatron_golden.json` before any
rule was fitted; the only fitted number is the library workspace (median of the tuned half's
steady residuals: `megatron.WORKSPACE_BYTES`).

{titan_section(titan, titan_err, titan_res)}
{pp_section}## transformers, trained as `Trainer` trains them (real CPU runs, default convention)

{_share(hf_err)}.

{markdown_table(HF_COLS, hf)}

## DeepSpeed's published estimator (t5-3b, 8 GPUs; CPU GB per node / GPU GB per GPU)

These are DeepSpeed's formulas (`estimate_zero2/3_model_states_mem_needs`), reproduced by
`gpumem.estimator.frameworks.deepspeed.published_estimate`; gpumem's `deepspeed` bill follows
what its ZeRO code allocates instead (docs/estimator.md, "DeepSpeed": at ZeRO-2 the 16-bit
gradients live as this rank's partition plus the IPG bucket, not whole).

{markdown_table(["configuration", "DeepSpeed printed", "reproduced"], ds)}
"""
    figures = [
        value_figure("megatron median |error|", "%", 100 * statistics.median(mega_err)),
        value_figure("transformers median |error|", "%", 100 * statistics.median(hf_err)),
    ]
    figures += titan_figures(titan_err, titan_res)
    figures += recorded_pp_figures()
    write_results(
        "published",
        "The estimate against published and measured memory of real training jobs",
        cols,
        table,
        notes,
        info,
        figures=figures,
    )


if __name__ == "__main__":
    main()
