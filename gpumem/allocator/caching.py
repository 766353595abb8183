"""A simulator of PyTorch's CUDA caching allocator (``DeviceCachingAllocator``), in pure Python.

Fed a sequence of ``malloc(handle, size, stream)`` / ``free(handle)`` calls (plus
``record_stream``, ``free_completed``, ``synchronize`` and ``empty_cache``), it makes the
decisions the C++ allocator makes and keeps its statistics: reserved and allocated bytes and
their peaks, the segments and their blocks, what an ``empty_cache()`` returns, and whether a
device of a given size would have run out of memory.

Source followed: ``c10/cuda/CUDACachingAllocator.cpp`` of pytorch/pytorch at commit
``001074d25084fdb87a799823e395a50f5ec044d3``, with the config of torch 2.9+
(``c10/core/AllocatorConfig.cpp``: ``max_non_split_rounding_mb``) and the refinements of the
generic ``c10/core/CachingDeviceAllocator.h`` where they differ (expandable blocks are never
released by ``release_available_cached_blocks`` or the garbage collector). Every rule below
names the C++ function and the statement it follows.

Addresses are simulated: segments are laid out one after the other (2 MiB aligned, as cudaMalloc
returns them) and never reuse a freed segment's address, so among equal-sized cached blocks the
choice may differ from a real run's (which block is taken, never how many bytes are reserved,
unless sizes then diverge).
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpumem.allocator.alloc_conf import SIZE_MAX, AllocConf, resolve

# CUDACachingAllocator.cpp, the constants at the top of namespace Native
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations between 1 and 10 MiB use kLargeBuffer
K_ROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
_NO_CAPACITY_SPACE = 1 << 44  # an expandable segment's address space when no capacity is given


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` rounded up to the next of ``divisions``
    equal steps between the powers of two around it (1200 with 4 divisions: 1280)."""
    if size & (size - 1) == 0:  # llvm::isPowerOf2_64
        return size
    floor = _pow2_floor(size)
    step = floor >> (divisions.bit_length() - 1)  # power2_floor >> log2(divisions)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, conf: AllocConf) -> int:
    """``round_size``: below 512 B, 512 B; with ``roundup_power2_divisions`` set for the size's
    interval (and the size above 512 B × divisions), the next division; else a multiple of
    512 B."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = conf.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int, large_segment: int = K_LARGE_BUFFER) -> int:
    """``get_allocation_size``: the segment cudaMalloc'ed for a request no cached block holds:
    2 MiB for small requests, 20 MiB (``large_segment_size_mb``) below 10 MiB, else the size
    rounded up to 2 MiB (never less than the request, whatever the large segment size)."""
    rounded = K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return max(large_segment, rounded)
    return rounded


class _Segment:
    """One cudaMalloc, or one expandable segment (a virtual range mapped page by page)."""

    __slots__ = ("base", "expandable", "page", "size", "small", "stream")

    def __init__(self, base: int, size: int, stream: int, small: bool, page: int = 0) -> None:
        self.base = base
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = page > 0
        self.page = page


class _Block:
    """``struct Block``: a piece of a segment, allocated, cached (free) or unmapped."""

    __slots__ = (
        "addr",
        "allocated",
        "due",
        "gc_base",
        "handle",
        "mapped",
        "next",
        "pending",
        "prev",
        "requested",
        "seg",
        "size",
        "uses",
    )

    def __init__(self, addr: int, size: int, seg: _Segment) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.pending = False  # freed with outstanding stream uses (event_count > 0)
        self.uses: set[int] | None = None  # stream_uses
        self.due = 0  # pending: the malloc count at which its events have completed
        self.requested = 0
        self.gc_base = 0
        self.handle: Hashable = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``struct BlockPool``: the cached blocks of one kind (small or large), ordered like
    ``BlockComparatorSize`` (stream, size, address); the unmapped ranges of expandable segments
    ordered like ``BlockComparatorAddress`` (stream, address)."""

    __slots__ = ("blocks", "by_key", "gc_calls", "small", "unmapped", "unmapped_by_key")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.blocks: list[tuple[int, int, int]] = []
        self.by_key: dict[tuple[int, int, int], _Block] = {}
        self.unmapped: list[tuple[int, int]] = []
        self.unmapped_by_key: dict[tuple[int, int], _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:  # insert_into_blocks
        b.gc_base = self.gc_calls
        k = (b.seg.stream, b.size, b.addr)
        insort(self.blocks, k)
        self.by_key[k] = b

    def erase(self, b: _Block) -> None:
        k = (b.seg.stream, b.size, b.addr)
        del self.by_key[k]
        del self.blocks[bisect_left(self.blocks, k)]

    def insert_unmapped(self, b: _Block) -> None:
        k = (b.seg.stream, b.addr)
        insort(self.unmapped, k)
        self.unmapped_by_key[k] = b

    def erase_unmapped(self, b: _Block) -> None:
        k = (b.seg.stream, b.addr)
        del self.unmapped_by_key[k]
        del self.unmapped[bisect_left(self.unmapped, k)]


class OutOfMemory(Exception):
    """A simulated allocation failed even after freeing the cache (the C++ OutOfMemoryError)."""

    def __init__(self, size: int, reserved: int, allocated: int, limit: int) -> None:
        self.size = size
        self.reserved = reserved
        self.allocated = allocated
        self.limit = limit
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {size} B with {reserved} B "
            f"reserved ({allocated} B allocated) of {limit} B"
        )


@dataclass(frozen=True)
class BlockInfo:
    size: int
    allocated: bool
    requested: int = 0
    """The bytes asked for (before rounding); 0 for a free block."""


@dataclass(frozen=True)
class SegmentInfo:
    """One segment of the map (for an expandable segment: one contiguous mapped range)."""

    address: int
    size: int
    stream: int
    pool: str
    """``"small"`` or ``"large"``."""
    expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated(self) -> int:
        return sum(b.size for b in self.blocks if b.allocated)


@dataclass
class AllocatorStats:
    """What ``torch.cuda.memory_stats()`` would say (the ``all`` pool)."""

    reserved: int = 0
    reserved_peak: int = 0
    allocated: int = 0
    allocated_peak: int = 0
    requested: int = 0
    requested_peak: int = 0
    segments: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0
    num_sync_all_streams: int = 0


@dataclass
class OOMInfo:
    event: int
    """Index of the malloc that failed."""
    size: int
    """Its request (bytes, before rounding)."""
    reserved: int
    allocated: int


@dataclass
class SimResult:
    """The outcome of :func:`simulate`."""

    peak_reserved: int
    """``reserved_bytes.all.peak``."""
    peak_allocated: int
    """``allocated_bytes.all.peak`` (block sizes: requests rounded by ``round_size``)."""
    reserved_at_end: int
    allocated_at_end: int
    peak_event: int
    """Index of the peak moment's event: the first after which reserved memory is at its peak
    and allocated memory at its highest while it is (-1: no allocation)."""
    allocated_at_peak: int
    """Allocated bytes at that moment."""
    largest_free_at_peak: int
    """The largest cached (free, mapped) block at that moment."""
    segments_at_peak: list[SegmentInfo] | None
    """The segment map at that moment (``None`` when not asked for)."""
    stats: AllocatorStats
    events: int
    """Events processed (all of them unless the simulation ran out of memory)."""
    oom: OOMInfo | None = None
    conf: AllocConf = field(default_factory=AllocConf)
    capacity: int | None = None

    @property
    def fragmentation(self) -> int:
        """Reserved less allocated at the reserved peak: cached memory no tensor uses."""
        return self.peak_reserved - self.allocated_at_peak

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_reserved_bytes": self.peak_reserved,
            "peak_allocated_bytes": self.peak_allocated,
            "fragmentation_bytes": self.fragmentation,
            "largest_free_block_bytes": self.largest_free_at_peak,
            "segments_at_peak": None
            if self.segments_at_peak is None
            else len(self.segments_at_peak),
            "events": self.events,
            "oom": None if self.oom is None else vars(self.oom),
            "alloc_conf": self.conf.text,
            "capacity": self.capacity,
        }


class CachingAllocatorSim:
    """One device's caching allocator.

    Args:
        alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` string, an :class:`AllocConf`, or ``None``
            to read the environment.
        capacity: device memory the allocator may reserve (bytes); ``None``: unlimited (never
            OOMs). With a capacity, a cudaMalloc that would exceed it fails, and the allocator
            frees cached blocks and retries as the C++ does before raising :class:`OutOfMemory`.
        record_stream_lag: a free of a block used on other streams (``record_stream``) completes
            at the malloc this many mallocs later (0: the next one, whose ``process_events``
            finds the other streams done); ``None``: only at ``free_completed`` or
            ``synchronize``.

    Example:
        >>> sim = CachingAllocatorSim("")
        >>> sim.malloc("a", 1000); sim.malloc("b", 3 << 20); sim.free("a")
        >>> sim.stats.reserved, sim.stats.allocated     # a 2 MiB small segment, a 20 MiB one
        (23068672, 3145728)
    """

    def __init__(
        self,
        alloc_conf: str | AllocConf | None = None,
        *,
        capacity: int | None = None,
        record_stream_lag: int | None = 0,
    ) -> None:
        self.conf = conf = resolve(alloc_conf)
        self.capacity = capacity
        self.record_stream_lag = record_stream_lag
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.stats = AllocatorStats()
        self.live: dict[Hashable, _Block] = {}
        self.pending: dict[Hashable, _Block] = {}
        self._empty: set[Hashable] = set()  # handles of 0-byte allocations
        self.mallocs = 0
        self._next_addr = 1 << 32
        self._segments: dict[int, _Segment] = {}  # base -> segment
        # setMemoryFraction: per_process_memory_fraction (or capacity alone: no fraction)
        frac = conf.per_process_memory_fraction
        self.set_fraction = frac is not None and capacity is not None
        self.allowed_max = int(frac * capacity) if frac is not None and capacity else 0
        self.gc_enabled = self.set_fraction and conf.garbage_collection_threshold > 0.0
        self._max_split = conf.max_split_size
        self._plain_rounding = max(conf.roundup_power2_divisions) <= 1
        self._max_nsr = conf.max_non_split_rounding_size

    # -- the public calls ----------------------------------------------------------------------
    def malloc(self, handle: Hashable, size: int, stream: int = 0) -> None:
        """``DeviceCachingAllocator::malloc``. A 0-byte request allocates nothing (``allocate``
        skips it). Raises :class:`OutOfMemory` when a capacity is set and nothing frees
        enough."""
        if size <= 0:
            self._empty.add(handle)
            return
        if handle in self.live:
            raise ValueError(f"handle {handle!r} is already allocated")
        if self.pending:
            self._process_events()
        self.mallocs += 1
        if self._plain_rounding:  # no roundup_power2_divisions: round_size's last branch
            rsize = K_MIN_BLOCK_SIZE if size < K_MIN_BLOCK_SIZE else (size + 511) & ~511
        else:
            rsize = round_size(size, self.conf)
        pool = self.small if rsize <= K_SMALL_SIZE else self.large  # get_pool
        if self.gc_enabled:  # get_free_block, its pool left as it is until a block is taken
            pool.gc_calls += 1
        block = self._find_free_block(pool, stream, rsize)
        if block is not None:
            pool.erase(block)
        else:
            if self.gc_enabled:
                self._garbage_collect()
            # malloc: alloc_block || (release_available_cached_blocks && alloc_block)
            #   || (release_cached_blocks && alloc_block(isRetry=true))
            block = self._alloc_block(pool, stream, rsize, False)
            if block is None and self._release_available_cached_blocks(pool, stream, rsize):
                block = self._alloc_block(pool, stream, rsize, False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, rsize, True)
            if block is None:
                st = self.stats
                st.num_ooms += 1
                limit = self.allowed_max if self.set_fraction else (self.capacity or 0)
                raise OutOfMemory(size, st.reserved, st.allocated, limit)
        self._alloc_found_block(block, pool, rsize, size, self._should_split(block, pool, rsize))
        block.handle = handle
        self.live[handle] = block

    def free(self, handle: Hashable) -> None:
        """``DeviceCachingAllocator::free``: back to the cache, or, when the block was used on
        other streams, held until those streams are done (``insert_events``)."""
        block = self.live.pop(handle, None)
        if block is None:
            if handle in self._empty:  # a 0-byte allocation: nothing to give back
                self._empty.discard(handle)
                return
            raise KeyError(f"free of handle {handle!r}, which is not allocated")
        block.allocated = False
        st = self.stats
        st.allocated -= block.size
        st.requested -= block.requested
        if block.uses:
            block.uses = None
            block.pending = True
            lag = self.record_stream_lag
            block.due = -1 if lag is None else self.mallocs + lag
            self.pending[handle] = block
        else:
            self._free_block(block)

    def record_stream(self, handle: Hashable, stream: int) -> None:
        """``recordStream``: the block is in use on ``stream`` too (ignored for its own)."""
        block = self.live[handle]
        if stream == block.seg.stream:
            return
        if block.uses is None:
            block.uses = set()
        block.uses.add(stream)

    def free_completed(self, handle: Hashable) -> None:
        """The other streams are done with a freed block (a trace's ``free_completed``)."""
        block = self.pending.pop(handle, None)
        if block is not None:
            block.pending = False
            self._free_block(block)

    def synchronize(self) -> None:
        """``synchronize_and_free_events``: every pending free completes."""
        self.stats.num_sync_all_streams += 1
        for h in list(self.pending):
            self.free_completed(h)

    def empty_cache(self) -> int:
        """``emptyCache`` (``release_cached_blocks``): returns the bytes given back."""
        before = self.stats.reserved
        self._release_cached_blocks()
        return before - self.stats.reserved

    def fork(self) -> CachingAllocatorSim:
        """An independent copy of this allocator's state (to try several continuations of one
        prefix, e.g. one per planner candidate)."""
        new = copy.copy(self)
        memo: dict[int, _Block] = {}

        def dup(b: _Block) -> _Block:
            # every slot of _Block, assigned by name (a loop over __slots__ costs twice as much:
            # a planner's sweep forks thousands of simulations)
            nb = _Block.__new__(_Block)
            nb.addr, nb.allocated, nb.due, nb.gc_base = b.addr, b.allocated, b.due, b.gc_base
            nb.handle, nb.mapped, nb.next, nb.pending = b.handle, b.mapped, b.next, b.pending
            nb.prev, nb.requested, nb.seg, nb.size = b.prev, b.requested, b.seg, b.size
            nb.uses = set(b.uses) if b.uses else b.uses
            memo[id(b)] = nb
            return nb

        new.live = {h: dup(b) for h, b in self.live.items()}
        new.pending = {h: dup(b) for h, b in self.pending.items()}
        for name in ("small", "large"):
            old_pool: _Pool = getattr(self, name)
            pool = _Pool(old_pool.small)
            pool.gc_calls = old_pool.gc_calls
            pool.blocks = list(old_pool.blocks)
            pool.by_key = {k: dup(b) for k, b in old_pool.by_key.items()}
            pool.unmapped = list(old_pool.unmapped)
            pool.unmapped_by_key = {k: dup(b) for k, b in old_pool.unmapped_by_key.items()}
            setattr(new, name, pool)
        for nb in memo.values():  # relink: every block is live, held, cached or unmapped
            if nb.prev is not None:
                nb.prev = memo[id(nb.prev)]
            if nb.next is not None:
                nb.next = memo[id(nb.next)]
        new.stats = copy.copy(self.stats)
        new._empty = set(self._empty)
        new._segments = dict(self._segments)  # segments do not change once made: shared
        return new

    # -- the state -----------------------------------------------------------------------------
    def would_reserve(self, size: int, stream: int = 0) -> int | None:
        """The bytes a ``malloc(size, stream)`` now would add to the reserved memory (0: a
        cached block holds it), the allocator left untouched; ``None`` where only running it
        tells (expandable segments, frees pending on other streams, a capacity or memory
        fraction: garbage collection and release-and-retry). With none of those ``malloc``
        takes ``get_free_block``'s block or else one new segment of ``get_allocation_size``."""
        if self.conf.expandable_segments or self.pending or self.capacity is not None:
            return None
        if size <= 0:
            return 0
        rsize = round_size(size, self.conf)
        pool = self.small if rsize <= K_SMALL_SIZE else self.large
        if self._find_free_block(pool, stream, rsize) is not None:
            return 0
        return get_allocation_size(rsize, self.conf.large_segment_size)

    def largest_free_block(self) -> int:
        """``cacheInfo``'s largest cached block (free and mapped), 0 when none."""
        best = 0
        for pool in (self.small, self.large):
            keys = pool.blocks
            i = len(keys)
            while i > 0:  # the last key of each stream is its largest block
                k = keys[i - 1]
                if k[1] > best:
                    best = k[1]
                i = bisect_left(keys, (k[0],))
        return best

    def releasable(self) -> int:
        """Cached bytes ``release_cached_blocks`` would give back now (every unsplit free
        segment; the whole free pages of expandable segments): what an allocation that finds
        no room frees before it fails. Reserved minus this is what the allocator cannot
        release."""
        out = 0
        for pool in (self.small, self.large):
            for b in pool.by_key.values():
                seg = b.seg
                if seg.expandable:
                    page = seg.page
                    begin = -(-(b.addr - seg.base) // page)
                    end = (b.addr + b.size - seg.base) // page
                    out += max(0, end - begin) * page
                elif b.prev is None and b.next is None and not b.pending:
                    out += b.size
        return out

    def segments(self) -> list[SegmentInfo]:
        """The segment map, ordered by address (``snapshot()``: for an expandable segment, one
        entry per contiguous mapped range)."""
        blocks: list[_Block] = [*self.live.values(), *self.pending.values()]
        for pool in (self.small, self.large):
            blocks += pool.by_key.values()
        by_seg: dict[int, list[_Block]] = {}
        for b in blocks:
            by_seg.setdefault(b.seg.base, []).append(b)
        out = []
        for base in sorted(by_seg):
            seg = self._segments[base]
            run: list[_Block] = []
            for b in sorted(by_seg[base], key=lambda b: b.addr):
                if run and run[-1].addr + run[-1].size != b.addr:
                    out.append(self._seg_info(seg, run))
                    run = []
                run.append(b)
            out.append(self._seg_info(seg, run))
        return out

    @staticmethod
    def _seg_info(seg: _Segment, run: list[_Block]) -> SegmentInfo:
        return SegmentInfo(
            address=run[0].addr,
            size=sum(b.size for b in run),
            stream=seg.stream,
            pool="small" if seg.small else "large",
            expandable=seg.expandable,
            blocks=tuple(BlockInfo(b.size, b.allocated, b.requested) for b in run),
        )

    # -- malloc's steps --------------------------------------------------------------------------
    def _process_events(self) -> None:
        """``process_events``: pending frees whose streams are done (by ``record_stream_lag``)."""
        done = [h for h, b in self.pending.items() if 0 <= b.due <= self.mallocs]
        for h in done:
            self.free_completed(h)

    def _find_free_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        """``get_free_block``'s choice, the pool left as it is (``malloc`` erases it from the
        pool): the smallest cached block of this stream that fits (lowest address among
        equals), unless it is oversize (>= max_split_size) for a request that is not, or an
        oversize request would waste ``max_non_split_rounding_size`` or more."""
        keys = pool.blocks
        i = bisect_left(keys, (stream, size))
        n = len(keys)
        if i == n or keys[i][0] != stream:
            return None
        b = pool.by_key[keys[i]]
        if b.seg.expandable:
            if self.conf.expandable_segments:
                # best fit counts a block's room to grow into the unmapped range after it
                def grow(x: _Block) -> int:
                    nx = x.next
                    return x.size + (nx.size if nx is not None and not nx.mapped else 0)

                j = i + 1
                while (
                    b.seg.expandable
                    and j < n
                    and keys[j][0] == stream
                    and grow(pool.by_key[keys[j]]) < grow(b)
                ):
                    b = pool.by_key[keys[j]]
                    j += 1
            else:  # expandable segments turned off since: only non-expandable blocks
                j = i + 1
                while j < n and keys[j][0] == stream and pool.by_key[keys[j]].seg.expandable:
                    j += 1
                if j == n or keys[j][0] != stream:
                    return None
                b = pool.by_key[keys[j]]
        ms = self._max_split
        if size < ms and b.size >= ms:  # "Do not return an oversized block for a large request"
            return None
        if size >= ms and b.size >= size + self._max_nsr:  # "rounded up but within a limit"
            return None
        return b

    def _should_split(self, block: _Block, pool: _Pool, size: int) -> bool:
        """``should_split``: small pool or expandable segments: a remainder of 512 B or more;
        large pool: a request below max_split_size and a remainder above 1 MiB."""
        remaining = block.size - size
        if pool.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(
        self, block: _Block, pool: _Pool, size: int, orig: int, split: bool
    ) -> None:
        """``alloc_found_block``: split off the front ``size`` bytes when asked, the rest goes
        back to the cache."""
        if split:
            rest = _Block(block.addr + size, block.size - size, block.seg)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        block.requested = orig
        st = self.stats
        st.allocated += block.size
        if st.allocated > st.allocated_peak:
            st.allocated_peak = st.allocated
        st.requested += orig
        if st.requested > st.requested_peak:
            st.requested_peak = st.requested

    def _reserve(self, n: int) -> None:
        st = self.stats
        st.reserved += n
        st.num_device_alloc += 1
        if st.reserved > st.reserved_peak:
            st.reserved_peak = st.reserved

    def _fits(self, n: int) -> bool:
        """Whether the device can give ``n`` more bytes (cudaMalloc / cuMemCreate succeed)."""
        if self.set_fraction and self.stats.reserved + n > self.allowed_max:
            return False
        return self.capacity is None or self.stats.reserved + n <= self.capacity

    def _new_addr(self, size: int) -> int:
        a = self._next_addr
        self._next_addr += -(-size // K_SMALL_BUFFER) * K_SMALL_BUFFER + K_SMALL_BUFFER
        return a

    def _alloc_block(self, pool: _Pool, stream: int, size: int, retry: bool) -> _Block | None:
        """``alloc_block``: a new segment of ``get_allocation_size(size)`` (or, with expandable
        segments, more pages mapped); ``None`` when the device (or the memory fraction) has no
        room."""
        if retry:
            self.stats.num_alloc_retries += 1
        alloc_size = get_allocation_size(size, self.conf.large_segment_size)
        if self.set_fraction and self.stats.reserved + alloc_size > self.allowed_max:
            return None
        if self.conf.expandable_segments:
            return self._try_allocate_expandable(pool, stream, size)
        if not self._fits(alloc_size):
            return None
        seg = _Segment(self._new_addr(alloc_size), alloc_size, stream, pool.small)
        self._segments[seg.base] = seg
        self.stats.segments += 1
        self._reserve(alloc_size)
        return _Block(seg.base, alloc_size, seg)

    # -- expandable segments ----------------------------------------------------------------------
    @staticmethod
    def _allocatable(b: _Block | None) -> bool:
        return b is not None and not b.allocated and not b.pending and not b.uses

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """``find_expandable_block``: the lowest-address unmapped range of this stream's segment
        (with the free block just before it) that has ``size`` bytes of room; else a new
        segment (address space for 1 1/8 of the device)."""
        keys = pool.unmapped
        i = bisect_left(keys, (stream,))
        while i < len(keys) and keys[i][0] == stream:
            c = pool.unmapped_by_key[keys[i]]
            if self._allocatable(c.prev):
                assert c.prev is not None
                c = c.prev
            room = 0
            x: _Block | None = c
            while room < size and x is not None and self._allocatable(x):
                room += x.size
                x = x.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.small else self.conf.large_segment_size
        cap = self.capacity
        space = cap + cap // 8 if cap is not None else _NO_CAPACITY_SPACE
        space = -(-space // page) * page
        seg = _Segment(self._new_addr(space), space, stream, pool.small, page)
        self._segments[seg.base] = seg
        self.stats.segments += 1
        cand = _Block(seg.base, space, seg)
        cand.mapped = False
        pool.insert_unmapped(cand)
        return cand

    def _map_block(self, pool: _Pool, b: _Block, size: int) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped range
        (all or nothing), merge them with free neighbours, cache the result."""
        seg = b.seg
        page = seg.page
        begin = (b.addr - seg.base) // page
        end = -(-(b.addr + size - seg.base) // page)
        mapped = (end - begin) * page
        if mapped == 0 or not self._fits(mapped):
            return False
        pool.erase_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, seg)
            rest.mapped = False
            rest.prev = b
            rest.next = b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.insert_unmapped(rest)
            b.size = mapped
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self._reserve(mapped)
        return True

    def _try_allocate_expandable(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map just enough pages after (or into) the
        candidate for a block of ``size`` bytes."""
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nc = c.next
            assert nc is not None
            if not self._map_block(pool, nc, min(size - c.size, nc.size)):
                return None
            c = nc
        pool.erase(c)
        return c

    def _unmap_block(self, pool: _Pool, b: _Block) -> None:
        """``unmap_block``: give back the whole pages inside a cached expandable block; the
        partial pages at either end stay cached."""
        seg = b.seg
        page = seg.page
        begin = -(-(b.addr - seg.base) // page)
        end = (b.addr + b.size - seg.base) // page
        if begin >= end:
            return
        pool.erase(b)
        uaddr = seg.base + begin * page
        usize = (end - begin) * page
        before = uaddr - b.addr
        if before > 0:
            bf = _Block(b.addr, before, seg)
            bf.prev = b.prev
            if b.prev is not None:
                b.prev.next = bf
            bf.next = b
            b.prev = bf
            pool.insert(bf)
        after = b.size - before - usize
        if after > 0:
            af = _Block(uaddr + usize, after, seg)
            af.next = b.next
            if b.next is not None:
                b.next.prev = af
            af.prev = b
            b.next = af
            pool.insert(af)
        b.addr = uaddr
        b.size = usize
        b.mapped = False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.stats.reserved -= usize
        self.stats.num_device_free += 1

    # -- freeing ---------------------------------------------------------------------------------
    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """``try_merge_blocks``: absorb a free neighbour (both mapped or both unmapped)."""
        if src is None or src.allocated or src.pending or src.uses or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _free_block(self, b: _Block) -> None:
        """``free_block``: merge with free neighbours and cache."""
        pool = self.small if b.seg.small else self.large
        b.handle = None
        b.requested = 0
        # an allocated (or absent) neighbour never merges: skip the call (the hot path of a
        # planner's sweep, which frees some 100k blocks)
        p = b.prev
        if p is not None and not p.allocated:
            self._try_merge(b, p, pool)
        n = b.next
        if n is not None and not n.allocated:
            self._try_merge(b, n, pool)
        pool.insert(b)

    def _release_block(self, pool: _Pool, b: _Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        pool.erase(b)
        st = self.stats
        st.reserved -= b.size
        st.segments -= 1
        st.num_device_free += 1
        del self._segments[b.seg.base]

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: free every unsplit cached segment; unmap the free pages of
        expandable segments, dropping a segment left wholly unmapped."""
        to_unmap = []
        for k in list(pool.blocks):
            b = pool.by_key.get(k)
            if b is None:
                continue
            if b.seg.expandable:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self._release_block(pool, b)
        for b in to_unmap:
            self._unmap_block(pool, b)
            if b.prev is None and b.next is None and not b.mapped:
                pool.erase_unmapped(b)  # release_expandable_segment
                self.stats.segments -= 1
                del self._segments[b.seg.base]

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: synchronize (pending frees complete), then release the
        large pool, then the small one."""
        self.synchronize()
        self._release_blocks(self.large)
        self._release_blocks(self.small)

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks`` (only with max_split_size set): free the smallest
        oversize cached block that is big enough, or else the largest ones until their sum is."""
        ms = self._max_split
        if ms == SIZE_MAX:
            return False
        target = max(size, ms)
        keys = pool.blocks
        i = bisect_left(keys, (stream, target))
        if i < len(keys) and keys[i][0] == stream and not pool.by_key[keys[i]].seg.expandable:
            self._release_block(pool, pool.by_key[keys[i]])
            return True
        if i == 0:
            return False
        released = 0
        i -= 1
        while released < target and i >= 0:
            k = keys[i]
            if k[1] < ms or k[0] != stream:
                break
            b = pool.by_key[k]
            if not b.seg.expandable:
                self._release_block(pool, b)
                released += k[1]
            i -= 1
        return released >= target

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``garbage_collection_threshold`` of the
        allowed memory, free unsplit large cached segments at least as old (get_free_block
        calls since cached) as the average, until enough is back."""
        threshold = int(self.conf.garbage_collection_threshold * self.allowed_max)
        if self.stats.reserved <= threshold:
            return
        target = self.stats.reserved - threshold
        pool = self.large
        calls = pool.gc_calls
        total_age = 0
        count = 0
        for k in pool.blocks:
            b = pool.by_key[k]
            if not b.is_split():
                total_age += calls - b.gc_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for k in list(pool.blocks):
                b = pool.by_key[k]
                age = calls - b.gc_base
                if not b.is_split() and not b.seg.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, b)


Event = tuple[Any, ...]
"""``("alloc", handle, size[, stream])``, ``("free", handle)``, ``("record_stream", handle,
stream)``, ``("free_completed", handle)``, ``("synchronize",)``, ``("empty_cache",)``."""


def _step(sim: CachingAllocatorSim, ev: Event) -> None:
    op = ev[0]
    if op == "alloc":
        sim.malloc(ev[1], ev[2], ev[3] if len(ev) > 3 else 0)
    elif op == "free":
        sim.free(ev[1])
    elif op == "record_stream":
        sim.record_stream(ev[1], ev[2])
    elif op == "free_completed":
        sim.free_completed(ev[1])
    elif op == "synchronize":
        sim.synchronize()
    elif op == "empty_cache":
        sim.empty_cache()
    else:
        raise ValueError(f"unknown allocator event {op!r} in {ev!r}")


def simulate(
    events: Iterable[Event],
    alloc_conf: str | AllocConf | None = None,
    *,
    capacity: int | None = None,
    record_stream_lag: int | None = 0,
    segment_map: bool = True,
    sim: CachingAllocatorSim | None = None,
) -> SimResult:
    """Run ``events`` through a caching allocator and report its peaks.

    ``events``: tuples (see :data:`Event`); handles are any hashable (an int counter is the
    cheapest). Allocation sizes are the bytes asked for (``storage.nbytes()``), rounded here.
    With ``capacity``, the run stops at the first simulated OOM (``result.oom``).
    ``segment_map=True`` replays the events a second time up to the peak to keep the segment
    map there (twice the cost); an estimator that needs only the figures passes ``False``.
    ``sim``: continue from this allocator's state (e.g. a :meth:`~CachingAllocatorSim.fork`
    after a shared prefix) instead of a fresh one; ``alloc_conf`` and ``capacity`` are then its.

    Example:
        >>> r = simulate([("alloc", 0, 3 << 20), ("alloc", 1, 3 << 20), ("free", 0)], "")
        >>> r.peak_reserved, r.peak_allocated, r.fragmentation
        (20971520, 6291456, 14680064)
    """
    evs = events if isinstance(events, list) else list(events)
    start = None
    if sim is None:
        sim = CachingAllocatorSim(
            alloc_conf, capacity=capacity, record_stream_lag=record_stream_lag
        )
    else:
        start = sim.fork() if segment_map else None
    st = sim.stats
    peak = st.reserved_peak
    peak_event = -1
    alloc_at_peak = st.allocated
    largest = sim.largest_free_block() if peak else 0
    oom = None
    n = 0
    malloc, free = sim.malloc, sim.free
    try:
        for n, ev in enumerate(evs):
            op = ev[0]
            if op == "alloc":
                malloc(ev[1], ev[2], ev[3] if len(ev) > 3 else 0)
                # the peak moment: reserved at its peak, and allocated at its highest then
                if st.reserved > peak or (st.reserved == peak and st.allocated > alloc_at_peak):
                    peak = st.reserved
                    peak_event = n
                    alloc_at_peak = st.allocated
                    largest = sim.largest_free_block()
            elif op == "free":
                free(ev[1])
            else:
                _step(sim, ev)
        n = len(evs)
    except OutOfMemory as e:
        oom = OOMInfo(n, e.size, e.reserved, e.allocated)
    segments = None
    if segment_map and peak_event >= 0:
        again = (
            start
            if start is not None
            else CachingAllocatorSim(
                sim.conf, capacity=capacity, record_stream_lag=record_stream_lag
            )
        )
        for ev in evs[: peak_event + 1]:
            _step(again, ev)
        segments = again.segments()
    return SimResult(
        peak_reserved=peak,
        peak_allocated=st.allocated_peak,
        reserved_at_end=st.reserved,
        allocated_at_end=st.allocated,
        peak_event=peak_event,
        allocated_at_peak=alloc_at_peak,
        largest_free_at_peak=largest,
        segments_at_peak=segments,
        stats=st,
        events=n,
        oom=oom,
        conf=sim.conf,
        capacity=sim.capacity,
    )


__all__ = [
    "AllocatorStats",
    "BlockInfo",
    "CachingAllocatorSim",
    "Event",
    "OOMInfo",
    "OutOfMemory",
    "SegmentInfo",
    "SimResult",
    "get_allocation_size",
    "round_size",
    "roundup_power2_next_division",
    "simulate",
]
