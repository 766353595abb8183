"""torchtitan with pipeline parallelism: every pipeline rank of a few layouts, the fake profile
of torchtitan's own split model driven in its schedule's order (``torchtitan_pp_reference.py``)
against ``gpumem.estimate(..., framework="torchtitan")``'s bill of that rank.

No published table measures torchtitan's pipeline memory, so these rows are layouts of the kind
its train_configs run (Llama 3.1 8B and 70B, 8192 tokens, local batch = micro-batches of 1);
the reference is the independent check. ``bench_published.py --only torchtitan-pp`` writes them
into ``benchmarks/results/published.md``.

    python benchmarks/published/torchtitan_pp_results.py [--only ROW]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torchtitan_pp_reference import profile_pp_step  # noqa: E402
from torchtitan_reference import FLAVORS  # noqa: E402

import gpumem  # noqa: E402
from gpumem.estimator.resolver import resolve_model  # noqa: E402

GIB = 2**30
MODELS = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}


@dataclasses.dataclass(frozen=True)
class PPRow:
    name: str
    flavor: str
    dp: int  # FSDP ranks of each stage
    pp: int
    schedule: str
    batch: int  # the local batch: batch micro-batches of 1
    seq: int
    ac: str  # torchtitan's policy: none, selective, full, selective:N


ROWS = [
    PPRow("8B PP 2 1F1B SAC", "8B", 4, 2, "1F1B", 4, 8192, "selective"),
    PPRow("8B PP 4 1F1B SAC", "8B", 8, 4, "1F1B", 8, 8192, "selective"),
    PPRow("8B PP 4 1F1B full AC", "8B", 8, 4, "1F1B", 8, 8192, "full"),
    PPRow("8B PP 4 1F1B no AC", "8B", 8, 4, "1F1B", 8, 8192, "none"),
    PPRow("8B PP 4 1F1B layer SAC 2", "8B", 8, 4, "1F1B", 8, 8192, "selective:2"),
    PPRow("8B PP 2 Interleaved1F1B SAC", "8B", 4, 2, "Interleaved1F1B", 4, 8192, "selective"),
    PPRow("8B PP 4 Interleaved1F1B full AC", "8B", 8, 4, "Interleaved1F1B", 8, 8192, "full"),
    PPRow("8B PP 4 GPipe SAC", "8B", 8, 4, "GPipe", 8, 8192, "selective"),
    PPRow("70B PP 8 1F1B full AC", "70B", 4, 8, "1F1B", 16, 8192, "full"),
]


def estimate(row: PPRow) -> Any:
    """The bill (its ``pipeline_ranks``: one per rank)."""
    spec = dataclasses.replace(resolve_model(MODELS[row.flavor]), max_seq=row.seq)
    return gpumem.estimate(
        spec,
        batch_size=row.batch,
        seq_len=row.seq,
        framework="torchtitan",
        recompute=row.ac,
        layout=gpumem.Layout(dp=row.dp, pp=row.pp),
        pp_schedule=row.schedule,
    )


def allocated(bill: Any) -> int:
    return sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))


@dataclasses.dataclass
class PPMeasured:
    row: PPRow
    reference: list[int]  # each rank's fake-profile peak allocated
    estimate: list[int]  # each rank's estimated allocated
    worst: int  # the bill's rank (its worst)
    seconds: float

    @property
    def errors(self) -> list[float]:
        return [e / r - 1 for e, r in zip(self.estimate, self.reference, strict=True)]


def measure(row: PPRow) -> PPMeasured:
    dim, n_layers, n_heads, n_kv, mult, multiple_of = FLAVORS[row.flavor]
    ac = row.ac.split(":")[1] if ":" in row.ac else row.ac
    start = time.perf_counter()
    ref = [
        profile_pp_step(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            ffn_dim_multiplier=mult, multiple_of=multiple_of, world=row.dp, pp=row.pp,
            pp_rank=r, schedule=row.schedule, n_microbatches=row.batch, seq=row.seq, ac=ac,
        ).peak_bytes
        for r in range(row.pp)
    ]  # fmt: skip
    bill = estimate(row)
    est = [allocated(b) for b in bill.pipeline_ranks]
    return PPMeasured(row, ref, est, bill.stage, time.perf_counter() - start)


def run(names: list[str] | None = None) -> list[PPMeasured]:
    out = []
    for row in ROWS:
        if names and row.name not in names:
            continue
        m = measure(row)
        print(f"{row.name}: max |error| {100 * max(map(abs, m.errors)):.4f} %", flush=True)
        out.append(m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="rows by name, comma-separated")
    args = ap.parse_args()
    for m in run(args.only.split(",") if args.only else None):
        print(m.row.name, [f"{r / GIB:.2f}" for r in m.reference], m.errors)


if __name__ == "__main__":
    main()
