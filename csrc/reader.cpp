// pread on the shared pool, each chunk's CRC32C taken by the thread that read it. The first error
// stops the remaining work and is reported with errno, path and the failing call. Descriptors are
// owned by Fd, so no exit path leaks one.
#include "reader.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "crc32c.h"
#include "parallel.h"

namespace gpumem::io {

namespace {

constexpr uint64_t kPrefaultAhead = uint64_t(32) << 20;  // O_DIRECT bytes worth a prefault thread
constexpr int kEof = -1;  // pread_all: the file ended first (reported as EIO, "shorter than expected")

// Reads all of [data, data + size) at offset; returns 0, errno, or kEof when the file ends first.
// EINVAL from an O_DIRECT descriptor is returned as is so the caller can retry buffered.
int pread_all(int fd, uint8_t* data, size_t size, uint64_t offset) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return kEof;  // the file is shorter than the manifest says
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

// Faults a fresh destination in before an O_DIRECT read lands in it: MADV_POPULATE_WRITE (Linux
// 5.14+) maps the pages in one call, far cheaper than the page-by-page faults the read would take
// while pinning them. Best effort: older kernels say EINVAL and the read faults them itself.
void prefault(uint8_t* data, size_t size) {
#ifdef __linux__
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data) / kAlign * kAlign;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + size + kAlign - 1) / kAlign * kAlign;
  ::madvise(reinterpret_cast<void*>(lo), hi - lo, kPopulateWrite);
#else
  (void)data;
  (void)size;
#endif
}

// Whether the page cache holds every page of [offset, offset + size), asked with cachestat(2)
// (Linux 6.5+), which reads nothing and starts no readahead. A range it holds is copied from
// memory: O_DIRECT would read a file just written (or just read) from the disk again, 4x slower
// here. Any error (ENOSYS on an older kernel, a file system without it) answers false, and the
// read stays O_DIRECT.
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
constexpr long kCachestat = 451;  // __NR_cachestat on both, absent from older headers
#endif

bool page_cached(int fd, uint64_t offset, size_t size, std::atomic<bool>& supported) {
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
  if (size == 0 || !supported.load(std::memory_order_relaxed)) return false;
  struct {
    uint64_t off, len;
  } range{offset, size};
  struct {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
  } stat{};
  if (::syscall(kCachestat, fd, &range, &stat, 0) != 0) {
    if (errno == ENOSYS || errno == EOPNOTSUPP || errno == EBADF) supported.store(false);
    return false;
  }
  const uint64_t first = offset / kAlign, last = (offset + size + kAlign - 1) / kAlign;
  return stat.nr_cache >= last - first;
#else
  (void)fd;
  (void)offset;
  (void)size;
  supported.store(false);
  return false;
#endif
}

Fd open_for_reading(const std::string& path, const ReadOptions& opts, int extra_flags) {
  if (opts.expect_size >= 0) return open_regular(opts.dir_fd, path, O_RDONLY | extra_flags, opts.expect_size);
  Fd fd(open_at(opts.dir_fd, path, O_RDONLY | extra_flags));
  if (!fd.valid() && extra_flags == 0) throw SysError(errno, path, "open for reading");
  return fd;
}

// A second descriptor with O_DIRECT for the aligned middles, or an invalid one where the file
// system refuses it (the reads then stay buffered). It must be the file the first one opened.
Fd open_direct(const std::string& path, const ReadOptions& opts, const Fd& fd) {
#ifdef O_DIRECT
  try {
    Fd dfd = open_for_reading(path, opts, O_DIRECT);
    if (dfd.valid()) require_same_file(fd, dfd, path);
    return dfd;
  } catch (const UnexpectedFile&) {
    throw;
  } catch (const SysError&) {
    return Fd();  // no O_DIRECT here (EINVAL on tmpfs): the reads stay buffered
  }
#else
  (void)path;
  (void)opts;
  (void)fd;
  return Fd();
#endif
}

}  // namespace

uint64_t read_into(const std::string& path, uint64_t offset, uint8_t* out, size_t size, int threads) {
  Fd fd(open_at(kCwd, path, O_RDONLY));
  if (!fd.valid()) throw SysError(errno, path, "open for reading");
  const size_t count = (size + kSplit - 1) / kSplit;
  FirstError error;
  parallel_for(
      count,
      [&](size_t i) {
        if (error.set()) return;
        size_t done = i * kSplit;
        const size_t end = done + kSplit < size ? done + kSplit : size;
        while (done < end) {
          const ssize_t n = ::pread(fd.get(), out + done, end - done, static_cast<off_t>(offset + done));
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) {
            error.record(errno, describe("pread", end - done, offset + done));
            return;
          }
          if (n == 0) {
            error.record(EIO, "unexpected end of file: pread of " + std::to_string(end - done) +
                                  " bytes at offset " + std::to_string(offset + done) +
                                  " returned 0 (the file is shorter than expected)");
            return;
          }
          done += static_cast<size_t>(n);
        }
      },
      threads);
  error.raise(path);
  fd.close(path);
  return size;
}

// Lowest offset of a nonzero byte in [data, data + size), or -1. Padding is mostly long runs of
// zeros: compared a page at a time against a zero page with memcmp (libc's vector code, several
// times the speed of a word loop), and only the page that differs is searched byte by byte.
static int64_t first_nonzero(const uint8_t* data, size_t size) {
  static const uint8_t zeros[kAlign] = {};
  for (size_t i = 0; i < size; i += kAlign) {
    const size_t n = size - i < kAlign ? size - i : kAlign;
    if (std::memcmp(data + i, zeros, n) == 0) continue;
    for (size_t j = 0; j < n; ++j)
      if (data[i + j] != 0) return static_cast<int64_t>(i + j);
  }
  return -1;
}

ReadResult read_file(const std::string& path, const std::vector<ReadPiece>& pieces, const ReadOptions& opts) {
  Fd fd = open_for_reading(path, opts, 0);
  Fd dfd = opts.direct ? open_direct(path, opts, fd) : Fd();
  // Tasks never straddle a checksum chunk, so each task hashes whole chunks it has just read (hot
  // in cache).
  const size_t step = opts.chunk >= kSplit ? opts.chunk : opts.chunk > 0 ? kSplit / opts.chunk * opts.chunk : kSplit;
  // A task reads one contiguous range: part [begin, end) of one piece, or whole pieces
  // [first, last) that follow each other in the file and in memory (one pread for all of them).
  struct ReadTask {
    size_t first, last;
    size_t begin, end;  // byte range within piece `first` (whole pieces: 0 and the last's size)
  };
  std::vector<ReadTask> tasks;
  for (size_t i = 0; i < pieces.size();) {
    const ReadPiece& p = pieces[i];
    if (p.size >= step) {
      for (size_t b = 0; b < p.size; b += step)
        tasks.push_back({i, i + 1, b, b + step < p.size ? b + step : p.size});
      ++i;
      continue;
    }
    size_t j = i + 1, total = p.size;
    while (j < pieces.size() && total + pieces[j].size <= step &&
           pieces[j].offset == pieces[j - 1].offset + pieces[j - 1].size &&
           pieces[j].data == pieces[j - 1].data + pieces[j - 1].size) {
      total += pieces[j].size;
      ++j;
    }
    tasks.push_back({i, j, 0, total});
    i = j;
  }
  // Each task's O_DIRECT middle, computed once: the readers read it, the prefaulter maps it in.
  struct Span {
    uint64_t off, lo, hi, end;
  };
  std::vector<Span> spans(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const ReadTask& t = tasks[i];
    const ReadPiece& p = pieces[t.first];
    const uint64_t off = p.offset + t.begin;
    const uint64_t end = p.offset + (t.last == t.first + 1 ? t.end : pieces[t.last - 1].offset - p.offset + pieces[t.last - 1].size);
    // The buffer and the file offset must be misaligned by the same amount for the middle of
    // the range to be aligned in both (as in write_file).
    const bool same_phase = (reinterpret_cast<uintptr_t>(p.data) - p.offset) % kAlign == 0;
    uint64_t lo = (off + kAlign - 1) / kAlign * kAlign;
    uint64_t hi = end / kAlign * kAlign;
    if (!dfd.valid() || !same_phase || lo >= hi) lo = hi = end;
    spans[i] = {off, lo, hi, end};
  }
  // Whether a task's middle has been claimed for mapping in (by the prefaulter or its reader).
  std::unique_ptr<std::atomic<bool>[]> mapped(new std::atomic<bool>[tasks.size()]);
  uint64_t direct_total = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    mapped[i].store(false, std::memory_order_relaxed);
    direct_total += spans[i].hi - spans[i].lo;
  }
  std::atomic<bool> direct_ok{dfd.valid()};
  std::atomic<bool> cachestat_ok{true};
  std::atomic<uint64_t> direct_bytes{0}, cached_bytes{0};
  std::atomic<int64_t> nonzero_at{-1};
  FirstError error;
  auto read_range = [&](uint8_t* data, size_t size, uint64_t offset, bool direct) {
    if (size == 0 || error.set()) return;
    if (direct && direct_ok.load(std::memory_order_relaxed) && page_cached(fd.get(), offset, size, cachestat_ok)) {
      cached_bytes.fetch_add(size, std::memory_order_relaxed);
      direct = false;  // in memory already: a copy, not a second read from the disk
    }
    if (direct && direct_ok.load(std::memory_order_relaxed)) {
      const int rc = pread_all(dfd.get(), data, size, offset);
      if (rc == 0) {
        direct_bytes.fetch_add(size, std::memory_order_relaxed);
        return;
      }
      if (rc == kEof) {
        error.record(EIO, describe("pread (O_DIRECT)", size, offset) + " reached the end of the file (it is shorter than expected)");
        return;
      }
      if (rc != EINVAL) {
        error.record(rc, describe("pread (O_DIRECT)", size, offset));
        return;
      }
      direct_ok.store(false);  // the file system refuses O_DIRECT here: buffered from now on
    }
    const int rc = pread_all(fd.get(), data, size, offset);
    if (rc == kEof)
      error.record(EIO, describe("pread", size, offset) + " reached the end of the file (it is shorter than expected)");
    else if (rc != 0)
      error.record(rc, describe("pread", size, offset));
  };
  // Checks [b, e) of piece k once its bytes landed: its chunk CRCs, or that it is all zero.
  auto check = [&](const ReadPiece& p, size_t b, size_t e) {
    if (p.crc_index == kMustBeZero) {
      const int64_t at = first_nonzero(p.data + b, e - b);
      if (at < 0) return;
      const int64_t off = static_cast<int64_t>(p.offset + b) + at;
      int64_t seen = nonzero_at.load();
      while ((seen < 0 || off < seen) && !nonzero_at.compare_exchange_weak(seen, off)) {
      }
      return;
    }
    if (opts.chunk == 0 || p.crc_index < 0) return;
    for (size_t c = b; c < e; c += opts.chunk) {
      const size_t n = c + opts.chunk < p.size ? opts.chunk : p.size - c;
      opts.crc_out[p.crc_index + c / opts.chunk] = crc32c::extend(0, p.data + c, n);
    }
  };
  // Fresh destinations are mapped in ahead of the readers by a thread of their own, in task
  // order (the order the pool hands tasks out): a reader that maps its own pages first leaves the
  // disk queue short of its read meanwhile, so mapping (the kernel zeroing fresh pages, as costly
  // as the read itself on a VM) and reading add up instead of overlapping. A task the prefaulter
  // has not reached is mapped by its reader; mapping twice would only cost time, never bytes.
  auto map_in = [&](size_t i) {
    if (spans[i].hi == spans[i].lo || mapped[i].exchange(true, std::memory_order_relaxed)) return;
    const ReadPiece& p = pieces[tasks[i].first];
    prefault(p.data + (spans[i].lo - p.offset), spans[i].hi - spans[i].lo);
  };
  std::thread prefaulter;
  if (direct_total >= kPrefaultAhead && tasks.size() > 1) {
    prefaulter = std::thread([&] {
      for (size_t i = 0; i < tasks.size() && !error.set() && direct_ok.load(std::memory_order_relaxed); ++i) map_in(i);
    });
  }
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{prefaulter};
  parallel_for(
      tasks.size(),
      [&](size_t i) {
        const ReadTask& t = tasks[i];
        const ReadPiece& p = pieces[t.first];
        const auto [off, lo, hi, end] = spans[i];
        map_in(i);
        // Destinations are p.data + (file offset - p.offset): every pointer formed stays inside
        // the task's pieces, which are contiguous in memory.
        read_range(p.data + t.begin, lo - off, off, false);
        read_range(p.data + (lo - p.offset), hi - lo, lo, true);
        read_range(p.data + (hi - p.offset), end - hi, hi, false);
        if (error.set()) return;
        if (t.last == t.first + 1) {
          check(p, t.begin, t.end);
        } else {
          for (size_t k = t.first; k < t.last; ++k) check(pieces[k], 0, pieces[k].size);
        }
      },
      opts.threads);
  if (prefaulter.joinable()) prefaulter.join();
  error.raise(path);
  ReadResult result;
  for (const ReadPiece& p : pieces) result.bytes += p.size;
  result.direct_bytes = direct_bytes.load();
  result.cached_bytes = cached_bytes.load();
  result.nonzero_at = nonzero_at.load();
  return result;
}

}  // namespace gpumem::io
