// The caching allocator simulator's plain case, compiled: gpumem/allocator/caching.py's
// CachingAllocatorSim without expandable segments, a capacity (so no garbage collection, no
// release-and-retry, no OOM) or frees pending on other streams (record_stream). The Python class
// is the reference (tests/allocator/test_native_sim.py checks this one against it event by
// event); every rule here is the one its docstrings cite from c10/cuda/CUDACachingAllocator.cpp.
//
// Blocks live in one vector and link by index, so that fork() (the planner's shared prefixes) is
// a copy of plain containers. On top of the simulator, take()/give() keep what
// gpumem/estimator/step_trace.py's _Run keeps: the requested bytes alive, their peak, and the
// largest reserved - releasable at a moment a new segment was needed.
#pragma once

#include <array>
#include <cstdint>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace gpumem::alloc {

struct Conf {
  int64_t max_split = INT64_MAX;  // max_split_size (SIZE_MAX saturated: no block is that large)
  int64_t max_non_split_rounding = 20 << 20;
  int64_t large_segment = 20 << 20;
  std::array<int64_t, 16> divisions{};  // roundup_power2_divisions per interval, 1 MiB .. 64 GiB
};

struct Block {
  int64_t addr = 0, size = 0, requested = 0, seg_base = 0, stream = 0;
  int32_t prev = -1, next = -1;
  bool allocated = false, small = false;
};

struct Key {  // BlockComparatorSize: (stream, size, address)
  int64_t stream, size, addr;
  int32_t idx;
  bool operator<(const Key& o) const {
    if (stream != o.stream) return stream < o.stream;
    if (size != o.size) return size < o.size;
    return addr < o.addr;
  }
};

struct SegmentRun {  // one segment of the map: its blocks by address
  int64_t address = 0, size = 0, stream = 0;
  bool small = false;
  std::vector<std::array<int64_t, 3>> blocks;  // (size, allocated, requested)
};

class PlainSim {
 public:
  explicit PlainSim(const Conf& conf) : conf_(conf) {}

  // the simulator (CachingAllocatorSim's calls)
  void malloc(int64_t handle, int64_t size, int64_t stream);
  void free(int64_t handle);
  int64_t empty_cache();
  int64_t would_reserve(int64_t size, int64_t stream) const;
  int64_t largest_free_block() const;
  int64_t releasable() const { return releasable_; }
  std::vector<SegmentRun> segments() const;
  int64_t round_size(int64_t size) const;

  // _Run's bookkeeping
  int64_t take(int64_t size, int64_t handle, int64_t stream);
  void give(int64_t handle);

  // AllocatorStats
  int64_t reserved = 0, reserved_peak = 0, allocated = 0, allocated_peak = 0;
  int64_t requested = 0, requested_peak = 0, segments_count = 0;
  int64_t num_device_alloc = 0, num_device_free = 0, mallocs = 0;
  // _Run's
  int64_t live = 0, peak = 0, pinned = 0, next_handle = 0;

 private:
  std::set<Key>& pool(bool small) { return small ? small_ : large_; }
  int32_t find_free_block(bool small, int64_t stream, int64_t size) const;
  int32_t new_block();
  void insert(int32_t b);
  void erase(int32_t b);
  void try_merge(int32_t dst, int32_t src);
  void free_block(int32_t b);
  bool unsplit(int32_t b) const { return blocks_[b].prev < 0 && blocks_[b].next < 0; }

  Conf conf_;
  std::vector<Block> blocks_;
  std::vector<int32_t> spare_;  // indices of blocks merged away, for reuse
  std::set<Key> small_, large_;
  std::unordered_map<int64_t, int32_t> live_;
  std::unordered_set<int64_t> empty_;  // handles of 0-byte allocations
  std::unordered_map<int64_t, int64_t> sizes_;
  int64_t next_addr_ = int64_t{1} << 32;
  int64_t releasable_ = 0;  // the cached unsplit segments' bytes
};

}  // namespace gpumem::alloc
