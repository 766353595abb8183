"""Reserved memory of a training step: the allocations one pipeline rank makes, in the order
the framework makes them, run through the caching allocator simulator (``gpumem.allocator``).

Two traces per rank, simulated apart (their blocks never meet: the states are never freed):

* ``StatesShape`` — the long-lived tensors: every parameter tensor's weight, the persistent
  gradients and the optimizer states (one tensor per state and parameter; a flat buffer per
  state where Megatron's distributed optimizer or DeepSpeed keep one), the steady
  communication buckets. Allocations only.
* ``StepShape`` — one step's dynamic tensors: the in-flight micro-batches' saved activations
  layer by layer (each ``Item`` one allocation; a layer's gathered parameters around it),
  then one micro-batch's backward: the start transient, and per layer from the last the
  recomputed tensors, the layer's temporaries, the frees of its saved tensors and the weight
  gradients it makes; then the optimizer step's temporaries.

What a bill takes from them is the fragmentation, two figures over the bytes the trace itself
asked for at its peak (``frag_bytes``): the reserved peak with ample memory (what
``reserved_bytes.all.peak`` reads on a GPU that never fills), and what the allocator cannot
release: the largest ``reserved - releasable`` at a moment it needs a new segment, where
``releasable`` is the cached segments (pages) ``release_cached_blocks`` frees before an
allocation fails and is retried. The bill's reserved peak is its allocated peak plus the first;
its verdict counts the second.

Identical layers make the traces periodic, so a rank of many layers is simulated for ``K`` and
``2 K`` layers and the rest extrapolated linearly (``scaled``); results are cached per shape
(the held micro-batches, the states' layers and the rest apart, so that shapes repeat), which
is what lets the planner's candidates share a few thousand simulations.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.allocator.caching import CachingAllocatorSim, SegmentInfo
from gpumem.allocator.compiled import compiled_segments, plain_sim
from gpumem.allocator.trace import Trace
from gpumem.estimator import sim_cache

K = 4
"""Layers simulated exactly; a rank of more than ``2 K`` is extrapolated from ``K`` and ``2 K``."""


@dataclass(frozen=True)
class StatesShape:
    """The long-lived tensors of a rank (bytes per tensor, as asked for)."""

    layer: tuple[int, ...]
    """One layer's tensors: weights, then (persistent) gradients, then optimizer states."""
    outer: tuple[int, ...] = ()
    """Tensors outside the layers: embedding, head, flat buffers, buckets."""


@dataclass(frozen=True)
class StepShape:
    """One step's dynamic tensors on a rank (bytes per tensor, as asked for)."""

    saved: tuple[int, ...]
    """One layer's saved tensors, in forward order."""
    recomputed: tuple[int, ...] = ()
    """Made again in the layer's backward (recompute), freed after it."""
    grads: tuple[int, ...] = ()
    """The weight gradients a layer's backward makes (none when gradients persist)."""
    gather: int = 0
    """A layer's gathered buffer (FSDP/ZeRO-3 parameters, CP's KV, MoE dispatch), fwd and bwd."""
    t_layer: int = 0
    t_start: int = 0
    t_step: int = 0
    first: int = 0
    """The embedding's saved tensors (first stage), per micro-batch."""
    last: int = 0
    """The head's and the loss's (last stage), of the micro-batch that runs backward."""
    held: float = 0.0
    """Further micro-batches in flight whose activations stay through this backward."""


def frag_bytes(
    conf: AllocConf, states: StatesShape, step: StepShape, n_layers: int
) -> tuple[int, int]:
    """(unreleasable, reserved) bytes over the requested peak, for ``n_layers`` layers.

    Simulated apart so that shapes repeat across a planner's candidates: the states' layers
    (``StatesShape`` without ``outer``), the tensors outside them, the held micro-batches'
    activations (allocations only: ``held`` micro-batches of the layer's saved tensors) and
    the step of one micro-batch (``held=0``)."""
    parts = [
        scaled(conf, replace(states, outer=()), n_layers),
        fragmentation(conf, StatesShape((), states.outer), 0),
        scaled(conf, replace(step, held=0.0), n_layers),
    ]
    passes = round(step.held * n_layers)
    if passes and step.saved:
        parts.append(scaled(conf, StatesShape(step.saved), passes))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def scaled(conf: AllocConf, shape: StatesShape | StepShape, n: int) -> tuple[int, int]:
    """``fragmentation`` of ``n`` layers: exact up to ``2 K``, else linear through ``K`` and
    ``2 K`` (periodic traces: exact when the period divides ``K``)."""
    if n <= 2 * K:
        return fragmentation(conf, shape, n)
    f1, f2 = fragmentation(conf, shape, K), fragmentation(conf, shape, 2 * K)
    u, r = (max(0, a + (n - K) * (b - a) // K) for a, b in zip(f1, f2, strict=True))
    return u, r


@functools.lru_cache(maxsize=65536)
def fragmentation(conf: AllocConf, shape: StatesShape | StepShape, n: int) -> tuple[int, int]:
    """(unreleasable, reserved) over the requested peak of ``shape``'s trace of ``n`` layers,
    simulated (cached: the planner asks for the same shapes again and again; and on disk,
    ``sim_cache``, for the next process)."""
    key = None
    if sim_cache.enabled():  # the key (repr and hash) costs a cold plan 5 %: only when used
        key = hashlib.blake2b(repr((conf, shape, n)).encode(), digest_size=16).hexdigest()
        hit = sim_cache.lookup(key)
        if hit is not None:
            return hit
    try:
        out = _simulated(conf, shape, n)
    except (OverflowError, TypeError):  # sizes beyond int64 (absurd inputs): in Python
        out = replayed(conf, shape, n, compiled=False)
    if key is not None:
        sim_cache.store(key, out)
    return out


def _simulated(conf: AllocConf, shape: StatesShape | StepShape, n: int) -> tuple[int, int]:
    """``fragmentation``, simulated. A step is run in three cached stages (forward; backward;
    optimizer step), each continuing a fork of the one before, so that steps differing only in
    their later transients share the rest."""
    if isinstance(shape, StepShape) and not shape.held:
        walked = _walk_stage(conf, replace(shape, t_step=0), n)
        if not shape.t_step:
            return walked.result()
        grow = walked.sim.would_reserve(shape.t_step)
        if grow is not None:  # the step's one temporary, taken and given back, without a fork
            return walked.result_with(shape.t_step, grow)
        run = walked.fork()
        run.give(run.take(shape.t_step))
        return run.result()
    return replayed(conf, shape, n)


def replayed(
    conf: AllocConf, shape: StatesShape | StepShape, n: int, *, compiled: bool = True
) -> tuple[int, int]:
    """``fragmentation`` the plain way: the whole trace built and run event by event, no
    staged forks (``compiled=False``: on the Python simulator, the reference)."""
    t, _ = states_trace(shape, n) if isinstance(shape, StatesShape) else step_trace(shape, n)
    run = new_run(conf, compiled=compiled)
    for ev in t.events:
        if ev[0] == "alloc":
            run.take(ev[2], ev[1])
        else:
            run.give(ev[1])
    return run.result()


def new_run(conf: AllocConf, *, compiled: bool = True) -> Run:
    """A ``_Run`` on the compiled simulator where it applies (``allocator.compiled``), else on
    ``CachingAllocatorSim``; ``compiled=False``: always the latter (the reference)."""
    sim = plain_sim(conf) if compiled else None
    return _Run(conf) if sim is None else _CompiledRun(sim)


class _Figures:
    """What a bill takes from a run, from its counters (shared by both kinds of run)."""

    def counters(self) -> tuple[int, int, int, int, int]:
        """(requested alive, their peak, unreleasable peak, reserved, reserved peak)."""
        raise NotImplementedError

    def releasable(self) -> int:
        raise NotImplementedError

    def segments(self) -> list[SegmentInfo]:
        """The simulator's segment map now (``CachingAllocatorSim.segments``)."""
        raise NotImplementedError

    def result(self) -> tuple[int, int]:
        _, peak, pinned, _, reserved_peak = self.counters()
        return max(0, pinned - peak), max(0, reserved_peak - peak)

    def result_with(self, size: int, grow: int) -> tuple[int, int]:
        """``result`` after ``give(take(size))``, the take reserving ``grow`` new bytes
        (``CachingAllocatorSim.would_reserve``), computed without running it: the peak takes
        the temporary; a new segment raises reserved (and its peak) by ``grow``, and since it
        holds the temporary, the releasable bytes stay as they are."""
        live, peak, pinned, reserved, reserved_peak = self.counters()
        peak = max(peak, live + size)
        if grow:
            pinned = max(pinned, reserved + grow - self.releasable())
            reserved_peak = max(reserved_peak, reserved + grow)
        return max(0, pinned - peak), max(0, reserved_peak - peak)


class _CompiledRun(_Figures):
    """``_Run`` on ``gpumem._C.PlainSim``, which keeps the counters itself: ``take`` and
    ``give`` are its own methods, one native call per event."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.take = sim.take
        self.give = sim.give
        self.layers: list[list[int]] = []
        self.ends: list[int | None] = []

    def counters(self) -> tuple[int, int, int, int, int]:
        s = self.sim
        return s.live, s.peak, s.pinned, s.reserved, s.reserved_peak

    @property
    def peak(self) -> int:
        """The requested bytes' peak (``_Run.peak``)."""
        return int(self.sim.peak)

    def releasable(self) -> int:
        return int(self.sim.releasable())

    def segments(self) -> list[SegmentInfo]:
        return compiled_segments(self.sim)

    def fork(self) -> _CompiledRun:
        new = _CompiledRun(self.sim.fork())
        new.layers = [list(x) for x in self.layers]
        new.ends = list(self.ends)
        return new


class _Run(_Figures):
    """A simulator with the requested bytes alive, their peak, and the unreleasable peak."""

    def __init__(self, conf: AllocConf | None = None) -> None:
        if conf is not None:
            self.sim = CachingAllocatorSim(conf)
        self.sizes: dict[int, int] = {}
        self.live = self.peak = self.pinned = self.next = 0
        self.layers: list[list[int]] = []
        self.ends: list[int | None] = []

    def take(self, size: int, h: int | None = None, stream: int = 0) -> int:
        if h is None:
            h = self.next
            self.next += 1
        sim = self.sim
        st = sim.stats
        before = st.reserved
        sim.malloc(h, size, stream)
        if st.reserved > before:  # a new segment: where a full GPU would release and retry
            pinned = st.reserved - sim.releasable()
            if pinned > self.pinned:
                self.pinned = pinned
        self.sizes[h] = size
        live = self.live = self.live + size
        if live > self.peak:  # not max(): the sweep's hot path
            self.peak = live
        return h

    def give(self, h: int) -> None:
        self.sim.free(h)
        self.live -= self.sizes.pop(h)

    def fork(self) -> _Run:
        new = _Run()
        new.sim = self.sim.fork()
        new.sizes = dict(self.sizes)
        new.live, new.peak, new.pinned, new.next = self.live, self.peak, self.pinned, self.next
        new.layers = [list(x) for x in self.layers]
        new.ends = list(self.ends)
        return new

    def counters(self) -> tuple[int, int, int, int, int]:
        st = self.sim.stats
        return self.live, self.peak, self.pinned, st.reserved, st.reserved_peak

    def releasable(self) -> int:
        return self.sim.releasable()

    def segments(self) -> list[SegmentInfo]:
        return self.sim.segments()


Run = _Run | _CompiledRun


@functools.lru_cache(maxsize=4096)
def _step_stage(conf: AllocConf, saved: tuple[int, ...], gather: int, first: int, n: int) -> Run:
    """The forward of one micro-batch's layers (see ``step_trace``), the head's tensors not
    yet taken (so that ranks differing only in them share it); never mutated."""
    run = new_run(conf)
    f = run.take(first) if first else None
    for _ in range(n):
        g = run.take(gather) if gather else None
        run.layers.append([run.take(size) for size in saved])
        if g is not None:
            run.give(g)
    run.ends = [f]
    return run


def _backward(run: Any, s: StepShape, layers: list, first: Any, last: Any) -> None:
    """The backward on ``run`` (a ``_Run`` or a ``_Live``: both take and give): the start
    transient, the head's saved tensors, then layer by layer from the last (gather, recomputed
    tensors and the layer's temporary taken, its saved tensors freed, its weight grads made),
    the first stage's tensors last. One walk for the cached stages and the plain trace."""
    if s.t_start:
        run.give(run.take(s.t_start))
    if last is not None:
        run.give(last)
    for saved in reversed(layers):
        g = run.take(s.gather) if s.gather else None
        rc = [run.take(size) for size in s.recomputed]
        tl = run.take(s.t_layer) if s.t_layer else None
        for h in reversed(saved):
            run.give(h)
        for size in s.grads:
            run.take(size)
        for h in (*rc, tl, g):
            if h is not None:
                run.give(h)
    if first is not None:
        run.give(first)


@functools.lru_cache(maxsize=4096)
def _walk_stage(conf: AllocConf, s: StepShape, n: int) -> Run:
    """The forward, then the backward (start transient, then layer by layer from the last);
    never mutated."""
    run = _step_stage(conf, s.saved, s.gather, s.first, n).fork()
    first = run.ends[0]
    last = run.take(s.last) if s.last else None
    _backward(run, s, run.layers, first, last)
    return run


class _Live(Trace):
    """A trace that also keeps the requested bytes alive and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def take(self, size: int) -> int:
        h = self.alloc(size)
        self.sizes[h] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        return h

    def give(self, h: int) -> None:
        self.free(h)
        self.live -= self.sizes.pop(h)


def states_trace(s: StatesShape, n: int) -> tuple[Trace, int]:
    """The long-lived tensors of ``n`` layers: allocations only; (trace, requested bytes)."""
    t = _Live()
    for size in s.outer[:1]:  # the embedding is built first, the rest after the layers
        t.take(size)
    for _ in range(n):
        for size in s.layer:
            t.take(size)
    for size in s.outer[1:]:
        t.take(size)
    return t, t.peak


def step_trace(s: StepShape, n: int) -> tuple[Trace, int]:
    """One step of ``n`` layers (see the module docstring); (trace, peak requested bytes)."""
    t = _Live()
    held = math.ceil(s.held)
    for _ in range(held):  # the micro-batches whose backward comes later
        if s.first:
            t.take(s.first)
        for _ in range(round(s.held / held * n) if held else 0):
            g = t.take(s.gather) if s.gather else None
            for size in s.saved:
                t.take(size)
            if g is not None:
                t.give(g)
    first = t.take(s.first) if s.first else None
    layers = []
    for _ in range(n):
        g = t.take(s.gather) if s.gather else None
        layers.append([t.take(size) for size in s.saved])
        if g is not None:
            t.give(g)
    last = t.take(s.last) if s.last else None
    _backward(t, s, layers, first, last)
    if s.t_step:
        t.give(t.take(s.t_step))
    return t, t.peak


__all__ = [
    "K",
    "Run",
    "StatesShape",
    "StepShape",
    "frag_bytes",
    "fragmentation",
    "new_run",
    "replayed",
    "scaled",
    "states_trace",
    "step_trace",
]
