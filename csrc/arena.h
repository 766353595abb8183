// Host arena: one page-aligned allocation made once and reused, pinned (cudaHostRegister in chunks
// of at most 1 GiB, in a background thread) on CUDA machines, plain memory elsewhere.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gpumem::arena {

// cudaHostRegister granularity (spec: <= 1 GiB). Each chunk is a separate registration, and one
// CUDA copy must not span two of them (or a registered and an unregistered range while pinning
// runs): the driver rejects such a copy with cudaErrorInvalidValue. Copies split at multiples of
// this from data() (HostArena.copy_from_device).
constexpr size_t kPinChunk = size_t(1) << 30;

class HostBuffer {
 public:
  // Allocates `nbytes` (> 0) aligned to `alignment` (a power of two >= 64). Throws std::bad_alloc
  // when the memory is not there and std::invalid_argument for a bad alignment or a size that
  // cannot be mapped at all (over PTRDIFF_MAX, or whose rounding to pages plus the alignment
  // padding overflows size_t).
  HostBuffer(size_t nbytes, size_t alignment);
  // Calls close().
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

  // Starts registering the buffer with the CUDA runtime in a background thread, on `device`, or
  // (device < 0) on the device current in the calling thread, so that no context is created on
  // GPU 0 for a rank using GPU 3. A caller on a worker thread (whose current device is 0) passes
  // the device of the thread it works for. Throws std::runtime_error when the runtime is not
  // available. Safe to call from several threads; does nothing once started or stopped.
  void start_pinning(int device = -1);
  // Waits up to timeout_s (< 0: forever) for pinning; true when finished. Throws std::runtime_error
  // with the CUDA message if registering failed.
  bool wait_pinned(double timeout_s);
  // Asks the pinning thread to stop after its current chunk and joins it (registering one chunk
  // can take a second). Idempotent.
  void stop_pinning();
  // Stops pinning, unregisters what was registered and frees the memory; idempotent, and data()
  // is null afterwards. The destructor calls it. Joining, unregistering and unmapping tens of GiB
  // take a while, so an owner that holds a lock other threads need (the Python GIL) calls it
  // first with that lock released.
  void close();
  bool pinning() const { return pin_started_.load(std::memory_order_acquire); }
  size_t pinned_bytes() const { return pinned_bytes_.load(); }

  // Starts faulting the buffer in (and with `lock`, mlock-ing it) in a background thread, in
  // chunks of `chunk` bytes from the end toward the start, without the GIL: a first copy, which
  // runs from the start forward, faults its own pages while this thread works from the other
  // end, and the two meet instead of contending. [ready_from(), size()) is resident. The first
  // mlock refusal (RLIMIT_MEMLOCK) unlocks what was locked and pre-faults the rest
  // (MADV_POPULATE_WRITE; `populate` false or an old kernel: one atomic no-op write per page,
  // safe beside a concurrent copy). Contents are never changed. Does nothing once started.
  void start_faulting(bool lock, size_t chunk, bool populate = true);
  // Waits up to timeout_s (< 0: forever) for the faulting thread; true when it finished (or never
  // started).
  bool wait_faulted(double timeout_s);
  // Stops the faulting thread after its current chunk, joins it and munlocks what it locked (the
  // memory may outlive its owner through views; locked memory counts against the process).
  void unlock();
  bool faulting() const { return fault_started_.load(std::memory_order_acquire); }
  // Lowest offset from which the buffer is resident (size() until faulting starts, 0 once done).
  size_t ready_from() const { return ready_from_.load(std::memory_order_acquire); }
  // 1: faulted and locked; 0: faulted only (or unlocked); -1: still faulting or never started.
  int locked() const { return locked_.load(std::memory_order_acquire); }

  // Multithreaded copy of sources[i] (sizes[i] bytes) to data() + offsets[i]; bounds-checked first
  // (std::invalid_argument naming the piece). Large pieces are split so all threads share the work.
  // With chunk > 0 and crc_slots[i] >= 0, the copy also writes the CRC32C of every chunk of piece i
  // (relative to its start) to crc_out[crc_slots[i] + k], computed from the copied bytes block by
  // block while they are still in cache: one pass over memory instead of the copy's and a later
  // checksum's (the caller bounds-checks the slots).
  void copy_in(const std::vector<const uint8_t*>& sources, const std::vector<size_t>& sizes,
               const std::vector<uint64_t>& offsets, int threads, size_t chunk = 0,
               const std::vector<int64_t>* crc_slots = nullptr, int64_t* crc_out = nullptr);

  // One device-to-host copy: `nbytes` from device address `src` to data() + `offset`.
  struct DeviceCopy {
    uint64_t src;
    uint64_t nbytes;
    uint64_t offset;
  };
  // Enqueues every copy on `stream` (a cudaStream_t) with cudaMemcpyAsync, each cut at the
  // multiples of kPinChunk from data() (one copy must not span two registrations), and returns
  // without waiting: a whole snapshot in one call, whatever the number of tensors. Every copy is
  // bounds-checked before the first is enqueued (std::invalid_argument naming it). A CUDA error
  // stops the loop and throws std::runtime_error naming the copy; the copies enqueued before it
  // stay enqueued, so the caller synchronizes the stream before reusing their bytes.
  // Returns the number of cudaMemcpyAsync calls made.
  size_t enqueue_d2h(const DeviceCopy* copies, size_t count, uintptr_t stream);

 private:
  void pin_all(int device);
  void unpin_all();
  void fault_all(bool lock, size_t chunk, bool populate);
  void stop_faulting();

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // bytes mapped (size rounded up to the alignment/page)
  uint8_t* base_ = nullptr;

  // Atomic: start_pinning sets it under pin_mu_, but pinning() and wait_pinned() read it without
  // the lock, from threads that run without the GIL.
  std::atomic<bool> pin_started_{false};
  std::thread pin_thread_;
  std::mutex pin_mu_;
  std::atomic<bool> pin_done_{false};
  std::atomic<bool> pin_cancel_{false};
  std::atomic<size_t> pinned_bytes_{0};
  std::vector<uint8_t*> registered_;  // chunk starts registered so far (pin thread, then dtor)
  std::string pin_error_;

  std::atomic<bool> fault_started_{false};
  std::atomic<bool> fault_done_{false};
  std::atomic<bool> fault_cancel_{false};
  std::atomic<size_t> ready_from_{0};  // set to size_ by the constructor
  std::atomic<int> locked_{-1};
  size_t locked_from_ = SIZE_MAX;  // [locked_from_, end) is mlock-ed; SIZE_MAX: nothing
  std::thread fault_thread_;
  std::mutex fault_mu_;
};

}  // namespace gpumem::arena
