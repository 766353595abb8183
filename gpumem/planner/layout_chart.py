"""A picture of per-GPU bills: one stacked bar per layout, by category, against the GPU's memory.

``gpumem estimate --plot FILE`` draws the layout asked for beside the planner's best layouts for
the same job on the same number of GPUs, so the cost of a choice is seen at a glance.
matplotlib is imported when a picture is drawn, not with the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumem._plots import pyplot
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
    """A matplotlib Figure: one stacked bar per (label, bill) in GiB, the GPU's memory dashed.

    The legend (categories and the GPU's memory) stands right of the axes, never over a bar;
    ``title`` may hold line breaks, the figure is laid out around it."""
    plt = pyplot()
    # bars, plus room on the right for the legend (about 2 inches)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(bills) + 4), 5.5))
    x = range(len(bills))
    bottom = [0.0] * len(bills)
    for c in CATEGORIES:
        vals = [b.per_gpu[c] / GiB for _, b in bills]
        ax.bar(x, vals, bottom=bottom, color=COLORS[c], label=c, width=0.6)
        bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    for gpu in {b.gpu.name: b.gpu for _, b in bills}.values():
        label = f"{gpu.name}: {gpu.total_bytes / GiB:.1f} GiB"
        ax.axhline(gpu.total_bytes / GiB, color="red", ls="--", lw=1, label=label)
    ax.set_xticks(list(x), [label for label, _ in bills], rotation=20, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(bills) - 0.4)
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def chart_title(bill: Bill, n_gpus: int, n_best: int) -> str:
    """Two lines: the job, then what the bars are (the planner's best only when there are)."""
    fits = "fits" if bill.fits else "does NOT fit"
    if n_best:
        what = f"the layout asked for ({fits}) beside the planner's best {n_best}"
    elif isinstance(bill.model, ModelSpec):
        what = f"the layout asked for ({fits}); the planner finds no layout that fits"
    else:  # a measured nn.Module: the planner needs a described model
        what = f"the layout asked for ({fits})"
    return f"{bill.model.name} on {n_gpus} x {bill.gpu.name}\n{what}"


def plot_layouts(bill: Bill, path: str | Path, *, n_gpus: int, top: int = 4) -> Path:
    """PNG of ``bill`` (labelled "asked") beside :func:`best_layouts`; returns the path."""
    plt = pyplot()
    best = best_layouts(bill, n_gpus, top)
    bills = [(f"asked: {bill.layout.describe()}", bill), *best]
    fig = bills_figure(bills, chart_title(bill, n_gpus, len(best)))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
