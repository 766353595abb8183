"""The per-GPU peak, assembled from precomputed terms by one scalar function.

``assemble`` is plain arithmetic on numbers so that the estimator calls it in Python and the
planner compiles the very same function with numba for its sweep: one formula, two speeds.

The peak is the largest of three moments of a training step (HF "Visualize and understand GPU
memory" and the Megatron golden values agree on this shape):

1. start of backward: every activation of the in-flight micro-batches, the logits and the loss's
   backward transients, plus any gradient buffers that persist across steps; or, when wider,
   the last layer's widest backward moment, by which the head's saved tensors are released
   (``A_GONE``) and the head's and that layer's weight gradients exist (``G_START``);
2. end of backward, inside the stage's first layer (the last one backward reaches): every
   gradient but that layer's (and an untied embedding's) unless gradients persist, the weight
   grads the layer has produced by its widest moment, its live (or recomputed) activations and
   the gradients in flight there (``backward.py`` replays its nodes), the logits the caller
   still holds;
3. optimizer step: all gradients plus the step's temporaries;
4. end of forward, before the autocast region exits: every saved activation plus what only
   the forward holds (``CASTS``: autocast's cached 16-bit weight copies that no saved tensor
   keeps, all the layers' under full recompute; they are freed before backward starts).

Logits the training loop still holds (``keep_logits``: a ``logits = model(x)`` variable lives
until the next forward replaces it) count in all three, and so does the input batch (``IDS``,
inside ``A_FIRST`` during backward).

Weights and optimizer state are present throughout. Communication buffers come in two kinds:
``COMM`` (buckets that live through the whole step: DeepSpeed's ZeRO-1/2 buckets, DDP's flat
gradient buckets) and ``GATHER`` (per-layer buffers of forward and backward only: ZeRO-3/FSDP's
gathered and prefetched layer with its unsharded gradients, context parallelism's KV exchange,
MoE token dispatch/combine).
"""

from __future__ import annotations

import numpy as np

# indices into the terms vector (float64) given to assemble()
P_TRAIN, P_FROZEN, P_EXP_TRAIN, P_EXP_FROZEN = 0, 1, 2, 3
W_BYTES, W_FROZEN_BYTES, G_BYTES, O_BYTES = 4, 5, 6, 7
N_SHARD, N_SHARD_EXP, STAGE = 8, 9, 10
A_LAYER, N_LAYERS, INFLIGHT, A_FIRST, A_LAST = 11, 12, 13, 14, 15
T_BWD0, T_LAYER, T_STEP, GATHER, CASTS = 16, 17, 18, 19, 20
G_PERSIST, CONTEXT, NCCL, FRAG, OFFLOAD, COMM = 21, 22, 23, 24, 25, 26
P_PEND, P_PEND_EXP, G_WALK, A_END, W_BUFFERS, HELD, IDS = 27, 28, 29, 30, 31, 32, 33
# the start moment inside the last layer's backward: the head's saved tensors already released
# (A_GONE) and the weight grads produced by then (G_START), so that T_BWD0 is only temporaries
A_GONE, G_START = 34, 35
# the simulated caching allocator's fragmentation (step_trace.py), bytes: what it cannot
# release when the GPU fills (FRAG_BYTES, in the overhead: replaces FRAG's flat share when the
# simulator ran), and reserved minus allocated at its peak with ample memory (RESERVED_FRAG,
# reported only)
FRAG_BYTES, RESERVED_FRAG = 36, 37
N_TERMS = 38
# positions in assemble()'s result
OUT_COMM, OUT_TEMP, OUT_OVERHEAD, OUT_TOTAL, OUT_PHASE = 4, 5, 6, 7, 8
N_OUT = 9


def assemble(x):
    """Category bytes at the peak of one rank: (weights, gradients, optimizer, activations,
    communication, temporary, overhead, total, phase) with phase 0/1/2/3 = backward start/end,
    step, forward end. Every sum is in float64 (exact for integers below 2**53, and without
    overflow far beyond: a job of 1e14 tokens or 1e9 layers comes out as a huge number, never
    a wrapped negative one); each category saturates at ``LIMIT`` when made an integer."""
    stage = x[STAGE]
    nw = x[N_SHARD] if stage >= 3 else 1.0
    nwe = x[N_SHARD_EXP] if stage >= 3 else 1.0
    ng = x[N_SHARD] if stage >= 2 else 1.0
    nge = x[N_SHARD_EXP] if stage >= 2 else 1.0
    no = x[N_SHARD] if stage >= 1 else 1.0
    noe = x[N_SHARD_EXP] if stage >= 1 else 1.0
    weights = (
        (x[P_TRAIN] * x[W_BYTES] + x[P_FROZEN] * x[W_FROZEN_BYTES]) / nw
        + (x[P_EXP_TRAIN] * x[W_BYTES] + x[P_EXP_FROZEN] * x[W_FROZEN_BYTES]) / nwe
        + x[W_BUFFERS]
    )
    grads = x[P_TRAIN] * x[G_BYTES] / ng + x[P_EXP_TRAIN] * x[G_BYTES] / nge
    optim = (
        0.0 if x[OFFLOAD] > 0 else x[P_TRAIN] * x[O_BYTES] / no + x[P_EXP_TRAIN] * x[O_BYTES] / noe
    )
    acts = x[INFLIGHT] * (x[N_LAYERS] * x[A_LAYER] + x[A_FIRST]) + x[A_LAST]
    g_keep = grads if x[G_PERSIST] > 0 else 0.0
    base = weights + optim + x[COMM]
    # weight grads made inside the last layer: new tensors, unless gradients persist (they
    # accumulate into the existing ones; the walk's share is then counted as temporary)
    g_new = 0.0 if x[G_PERSIST] > 0 else x[G_START]
    t_start = x[T_BWD0] + x[G_START] - g_new
    start = base + g_keep + g_new + acts - x[A_GONE] + t_start + x[GATHER]
    pend = x[P_PEND] * x[G_BYTES] / ng + x[P_PEND_EXP] * x[G_BYTES] / nge
    g_end = grads - pend + x[G_WALK]
    end = base + g_end + x[A_FIRST] + x[A_END] + x[HELD] + x[T_LAYER] + x[GATHER]
    step = base + grads + x[HELD] + x[IDS] + x[T_STEP]
    fwd = base + g_keep + acts + x[CASTS] + x[GATHER]
    phase = 0
    best = start
    if end > best:
        phase = 1
        best = end
    if step > best:
        phase = 2
        best = step
    if fwd > best:
        phase = 3
        best = fwd
    if phase == 0:
        g, a, c, t = g_keep + g_new, acts - x[A_GONE], x[GATHER] + x[COMM], t_start
    elif phase == 1:
        g, a, c, t = g_end, x[A_FIRST] + x[A_END] + x[HELD], x[GATHER] + x[COMM], x[T_LAYER]
    elif phase == 2:
        g, a, c, t = grads, x[HELD] + x[IDS], x[COMM], x[T_STEP]
    else:
        g, a, c, t = g_keep, acts, x[GATHER] + x[COMM], x[CASTS]
    # min(LIMIT, v) saturates each category (and maps a NaN, which only absurd inputs produce,
    # to the limit): their integer sum stays far inside int64 however large the job
    w_i, g_i, o_i = int(min(LIMIT, weights)), int(min(LIMIT, g)), int(min(LIMIT, optim))
    a_i, c_i, t_i = int(min(LIMIT, a)), int(min(LIMIT, c)), int(min(LIMIT, t))
    allocated = w_i + g_i + o_i + a_i + c_i + t_i
    overhead = int(min(LIMIT, x[CONTEXT] + x[NCCL] + allocated * x[FRAG] + x[FRAG_BYTES]))
    return w_i, g_i, o_i, a_i, c_i, t_i, overhead, allocated + overhead, phase


LIMIT = 2.0**59  # 512 PiB per category: far beyond any GPU; 7 of them still fit in int64


_assemble_jit = assemble  # the planner swaps in the numba-compiled twin before compiling below


def sweep_rows(terms, owner, n_configs):
    """Max over each configuration's stage rows of the assembled total; returns (n, N_OUT)."""
    out = np.zeros((n_configs, N_OUT), dtype=np.int64)
    for r in range(terms.shape[0]):
        res = _assemble_jit(terms[r])
        c = owner[r]
        if res[OUT_TOTAL] > out[c, OUT_TOTAL]:
            for k in range(N_OUT):
                out[c, k] = res[k]
    return out
