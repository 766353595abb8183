// See alloc_sim.h. Each function names the CachingAllocatorSim method (and so the C++ allocator
// function) it follows; the comments there say why each rule is what it is.
#include "alloc_sim.h"

#include <algorithm>
#include <climits>
#include <map>
#include <stdexcept>
#include <string>

namespace gpumem::alloc {
namespace {

constexpr int64_t kMinBlockSize = 512;
constexpr int64_t kSmallSize = 1048576;
constexpr int64_t kSmallBuffer = 2097152;
constexpr int64_t kMinLargeAlloc = 10485760;
constexpr int64_t kRoundLarge = 2097152;
constexpr int64_t kMaxRequest = int64_t{1} << 50;  // 1 PiB: sums of many stay inside int64
constexpr int64_t kMaxAddress = int64_t{1} << 61;

int bit_length(int64_t n) { return n <= 0 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(n)); }

// roundup_power2_next_division
int64_t next_division(int64_t size, int64_t divisions) {
  if ((size & (size - 1)) == 0) return size;
  const int64_t floor = int64_t{1} << (bit_length(size) - 1);
  const int64_t step = floor >> (bit_length(divisions) - 1);
  if (step == 0) return floor << 1;
  const int64_t rounded = size & ~(step - 1);
  return rounded == size ? size : rounded + step;
}

// get_allocation_size
int64_t allocation_size(int64_t size, int64_t large_segment) {
  const int64_t rounded = kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return std::max(large_segment, rounded);
  return rounded;
}

}  // namespace

int64_t PlainSim::round_size(int64_t size) const {
  if (size < kMinBlockSize) return kMinBlockSize;
  const int log_size = bit_length(size) - 1;
  const int index = log_size > 20 ? log_size - 20 : 0;
  const int64_t divisions = conf_.divisions[std::min(index, 15)];
  if (divisions > 1 && size > kMinBlockSize * divisions) return next_division(size, divisions);
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

int32_t PlainSim::new_block() {
  if (!spare_.empty()) {
    const int32_t b = spare_.back();
    spare_.pop_back();
    blocks_[b] = Block{};
    return b;
  }
  blocks_.emplace_back();
  return static_cast<int32_t>(blocks_.size() - 1);
}

void PlainSim::insert(int32_t b) {
  const Block& x = blocks_[b];
  pool(x.small).insert(Key{x.stream, x.size, x.addr, b});
  if (unsplit(b)) releasable_ += x.size;
}

void PlainSim::erase(int32_t b) {
  const Block& x = blocks_[b];
  pool(x.small).erase(Key{x.stream, x.size, x.addr, b});
  if (unsplit(b)) releasable_ -= x.size;
}

// _find_free_block (no expandable segments)
int32_t PlainSim::find_free_block(bool small, int64_t stream, int64_t size) const {
  const std::set<Key>& keys = small ? small_ : large_;
  auto it = keys.lower_bound(Key{stream, size, INT64_MIN, 0});
  if (it == keys.end() || it->stream != stream) return -1;
  const int64_t ms = conf_.max_split;
  if (size < ms && it->size >= ms) return -1;
  if (size >= ms && it->size >= size + conf_.max_non_split_rounding) return -1;
  return it->idx;
}

// malloc: get_free_block, else alloc_block (a new segment: never refused without a capacity),
// then alloc_found_block with should_split
void PlainSim::malloc(int64_t handle, int64_t size, int64_t stream) {
  if (size <= 0) {
    empty_.insert(handle);
    return;
  }
  if (live_.count(handle)) {
    throw std::invalid_argument("handle " + std::to_string(handle) + " is already allocated");
  }
  if (size > kMaxRequest || next_addr_ > kMaxAddress) {
    // far beyond any device: the Python simulator (unbounded integers) takes such a trace
    throw std::overflow_error("allocation of " + std::to_string(size) +
                              " B is beyond the compiled simulator");
  }
  ++mallocs;
  const int64_t rsize = round_size(size);
  const bool small = rsize <= kSmallSize;
  int32_t b = find_free_block(small, stream, rsize);
  if (b >= 0) {
    erase(b);
  } else {
    const int64_t seg = allocation_size(rsize, conf_.large_segment);
    b = new_block();
    Block& x = blocks_[b];
    x.addr = x.seg_base = next_addr_;
    next_addr_ += (seg + kSmallBuffer - 1) / kSmallBuffer * kSmallBuffer + kSmallBuffer;
    x.size = seg;
    x.stream = stream;
    x.small = small;
    ++segments_count;
    reserved += seg;
    ++num_device_alloc;
    reserved_peak = std::max(reserved_peak, reserved);
  }
  const int64_t remaining = blocks_[b].size - rsize;
  const bool split = small ? remaining >= kMinBlockSize
                           : rsize < conf_.max_split && remaining > kSmallSize;
  if (split) {
    const int32_t r = new_block();  // may move blocks_: index, never hold a reference across
    Block& rest = blocks_[r];
    Block& x = blocks_[b];
    rest.addr = x.addr + rsize;
    rest.size = x.size - rsize;
    rest.seg_base = x.seg_base;
    rest.stream = x.stream;
    rest.small = x.small;
    rest.prev = b;
    rest.next = x.next;
    if (x.next >= 0) blocks_[x.next].prev = r;
    x.next = r;
    x.size = rsize;
    insert(r);
  }
  Block& x = blocks_[b];
  x.allocated = true;
  x.requested = size;
  allocated += x.size;
  allocated_peak = std::max(allocated_peak, allocated);
  requested += size;
  requested_peak = std::max(requested_peak, requested);
  live_[handle] = b;
}

// _try_merge (all blocks mapped, none pending)
void PlainSim::try_merge(int32_t dst, int32_t src) {
  if (src < 0 || blocks_[src].allocated) return;
  erase(src);
  Block& d = blocks_[dst];
  const Block& s = blocks_[src];
  if (d.prev == src) {
    d.addr = s.addr;
    d.prev = s.prev;
    if (d.prev >= 0) blocks_[d.prev].next = dst;
  } else {
    d.next = s.next;
    if (d.next >= 0) blocks_[d.next].prev = dst;
  }
  d.size += s.size;
  spare_.push_back(src);
}

// _free_block
void PlainSim::free_block(int32_t b) {
  blocks_[b].requested = 0;
  try_merge(b, blocks_[b].prev);
  try_merge(b, blocks_[b].next);
  insert(b);
}

void PlainSim::free(int64_t handle) {
  auto it = live_.find(handle);
  if (it == live_.end()) {
    if (empty_.erase(handle)) return;
    throw std::out_of_range("free of handle " + std::to_string(handle) + ", which is not allocated");
  }
  const int32_t b = it->second;
  live_.erase(it);
  Block& x = blocks_[b];
  x.allocated = false;
  allocated -= x.size;
  requested -= x.requested;
  free_block(b);
}

// empty_cache: release_blocks of the large pool, then the small one (unsplit segments only)
int64_t PlainSim::empty_cache() {
  const int64_t before = reserved;
  for (bool small : {false, true}) {
    std::vector<int32_t> whole;
    for (const Key& k : pool(small)) {
      if (unsplit(k.idx)) whole.push_back(k.idx);
    }
    for (int32_t b : whole) {
      erase(b);
      reserved -= blocks_[b].size;
      --segments_count;
      ++num_device_free;
      spare_.push_back(b);
    }
  }
  return before - reserved;
}

int64_t PlainSim::would_reserve(int64_t size, int64_t stream) const {
  if (size <= 0) return 0;
  const int64_t rsize = round_size(size);
  const bool small = rsize <= kSmallSize;
  if (find_free_block(small, stream, rsize) >= 0) return 0;
  return allocation_size(rsize, conf_.large_segment);
}

int64_t PlainSim::largest_free_block() const {
  int64_t best = 0;
  for (const std::set<Key>* keys : {&small_, &large_}) {
    auto it = keys->end();
    while (it != keys->begin()) {  // the last key of each stream is its largest block
      const Key& k = *std::prev(it);
      best = std::max(best, k.size);
      it = keys->lower_bound(Key{k.stream, INT64_MIN, INT64_MIN, 0});
    }
  }
  return best;
}

std::vector<SegmentRun> PlainSim::segments() const {
  std::map<int64_t, std::vector<int32_t>> by_seg;
  for (const auto& [h, b] : live_) by_seg[blocks_[b].seg_base].push_back(b);
  for (const std::set<Key>* keys : {&small_, &large_}) {
    for (const Key& k : *keys) by_seg[blocks_[k.idx].seg_base].push_back(k.idx);
  }
  std::vector<SegmentRun> out;
  for (auto& [base, ids] : by_seg) {
    std::sort(ids.begin(), ids.end(),
              [&](int32_t a, int32_t b) { return blocks_[a].addr < blocks_[b].addr; });
    SegmentRun run;
    run.address = blocks_[ids.front()].addr;
    run.stream = blocks_[ids.front()].stream;
    run.small = blocks_[ids.front()].small;
    for (int32_t b : ids) {
      const Block& x = blocks_[b];
      run.size += x.size;
      run.blocks.push_back({x.size, x.allocated ? 1 : 0, x.requested});
    }
    out.push_back(std::move(run));
  }
  return out;
}

int64_t PlainSim::take(int64_t size, int64_t handle, int64_t stream) {
  const int64_t before = reserved;
  malloc(handle, size, stream);
  if (reserved > before) pinned = std::max(pinned, reserved - releasable_);
  sizes_[handle] = size;
  live += size;
  peak = std::max(peak, live);
  return handle;
}

void PlainSim::give(int64_t handle) {
  free(handle);
  auto it = sizes_.find(handle);
  live -= it->second;
  sizes_.erase(it);
}

}  // namespace gpumem::alloc
