"""torchtitan's compiled loss (``estimator.frameworks.titan_compile``) against Inductor itself.

Two independent references: AOTAutograd's min-cut partitioner (the one Inductor uses) with
Inductor's decompositions, on fake tensors at Llama 3's real vocabulary (what the forward
saves); and Inductor's generated wrapper code on CPU at a small shape, its buffer plan replayed
(what the forward keeps and the backward allocates, and when each buffer dies).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import gpumem
from gpumem.estimator import peak
from gpumem.estimator.frameworks import torchtitan as tt
from gpumem.estimator.frameworks.titan_compile import compiled_loss_bwd, compiled_loss_saved
from gpumem.estimator.resolver import resolve_model


def titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``cross_entropy_loss`` (components/loss.py, e7c0cae)."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_partitioner_saves_the_logits_and_row_statistics_at_llama3_vocab() -> None:
    from functorch.compile import aot_function, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, s, v = 2, 8192, 128256
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    f = aot_function(
        titan_loss,
        fw_compiler=keep,
        bw_compiler=keep,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    with FakeTensorMode():
        pred = torch.empty(b, s, v, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.empty(b, s, dtype=torch.int64)
        f(pred, labels)
    fw = graphs[0]
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    saved = [n.meta["val"] for n in out[1:]]  # out[0] is the loss
    n = b * s
    # the primals (pred, labels) are saved as themselves; the rest are new buffers
    primal_bytes = sorted(_nbytes(t) for t in saved if t.dim() >= 2 and t.shape[-1] == v)
    assert primal_bytes == [compiled_loss_saved(n, v)["logits"]]
    new = sorted(
        _nbytes(t) for t in saved if not (t.shape == pred.shape or t.shape == labels.shape)
    )
    want = compiled_loss_saved(n, v)
    assert new == sorted([want["row_max"], want["row_lse"], want["weight"]])
    # nothing fp32 logits-sized is saved (eager keeps log-softmax's 4 B per logit)
    assert max(new) < n * v


_ALLOC = re.compile(r"^\s*(buf\d+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
_REUSE = re.compile(r"^\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)[,;]")
_DEL = re.compile(r"\bdel (buf\d+)")


def buffer_plan(code: str) -> tuple[list[int], int, set[str]]:
    """Inductor's wrapper ``call``: (each new buffer's bytes in order, the peak of the live
    buffers' bytes, the buffers it returns), aliases (``# reuse``, ``reinterpret_tensor``)
    followed to their storage."""
    call = code[code.index("def call(self, args)") :]
    call = call[: call.index("\n\n")]
    size: dict[str, int] = {}
    alias: dict[str, str] = {}
    live: set[str] = set()
    order: list[int] = []
    top = 0
    for line in call.splitlines():
        if m := _ALLOC.match(line):
            dims = [int(d) for d in m.group(2).split(",") if d.strip()]
            size[m.group(1)] = math.prod(dims) * getattr(torch, m.group(3)).itemsize
            live.add(m.group(1))
            order.append(size[m.group(1)])
            top = max(top, sum(size[b] for b in live))
        elif m := _REUSE.match(line):
            alias[m.group(1)] = alias.get(m.group(2), m.group(2))
        for d in _DEL.findall(line):
            if d in live and not (d in alias.values() and line.strip().endswith("# reuse")):
                live.discard(d)
        if line.strip().startswith("return"):
            names = set(re.findall(r"buf\d+", line))
            return order, top, {alias.get(x, x) for x in names}
    raise AssertionError("no return in Inductor's wrapper")


def test_inductor_buffer_plan_equals_the_model() -> None:
    from torch._inductor.utils import run_and_get_code

    b, s, v = 2, 64, 1000
    n = b * s
    pred = torch.randn(b, s, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    compiled = torch.compile(titan_loss, backend="inductor", fullgraph=True)

    def step() -> torch.Tensor:
        loss = compiled(pred, labels)
        loss.backward()
        return loss

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    assert len(codes) == 2, "one forward and one backward graph"
    fw_order, _, fw_out = buffer_plan(codes[0])
    bw_order, bw_top, bw_out = buffer_plan(codes[1])
    want = compiled_loss_saved(n, v)
    stats = sorted([want["row_max"], want["row_lse"], want["weight"]])
    # the forward: nothing logits-sized; what it returns beside the loss is the statistics
    assert max(fw_order) < n * v
    fw_sizes = dict(zip(re.findall(r"(buf\d+) = empty_strided", codes[0]), fw_order, strict=True))
    kept = sorted(fw_sizes[x] for x in fw_out if x in fw_sizes)
    assert sorted(kept) == sorted([*stats, 4])  # + the loss itself (a 4 B scalar)
    assert "primals_1" in codes[0].split("return (")[-1]  # the bf16 logits are saved
    # the backward: a per-row buffer, then the gradient, both alive at the kernel
    assert tuple(bw_order) == compiled_loss_bwd(n, v)
    assert bw_top == sum(compiled_loss_bwd(n, v))
    assert len(bw_out) == 1 and pred.grad is not None and _nbytes(pred.grad) == bw_order[-1]


def _terms(compiled: bool, **kw: object) -> list[float]:
    spec = dataclasses.replace(resolve_model("llama-3.1-8b"), max_seq=8192)
    return tt.terms(
        spec,
        gpumem.estimator.states.Training(precision="bf16-mixed"),
        gpumem.Layout(dp=kw.pop("dp", 32), fsdp="full"),  # type: ignore[arg-type]
        gpumem.estimator.gpus.find_gpu("H100-80GB"),
        batch=2,
        seq=8192,
        recompute="selective",
        cuda=False,
        compiled_loss=compiled,
        **kw,  # type: ignore[arg-type]
    )


def test_compiled_loss_terms_by_hand() -> None:
    eager, comp = _terms(False), _terms(True)
    n, v = 2 * 8192, 128256
    # saved: log-softmax's 4 B per logit become the logits' 2 B and 8 B per row
    assert comp[peak.A_LAST] - eager[peak.A_LAST] == -4 * n * v + 2 * n * v + 8 * n
    # the loss backward: two fp32 logits-sized gradients become a row buffer and the gradient
    assert eager[peak.T_BWD0] == 8 * n * v
    assert comp[peak.T_BWD0] == 2 * n * v + 4 * n


def test_compiled_loss_bill_and_trace_agree() -> None:
    spec = dataclasses.replace(resolve_model("llama-3.1-8b"), max_seq=8192)
    kw = {
        "batch_size": 2,
        "seq_len": 8192,
        "framework": "torchtitan",
        "recompute": "selective",
        "layout": gpumem.Layout(dp=32, fsdp="full"),
        "gpu": "H100-80GB",
        "alloc_conf": "",
    }
    eager = gpumem.estimate(spec, **kw)
    comp = gpumem.estimate(spec, compiled_loss=True, **kw)
    alloc = sum(x for k, x in comp.per_gpu.items() if k not in ("overhead", "total"))
    eager_alloc = sum(x for k, x in eager.per_gpu.items() if k not in ("overhead", "total"))
    n, v = 2 * 8192, 128256
    # the peak stays the loss's backward: 12 B per logit become 4 B (+ 12 B per row)
    assert comp.phase == eager.phase == "backward start"
    assert eager_alloc - alloc == 8 * n * v - 12 * n
    # titan_trace's own peak (its allocations replayed) equals the terms' peak
    shape = tt.titan_shape(
        spec,
        gpumem.Layout(dp=32, fsdp="full"),
        gpumem.estimator.gpus.find_gpu("H100-80GB"),
        batch=2,
        seq=8192,
        recompute="selective",
        compiled=True,
    )
    from gpumem.allocator.alloc_conf import AllocConf
    from gpumem.estimator.frameworks import titan_trace

    run = titan_trace.simulated_run(AllocConf(), shape)
    assert run.peak == alloc
    assert comp.peak_reserved_bytes is not None and comp.peak_reserved_bytes >= alloc
    assert comp.inputs["compiled_loss"] is True


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"framework": "torchtitan", "loss_chunks": 8}, ("compiled_loss", "loss_chunks")),
        (
            {"framework": "torchtitan", "layout": gpumem.Layout(dp=2, tp=2, fsdp="full", sp=True)},
            ("compiled_loss", "tp > 1"),
        ),
        ({"framework": "fsdp2"}, ("compiled_loss", "torchtitan")),
    ],
)
def test_compiled_loss_bad_input_is_one_line(kw: dict, words: tuple[str, ...]) -> None:
    kw.setdefault("layout", gpumem.Layout(dp=2, fsdp="full"))
    with pytest.raises(ValueError) as e:
        gpumem.estimate("llama-3.1-8b", batch_size=1, seq_len=1024, compiled_loss=True, **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_compiled_loss_on_the_command_line(capsys) -> None:
    import json

    from gpumem.cli import main

    args = ["estimate", "llama-3.1-8b", "--gpus", "8", "--fsdp", "full", "--framework"]
    args += ["torchtitan", "--batch-size", "1", "--seq-len", "2048", "--json"]

    def allocated_out() -> int:
        per_gpu = json.loads(capsys.readouterr().out)["per_gpu"]
        return per_gpu["total"] - per_gpu["overhead"]

    assert main(args) == 0
    eager = allocated_out()
    assert main([*args, "--compiled-loss"]) == 0
    bill = gpumem.estimate(
        "llama-3.1-8b",
        batch_size=1,
        seq_len=2048,
        framework="torchtitan",
        layout=gpumem.Layout(dp=8, fsdp="full"),
        compiled_loss=True,
    )
    compiled = allocated_out()
    assert compiled == bill.per_gpu["total"] - bill.per_gpu["overhead"] < eager
    assert main(["plan", "llama-3.1-8b", "--gpus", "8", "--compiled-loss"]) != 0
    err = capsys.readouterr().err.strip()
    assert "does not sweep torchtitan" in err and "\n" not in err
