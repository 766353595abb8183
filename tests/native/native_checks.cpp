// Checks of the native core that only C++ can make, built and run by tests/test_native_cpp.py
// (plainly, and with -fsanitize=thread where the compiler has it):
//
//   parallel_for  every item runs and the first exception is rethrown, on the serial path
//                 (threads = 1, or a single item) as on the pool (no binding can show this: no
//                 function the bindings pass to parallel_for throws)
//   pin_flag      HostBuffer::start_pinning from several threads while others poll pinning() and
//                 wait_pinned(): one pin thread, and under ThreadSanitizer no data race on the flag
//   read_file     io::read_file of a file in DIR with O_DIRECT into fresh memory, its prefault
//                 thread running ahead of the readers: every byte and chunk CRC right, and a read
//                 that fails part-way (a file shorter than its pieces) joins the prefaulter and
//                 raises; under ThreadSanitizer no data race between the prefaulter and readers
//
// Usage: native_checks parallel_for | native_checks pin_flag FAKE_LIBCUDART | native_checks read_file DIR
// Prints one line per check and exits 1 on the first failure.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "arena.h"
#include "crc32c.h"
#include "cuda_api.h"
#include "parallel.h"
#include "reader.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// fn throws on items 1 and 3: every item must still run, and the error that comes out must be one
// fn raised (the first one on the serial path, where "first" is well defined).
void check_parallel_for(size_t n, int threads) {
  std::atomic<size_t> ran{0};
  std::string caught;
  try {
    gpumem::parallel_for(
        n,
        [&](size_t i) {
          ran.fetch_add(1);
          if (i == 1 || i == 3) throw std::runtime_error("item " + std::to_string(i));
        },
        threads);
  } catch (const std::runtime_error& e) {
    caught = e.what();
  }
  const bool serial = threads == 1 || n == 1;
  const std::string tag = "n=" + std::to_string(n) + " threads=" + std::to_string(threads);
  expect(ran.load() == n, tag + ": all " + std::to_string(n) + " items ran (ran " +
                              std::to_string(ran.load()) + ")");
  if (n <= 1) {
    expect(caught.empty(), tag + ": no item threw, nothing rethrown (got '" + caught + "')");
  } else if (serial) {
    expect(caught == "item 1", tag + ": the first error, 'item 1', rethrown (got '" + caught + "')");
  } else {
    expect(caught == "item 1" || caught == "item 3",
           tag + ": one of the errors rethrown (got '" + caught + "')");
  }
}

int parallel_for_checks() {
  for (int threads : {1, 2, 4})
    for (size_t n : {size_t(1), size_t(2), size_t(5), size_t(64)}) check_parallel_for(n, threads);
  gpumem::set_num_threads(1);  // threads = 0 takes the default: GPUMEM_THREADS=1 is serial too
  check_parallel_for(5, 0);
  gpumem::set_num_threads(0);
  return failures ? 1 : 0;
}

// Starters race to start pinning while pollers read the flag through pinning() and wait_pinned(),
// as Python threads do when wait_pinned() runs without the GIL.
int pin_flag_checks(const char* library) {
  const gpumem::cuda::Status& st = gpumem::cuda::load(false, library);
  expect(st.available, "fake runtime loaded (" + st.reason + ")");
  if (!st.available) return 1;
  for (int round = 0; round < 20; ++round) {
    gpumem::arena::HostBuffer buf(3 * 4096, 4096);
    std::atomic<bool> go{false};
    std::atomic<int> seen_pinning{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t)
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        buf.start_pinning(0);
      });
    for (int t = 0; t < 2; ++t)
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        while (!buf.wait_pinned(0.0)) std::this_thread::yield();
        if (buf.pinning()) seen_pinning.fetch_add(1);
      });
    go.store(true);
    for (auto& t : threads) t.join();
    if (buf.pinned_bytes() != buf.size() || seen_pinning.load() != 2) {
      expect(false, "round " + std::to_string(round) + ": pinned " +
                        std::to_string(buf.pinned_bytes()) + " of " + std::to_string(buf.size()) +
                        " bytes once, both pollers saw it done");
      return 1;
    }
  }
  expect(true, "20 rounds: one pin thread per buffer, every poller saw pinning finish");
  return failures ? 1 : 0;
}

// Fresh, page-aligned memory that no one has touched (the prefaulter's work).
uint8_t* fresh(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
  return static_cast<uint8_t*>(p);
}

int read_file_checks(const std::string& dir) {
  constexpr size_t kSize = size_t(40) << 20, kChunk = size_t(1) << 20;  // above the prefault floor
  const std::string path = dir + "/read_file_check.bin";
  std::vector<uint8_t> data(kSize);
  uint32_t x = 12345;
  for (auto& b : data) b = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 24);
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(data.data(), 1, kSize, f) != kSize || std::fflush(f) != 0 ||
        ::fsync(fileno(f)) != 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 2;
    }
  }
  // out of the page cache, or the reader copies it from there instead of reading with O_DIRECT
  auto drop_cache = [&] {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f != nullptr) {
      ::posix_fadvise(fileno(f), 0, 0, POSIX_FADV_DONTNEED);
      std::fclose(f);
    }
  };
  std::vector<int64_t> expected(kSize / kChunk), got(kSize / kChunk, 0);
  gpumem::crc32c::chunks(data.data(), kSize, kChunk, expected.data(), 1);
  for (int round = 0; round < 3; ++round) {
    drop_cache();
    uint8_t* out = fresh(kSize);
    // two pieces: the halves of the buffer, each with its own CRC slots
    std::vector<gpumem::io::ReadPiece> pieces = {{0, out, kSize / 2, 0},
                                                 {kSize / 2, out + kSize / 2, kSize / 2, int64_t(kSize / 2 / kChunk)}};
    gpumem::io::ReadOptions opts;
    opts.threads = 4;
    opts.direct = true;
    opts.chunk = kChunk;
    opts.crc_out = got.data();
    const gpumem::io::ReadResult r = gpumem::io::read_file(path, pieces, opts);
    expect(r.bytes == kSize && std::memcmp(out, data.data(), kSize) == 0 && got == expected,
           "round " + std::to_string(round) + ": every byte and chunk CRC read back (" +
               std::to_string(r.direct_bytes) + " bytes through O_DIRECT)");
    ::munmap(out, kSize);
  }
  // a piece past the end of the file: the read fails part-way and the prefaulter is joined
  uint8_t* out = fresh(2 * kSize);
  std::vector<gpumem::io::ReadPiece> pieces = {{0, out, 2 * kSize, gpumem::io::kNoCheck}};
  gpumem::io::ReadOptions opts;
  opts.threads = 4;
  opts.direct = true;
  bool raised = false;
  try {
    gpumem::io::read_file(path, pieces, opts);
  } catch (const std::exception&) {
    raised = true;
  }
  expect(raised, "a file shorter than its pieces: the read raises (EIO)");
  ::munmap(out, 2 * kSize);
  std::remove(path.c_str());
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what == "parallel_for") return parallel_for_checks();
  if (what == "pin_flag" && argc > 2) return pin_flag_checks(argv[2]);
  if (what == "read_file" && argc > 2) return read_file_checks(argv[2]);
  std::fprintf(stderr, "usage: native_checks parallel_for | native_checks pin_flag LIBCUDART | native_checks read_file DIR\n");
  return 2;
}
