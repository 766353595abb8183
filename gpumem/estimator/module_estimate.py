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

from typing import Any

from gpumem.allocator.alloc_conf import AllocConf
from gpumem.estimator import inputs, peak
from gpumem.estimator.bill import Bill, make_bill
from gpumem.estimator.frameworks.conventions import default_keep_logits
from gpumem.estimator.job import Job
from gpumem.estimator.layout import Layout
from gpumem.estimator.module_inputs import resolve_batch
from gpumem.estimator.module_pass import measure, module_terms
from gpumem.estimator.module_structure import find_blocks
from gpumem.estimator.step_trace import StatesShape, fragmentation, new_run
from gpumem.estimator.terms import RECOMPUTE, cluster_states


def check_module_job(module: Any, job: Job) -> None:
    """The checks of an ``nn.Module``'s estimate that need no pass (before any work)."""
    acts = job.activations
    _check(module, job.training, job.layout, job.recompute, acts.attention, acts.dropout,
           acts.activation_model, job.seq_len)  # fmt: skip
    blocks = find_blocks(module)
    layout = job.layout
    if (layout.pp > 1 or layout.tp > 1) and not blocks:
        raise ValueError(
            f"layout {layout.describe()} is invalid for {type(module).__name__}: tensor and "
            "pipeline parallelism split repeated blocks, and this module repeats none "
            "(no two sibling submodules with the same class and parameter shapes)"
        )
    if layout.pp > len(blocks) and blocks:
        raise ValueError(
            f"layout {layout.describe()}: pp={layout.pp} exceeds the {len(blocks)} blocks"
        )
    if layout.tp > 1:
        _check_tp(module, layout.tp)


def estimate_module(module: Any, job: Job) -> Bill:
    """The bill of training ``module`` (see ``gpumem.estimate`` and above; checked by
    ``check_module_job``); ``job.alloc_conf``: simulate the caching allocator over the
    measured pass (``replica_fragmentation``)."""
    training, layout, device, fw = job.training, job.layout, job.device, job.framework
    keep_logits = job.activations.keep_logits
    batch = resolve_batch(module, job.example_input, job.batch_size)
    ms = measure(
        module,
        training,
        example_input=job.example_input,
        batch=batch,
        seq=job.seq_len,
        device=device,
        recompute=job.recompute,
        keep_logits=default_keep_logits(fw) if keep_logits is None else keep_logits,
        loss_fn=job.loss_fn,
    )
    terms = module_terms(
        ms, training, layout, job.gpu, device == "cuda", job.grad_accum, job.persistent_grads, fw
    )
    alloc_conf, reserved_note = job.alloc_conf, job.reserved_note
    simulated = alloc_conf is not None and whole_replica(layout) and bool(ms.alloc_events)
    if simulated:
        assert alloc_conf is not None
        for x in terms:
            unreleasable, reserved = replica_fragmentation(ms, alloc_conf, x)
            x[peak.FRAG_BYTES] = float(unreleasable) if device == "cuda" else 0.0
            x[peak.RESERVED_FRAG] = float(reserved)
            x[peak.FRAG] = 0.0
    elif alloc_conf is not None:
        reserved_note = (
            "the nn.Module path simulates one whole replica (tp, pp, cp 1, no ZeRO/FSDP): "
            "this layout keeps the flat share"
        )
    return make_bill(
        ms,
        ms.n_params,
        terms,
        list(range(layout.pp)),
        layout=layout,
        training=training,
        gpu=job.gpu,
        framework=fw,
        alloc_conf=(alloc_conf.text or "default") if simulated and alloc_conf else None,
        reserved_note=reserved_note,
        cluster_model_state_bytes=cluster_states(
            training, ms.n_trainable, ms.n_params - ms.n_trainable
        ),
        inputs={
            "batch_size": batch,
            "seq_len": job.seq_len,
            "recompute": job.recompute,
            "grad_accum": job.grad_accum,
            "device": device,
            "blocks": len(ms.blocks),
            "measured_moment": f"{ms.moment} of backward",
            "precision": training.precision,
            "optimizer": training.optimizer,
        },
        sources={
            **inputs.sources(
                seq_source="given" if job.seq_len is not None else "the example input's",
                batch_size=job.batch_size,
                grad_accum=job.grad_accum,
                recompute=job.recompute,
                training=training,
                given=job.given,
            ),
            **({} if job.batch_size is not None else {"batch_size": "the example input's"}),
        },
    )


def whole_replica(layout: Layout) -> bool:
    """Whether a rank holds what the measured pass held: the whole module, unsplit, unsharded."""
    return layout.tp == layout.pp == layout.cp == 1 and layout.stage == 0


def replica_fragmentation(ms: Any, conf: AllocConf, x: list[float]) -> tuple[int, int]:
    """(unreleasable, reserved) bytes over the requested peak of one replica's step: the
    measured pass's own allocations and frees in order (weights, forward, loss, backward:
    the profiler's log) then the optimizer step's temporary (``peak.T_STEP``), and apart the
    optimizer states (one tensor per fp32 state and trainable tensor) and DDP's buckets, never
    freed (``step_trace``'s split of states and step)."""
    run = new_run(conf)
    for h, n in ms.alloc_events:
        if n >= 0:
            run.take(n, h)
        else:
            run.give(h)
    t_step = int(x[peak.T_STEP])
    grow = run.sim.would_reserve(t_step) if t_step else 0
    if grow is not None:
        step = run.result_with(t_step, grow) if t_step else run.result()
    else:
        run.give(run.take(t_step))
        step = run.result()
    ob = x[peak.O_BYTES] if not x[peak.OFFLOAD] else 0.0
    k = max(1, round(ob / 4))
    sizes = [int(n * ob / k) for n in ms.trainable_numels for _ in range(k)] if ob else []
    sizes += [int(x[peak.COMM])] if x[peak.COMM] else []
    states = fragmentation(conf, StatesShape(tuple(s for s in sizes if s)), 1)
    return step[0] + states[0], step[1] + states[1]


def _check(
    module, training, layout, recompute, attention, dropout, activation_model, seq_len
) -> None:
    name = type(module).__name__
    if activation_model != "ops":
        raise ValueError(
            f"activation_model={activation_model!r} needs a transformer shape (presets, "
            "config.json, "
            f"ModelSpec); {name} is measured, which is the 'ops' model"
        )
    if attention != "sdpa" or dropout:
        raise ValueError(
            f"attention and dropout of an nn.Module are whatever {name}.forward does: set them in "
            "the module (its own attention code and dropout run in the fake pass)"
        )
    if training.lora_rank or training.base_quant:
        raise ValueError(
            "lora_rank/base_quant describe presets; for an nn.Module freeze the base yourself "
            "(requires_grad=False) and add the adapters: only trainable parameters get "
            "gradients and optimizer state"
        )
    if recompute not in RECOMPUTE and recompute != "every-1":
        raise ValueError(
            f"recompute={recompute!r} for an nn.Module: use 'none' or 'full' (every block under "
            "torch.utils.checkpoint); checkpointing inside your module is measured as it runs"
        )
    if recompute == "selective":
        raise ValueError(
            "recompute='selective' drops the attention core, which a generic module does not "
            "name: use 'none' or 'full', or checkpoint the attention inside your module (measured)"
        )
    if layout.cp > 1:
        raise ValueError(
            f"cp={layout.cp}: context parallelism is modelled for presets/configs only; "
            f"estimate {name} with cp=1"
        )
    if layout.ep > 1 or layout.etp is not None:
        raise ValueError(
            f"ep={layout.ep}: expert parallelism is modelled for MoE presets/configs only; "
            f"estimate {name} with ep=1"
        )
    if seq_len is not None and (
        not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0
    ):
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")


def _check_tp(module: Any, tp: int) -> None:
    """Every matrix must split over tp along some dimension (Megatron splits rows or columns)."""
    bad = [
        f"{n} {tuple(p.shape)}"
        for n, p in module.named_parameters()
        if p.dim() >= 2 and not any(d % tp == 0 for d in p.shape)
    ]
    if bad:
        raise ValueError(
            f"tp={tp} cannot split {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}: no "
            "dimension divisible by tp; pick a tp that divides the model's widths"
        )
