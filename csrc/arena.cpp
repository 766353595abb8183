// mmap-backed host buffers; pinning runs off the caller's thread because registering tens of GiB
// takes seconds (the kernel faults in and locks every page).
#include "arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>

#include "crc32c.h"
#include "cuda_api.h"
#include "parallel.h"

namespace gpumem::arena {
namespace {

constexpr size_t kCopySplit = size_t(4) << 20;  // memcpy task size: a few MiB per thread wake-up
constexpr size_t kCrcBlock = size_t(64) << 10;   // copy_in with CRCs: copied, then hashed from L2
constexpr size_t kHugePage = size_t(2) << 20;

size_t page_size() {
  const long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096;
}

}  // namespace

HostBuffer::HostBuffer(size_t nbytes, size_t alignment) {
  if (nbytes == 0) throw std::invalid_argument("arena size must be positive");
  if (alignment < 64 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("alignment must be a power of two >= 64, got " +
                                std::to_string(alignment));
  const size_t page = page_size();
  const size_t align = alignment > page ? alignment : page;
  // mmap gives page alignment; for a larger alignment map extra and start at the first boundary.
  const size_t pad = align > page ? align : 0;
  // Checked before rounding: a wrapped sum would map a few pages yet record size_ = nbytes, and
  // copy_in's bounds check (against size_) would then let writes run past the mapping.
  const size_t wraps = SIZE_MAX - pad - (page - 1);  // pad <= 2**63, so no underflow here
  const size_t limit = wraps < size_t(PTRDIFF_MAX) ? wraps : size_t(PTRDIFF_MAX);
  if (nbytes > limit)
    throw std::invalid_argument("arena size " + std::to_string(nbytes) + " bytes with alignment " +
                                std::to_string(alignment) + " cannot be mapped (at most " +
                                std::to_string(limit) + " bytes fit in the address space)");
  const size_t rounded = (nbytes + page - 1) / page * page;
  mapped_ = rounded + pad;
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  base_ = static_cast<uint8_t*>(p);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base_);
  data_ = reinterpret_cast<uint8_t*>((addr + align - 1) / align * align);
  size_ = nbytes;
  ready_from_.store(nbytes);
  locked_from_ = SIZE_MAX;
#ifdef MADV_HUGEPAGE
  // Fewer TLB misses and page faults for multi-GiB staging copies; a hint only.
  if (rounded >= 4 * kHugePage) madvise(base_, mapped_, MADV_HUGEPAGE);
#endif
}

HostBuffer::~HostBuffer() { close(); }

void HostBuffer::close() {
  stop_pinning();
  unlock();
  unpin_all();
  if (base_) munmap(base_, mapped_);
  base_ = data_ = nullptr;
  size_ = mapped_ = 0;
}

void HostBuffer::stop_pinning() {
  std::thread pinner;
  {
    // start_pinning assigns pin_thread_ under the lock and starts nothing once cancelled; the
    // join happens outside it, since the pin thread takes the lock to record each chunk.
    std::lock_guard<std::mutex> lock(pin_mu_);
    pin_cancel_.store(true);
    pinner = std::move(pin_thread_);
  }
  if (pinner.joinable()) pinner.join();
}

void HostBuffer::start_pinning(int device) {
  const cuda::Status st = cuda::status();
  if (!st.available)
    throw std::runtime_error("cannot pin host memory: CUDA runtime not available (" +
                             (st.attempted ? st.reason : std::string("not loaded yet")) + ")");
  std::lock_guard<std::mutex> lock(pin_mu_);
  if (pin_started_.load(std::memory_order_relaxed) || pin_cancel_.load()) return;
  std::string err;
  if (device < 0 && cuda::get_device(&device, &err) != 0)
    throw std::runtime_error("cannot pin host memory: cudaGetDevice failed: " + err);
  pin_thread_ = std::thread([this, device] { pin_all(device); });
  // Set once the thread exists (a failed std::thread throws, leaving it false): wait_pinned()
  // polls pin_done_ only when a thread will set it.
  pin_started_.store(true, std::memory_order_release);
}

void HostBuffer::pin_all(int device) {
  std::string err;
  if (cuda::set_device(device, &err) != 0) {
    std::lock_guard<std::mutex> lock(pin_mu_);
    pin_error_ = "cudaSetDevice(" + std::to_string(device) + ") failed: " + err;
  } else {
    for (size_t off = 0; off < size_ && !pin_cancel_.load(); off += kPinChunk) {
      const size_t n = size_ - off < kPinChunk ? size_ - off : kPinChunk;
      if (cuda::host_register(data_ + off, n, &err) != 0) {
        std::lock_guard<std::mutex> lock(pin_mu_);
        pin_error_ = "cudaHostRegister of " + std::to_string(n) + " bytes at arena offset " +
                     std::to_string(off) + " failed: " + err;
        break;
      }
      {
        std::lock_guard<std::mutex> lock(pin_mu_);
        registered_.push_back(data_ + off);
      }
      pinned_bytes_.fetch_add(n);
    }
  }
  pin_done_.store(true);
}

void HostBuffer::unpin_all() {
  std::string err;
  for (uint8_t* p : registered_) cuda::host_unregister(p, &err);  // best effort while freeing
  registered_.clear();
}

void HostBuffer::start_faulting(bool lock, size_t chunk, bool populate) {
  std::lock_guard<std::mutex> guard(fault_mu_);
  if (fault_started_.load() || fault_cancel_.load() || !data_) return;
  const size_t page = page_size();
  chunk = chunk < page ? page : chunk / page * page;
  fault_thread_ = std::thread([this, lock, chunk, populate] { fault_all(lock, chunk, populate); });
  fault_started_.store(true, std::memory_order_release);
}

namespace {

// One write per page that leaves its byte as it is even while another thread copies into the
// page: an atomic OR with 0 cannot lose a concurrent store (a plain read-then-write could).
void touch_pages(uint8_t* p, size_t n, size_t page) {
  for (size_t off = 0; off < n; off += page)
    __atomic_fetch_or(reinterpret_cast<volatile uint8_t*>(p + off), uint8_t(0), __ATOMIC_RELAXED);
}

}  // namespace

void HostBuffer::fault_all(bool lock, size_t chunk, bool populate) {
  const size_t page = page_size();
  // mlock/madvise want page-aligned ranges: data_ is aligned, the tail is rounded up to the page
  // (inside the mapping)
  const size_t end = (size_ + page - 1) / page * page;
  bool locking = lock;
  size_t hi = end;
  while (hi > 0 && !fault_cancel_.load()) {
    const size_t lo = hi > chunk ? hi - chunk : 0;
    uint8_t* p = data_ + lo;
    const size_t n = hi - lo;
    if (locking) {
      if (mlock(p, n) == 0) {
        std::lock_guard<std::mutex> guard(fault_mu_);
        locked_from_ = lo;
      } else {  // RLIMIT_MEMLOCK: all or nothing, so `locked` means the whole buffer
        std::lock_guard<std::mutex> guard(fault_mu_);
        if (locked_from_ < end) munlock(data_ + locked_from_, end - locked_from_);
        locked_from_ = SIZE_MAX;
        locking = false;
      }
    }
    if (!locking) {
#ifdef MADV_POPULATE_WRITE
      if (!populate || madvise(p, n, MADV_POPULATE_WRITE) != 0) touch_pages(p, n, page);
#else
      (void)populate;
      touch_pages(p, n, page);
#endif
    }
    ready_from_.store(lo < size_ ? lo : size_, std::memory_order_release);
    hi = lo;
  }
  locked_.store(hi == 0 ? (locking ? 1 : 0) : -1, std::memory_order_release);
  fault_done_.store(true, std::memory_order_release);
}

bool HostBuffer::wait_faulted(double timeout_s) {
  if (!fault_started_.load(std::memory_order_acquire)) return true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!fault_done_.load(std::memory_order_acquire)) {
    if (timeout_s >= 0 && std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void HostBuffer::stop_faulting() {
  std::thread faulter;
  {
    std::lock_guard<std::mutex> guard(fault_mu_);
    fault_cancel_.store(true);
    faulter = std::move(fault_thread_);
  }
  if (faulter.joinable()) faulter.join();
}

void HostBuffer::unlock() {
  stop_faulting();
  std::lock_guard<std::mutex> guard(fault_mu_);
  const size_t page = page_size();
  const size_t end = (size_ + page - 1) / page * page;
  if (data_ && locked_from_ < end) munlock(data_ + locked_from_, end - locked_from_);
  locked_from_ = SIZE_MAX;
  if (locked_.load() == 1) locked_.store(0);
}

bool HostBuffer::wait_pinned(double timeout_s) {
  if (!pin_started_.load(std::memory_order_acquire)) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!pin_done_.load()) {
    if (timeout_s >= 0 && std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(pin_mu_);
  if (!pin_error_.empty()) throw std::runtime_error(pin_error_);
  return true;
}

void HostBuffer::copy_in(const std::vector<const uint8_t*>& sources, const std::vector<size_t>& sizes,
                         const std::vector<uint64_t>& offsets, int threads, size_t chunk,
                         const std::vector<int64_t>* crc_slots, int64_t* crc_out) {
  if (sources.size() != offsets.size() || sources.size() != sizes.size() ||
      (crc_slots != nullptr && crc_slots->size() != sources.size()))
    throw std::invalid_argument("copy_in: got " + std::to_string(sources.size()) + " sources but " +
                                std::to_string(offsets.size()) + " offsets");
  const bool crc = chunk > 0 && crc_slots != nullptr && crc_out != nullptr;
  // With CRCs, tasks hold whole chunks (a chunk's CRC is one thread's running value).
  const size_t split = !crc ? kCopySplit : chunk >= kCopySplit ? chunk : kCopySplit / chunk * chunk;
  struct Task {
    uint8_t* dst;
    const uint8_t* src;
    size_t n;
    int64_t slot;  // CRC slot of the task's first chunk, or -1
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (offsets[i] > size_ || sizes[i] > size_ - offsets[i])
      throw std::invalid_argument("copy_in: source " + std::to_string(i) + " (" +
                              std::to_string(sizes[i]) + " bytes at offset " +
                              std::to_string(offsets[i]) + ") does not fit in the arena of " +
                              std::to_string(size_) + " bytes");
    const int64_t slot = crc ? (*crc_slots)[i] : -1;
    for (size_t done = 0; done < sizes[i]; done += split) {
      const size_t n = sizes[i] - done < split ? sizes[i] - done : split;
      tasks.push_back({data_ + offsets[i] + done, sources[i] + done, n,
                       slot < 0 ? -1 : slot + static_cast<int64_t>(done / chunk)});
    }
  }
  parallel_for(
      tasks.size(),
      [&](size_t i) {
        const Task& t = tasks[i];
        if (t.slot < 0) {
          std::memcpy(t.dst, t.src, t.n);
          return;
        }
        for (size_t c = 0, k = 0; c < t.n; c += chunk, ++k) {
          const size_t end = c + chunk < t.n ? c + chunk : t.n;
          uint32_t value = 0;
          for (size_t b = c; b < end; b += kCrcBlock) {
            const size_t m = end - b < kCrcBlock ? end - b : kCrcBlock;
            std::memcpy(t.dst + b, t.src + b, m);
            value = crc32c::extend(value, t.dst + b, m);  // the bytes just stored, from cache
          }
          crc_out[t.slot + static_cast<int64_t>(k)] = value;
        }
      },
      threads);
}

size_t HostBuffer::enqueue_d2h(const DeviceCopy* copies, size_t count, uintptr_t stream) {
  for (size_t i = 0; i < count; ++i) {
    const DeviceCopy& c = copies[i];
    if (c.offset > size_ || c.nbytes > size_ - c.offset)
      throw std::invalid_argument("enqueue_d2h: copy " + std::to_string(i) + " (" +
                                  std::to_string(c.nbytes) + " bytes at offset " +
                                  std::to_string(c.offset) + ") does not fit in the arena of " +
                                  std::to_string(size_) + " bytes");
  }
  size_t calls = 0;
  std::string err;
  for (size_t i = 0; i < count; ++i) {
    const DeviceCopy& c = copies[i];
    uint64_t done = 0;
    while (done < c.nbytes) {
      const uint64_t at = c.offset + done;
      const uint64_t room = kPinChunk - at % kPinChunk;  // to the next registration boundary
      const uint64_t n = c.nbytes - done < room ? c.nbytes - done : room;
      const int rc = cuda::memcpy_d2h_async(data_ + at, reinterpret_cast<const void*>(c.src + done),
                                            n, stream, &err);
      if (rc != 0)
        throw std::runtime_error("cudaMemcpyAsync of copy " + std::to_string(i) + " (" +
                                 std::to_string(n) + " bytes from device address " +
                                 std::to_string(c.src + done) + " to arena offset " +
                                 std::to_string(at) + ") failed: " + err);
      ++calls;
      done += n;
    }
  }
  return calls;
}

}  // namespace gpumem::arena
