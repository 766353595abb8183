"""The compiled plain-case simulator (``gpumem._C.PlainSim``) against the Python one, the
reference: random traces under each setting it takes, every figure compared after every event,
the segment maps at the end, forks, and the run counters the estimator reads."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocatorSim
from gpumem.allocator.alloc_conf import AllocConf
from gpumem.allocator.compiled import compiled_segments, plain_sim
from gpumem.estimator.step_trace import _CompiledRun, _Run

pytest.importorskip("gpumem._C")

KiB = 1 << 10
MiB = 1 << 20
CONFS = [
    "",
    "max_split_size_mb:32",
    "max_split_size_mb:32,max_non_split_rounding_mb:64",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,4:8,>:4],max_split_size_mb:40",
    "large_segment_size_mb:12",
]
SIZES = st.one_of(
    st.integers(0, 4 * KiB),
    st.integers(4 * KiB, 2 * MiB),  # around the 1 MiB small/large line
    st.integers(2 * MiB, 12 * MiB),  # around the 10 MiB kMinLargeAlloc line
    st.integers(12 * MiB, 80 * MiB),  # around max_split_size 32 MiB
    st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB, 20 * MiB, 32 * MiB]),
)
# (op, size, stream, pick): op 0 alloc, 1 free the pick-th live handle, 2 empty_cache
OPS = st.lists(
    st.tuples(st.sampled_from([0, 0, 0, 1, 1, 2]), SIZES, st.integers(0, 1), st.integers(0, 99)),
    max_size=120,
)


def _figures(py: CachingAllocatorSim, c) -> tuple:
    s = py.stats
    return (
        (s.reserved, s.reserved_peak, s.allocated, s.allocated_peak, s.requested),
        (s.requested_peak, s.segments, s.num_device_alloc, s.num_device_free, py.mallocs),
        (py.releasable(), py.largest_free_block()),
    ), (
        (c.reserved, c.reserved_peak, c.allocated, c.allocated_peak, c.requested),
        (c.requested_peak, c.segments_count, c.num_device_alloc, c.num_device_free, c.mallocs),
        (c.releasable(), c.largest_free_block()),
    )


@pytest.mark.parametrize("conf", CONFS)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, probe=SIZES)
def test_every_event_gives_the_python_simulators_figures(conf, ops, probe):
    ac = AllocConf.parse(conf)
    py, c = CachingAllocatorSim(ac), plain_sim(ac)
    live: list[int] = []
    for n, (op, size, stream, pick) in enumerate(ops):
        if op == 0:
            py.malloc(n, size, stream)
            c.malloc(n, size, stream)
            live.append(n)
        elif op == 1 and live:
            h = live.pop(pick % len(live))
            py.free(h)
            c.free(h)
        elif op == 2:
            assert py.empty_cache() == c.empty_cache()
        want, got = _figures(py, c)
        assert got == want, (n, op, size, stream)
        assert c.would_reserve(probe, stream) == py.would_reserve(probe, stream)
    assert compiled_segments(c) == py.segments()


@settings(max_examples=40, deadline=None)
@given(ops=OPS, more=OPS, conf=st.sampled_from(CONFS))
def test_a_fork_goes_on_like_the_python_fork_and_leaves_its_parent(conf, ops, more):
    ac = AllocConf.parse(conf)
    runs = [_Run(ac), _CompiledRun(plain_sim(ac))]
    handles: list[list[int]] = [[], []]

    def play(rs, hs, seq):
        for op, size, stream, pick in seq:
            for r, h in zip(rs, hs, strict=True):
                if op == 0:
                    h.append(r.take(size, None, stream))
                elif op == 1 and h:
                    r.give(h.pop(pick % len(h)))
        return [(r.counters(), r.releasable(), r.result(), r.segments()) for r in rs]

    before = play(runs, handles, ops)
    assert before[0] == before[1]
    forks = [r.fork() for r in runs]
    after = play(forks, [list(h) for h in handles], more)
    assert after[0] == after[1]
    assert [(r.counters(), r.segments()) for r in runs] == [(b[0], b[3]) for b in before]
    for size in (100, 3 * MiB, 50 * MiB):
        grow = runs[0].sim.would_reserve(size)
        assert runs[1].result_with(size, grow) == runs[0].result_with(size, grow)


def test_hand_derived_figures():
    # 1000 B: a 2 MiB small segment; 3 MiB: a 20 MiB large one, split (17 MiB left cached);
    # freeing the 1000 B leaves the small segment whole, so releasable; 17 MiB is the largest
    c = plain_sim(AllocConf())
    c.malloc(0, 1000)
    c.malloc(1, 3 * MiB)
    c.free(0)
    assert (c.reserved, c.allocated, c.releasable(), c.largest_free_block()) == (
        22 * MiB,
        3 * MiB,
        2 * MiB,
        17 * MiB,
    )
    assert c.would_reserve(17 * MiB) == 0 and c.would_reserve(17 * MiB + 1) == 18 * MiB
    assert c.empty_cache() == 2 * MiB


def test_bad_calls_are_python_errors():
    c = plain_sim(AllocConf())
    c.malloc(1, 4096)
    with pytest.raises(ValueError, match="already allocated"):
        c.malloc(1, 4096)
    with pytest.raises(KeyError, match="not allocated"):
        c.free(2)
    with pytest.raises(OverflowError):
        c.malloc(3, 1 << 55)


def test_where_the_python_simulator_runs_instead(monkeypatch):
    assert plain_sim(AllocConf.parse("expandable_segments:True")) is None
    monkeypatch.setenv("GPUMEM_PY_ALLOCATOR", "1")
    assert plain_sim(AllocConf()) is None


def test_sizes_beyond_the_compiled_simulator_are_simulated_in_python():
    from gpumem.estimator.step_trace import StepShape, fragmentation, replayed

    shape = StepShape(saved=(1 << 55, 3 * MiB), t_layer=1 << 70, first=5000)
    conf = AllocConf()
    assert fragmentation(conf, shape, 3) == replayed(conf, shape, 3, compiled=False)
