"""torchtitan's compiled loss: what ``torch.compile`` (Inductor) of its cross-entropy keeps.

torchtitan's ``build_cross_entropy_loss`` (``components/loss.py``, the ``config_manager`` era
that includes e7c0cae, June 2025) wraps ``cross_entropy(pred.flatten(0, 1).float(),
labels.flatten(0, 1))`` in ``torch.compile`` when ``--training.compile`` is set. AOTAutograd's
min-cut partitioner (the one Inductor uses) with Inductor's decompositions then saves, for the
backward, the bf16 logits themselves (the graph's input: ``del pred`` no longer frees them), the
per-row max and log-sum-exp (fp32) and nll's fp32 total weight; the fp32 upcast, log-softmax's
output and both fp32 gradients are never materialised (fused into one reduction kernel forward
and one pointwise kernel backward). The backward allocates one fp32 per-row buffer and the bf16
gradient of the logits, which it returns.

So the loss holds 2 B per logit through backward and 4 B at its backward's widest moment, where
eager holds 4 B (log-softmax's output) and 12 B. Checked against Inductor's own buffer plan (its
generated wrapper code on CPU, ``tests/estimator/test_titan_compile.py``), exactly.

Not modelled: the compiled *blocks* (torchtitan compiles each block too; they are priced as
eager, whose per-op SAC saved set is the save list's, but whose temporaries Inductor fuses:
an upper bound on the block moments), loss parallel (TP) and the chunked loss under compile.
"""

from __future__ import annotations

_BF16 = 2
_FP32 = 4


def compiled_loss_saved(n: int, v: int) -> dict[str, int]:
    """What the compiled loss's forward keeps for backward (``n`` tokens, ``v`` local vocab):
    the logits (its input), the per-row max and log-sum-exp, and nll's total weight."""
    return {"logits": n * v * _BF16, "row_max": n * _FP32, "row_lse": n * _FP32, "weight": _FP32}


def compiled_loss_bwd(n: int, v: int) -> tuple[int, ...]:
    """The compiled backward's own allocations, in order: the fp32 per-row buffer (freed before
    it returns) and the bf16 gradient of the logits (returned)."""
    return (n * _FP32, n * v * _BF16)


def check_compiled_loss(compiled_loss: bool, loss_chunks: int, tp: int) -> None:
    """``compiled_loss`` models the whole-logits loss without loss parallel."""
    if not isinstance(compiled_loss, bool):
        raise ValueError(f"compiled_loss must be True or False, got {compiled_loss!r}")
    if compiled_loss and (loss_chunks or tp > 1):
        raise ValueError(
            "framework='torchtitan': compiled_loss models the compiled whole-logits loss "
            "without tensor parallelism; with loss_chunks or tp > 1 (loss parallel) it is not "
            "modelled yet: use compiled_loss=False"
        )


__all__ = ["check_compiled_loss", "compiled_loss_bwd", "compiled_loss_saved"]
