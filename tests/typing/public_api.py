"""Type-checked by mypy (tests/test_house.py), never run: the public face is typed, not ``Any``.

``assert_type`` fails on ``Any``, so each line proves that the lazy ``gpumem`` name resolves to
its real type for a type checker.
"""

from __future__ import annotations

from typing_extensions import assert_type

import gpumem
from gpumem.allocator import (
    AllocConf,
    CachingAllocatorSim,
    ReplayResult,
    SimResult,
    Trace,
    replay_snapshot,
    simulate,
)
from gpumem.checkpoint import Checkpointer, SaveStats
from gpumem.dcp import StorageReader
from gpumem.estimator import Bill, Layout
from gpumem.integrations.hf import CheckpointCallback
from gpumem.planner import PlanResult
from gpumem.profiler import Profile, Report, cluster_table, gather


def public_api(model: object, optimizer: object) -> None:
    assert_type(gpumem.__version__, str)
    layout = gpumem.Layout(dp=8, tp=8, zero=1)
    assert_type(layout, Layout)
    bill = gpumem.estimate("llama-2-70b", seq_len=4096, layout=layout)
    assert_type(bill, Bill)
    assert_type(bill.fits, bool)
    assert_type(bill.per_gpu, dict[str, int])
    assert_type(gpumem.plan("llama-2-70b", n_gpus=64), PlanResult)
    prof = gpumem.profile(model, optimizer)
    assert_type(prof, Profile)
    assert_type(prof.report(), Report)
    assert_type(prof.report().peak_bytes, int)
    assert_type(prof.report().peak_reserved_bytes, int | None)
    assert_type(gpumem.profile(model, alloc_conf="expandable_segments:True"), Profile)
    sim = simulate([("alloc", 0, 512), ("free", 0)], "expandable_segments:True")
    assert_type(sim, SimResult)
    assert_type(sim.peak_reserved, int)
    assert_type(sim.fragmentation, int)
    trace = Trace()
    assert_type(trace.alloc(4096), int)
    assert_type(trace.simulate(AllocConf.parse("max_split_size_mb:256")), SimResult)
    assert_type(CachingAllocatorSim(capacity=80 << 30).empty_cache(), int)
    assert_type(replay_snapshot("snapshot.pickle"), ReplayResult)
    reports = gather(prof.report())
    assert_type(reports, list[Report] | None)
    if reports is not None:
        assert_type(cluster_table(reports), str)
    ckpt = gpumem.Checkpointer("ckpts", keep=3)
    assert_type(ckpt, Checkpointer)
    assert_type(ckpt.restore(), int | None)
    assert_type(ckpt.save(1), SaveStats)
    assert_type(gpumem.checksum.crc32c(b"abc"), int)
    assert_type(gpumem.units.parse_bytes("1GiB"), int)
    assert_type(gpumem.dcp.StorageReader("ckpts"), StorageReader)
    assert_type(gpumem.integrations.hf.CheckpointCallback, type[CheckpointCallback])
