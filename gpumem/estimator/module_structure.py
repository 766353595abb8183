"""What the estimator learns about an ``nn.Module``'s structure: its repeated blocks, the
parameters of each region (before, inside, after the blocks) and the record of one measured
pass (``ModuleSpec``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumem.estimator.states import ParamMix

PRE, BLOCK, POST = "pre", "block", "post"


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
    mix: ParamMix = field(default_factory=ParamMix)  # matrices vs the rest (Muon, Adafactor)
    # the measured pass's storages as the caching allocator sees them, in order: (handle,
    # bytes) allocations and (handle, -1) frees (the profiler's log; empty when not logged)
    alloc_events: tuple[tuple[int, int], ...] = ()
    casts: float = 0.0  # temporaries alive at the forward's end (autocast's unsaved casts)
    trainable_numels: tuple[int, ...] = ()  # each trainable tensor's elements, tied ones once
    # bytes per element of the trainable parameters when they keep a dtype of their own beside
    # a frozen base of another (PEFT's fp32 adapters on a 16-bit base); 0: the precision's
    trainable_bytes: int = 0

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
        regions[
            _region_of(owner, blocks, order, first, last)
        ].buffers += b.untyped_storage().nbytes()
    block = regions[BLOCK]
    nb = max(len(blocks), 1)
    mean = Params(
        *(
            getattr(block, f) / nb
            for f in ("train_mat", "train_vec", "frozen_mat", "frozen_vec", "buffers")
        )
    )
    regions[BLOCK] = mean  # type: ignore[assignment]
    # what ZeRO-3/FSDP gathers at once: one block (the whole model when nothing repeats)
    gather = (
        int(mean.train_mat + mean.train_vec + mean.frozen_mat + mean.frozen_vec)
        if blocks
        else total
    )
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
