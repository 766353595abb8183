"""torchtitan's mixture of experts: its Qwen3-30B-A3B (``models/qwen3``: ``_30b_a3b``) on FSDP
layouts, the fake profile of torchtitan's own model (``torchtitan_moe_reference.py``) against
``gpumem.estimate(..., framework="torchtitan")``. No published table measures it; the reference
is the independent check. ``bench_published.py --only torchtitan-pp`` writes these rows beside
the pipeline ones.

    python benchmarks/published/torchtitan_moe_results.py
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from torchtitan_moe_reference import FLAVORS, profile_flavor  # noqa: E402

import gpumem  # noqa: E402
from gpumem.estimator.model_spec import ModelSpec  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MoERow:
    name: str
    flavor: str
    dp: int
    batch: int
    seq: int
    ac: str


ROWS = [
    MoERow("Qwen3-30B-A3B FSDP 8 no AC", "30B-A3B", 8, 1, 4096, "none"),
    MoERow("Qwen3-30B-A3B FSDP 8 full AC", "30B-A3B", 8, 2, 8192, "full"),
    MoERow("Qwen3-30B-A3B FSDP 64 layer SAC 2", "30B-A3B", 64, 1, 8192, "selective:2"),
]


def spec(flavor: str, seq: int) -> ModelSpec:
    """torchtitan's flavor as a ModelSpec (what a Qwen3-MoE config.json gives)."""
    dim, n_layers, n_heads, n_kv, head_dim, hidden, experts, top_k, vocab = FLAVORS[flavor]
    return ModelSpec(
        name=f"qwen3-{flavor.lower()}", arch="llama", n_layers=n_layers, hidden=dim,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn=hidden, vocab=vocab,
        max_seq=seq, n_experts=experts, top_k=top_k, qk_norm=True,
    )  # fmt: skip


def allocated(bill: Any) -> int:
    return sum(v for k, v in bill.per_gpu.items() if k not in ("overhead", "total"))


@dataclasses.dataclass
class MoEMeasured:
    row: MoERow
    reference: int
    estimate: int
    phase: str
    seconds: float

    @property
    def error(self) -> float:
        return self.estimate / self.reference - 1


def measure(row: MoERow) -> MoEMeasured:
    start = time.perf_counter()
    ac = row.ac.split(":")[1] if ":" in row.ac else row.ac
    ref = profile_flavor(row.flavor, world=row.dp, batch=row.batch, seq=row.seq, ac=ac)
    bill = gpumem.estimate(
        spec(row.flavor, row.seq), batch_size=row.batch, seq_len=row.seq,
        framework="torchtitan", recompute=row.ac, layout=gpumem.Layout(dp=row.dp),
    )  # fmt: skip
    return MoEMeasured(
        row, ref.peak_bytes, allocated(bill), bill.phase, time.perf_counter() - start
    )


def run() -> list[MoEMeasured]:
    out = []
    for row in ROWS:
        m = measure(row)
        print(f"{row.name}: error {100 * m.error:+.4f} %", flush=True)
        out.append(m)
    return out


if __name__ == "__main__":
    run()
