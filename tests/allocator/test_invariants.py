"""Random traces against the allocator's invariants: whatever the sequence, the segments tile
their memory, reserved and allocated are the sums they stand for, no two free neighbours stay
unmerged, and freeing everything then emptying the cache gives every byte back."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocatorSim, simulate
from gpumem.allocator.caching import K_LARGE_BUFFER, K_SMALL_BUFFER

KiB = 1 << 10
MiB = 1 << 20

CONFS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:32",
    "max_split_size_mb:32,max_non_split_rounding_mb:64",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
]
SIZES = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(4 * KiB, 2 * MiB),  # around the 1 MiB small/large line
    st.integers(2 * MiB, 12 * MiB),  # around the 10 MiB kMinLargeAlloc line
    st.integers(12 * MiB, 80 * MiB),  # around max_split_size 32 MiB
)


def _all_blocks(sim):
    blocks = [*sim.live.values(), *sim.pending.values()]
    for pool in (sim.small, sim.large):
        assert len(pool.blocks) == len(pool.by_key) and pool.blocks == sorted(pool.blocks)
        assert len(pool.unmapped) == len(pool.unmapped_by_key)
        blocks += pool.by_key.values()
        blocks += pool.unmapped_by_key.values()
    return blocks


def check(sim):
    blocks = _all_blocks(sim)
    assert len({id(b) for b in blocks}) == len(blocks)  # each block in one place
    by_seg = {}
    for b in blocks:
        by_seg.setdefault(b.seg.base, []).append(b)
    reserved = 0
    for base, bs in by_seg.items():
        seg = sim._segments[base]
        bs.sort(key=lambda b: b.addr)
        assert bs[0].addr == base and bs[0].prev is None and bs[-1].next is None
        for a, b in itertools.pairwise(bs):
            assert a.addr + a.size == b.addr and a.next is b and b.prev is a  # tiled, linked
            free_a = not a.allocated and not a.pending
            free_b = not b.allocated and not b.pending
            assert not (free_a and free_b and a.mapped == b.mapped)  # merged
        assert sum(b.size for b in bs) == seg.size
        mapped = sum(b.size for b in bs if b.mapped)
        if seg.expandable:
            page = K_SMALL_BUFFER if seg.small else K_LARGE_BUFFER
            assert all(b.addr % page == base % page for b in bs if not b.mapped)
        else:
            assert mapped == seg.size
        reserved += mapped
    assert reserved == sim.stats.reserved
    assert sum(b.size for b in sim.live.values()) == sim.stats.allocated
    assert sim.stats.reserved <= sim.stats.reserved_peak
    assert sum(s.size for s in sim.segments()) == sim.stats.reserved


@st.composite
def traces(draw):
    n = draw(st.integers(1, 60))
    live, events, nxt = [], [], 0
    for _ in range(n):
        if live and draw(st.booleans()):
            h = live.pop(draw(st.integers(0, len(live) - 1)))
            if draw(st.integers(0, 5)) == 0:
                events.append(("record_stream", h, 1))
            events.append(("free", h))
        else:
            events.append(("alloc", nxt, draw(SIZES), draw(st.sampled_from([0, 0, 0, 2]))))
            live.append(nxt)
            nxt += 1
        if draw(st.integers(0, 15)) == 0:
            events.append(("empty_cache",))
    return events, live


@settings(max_examples=150, deadline=None)
@given(traces(), st.sampled_from(CONFS), st.sampled_from([None, 0, 1]))
def test_invariants_hold_after_every_event(trace, conf, lag):
    events, live = trace
    sim = CachingAllocatorSim(conf, capacity=2048 * MiB, record_stream_lag=lag)
    for ev in events:
        if ev[0] == "alloc":
            sim.malloc(ev[1], ev[2], ev[3])
        elif ev[0] == "free":
            sim.free(ev[1])
        elif ev[0] == "record_stream":
            sim.record_stream(ev[1], ev[2])
        else:
            sim.empty_cache()
        check(sim)
    twin = sim.fork()  # a copy that goes on the same way
    check(twin)
    for s in (sim, twin):
        for h in live:
            s.free(h)
            check(s)
    assert twin.stats == sim.stats and twin.segments() == sim.segments()
    sim.empty_cache()  # synchronizes: held frees complete, then everything unsplit goes
    check(sim)
    assert (sim.stats.reserved, sim.stats.allocated) == (0, 0) and sim.segments() == []
    # and simulate() agrees with the step-by-step run on the peak
    r = simulate(events, conf, capacity=2048 * MiB, record_stream_lag=lag)
    assert r.peak_allocated <= r.peak_reserved and r.oom is None


@settings(max_examples=60, deadline=None)
@given(traces())
def test_expandable_never_reserves_more_than_needed_pages(trace):
    # one mapping per stream and pool grows in whole pages: at any moment, reserved is at most
    # the allocated bytes rounded up to pages plus one page per mapping and free block
    events, _ = trace
    sim = CachingAllocatorSim("expandable_segments:True")
    for ev in events:
        if ev[0] == "alloc":
            sim.malloc(ev[1], ev[2], ev[3])
        elif ev[0] == "free":
            sim.free(ev[1])
        elif ev[0] == "record_stream":
            sim.record_stream(ev[1], ev[2])
        else:
            sim.empty_cache()
    sim.empty_cache()
    check(sim)
    free_blocks = len(sim.small.blocks) + len(sim.large.blocks)
    pages = sim.stats.allocated + (free_blocks + 4) * K_LARGE_BUFFER
    assert sim.stats.reserved <= pages
