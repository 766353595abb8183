"""The caching allocator's rules, one hand-derived trace each (CUDACachingAllocator.cpp at
pytorch/pytorch 001074d; the expected figures are worked out in the comments)."""

import pytest

from gpumem.allocator import CachingAllocatorSim, OutOfMemory, simulate
from gpumem.allocator.alloc_conf import AllocConf
from gpumem.allocator.caching import (
    get_allocation_size,
    round_size,
    roundup_power2_next_division,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
DEFAULT = AllocConf()


def sizes(sim):
    """The segment map as [(segment size, [(block size, allocated), ...]), ...]."""
    return [(s.size, [(b.size, b.allocated) for b in s.blocks]) for s in sim.segments()]


# -- round_size / get_allocation_size -------------------------------------------------------------
def test_round_size_512_byte_blocks():
    assert [round_size(n, DEFAULT) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]


def test_roundup_power2_divisions():
    # the C++ comment's example: 1200 between 1024 and 2048 in 4 steps of 256 -> 1280
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024  # a power of two stays
    conf = AllocConf.parse("roundup_power2_divisions:4")
    # 5 MiB + 1 lies in [4 MiB, 8 MiB): steps of 1 MiB -> 6 MiB
    assert round_size(5 * MiB + 1, conf) == 6 * MiB
    # 1200 B is not above 512 B x 4 = 2048 B: plain 512-byte rounding -> 1536
    assert round_size(1200, conf) == 1536
    # per interval: [256:1,512:2,>:8]; 300 MiB is in the 256 MiB interval (1: off), 600 MiB in
    # the 512 MiB one (2 steps of 256 MiB -> 768 MiB), 1.5 GiB + 1 in 1 GiB (8 steps of 128 MiB)
    conf = AllocConf.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert conf.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert round_size(300 * MiB + 1, conf) == 300 * MiB + 512
    assert round_size(600 * MiB, conf) == 768 * MiB
    assert round_size(1536 * MiB + 1, conf) == 1536 * MiB + 128 * MiB


def test_allocation_size():
    # small: a 2 MiB segment; up to 10 MiB: 20 MiB; from 10 MiB: rounded up to 2 MiB
    got = [
        get_allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)
    ]
    assert got == [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


def test_large_segment_size_mb():
    # newer torch: the 1-10 MiB segment (and the large pool's expandable page) is configurable;
    # a 2 MiB request then reserves 40 MiB (as torch.empty(2 << 20) does under
    # large_segment_size_mb:40)
    r = simulate([("alloc", 0, 2 * MiB)], "large_segment_size_mb:40")
    assert (r.peak_reserved, r.peak_allocated) == (40 * MiB, 2 * MiB)
    exp = simulate(
        [("alloc", 0, 2 * MiB), ("alloc", 1, 15 * MiB)],
        "expandable_segments:True,large_segment_size_mb:12",
    )
    # 12 MiB pages: 2 MiB in the first, 15 more need a second page: 24 MiB
    assert exp.peak_reserved == 24 * MiB
    with pytest.raises(ValueError, match="must be >= large_segment_size_mb"):
        AllocConf.parse("large_segment_size_mb:64,max_split_size_mb:32")


# -- pools, splitting, best fit -------------------------------------------------------------------
def test_small_pool_packs_2mib_segments():
    sim = CachingAllocatorSim("")
    for h in range(4):  # 4 x 512 KiB fill one 2 MiB segment exactly
        sim.malloc(h, 512 * KiB)
    assert sim.stats.reserved == 2 * MiB
    sim.malloc(4, 512 * KiB)  # the fifth needs a second segment
    assert sim.stats.reserved == 4 * MiB
    assert sizes(sim) == [
        (2 * MiB, [(512 * KiB, True)] * 4),
        (2 * MiB, [(512 * KiB, True), (1536 * KiB, False)]),
    ]


def test_large_pool_20mib_segment_split_and_reused():
    sim = CachingAllocatorSim("")
    sim.malloc("a", 3 * MiB)  # 20 MiB segment, split: 3 MiB + 17 MiB cached
    assert sizes(sim) == [(20 * MiB, [(3 * MiB, True), (17 * MiB, False)])]
    sim.malloc("b", 17 * MiB)  # the cached remainder fits exactly
    assert sim.stats.reserved == 20 * MiB
    sim.malloc("c", 21 * MiB)  # >= 10 MiB: its own segment, rounded up to 22 MiB
    assert sim.stats.reserved == 42 * MiB
    sim.free("a")
    sim.free("b")  # merges with the freed 3 MiB: one 20 MiB cached block again
    assert sizes(sim)[0] == (20 * MiB, [(20 * MiB, False)])


def test_no_split_when_the_remainder_is_1mib_or_less():
    # 11 MiB -> a 12 MiB segment; the 1 MiB left is not > kSmallSize: the whole block is handed
    # out, and allocated counts 12 MiB
    r = simulate([("alloc", 0, 11 * MiB)], "")
    assert (r.peak_reserved, r.peak_allocated) == (12 * MiB, 12 * MiB)
    assert [b.size for b in r.segments_at_peak[0].blocks] == [12 * MiB]


def test_best_fit_takes_the_smallest_block_that_fits():
    sim = CachingAllocatorSim("")
    sim.malloc("a", 30 * MiB)
    sim.malloc("b", 24 * MiB)
    sim.free("a")
    sim.free("b")  # cached: 30 MiB and 24 MiB
    sim.malloc("c", 22 * MiB)  # the 24 MiB block, split: 22 + 2 (2 MiB > 1 MiB)
    sim.malloc("d", 29 * MiB)  # the 30 MiB block, unsplit (1 MiB left)
    assert sim.stats.reserved == 54 * MiB
    assert sizes(sim) == [
        (30 * MiB, [(30 * MiB, True)]),
        (24 * MiB, [(22 * MiB, True), (2 * MiB, False)]),
    ]
    assert sim.stats.allocated == 52 * MiB


def test_per_stream_pools():
    same = simulate([("alloc", 0, 3 * MiB, 0), ("free", 0), ("alloc", 1, 3 * MiB, 0)], "")
    other = simulate([("alloc", 0, 3 * MiB, 0), ("free", 0), ("alloc", 1, 3 * MiB, 1)], "")
    assert same.peak_reserved == 20 * MiB  # reused
    assert other.peak_reserved == 40 * MiB  # stream 1 cannot take stream 0's cached block
    assert [s.stream for s in other.segments_at_peak] == [0, 1]


# -- max_split_size_mb, max_non_split_rounding_mb -------------------------------------------------
def test_max_split_size_oversize_blocks():
    sim = CachingAllocatorSim("max_split_size_mb:40")
    sim.malloc("a", 100 * MiB)
    sim.free("a")  # cached 100 MiB, oversize (>= 40 MiB)
    sim.malloc("b", 30 * MiB)  # below max_split: an oversize block is never handed to it
    assert sim.stats.reserved == 130 * MiB
    sim.malloc("c", 90 * MiB)  # oversize request: 100 < 90 + 20, taken whole, unsplit
    assert sim.stats.reserved == 130 * MiB and sim.stats.allocated == 130 * MiB
    sim.malloc("d", 60 * MiB)
    sim.free("d")
    sim.malloc("e", 40 * MiB)  # 60 >= 40 + 20: too wasteful, a new 40 MiB segment
    assert sim.stats.reserved == 230 * MiB
    wider = CachingAllocatorSim("max_split_size_mb:40,max_non_split_rounding_mb:30")
    for ev in [("d", 60 * MiB)]:
        wider.malloc(*ev)
    wider.free("d")
    wider.malloc("e", 40 * MiB)  # 60 < 40 + 30: the cached 60 MiB block is taken
    assert (wider.stats.reserved, wider.stats.allocated) == (60 * MiB, 60 * MiB)


def test_large_blocks_below_max_split_still_split():
    # 30 MiB request into a cached 36 MiB block under max_split 40: split 30 + 6
    sim = CachingAllocatorSim("max_split_size_mb:40")
    sim.malloc("a", 36 * MiB)
    sim.free("a")
    sim.malloc("b", 30 * MiB)
    assert sizes(sim) == [(36 * MiB, [(30 * MiB, True), (6 * MiB, False)])]


# -- out of memory: release and retry -------------------------------------------------------------
def test_release_available_cached_blocks_frees_an_oversize_block():
    # capacity 80 MiB: 60 MiB cached (oversize under max_split 40); a 30 MiB request cannot use
    # it and 60 + 30 > 80, so the smallest oversize block >= 40 MiB (the 60) is freed first
    sim = CachingAllocatorSim("max_split_size_mb:40", capacity=80 * MiB)
    sim.malloc("a", 60 * MiB)
    sim.free("a")
    sim.malloc("b", 30 * MiB)
    assert (sim.stats.reserved, sim.stats.reserved_peak) == (30 * MiB, 60 * MiB)
    assert sim.stats.num_alloc_retries == 0  # only the last attempt counts as a retry


def test_oom_frees_all_unsplit_cached_blocks_then_raises():
    ev = [
        ("alloc", "a", 3 * MiB),  # 20 MiB segment
        ("alloc", "s", 1 * KiB),  # 2 MiB small segment: 22 MiB reserved
        ("free", "a"),  # the 20 MiB segment is cached, unsplit
        ("alloc", "c", 30 * MiB),  # 22 + 30 > 40: release_cached_blocks frees the 20 MiB
        # segment (the small one is split: s lives in it), then 2 + 30 = 32 fits
        ("alloc", "d", 10 * MiB),  # 32 + 10 > 40 and nothing cached to free: OOM
        ("free", "c"),
    ]
    r = simulate(ev, "", capacity=40 * MiB)
    assert r.stats.num_alloc_retries == 2
    assert r.peak_reserved == 32 * MiB
    assert r.oom is not None and r.oom.event == 4 and r.oom.size == 10 * MiB
    assert (r.oom.reserved, r.oom.allocated) == (32 * MiB, 30 * MiB + 1 * KiB)
    assert r.events == 4  # stopped there
    with pytest.raises(OutOfMemory, match="simulated CUDA out of memory"):
        sim = CachingAllocatorSim("", capacity=10 * MiB)
        sim.malloc("x", 12 * MiB)


# -- garbage_collection_threshold -----------------------------------------------------------------
def test_garbage_collection_threshold_frees_old_blocks_early():
    ev = [
        ("alloc", "a", 30 * MiB),
        ("alloc", "b", 30 * MiB),
        ("free", "a"),
        ("free", "b"),  # 60 MiB cached, both cached after the 2nd get_free_block call
        # 3rd call finds nothing; 60 > 0.5 x 100: GC target 10 MiB, both blocks age 1 >= the
        # average 1: both freed (GC does not stop at the target); then a 40 MiB segment
        ("alloc", "c", 40 * MiB),
    ]
    gc = simulate(
        ev, "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0", capacity=100 * MiB
    )
    assert (gc.reserved_at_end, gc.peak_reserved) == (40 * MiB, 60 * MiB)
    # without a memory fraction the threshold does nothing (malloc gates GC on set_fraction)
    plain = simulate(ev, "garbage_collection_threshold:0.5", capacity=100 * MiB)
    assert plain.reserved_at_end == 100 * MiB


# -- expandable segments --------------------------------------------------------------------------
def test_expandable_segments_grow_one_mapping():
    ev = [("alloc", "a", 3 * MiB), ("alloc", "b", 30 * MiB)]
    # one 20 MiB page for a (3 MiB + 17 MiB free); b: the free 17 MiB at the end plus one more
    # 20 MiB page -> 40 MiB reserved, b = 30 MiB at 3 MiB, 7 MiB free after it
    exp = simulate(ev, "expandable_segments:True")
    assert (exp.peak_reserved, exp.peak_allocated) == (40 * MiB, 33 * MiB)
    (seg,) = exp.segments_at_peak
    assert seg.expandable and seg.size == 40 * MiB
    assert [(b.size, b.allocated) for b in seg.blocks] == [
        (3 * MiB, True),
        (30 * MiB, True),
        (7 * MiB, False),
    ]
    # without: a 20 MiB segment for a, a 30 MiB one for b
    assert simulate(ev, "").peak_reserved == 50 * MiB


def test_expandable_segments_empty_cache_unmaps_whole_pages():
    sim = CachingAllocatorSim("expandable_segments:True")
    sim.malloc("a", 3 * MiB)
    sim.malloc("b", 30 * MiB)
    sim.free("b")
    # pages: [0, 20) holds a at [0, 3); [20, 40) is free entirely -> unmapped; [3, 20) stays
    assert sim.empty_cache() == 20 * MiB
    assert sizes(sim) == [(20 * MiB, [(3 * MiB, True), (17 * MiB, False)])]
    sim.free("a")
    assert sim.empty_cache() == 20 * MiB
    assert sim.segments() == [] and sim.stats.reserved == 0


def test_expandable_small_pool_uses_2mib_pages():
    r = simulate([("alloc", h, 700 * KiB) for h in range(3)], "expandable_segments:True")
    # 3 x 700 KiB = 2100 KiB: two 2 MiB pages of one small mapping
    assert r.peak_reserved == 4 * MiB
    assert [(s.pool, s.size) for s in r.segments_at_peak] == [("small", 4 * MiB)]


# -- record_stream --------------------------------------------------------------------------------
def test_record_stream_delays_reuse():
    ev = [
        ("alloc", "a", 3 * MiB, 0),
        ("alloc", "f", 17 * MiB, 0),  # fills the rest of a's 20 MiB segment
        ("record_stream", "a", 1),
        ("free", "a"),  # held: stream 1 may still use it
        ("alloc", "b", 3 * MiB, 0),
    ]
    # lag 0: the next malloc's process_events finds stream 1 done: a's block is reused
    assert simulate(ev, "", record_stream_lag=0).peak_reserved == 20 * MiB
    # never completed before b: b needs a second segment
    held = simulate(ev, "", record_stream_lag=None)
    assert held.peak_reserved == 40 * MiB
    done = simulate([*ev[:4], ("free_completed", "a"), ev[4]], "", record_stream_lag=None)
    assert done.peak_reserved == 20 * MiB
    # a use on its own stream is no use at all
    own = [*ev[:2], ("record_stream", "a", 0), ("free", "a"), ev[4]]
    assert simulate(own, "", record_stream_lag=None).peak_reserved == 20 * MiB


def test_empty_cache_returns_only_unsplit_segments():
    sim = CachingAllocatorSim("")
    sim.malloc("a", 3 * MiB)
    sim.malloc("b", 3 * MiB)  # same 20 MiB segment
    sim.malloc("s", 100)
    sim.free("a")
    assert sim.empty_cache() == 0  # both segments are split (b, s live)
    sim.free("b")
    sim.free("s")
    assert sim.empty_cache() == 22 * MiB
    assert sim.stats.reserved == 0


# -- the result -----------------------------------------------------------------------------------
def test_fragmentation_and_largest_free_block_at_the_peak():
    ev = [
        ("alloc", 0, 3 * MiB),
        ("alloc", 1, 3 * MiB),  # peak moment: 20 MiB reserved, 6 MiB allocated
        ("free", 0),
        ("alloc", 2, 30 * MiB),  # new peak: 50 MiB reserved, 33 MiB allocated
        ("free", 2),
    ]
    r = simulate(ev, "")
    assert (r.peak_reserved, r.peak_event, r.allocated_at_peak) == (50 * MiB, 3, 33 * MiB)
    assert r.fragmentation == 17 * MiB
    # cached then: the freed 3 MiB and the 14 MiB tail of the first segment
    assert r.largest_free_at_peak == 14 * MiB
    assert (r.reserved_at_end, r.allocated_at_end) == (50 * MiB, 3 * MiB)
    assert sum(s.size for s in r.segments_at_peak) == r.peak_reserved


def test_zero_byte_allocations_allocate_nothing():
    r = simulate([("alloc", 0, 0), ("alloc", 1, 512), ("free", 1)], "")
    assert (r.peak_reserved, r.peak_allocated) == (2 * MiB, 512)


def test_fork_continues_independently():
    sim = CachingAllocatorSim("")
    sim.malloc("w", 3 * MiB)
    a = simulate([("alloc", 1, 17 * MiB)], sim=sim.fork())
    b = simulate([("alloc", 1, 18 * MiB)], sim=sim.fork())
    # 17 MiB fits the cached rest of w's segment; 18 MiB (>= 10 MiB) gets its own segment
    assert (a.peak_reserved, b.peak_reserved) == (20 * MiB, 38 * MiB)
    assert sim.stats.reserved == 20 * MiB  # the original is untouched


def test_fork_of_a_long_mapping_copies_every_block():
    # 3000 blocks linked in one expandable mapping: copied without recursion, and independent
    sim = CachingAllocatorSim("expandable_segments:True")
    for h in range(3000):
        sim.malloc(h, 2 * MiB)
    sim.record_stream(0, 1)
    sim.free(0)  # held: copied as held
    f = sim.fork()
    for h in range(1, 3000):
        f.free(h)
    f.synchronize()
    assert f.empty_cache() == 6000 * MiB and f.stats.reserved == 0
    assert sim.stats.reserved == 6000 * MiB and len(sim.live) == 2999 and len(sim.pending) == 1
    assert sum(s.size for s in sim.segments()) == 6000 * MiB


def test_bad_calls():
    sim = CachingAllocatorSim("")
    with pytest.raises(KeyError, match="not allocated"):
        sim.free("nope")
    sim.malloc("a", 10)
    with pytest.raises(ValueError, match="already allocated"):
        sim.malloc("a", 10)
    with pytest.raises(ValueError, match="unknown allocator event 'alloc_x'"):
        simulate([("alloc_x", 1)], "")


def test_the_simulator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, gpumem.allocator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_would_reserve_tells_a_malloc_without_running_it():
    sim = CachingAllocatorSim("")
    sim.malloc("w", 3 * MiB)  # a 20 MiB segment, 17 MiB of it cached
    before = (sim.stats.reserved, sim.stats.allocated, sim.largest_free_block())
    assert sim.would_reserve(17 * MiB) == 0  # the cached rest holds it
    assert sim.would_reserve(18 * MiB) == 18 * MiB  # >= 10 MiB: a segment of its own size
    assert sim.would_reserve(1000) == 2 * MiB  # small: a 2 MiB segment
    assert sim.would_reserve(17 * MiB, stream=1) == 18 * MiB  # another stream's pool is empty
    assert (sim.stats.reserved, sim.stats.allocated, sim.largest_free_block()) == before
    for size in (17 * MiB, 18 * MiB, 1000):  # what malloc then really does
        f = sim.fork()
        f.malloc("x", size)
        assert f.stats.reserved - sim.stats.reserved == sim.would_reserve(size)
    # only running it tells: expandable segments, a capacity, frees pending on other streams
    assert CachingAllocatorSim("expandable_segments:True").would_reserve(MiB) is None
    assert CachingAllocatorSim("", capacity=GiB).would_reserve(MiB) is None
    sim.record_stream("w", 1)
    sim.free("w")
    assert sim.would_reserve(MiB) is None
