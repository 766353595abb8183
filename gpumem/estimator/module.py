"""The estimate of an ``nn.Module``: exact parameter counts, and activations measured by one
fake-tensor training pass of a copy of the module.

The module itself is never run, moved or changed. A copy whose parameters and buffers are
``FakeTensor``s (shape and dtype, no data: nothing of the model's size is allocated, so a 70B
module built on the ``meta`` device is fine) runs one forward, loss and backward at the real
micro-batch under ``gpumem.fake()`` and ``gpumem.profile``. From that profile come the terms the
estimator's peak assembly (``peak.assemble``) needs; model states, layout sharding, the optimizer
step and the CUDA reserve come from the same formulas as for presets.

What is measured, and how it maps onto the three moments of ``peak.py``:

- **blocks**: the largest group of structurally identical sibling modules (same class and
  parameter shapes, e.g. the layers of a ``ModuleList``) are the model's blocks; pipeline stages
  split them. Modules that run before the first block are the first stage's, after the last the
  last stage's, and so are their saved tensors.
- **activations**: storages autograd saved, per module (the profiler's ``activations``);
  ``A_LAYER`` is the blocks' mean, ``A_FIRST`` what runs before them plus the model's inputs,
  ``A_LAST`` what runs after them (head, loss) plus the output the loop holds (``keep_logits``).
- **the widest moment of backward**: the profile's peak. With no parameter gradient yet it is the
  start of backward: ``T_BWD0`` is its excess over every saved activation. Otherwise it is an
  end-of-backward moment: ``P_PEND`` the parameters without a gradient yet, ``A_END`` the saved
  activations still alive beyond the first stage's, ``T_LAYER`` the temporaries (held output
  aside). At one GPU and the measured micro-batch the assembly reproduces the measured peak.
- **recompute**: ``"full"`` wraps every block of the copy in ``torch.utils.checkpoint`` and
  measures that; checkpointing inside the module is measured as it is.
- **tensor parallelism** (Megatron-style, a stated assumption): matrices (parameters of two or
  more dimensions) are split over ``tp``, vectors replicate; a saved tensor with as many
  elements as a block's input (the residual stream: norm inputs, inputs of column-parallel
  linears, dropout masks) replicates unless ``sp``, every other saved tensor and the temporaries
  split (a second fake forward classifies them).

Example:
    >>> with torch.device("meta"):
    ...     net = build_model("llama", "7b")
    >>> bill = gpumem.estimate(net, batch_size=1, seq_len=4096, layout=gpumem.Layout(dp=8, zero=1))
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator import peak
from gpumem.estimator.bill import grads_persist, inflight, job_terms
from gpumem.estimator.gpus import GPU
from gpumem.estimator.layout import Layout
from gpumem.estimator.states import Training

PRE, BLOCK, POST = "pre", "block", "post"


def is_module(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch when nothing did yet)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


@dataclass
class Params:
    """Unique parameter elements of one region, split the way TP splits them."""

    train_mat: int = 0  # trainable, >= 2-D: split over tp
    train_vec: int = 0  # trainable, 1-D: replicated
    frozen_mat: int = 0
    frozen_vec: int = 0
    buffers: int = 0  # bytes, in the copy's dtypes

    def trainable(self, tp: int) -> float:
        return self.train_mat / tp + self.train_vec

    def frozen(self, tp: int) -> float:
        return self.frozen_mat / tp + self.frozen_vec


@dataclass
class ModuleSpec:
    """What the estimator learned about an ``nn.Module`` (its counts and one measured pass).

    Attributes:
        name: the module's class name.
        n_params / n_trainable: unique parameters (tied tensors once) / those with requires_grad.
        blocks: fully qualified names of the repeated blocks, in order (may be empty).
        regions: parameter counts of ``pre``, one ``block`` (their mean) and ``post``.
        acts: saved activation bytes (one micro-batch): ``pre``, ``block`` (mean), ``post``.
        inputs / held: bytes of the model's inputs / of the output the loop holds.
        block_out: bytes of a block's output (the gradient a pipeline stage receives).
        moment: the measured widest moment: ``start`` or ``end`` of backward, and its terms.
        tp_split: per region, the share of saved bytes that tensor parallelism splits.
        scratch: elements a per-tensor optimizer step holds at once (registration order).
        peak_bytes: the measured peak of the fake pass (for reference).
    """

    name: str
    n_params: int
    n_trainable: int
    blocks: list[str]
    regions: dict[str, Params]
    acts: dict[str, float] = field(default_factory=dict)
    inputs: int = 0
    held: int = 0
    block_out: int = 0
    moment: str = "start"
    t_start: float = 0.0
    pend_params: float = 0.0
    a_end: float = 0.0
    t_end: float = 0.0
    tp_split: dict[str, float] = field(default_factory=dict)
    scratch: int = 0
    peak_bytes: int = 0
    residual_elems: int = 0
    tied_pre_post: int = 0  # trainable elements shared by pre and post (tied embeddings)
    block_params: int = 0  # one block's parameters (ZeRO-3/FSDP gathers one at a time)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def act_scale(self, region: str, tp: int, sp: bool) -> float:
        """The factor TP applies to saved bytes of ``region`` (1 without TP)."""
        if tp == 1:
            return 1.0
        if sp:
            return 1.0 / tp
        split = self.tp_split.get(region, 1.0)
        return (1.0 - split) + split / tp


# --- the copy and its inputs ----------------------------------------------------------------


def weight_dtype(training: Training):
    """The dtype of the copy's floating parameters: the precision's weight storage."""
    import torch

    if training.weight_bytes == 4:
        return torch.float32
    return torch.float16 if training.precision.startswith("fp16") else torch.bfloat16


def fake_copy(module: Any, device: str, dtype: Any) -> Any:
    """A copy of ``module`` whose parameters and buffers are fake tensors on ``device``; floating
    ones in ``dtype`` (as ``module.to(dtype)`` would). Call inside ``gpumem.fake()``."""
    import torch

    memo: dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            dt = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=dt, device=device), requires_grad=p.requires_grad
            )
    for b in module.buffers():
        if id(b) not in memo:
            dt = dtype if b.is_floating_point() else b.dtype
            memo[id(b)] = torch.empty(b.shape, dtype=dt, device=device)
    try:
        out = copy.deepcopy(module, memo)
    except Exception as exc:
        raise TypeError(
            f"cannot copy {type(module).__name__} for a fake-tensor pass ({type(exc).__name__}: "
            f"{exc}); the estimate runs a copy so that your module stays untouched: make it "
            "deep-copyable (no open files, locks or real tensors outside parameters/buffers)"
        ) from None
    return out.train()


def _resize(t: Any, batch: int | None, seq: int | None, device: str) -> Any:
    """A fake tensor shaped like ``t``: dim 0 set to ``batch``, dim 1 of integer (token) tensors to
    ``seq``."""
    import torch

    shape = list(t.shape)
    if batch is not None and shape:
        shape[0] = batch
    if seq is not None and len(shape) >= 2 and not t.is_floating_point() and not t.is_complex():
        shape[1] = seq
    return torch.zeros(shape, dtype=t.dtype, device=device)


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[Any]:
    out: list[Any] = []
    _map_tensors(obj, lambda t: out.append(t) or t)
    return out


def default_input(module: Any) -> Callable[[int, int | None], Any] | None:
    """For a built-in ``gpumem.models`` module: its example batch as an input factory."""
    cfg = getattr(module, "config", None)
    if cfg is None or type(cfg).__module__ != "gpumem.models.config":
        return None
    from gpumem.models import example_batch

    return lambda batch, seq: example_batch(cfg, batch, seq)[0]


def resolve_batch(module: Any, example_input: Any, batch_size: int | None) -> int:
    """The micro-batch: ``batch_size``, else dim 0 of the example's first tensor, else 1."""
    if batch_size is not None:
        return batch_size
    if example_input is not None and not callable(example_input):
        ts = _tensors(example_input)
        if ts and ts[0].dim() > 0:
            return int(ts[0].shape[0])
    return 1


def make_inputs(module: Any, example_input: Any, batch: int, seq: int | None, device: str):
    """(args, kwargs) of fake tensors for one micro-batch. Call inside ``gpumem.fake()``."""
    import torch

    factory = example_input if callable(example_input) and not isinstance(example_input, torch.Tensor) else None
    if example_input is None:
        factory = default_input(module)
        if factory is None:
            needed = _required_args(module)
            if needed:
                raise ValueError(
                    f"{type(module).__name__}.forward needs {', '.join(needed)}: pass example_input= "
                    "(a tensor, a tuple of positional inputs, a dict of keyword inputs, or a "
                    "function (batch_size, seq_len) -> those) shaped like one micro-batch"
                )
            return (), {}
    if factory is not None:
        with torch.device(device):
            made = factory(batch, seq)
        example, resize = made, False
    else:
        example, resize = example_input, True
    fake = lambda t: _resize(t, batch if resize else None, seq if resize else None, device)  # noqa: E731
    if isinstance(example, dict):
        return (), _map_tensors(example, fake)
    if isinstance(example, tuple):
        return _map_tensors(example, fake), {}
    return (_map_tensors(example, fake),), {}


def _required_args(module: Any) -> list[str]:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return []
    return [
        n for n, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip


# --- structure: blocks, regions, parameter groups --------------------------------------------


def find_blocks(module: Any) -> list[str]:
    """Names of the largest group of identical sibling modules (class and parameter shapes),
    at least two, by total parameters; ``[]`` when the module repeats nothing."""
    best: tuple[int, list[str]] = (0, [])
    for prefix, parent in module.named_modules():
        groups: dict[tuple, list[str]] = {}
        for name, child in parent.named_children():
            shapes = tuple((n, tuple(p.shape)) for n, p in child.named_parameters())
            if shapes:
                key = (type(child), shapes)
                groups.setdefault(key, []).append(f"{prefix}.{name}" if prefix else name)
        for key, names in groups.items():
            size = len(names) * sum(_numel(s) for _, s in key[1])
            if len(names) >= 2 and size > best[0]:
                best = (size, names)
    return best[1]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _region_of(fqn: str, blocks: list[str], order: dict[str, int], first: int, last: int) -> str:
    for b in blocks:
        if fqn == b or fqn.startswith(b + "."):
            return BLOCK
    pos = order.get(fqn)
    return POST if pos is not None and pos > last else PRE


def count_params(module: Any, blocks: list[str], order: dict[str, int], first: int, last: int):
    """Parameter groups by region: (regions, n_params, n_trainable, tied pre/post elements,
    parameters gathered at once)."""
    regions = {PRE: Params(), BLOCK: Params(), POST: Params()}
    owners: dict[int, set[str]] = {}
    tensors: dict[int, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        owners.setdefault(id(p), set()).add(_region_of(owner, blocks, order, first, last))
        tensors[id(p)] = p
    total = trainable = tied = 0
    for key, p in tensors.items():
        where = owners[key]
        region = PRE if PRE in where else (BLOCK if BLOCK in where else POST)
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
        mat = p.dim() >= 2
        g = regions[region]
        if p.requires_grad:
            g.train_mat += n if mat else 0
            g.train_vec += 0 if mat else n
            if PRE in where and POST in where:
                tied += n
        else:
            g.frozen_mat += n if mat else 0
            g.frozen_vec += 0 if mat else n
    for name, b in module.named_buffers():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        regions[_region_of(owner, blocks, order, first, last)].buffers += b.untyped_storage().nbytes()
    block = regions[BLOCK]
    nb = max(len(blocks), 1)
    mean = Params(*(getattr(block, f) / nb for f in ("train_mat", "train_vec", "frozen_mat", "frozen_vec", "buffers")))
    regions[BLOCK] = mean  # type: ignore[assignment]
    # what ZeRO-3/FSDP gathers at once: one block (the whole model when nothing repeats)
    gather = int(mean.train_mat + mean.train_vec + mean.frozen_mat + mean.frozen_vec) if blocks else total
    return regions, total, trainable, tied, gather


def step_scratch(module: Any) -> int:
    """Elements torch's per-tensor Adam holds at once: the largest ``previous + 2 x current``
    over consecutive trainable parameters in registration order (``models._step_scratch``'s
    rule, measured on CPU)."""
    prev = best = 0
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        best = max(best, prev + 2 * p.numel())
        prev = p.numel()
    return best
