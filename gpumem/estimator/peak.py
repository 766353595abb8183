"""The per-GPU peak, assembled from precomputed terms by one scalar function.

``assemble`` is plain arithmetic on numbers so that the estimator calls it in Python and the
planner compiles the very same function with numba for its sweep: one formula, two speeds.

The peak is the largest of three moments of a training step (HF "Visualize and understand GPU
memory" and the Megatron golden values agree on this shape):

1. start of backward: every activation of the in-flight micro-batches, the logits and the loss's
   backward transients, plus any gradient buffers that persist across steps;
2. end of backward, inside the stage's first layer (the last one backward reaches): every
   gradient but that layer's (and an untied embedding's) unless gradients persist, the weight
   grads the layer has produced by its widest moment, its live (or recomputed) activations and
   the gradients in flight there (``backward.py`` replays its nodes), the logits the caller
   still holds;
3. optimizer step: all gradients plus the step's temporaries.

Logits the training loop still holds (``keep_logits``: a ``logits = model(x)`` variable lives
until the next forward replaces it) count in all three, and so does the input batch (``IDS``,
inside ``A_FIRST`` during backward).

Weights, optimizer state and (for ZeRO-3/FSDP) the all-gather buffers are present throughout.
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
N_TERMS = 34


def assemble(x):
    """Category bytes at the peak of one rank: (weights, gradients, optimizer, activations,
    temporary, overhead, total, phase) with phase 0/1/2 = backward start/end, step."""
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
    acts = x[INFLIGHT] * (x[N_LAYERS] * x[A_LAYER] + x[A_FIRST]) + x[A_LAST] + x[CASTS]
    g_keep = grads if x[G_PERSIST] > 0 else 0.0
    base = weights + optim + x[COMM]
    start = base + g_keep + acts + x[T_BWD0] + x[GATHER]
    pend = x[P_PEND] * x[G_BYTES] / ng + x[P_PEND_EXP] * x[G_BYTES] / nge
    g_end = grads - pend + x[G_WALK]
    end = base + g_end + x[A_FIRST] + x[A_END] + x[HELD] + x[T_LAYER] + x[GATHER]
    step = base + grads + x[HELD] + x[IDS] + x[T_STEP]
    phase = 0
    best = start
    if end > best:
        phase = 1
        best = end
    if step > best:
        phase = 2
        best = step
    if phase == 0:
        g, a, t = g_keep, acts, x[T_BWD0] + x[GATHER] + x[COMM]
    elif phase == 1:
        g, a, t = g_end, x[A_FIRST] + x[A_END] + x[HELD], x[T_LAYER] + x[GATHER] + x[COMM]
    else:
        g, a, t = grads, x[HELD] + x[IDS], x[T_STEP] + x[COMM]
    w_i, g_i, o_i, a_i, t_i = int(weights), int(g), int(optim), int(a), int(t)
    allocated = w_i + g_i + o_i + a_i + t_i
    overhead = int(x[CONTEXT] + x[NCCL] + allocated * x[FRAG])
    return w_i, g_i, o_i, a_i, t_i, overhead, allocated + overhead, phase


_assemble_jit = assemble  # the planner swaps in the numba-compiled twin before compiling below


def sweep_rows(terms, owner, n_configs):
    """Max over each configuration's stage rows of the assembled total; returns (n, 8)."""
    out = np.zeros((n_configs, 8), dtype=np.int64)
    for r in range(terms.shape[0]):
        res = _assemble_jit(terms[r])
        c = owner[r]
        if res[6] > out[c, 6]:
            for k in range(8):
                out[c, k] = res[k]
    return out
