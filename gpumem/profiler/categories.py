"""The memory categories and training phases every gpumem report speaks in.

They are the estimator's categories too (issue #4), so a measured profile can calibrate an
estimate term by term.

- ``weights``: parameters and buffers of the model.
- ``gradients``: ``.grad`` of parameters (from the moment autograd accumulates them).
- ``optimizer``: tensors held in ``optimizer.state`` (Adam moments, step counters, ...).
- ``activations``: storages saved for backward during forward (autograd saved-tensor hooks), and
  the inputs ``torch.utils.checkpoint`` keeps for its recomputation.
- ``communication``: what sharding costs under torch.distributed: parameters FSDP (or tensor
  parallelism) gathers to full size, its gather and prefetch buffers, unsharded gradients
  waiting for their reduce-scatter, and the reduce-scatter and all-reduce buffers; outputs of
  collectives that autograd saves for backward are activations instead.
- ``temporary``: everything else created inside the region (outputs not saved for backward,
  gradients of activations, checkpoint recomputation, optimizer scratch space).
- ``inputs``: tensors passed to the model's forward.
"""

from __future__ import annotations

WEIGHTS = "weights"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer"
ACTIVATIONS = "activations"
COMMUNICATION = "communication"
TEMPORARY = "temporary"
INPUTS = "inputs"

CATEGORIES: tuple[str, ...] = (
    WEIGHTS,
    GRADIENTS,
    OPTIMIZER,
    ACTIVATIONS,
    COMMUNICATION,
    TEMPORARY,
    INPUTS,
)

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER_PHASE = "optimizer"

PHASES: tuple[str, ...] = (FORWARD, BACKWARD, OPTIMIZER_PHASE)
