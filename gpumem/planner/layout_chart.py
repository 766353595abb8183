"""A picture of per-GPU bills: one stacked bar per layout, by category, against the GPU's memory.

``gpumem estimate --plot FILE`` draws the layout asked for beside the planner's best layouts for
the same job on the same number of GPUs, so the cost of a choice is seen at a glance.
matplotlib is imported when a picture is drawn, not with the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumem.estimator import bill as bills
from gpumem.estimator.bill import Bill
from gpumem.estimator.model_spec import ModelSpec
from gpumem.planner.search import plan

# every category of the bill's table, so that a bar is as tall as the table's total
CATEGORIES = tuple(c for c in bills.CATEGORIES if c != "total")
COLORS = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#e15759",
    "activations": "#76b7b2",
    "communication": "#59a14f",
    "temporary": "#edc948",
    "overhead": "#bab0ac",
}
GiB = 2**30


def best_layouts(bill: Bill, n_gpus: int, top: int = 4) -> list[tuple[str, Bill]]:
    """The planner's ``top`` layouts for ``bill``'s job on ``n_gpus`` GPUs, as (label, bill);
    empty for a measured ``nn.Module`` (the planner needs a described model)."""
    if not isinstance(bill.model, ModelSpec):
        return []
    t = bill.training
    result = plan(
        bill.model,
        gpu=bill.gpu,
        n_gpus=n_gpus,
        seq_len=bill.inputs.get("seq_len"),
        precision=t.precision,
        optimizer=t.optimizer,
        grads=t.grads,
        offload_optimizer=t.offload_optimizer,
        deepspeed=t.deepspeed,
        lora_rank=t.lora_rank,
        base_quant=t.base_quant,
    )
    return [
        (f"#{i} {c.describe()}", result.bill(c)) for i, c in enumerate(result.candidates[:top], 1)
    ]


def bills_figure(bills: list[tuple[str, Bill]], title: str = "") -> Any:
    """A matplotlib Figure: one stacked bar per (label, bill) in GiB, the GPU's memory dashed."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(bills) + 2), 5.5))
    x = range(len(bills))
    bottom = [0.0] * len(bills)
    for c in CATEGORIES:
        vals = [b.per_gpu[c] / GiB for _, b in bills]
        ax.bar(x, vals, bottom=bottom, color=COLORS[c], label=c, width=0.6)
        bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    caps = {b.gpu.total_bytes for _, b in bills}
    for cap in caps:
        ax.axhline(cap / GiB, color="red", ls="--", lw=1)
    gpu = bills[0][1].gpu
    ax.text(
        len(bills) - 0.5,
        gpu.total_bytes / GiB,
        f" {gpu.name}: {gpu.total_bytes / GiB:.1f} GiB",
        color="red",
        va="bottom",
        ha="right",
        fontsize=8,
    )
    ax.set_xticks(list(x), [label for label, _ in bills], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_layouts(bill: Bill, path: str | Path, *, n_gpus: int, top: int = 4) -> Path:
    """PNG of ``bill`` (labelled "asked") beside :func:`best_layouts`; returns the path."""
    import matplotlib.pyplot as plt

    bills = [(f"asked: {bill.layout.describe()}", bill), *best_layouts(bill, n_gpus, top)]
    fits = "fits" if bill.fits else "does NOT fit"
    title = (
        f"{bill.model.name} on {n_gpus} x {bill.gpu.name}: the layout asked for ({fits}) and "
        f"the planner's best {len(bills) - 1}"
    )
    fig = bills_figure(bills, title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
