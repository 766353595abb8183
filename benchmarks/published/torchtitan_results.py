"""The torchtitan rows of the published tables: fake profile of torchtitan's own model
(``torchtitan_reference.py``) against ``gpumem.estimate(..., framework="torchtitan")``, written to
``benchmarks/results/torchtitan_reference.md``.

Published figures are peak *reserved* (torchtitan's ``max_reserved_gib``, with torch.compile
and float8 where the table says so); both columns here are peak *allocated* of eager bf16 runs,
so the published figure is context, not a target. Every row runs on the fake group: tensor
parallelism through torchtitan's ``ParallelDims`` and ``model.parallelize``, context parallelism
through its ``apply_cp_to_forward`` (FlexAttention's K/V all-gather).

    python benchmarks/published/torchtitan_results.py [--only ROW]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torchtitan_reference import FLAVORS, profile_flavor  # noqa: E402

import gpumem  # noqa: E402
from gpumem.estimator.resolver import resolve_model  # noqa: E402

GIB = 2**30
RESULT = HERE.parent / "results" / "torchtitan_reference.md"


@dataclasses.dataclass
class Row:
    name: str
    flavor: str
    dp: int
    batch: int
    seq: int
    ac: str
    published: float
    tp: int = 1
    cp: int = 1
    note: str = ""
    loss_chunks: int = 0
    float8: str = ""  # torchtitan_reference.FLOAT8; "" is bf16
    float8_all_gather: bool = False
    compiled_loss: bool = False  # the reserved estimate's loss compiled (titan_compile)


TRAINY = (
    "compile+float8 published; reserved estimate: compiled loss (e7c0cae compiles it), "
    "blocks eager bf16; allocated columns eager"
)
F8 = "float8 tensorwise + FSDP float8 all-gather (the published runs' float8; no compile)"
ROWS = [
    Row("T1 FSDP 8", "8B", 8, 2, 8192, "selective", 82.4),
    Row("T3 FSDP 128", "8B", 128, 2, 8192, "selective", 67.0),
    # e7c0cae's --training.compile compiles the loss (build_cross_entropy_loss): the reserved
    # estimate prices it compiled; its blocks (also compiled) and float8 are priced eager bf16
    Row("Trainy FSDP 32", "8B", 32, 2, 8192, "selective", 47.96, note=TRAINY, compiled_loss=True),
    Row("Trainy FSDP 64", "8B", 64, 2, 8192, "selective", 46.97, note=TRAINY, compiled_loss=True),
    Row("T2 FSDP 8 CP 1", "8B", 8, 1, 32768, "full", 83.9, note="compile+float8 published"),
    Row("T2 FSDP 4 CP 2", "8B", 4, 1, 65536, "full", 84.2, cp=2, note="compile+float8 published"),
    Row("T2 FSDP 2 CP 4", "8B", 2, 1, 131072, "full", 84.0, cp=4, note="compile+float8 published"),
    Row("T2 FSDP 1 CP 8", "8B", 1, 1, 262144, "full", 84.5, cp=8, note="compile+float8 published"),
    Row(
        "T4 FSDP 32 TP 8", "70B", 32, 16, 8192, "full", 71.9, tp=8, note="compile+float8 published"
    ),  # not a published row: Table 1's job under torchtitan 0.3.0's own llama3_8b loss
    Row(
        "T1 + 0.3.0 chunked loss",
        "8B",
        8,
        2,
        8192,
        "selective",
        82.4,
        loss_chunks=8,
        note="ChunkedLossWrapper(8): not the published run's loss",
    ),
    # float8: the published recipe (torchao tensorwise, FSDP float8 all-gather, precomputed
    # scales), and torchtitan 0.3.0's own rowwise recipes
    Row(
        "T1 FSDP 8 float8",
        "8B",
        8,
        2,
        8192,
        "selective",
        76.8,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
    Row(
        "T1 FSDP 8 float8 rowwise",
        "8B",
        8,
        2,
        8192,
        "selective",
        76.8,
        note="0.3.0's rowwise recipe",
        float8="rowwise",
    ),
    Row(
        "T1 FSDP 8 float8 rowwise_with_gw_hp",
        "8B",
        8,
        2,
        8192,
        "selective",
        76.8,
        note="0.3.0's rowwise_with_gw_hp recipe",
        float8="rowwise_with_gw_hp",
    ),
    Row(
        "T3 FSDP 128 float8",
        "8B",
        128,
        2,
        8192,
        "selective",
        61.8,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
    Row(
        "Trainy FSDP 32 float8",
        "8B",
        32,
        2,
        8192,
        "selective",
        47.96,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
    Row(
        "Trainy FSDP 64 float8",
        "8B",
        64,
        2,
        8192,
        "selective",
        46.97,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
    Row(
        "T2 FSDP 8 CP 1 float8",
        "8B",
        8,
        1,
        32768,
        "full",
        83.9,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
    Row(
        "T2 FSDP 1 CP 8 float8",
        "8B",
        1,
        1,
        262144,
        "full",
        84.5,
        cp=8,
        note=F8,
        float8="tensorwise",
        float8_all_gather=True,
    ),
]


def _bill(row: Row, **kw: Any) -> Any:
    """``gpumem.estimate`` of ``row``'s job under ``framework="torchtitan"`` (H100-80GB: ample
    memory, so neither peak depends on the capacity)."""
    spec = resolve_model("llama-3.1-8b" if row.flavor == "8B" else "llama-3.1-70b")
    spec = dataclasses.replace(spec, max_seq=max(spec.max_seq, row.seq))
    return gpumem.estimate(
        spec,
        batch_size=row.batch,
        seq_len=row.seq,
        framework="torchtitan",
        recompute=row.ac,
        layout=gpumem.Layout(dp=row.dp, tp=row.tp, cp=row.cp, fsdp="full", sp=row.tp > 1),
        gpu="H100-80GB",
        loss_chunks=row.loss_chunks,
        fp8_recipe=row.float8 or None,
        fsdp_float8_all_gather=row.float8_all_gather,
        **kw,
    )


def estimate(row: Row) -> tuple[int, str]:
    bill = _bill(row)
    allocated = sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))
    return allocated, bill.phase


def estimate_reserved(row: Row) -> int:
    """The estimate's ``peak_reserved_bytes`` (the caching allocator simulated under default
    settings over torchtitan's step, ``gpumem.estimator.frameworks.titan_trace``), with the loss
    compiled where the row's torchtitan compiled it (``Row.compiled_loss``)."""
    return _bill(row, alloc_conf="", compiled_loss=row.compiled_loss).peak_reserved_bytes or 0


def reference(row: Row) -> Any:
    """The fake profile of torchtitan's own model under ``row``'s settings."""
    return profile_flavor(
        row.flavor,
        world=row.dp,
        batch=row.batch,
        seq=row.seq,
        ac=row.ac,
        tp=row.tp,
        cp=row.cp,
        loss_chunks=row.loss_chunks,
        float8=row.float8,
        float8_all_gather=row.float8_all_gather,
    )


@dataclasses.dataclass
class Measured:
    """One row run: the estimate (allocated bytes, phase) and the fake profile's peak."""

    row: Row
    estimate: int
    phase: str
    reference: int
    seconds: float
    reserved_estimate: int = 0  # the estimate's simulated peak reserved (0: flat share)
    reserved_one_stream: int = 0  # the reference's allocations replayed on one stream
    reserved_streams: int = 0  # ... on the streams FSDP2 entered

    @property
    def error(self) -> float:
        return self.estimate / self.reference - 1

    def line(self) -> str:
        r, est, ref = self.row, self.estimate, self.reference
        return (
            f"| {r.name} | {r.flavor} | {r.batch} × {r.seq} | {r.ac} | "
            f"{ref / GIB:.2f} ({ref:,} B) | {est / GIB:.2f} ({est:,} B, {self.phase}) | "
            f"{self.error:+.4%} | {r.published} | {self.seconds:.0f} | {r.note} |"
        )


def run(only: str | None = None, names: Collection[str] = ()) -> list[Measured]:
    """Every row (or those whose name contains ``only``, or is one of ``names``), each printed
    as it is measured."""
    out = []
    for row in ROWS:
        if (only and only not in row.name) or (names and row.name not in names):
            continue
        est, phase = estimate(row)
        t0 = time.perf_counter()
        r = reference(row)
        seconds = time.perf_counter() - t0
        out.append(
            Measured(
                row,
                est,
                phase,
                r.peak_bytes,
                seconds,
                estimate_reserved(row),
                r.reserved_one_stream_bytes,
                r.reserved_bytes,
            )
        )
        print(out[-1].line(), flush=True)
    return out


def write(measured: list[Measured], out: str | Path = RESULT) -> None:
    """``benchmarks/results/torchtitan_reference.md`` from a run of every row."""
    import torchtitan

    lines = [m.line() for m in measured]
    head = [
        "# torchtitan: fake profile of its own model vs the estimate",
        "",
        "`python benchmarks/published/torchtitan_results.py` (or `benchmarks/bench_published.py`, "
        "which writes this file from the same runs) "
        f"({datetime.date.today().isoformat()}; {platform.machine()}, "
        f"{platform.python_version()}, torch {torch.__version__}, torchtitan "
        f"{getattr(torchtitan, '__version__', '0.3.0')}, 2 CPU cores, no GPU).",
        "",
        "Reference: `benchmarks/published/torchtitan_reference.py`: torchtitan's Llama3 model "
        "(shapes of its `_8b`/`_70b`, vocab 128256), its `SelectiveAC`/`FullAC`, "
        "`apply_fsdp_to_decoder` (bf16 params, fp32 reduce), rank 0 of a fake process group, "
        "two steps (forward, `cross_entropy_loss` on `pred.float()`, `del pred`, backward, "
        "`clip_grad_norm_`, fused AdamW) on fake CPU tensors; attention is the CUDA flash op "
        "(see the script). Peak allocated, GiB; the estimate is `gpumem.estimate(..., "
        "framework='torchtitan')` without the CUDA context/NCCL/fragmentation overhead. "
        "Published: torchtitan's peak *reserved* GiB (with torch.compile, and float8 where "
        "noted), for context only.",
        "",
        "| row | model | batch × seq | AC | fake profile | estimate (phase) | error | "
        "published reserved | reference s | note |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    tail = [
        "",
        "TP rows: torchtitan's `ParallelDims` (legacy `partial_dtensor` backend) and "
        "`model.parallelize` (sequence parallel, loss parallel) on the fake group. CP rows: "
        "torchtitan 0.3.0's CP for its FlexAttention (`apply_cp_to_forward`: K and V "
        "all-gathered along the sequence), not the SDPA ring attention of the published runs. "
        "float8 rows: torchao 0.18's Float8Linear on the blocks' Linears (lm_head filtered, as "
        "the published runs and 0.3.0's 405B recipe), tensorwise through "
        "`convert_to_float8_training` with `enable_fsdp_float8_all_gather` and "
        "`precompute_float8_dynamic_scale_for_fsdp` (what the published runs and Trainy's "
        "command line enable), rowwise through torchtitan's `Float8LinearConverter` (its CUDA "
        "capability check patched: nothing is computed); eager, so the casts' temporaries are "
        "those of torchao's eager code. torch.compile is not run here; the Trainy rows' reserved "
        "estimate (published.md) prices their compiled loss (`compiled_loss=True`, "
        '`gpumem/estimator/frameworks/titan_compile.py`; docs/estimator.md, "torch.compile"); '
        "float8 with TP is not modelled.",
        f"Flavors: {', '.join(FLAVORS)}.",
    ]
    Path(out).write_text("\n".join(head + lines + tail) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="run the rows whose name contains this")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    measured = run(args.only)
    if not args.only:
        write(measured, args.out)


if __name__ == "__main__":
    main()
