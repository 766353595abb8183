// pwrite/pread on the shared pool. The first error stops the remaining work and is reported with
// errno, path and the failing call; nothing is swallowed and a short write is never accepted.
#include "writer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "crc32c.h"
#include "parallel.h"

namespace gpumem::io {

SysError::SysError(int e, std::string p, const std::string& what)
    : std::runtime_error(what), err(e), path(std::move(p)) {}

namespace {

constexpr size_t kSplit = size_t(8) << 20;  // sub-range per task: big enough for the disk queue
constexpr uint64_t kAlign = 4096;           // O_DIRECT alignment of address, offset and length

struct Task {
  uint64_t offset;
  const uint8_t* data;
  size_t size;
  bool direct;
};

// The first failure of a parallel job; later ones are dropped (they are usually its echoes).
class FirstError {
 public:
  bool set() const { return failed_.load(std::memory_order_relaxed); }
  void record(int err, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load()) return;
    err_ = err;
    what_ = what;
    failed_.store(true);
  }
  void raise(const std::string& path) const {
    if (failed_.load()) throw SysError(err_, path, what_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  int err_ = 0;
  std::string what_;
};

std::string describe(const char* call, size_t size, uint64_t offset) {
  return std::string(call) + " of " + std::to_string(size) + " bytes at offset " +
         std::to_string(offset);
}

// Appends [offset, offset + size) from data as tasks of at most kSplit bytes (kSplit is a multiple
// of kAlign, so split direct ranges stay aligned).
void split(std::vector<Task>* tasks, uint64_t offset, const uint8_t* data, size_t size, bool direct) {
  while (size > 0) {
    const size_t n = size < kSplit ? size : kSplit;
    tasks->push_back({offset, data, n, direct});
    offset += n;
    data += n;
    size -= n;
  }
}

std::vector<Task> plan(const std::vector<Piece>& pieces, bool direct) {
  std::vector<Task> tasks;
  for (const Piece& p : pieces) {
    const uint64_t end = p.offset + p.size;
    const uint64_t lo = (p.offset + kAlign - 1) / kAlign * kAlign;
    const uint64_t hi = end / kAlign * kAlign;
    // The buffer and the file offset must be misaligned by the same amount for the middle to be
    // aligned in both.
    const bool same_phase = (reinterpret_cast<uintptr_t>(p.data) - p.offset) % kAlign == 0;
    if (!direct || !same_phase || lo >= hi) {
      split(&tasks, p.offset, p.data, p.size, false);
      continue;
    }
    split(&tasks, p.offset, p.data, lo - p.offset, false);
    split(&tasks, lo, p.data + (lo - p.offset), hi - lo, true);
    split(&tasks, hi, p.data + (hi - p.offset), end - hi, false);
  }
  return tasks;
}

// Writes all of [data, data + size) at offset; returns 0 or errno. EINVAL from an O_DIRECT
// descriptor is returned as is so the caller can retry buffered.
int pwrite_all(int fd, const uint8_t* data, size_t size, uint64_t offset) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;  // no progress and no error: never loop forever
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

// Reads all of [data, data + size) at offset; returns 0 or errno (EIO when the file ends first).
// EINVAL from an O_DIRECT descriptor is returned as is so the caller can retry buffered.
int pread_all(int fd, uint8_t* data, size_t size, uint64_t offset) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;  // the file is shorter than the manifest says
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

int open_checked(const std::string& path, int flags, mode_t mode = 0644) {
  for (;;) {
    const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EINTR) return fd;
  }
}

// A second descriptor with O_DIRECT for the aligned parts, or -1 where there is none (the file
// system refuses it, as tmpfs did before Linux 6.6): the caller then stays buffered.
int open_direct(const std::string& path, int flags) {
#ifdef O_DIRECT
  return open_checked(path, flags | O_DIRECT);
#else
  (void)path;
  (void)flags;
  return -1;
#endif
}

void close_checked(int fd, const std::string& path, bool report) {
  if (fd < 0) return;
  if (::close(fd) != 0 && report) throw SysError(errno, path, "close");
}

}  // namespace

WriteResult write_file(const std::string& path, const std::vector<Piece>& pieces,
                       const WriteOptions& opts) {
  const int fd = open_checked(path, O_WRONLY | O_CREAT | O_TRUNC);
  if (fd < 0) throw SysError(errno, path, "open for writing");
  const int dfd = opts.direct ? open_direct(path, O_WRONLY) : -1;
  std::atomic<bool> direct_ok{dfd >= 0};
  std::atomic<uint64_t> direct_bytes{0};
  const std::vector<Task> tasks = plan(pieces, dfd >= 0);
  FirstError error;
  parallel_for(
      tasks.size(),
      [&](size_t i) {
        if (error.set()) return;
        const Task& t = tasks[i];
        if (t.direct && direct_ok.load(std::memory_order_relaxed)) {
          const int rc = pwrite_all(dfd, t.data, t.size, t.offset);
          if (rc == 0) {
            direct_bytes.fetch_add(t.size, std::memory_order_relaxed);
            return;
          }
          if (rc != EINVAL) {
            error.record(rc, describe("pwrite (O_DIRECT)", t.size, t.offset));
            return;
          }
          direct_ok.store(false);  // the file system refuses O_DIRECT here: buffered from now on
        }
        const int rc = pwrite_all(fd, t.data, t.size, t.offset);
        if (rc != 0) error.record(rc, describe("pwrite", t.size, t.offset));
      },
      opts.threads);
  WriteResult result;
  for (const Piece& p : pieces) result.bytes += p.size;
  result.direct_bytes = direct_bytes.load();
  try {
    error.raise(path);
    if (opts.size >= 0 && ::ftruncate(fd, static_cast<off_t>(opts.size)) != 0)
      throw SysError(errno, path, "ftruncate to " + std::to_string(opts.size) + " bytes");
    if (opts.fsync && ::fdatasync(fd) != 0) throw SysError(errno, path, "fdatasync");
  } catch (...) {
    close_checked(dfd, path, false);
    close_checked(fd, path, false);
    throw;
  }
  close_checked(dfd, path, true);
  close_checked(fd, path, true);
  return result;
}

void fsync_dir(const std::string& path) {
  const int fd = open_checked(path, O_RDONLY | O_DIRECTORY);
  if (fd < 0) throw SysError(errno, path, "open directory");
  if (::fsync(fd) != 0) {
    const int e = errno;
    close_checked(fd, path, false);
    throw SysError(e, path, "fsync of directory");
  }
  close_checked(fd, path, true);
}

uint64_t read_into(const std::string& path, uint64_t offset, uint8_t* out, size_t size, int threads) {
  const int fd = open_checked(path, O_RDONLY);
  if (fd < 0) throw SysError(errno, path, "open for reading");
  const size_t count = (size + kSplit - 1) / kSplit;
  FirstError error;
  parallel_for(
      count,
      [&](size_t i) {
        if (error.set()) return;
        size_t done = i * kSplit;
        const size_t end = done + kSplit < size ? done + kSplit : size;
        while (done < end) {
          const ssize_t n = ::pread(fd, out + done, end - done, static_cast<off_t>(offset + done));
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
  try {
    error.raise(path);
  } catch (...) {
    close_checked(fd, path, false);
    throw;
  }
  close_checked(fd, path, true);
  return size;
}

ReadResult read_file(const std::string& path, const std::vector<ReadPiece>& pieces, const ReadOptions& opts) {
  const int fd = open_checked(path, O_RDONLY);
  if (fd < 0) throw SysError(errno, path, "open for reading");
  const int dfd = opts.direct ? open_direct(path, O_RDONLY) : -1;
  // Tasks never straddle a checksum chunk, so each task hashes whole chunks it has just read (hot
  // in cache).
  const size_t step = opts.chunk >= kSplit ? opts.chunk : opts.chunk > 0 ? kSplit / opts.chunk * opts.chunk : kSplit;
  struct ReadTask {
    size_t piece;
    size_t begin, end;  // byte range within the piece
  };
  std::vector<ReadTask> tasks;
  for (size_t i = 0; i < pieces.size(); ++i)
    for (size_t b = 0; b < pieces[i].size; b += step)
      tasks.push_back({i, b, b + step < pieces[i].size ? b + step : pieces[i].size});
  std::atomic<bool> direct_ok{dfd >= 0};
  std::atomic<uint64_t> direct_bytes{0};
  FirstError error;
  auto read_range = [&](uint8_t* data, size_t size, uint64_t offset, bool direct) {
    if (size == 0 || error.set()) return;
    if (direct && direct_ok.load(std::memory_order_relaxed)) {
      prefault(data, size);
      const int rc = pread_all(dfd, data, size, offset);
      if (rc == 0) {
        direct_bytes.fetch_add(size, std::memory_order_relaxed);
        return;
      }
      if (rc != EINVAL) {
        error.record(rc, describe("pread (O_DIRECT)", size, offset));
        return;
      }
      direct_ok.store(false);  // the file system refuses O_DIRECT here: buffered from now on
    }
    const int rc = pread_all(fd, data, size, offset);
    if (rc == EIO)
      error.record(EIO, describe("pread", size, offset) + " reached the end of the file (it is shorter than expected)");
    else if (rc != 0)
      error.record(rc, describe("pread", size, offset));
  };
  parallel_for(
      tasks.size(),
      [&](size_t i) {
        const ReadTask& t = tasks[i];
        const ReadPiece& p = pieces[t.piece];
        const uint64_t off = p.offset + t.begin;
        const uint64_t end = p.offset + t.end;
        // The buffer and the file offset must be misaligned by the same amount for the middle of
        // the range to be aligned in both (as in write_file).
        const bool same_phase = (reinterpret_cast<uintptr_t>(p.data) - p.offset) % kAlign == 0;
        uint64_t lo = (off + kAlign - 1) / kAlign * kAlign;
        uint64_t hi = end / kAlign * kAlign;
        if (dfd < 0 || !same_phase || lo >= hi) lo = hi = end;
        uint8_t* base = p.data - p.offset;  // base + file offset = destination
        read_range(base + off, lo - off, off, false);
        read_range(base + lo, hi - lo, lo, true);
        read_range(base + hi, end - hi, hi, false);
        if (opts.chunk == 0 || p.crc_index < 0 || error.set()) return;
        for (size_t c = t.begin; c < t.end; c += opts.chunk) {
          const size_t n = c + opts.chunk < p.size ? opts.chunk : p.size - c;
          opts.crc_out[p.crc_index + c / opts.chunk] = crc32c::extend(0, p.data + c, n);
        }
      },
      opts.threads);
  ReadResult result;
  for (const ReadPiece& p : pieces) result.bytes += p.size;
  result.direct_bytes = direct_bytes.load();
  close_checked(dfd, path, false);
  close_checked(fd, path, false);
  error.raise(path);
  return result;
}

}  // namespace gpumem::io
