"""The measuring half of gpumem: where the memory of a training step goes, per layer and phase.

    with gpumem.profile(model, optimizer=opt) as prof:
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    rep = prof.report()

Modules: ``tracker`` (dispatch-mode storage tracking), ``hooks`` (phases, saved tensors),
``session`` (the context manager and its accounting), ``report`` and ``plot`` (outputs),
``fake`` (fake tensors), ``cuda`` (allocator and driver numbers), ``distributed`` (per-rank
summaries), ``categories`` (the shared vocabulary).
"""

from __future__ import annotations

from gpumem.profiler.categories import CATEGORIES, PHASES
from gpumem.profiler.fake import fake, note_assumption
from gpumem.profiler.report import LayerStats, Report, StepReport
from gpumem.profiler.session import DataDependentError, Profile, profile

__all__ = [
    "CATEGORIES", "PHASES", "DataDependentError", "LayerStats", "Profile", "Report",
    "StepReport", "fake", "note_assumption", "profile",
]
