// pwrite on the shared pool. The first error stops the remaining work and is reported with errno,
// path and the failing call; nothing is swallowed and a short write is never accepted. Descriptors
// are owned by Fd, so no exit path (a throwing plan, a failed pool) leaks one.
#include "writer.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <limits>
#include <stdexcept>

#include "parallel.h"

namespace gpumem::io {

namespace {

struct Task {
  uint64_t offset;
  const uint8_t* data;
  size_t size;
  bool direct;
};

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
  constexpr uint64_t kMaxEnd = static_cast<uint64_t>(std::numeric_limits<off_t>::max());
  std::vector<Task> tasks;
  for (const Piece& p : pieces) {
    if (p.offset > kMaxEnd || p.size > kMaxEnd - p.offset)
      throw std::invalid_argument("a piece of " + std::to_string(p.size) + " bytes at offset " +
                                  std::to_string(p.offset) + " ends past the largest file offset");
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

// A second descriptor with O_DIRECT for the aligned parts, or an invalid one where there is none
// (the file system refuses it, as tmpfs did before Linux 6.6): the caller then stays buffered.
Fd open_direct(const std::string& path, const WriteOptions& opts, const Fd& fd) {
#ifdef O_DIRECT
  Fd dfd(open_at(opts.dir_fd, path, O_WRONLY | O_DIRECT | (opts.exclusive ? O_NOFOLLOW : 0)));
  if (dfd.valid() && opts.exclusive) require_same_file(fd, dfd, path);
  return dfd;
#else
  (void)path;
  (void)opts;
  (void)fd;
  return Fd();
#endif
}

}  // namespace

WriteResult write_file(const std::string& path, const std::vector<Piece>& pieces,
                       const WriteOptions& opts) {
  const int flags = O_WRONLY | O_CREAT | (opts.exclusive ? O_EXCL | O_NOFOLLOW : O_TRUNC);
  Fd fd(open_at(opts.dir_fd, path, flags));
  if (!fd.valid()) throw SysError(errno, path, "open for writing");
  Fd dfd = opts.direct ? open_direct(path, opts, fd) : Fd();
  std::atomic<bool> direct_ok{dfd.valid()};
  std::atomic<uint64_t> direct_bytes{0};
  const std::vector<Task> tasks = plan(pieces, dfd.valid());
  FirstError error;
  parallel_for(
      tasks.size(),
      [&](size_t i) {
        if (error.set()) return;
        const Task& t = tasks[i];
        if (t.direct && direct_ok.load(std::memory_order_relaxed)) {
          const int rc = pwrite_all(dfd.get(), t.data, t.size, t.offset);
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
        const int rc = pwrite_all(fd.get(), t.data, t.size, t.offset);
        if (rc != 0) error.record(rc, describe("pwrite", t.size, t.offset));
      },
      opts.threads);
  error.raise(path);
  if (opts.size >= 0) {
    int rc;
    do rc = ::ftruncate(fd.get(), static_cast<off_t>(opts.size));
    while (rc != 0 && errno == EINTR);
    if (rc != 0) throw SysError(errno, path, "ftruncate to " + std::to_string(opts.size) + " bytes");
  }
  if (opts.fsync && retry_eintr(::fdatasync, fd.get()) != 0) throw SysError(errno, path, "fdatasync");
  dfd.close(path);
  fd.close(path);
  WriteResult result;
  for (const Piece& p : pieces) result.bytes += p.size;
  result.direct_bytes = direct_bytes.load();
  return result;
}

void fsync_dir(const std::string& path) {
  Fd fd(open_at(kCwd, path, O_RDONLY | O_DIRECTORY));
  if (!fd.valid()) throw SysError(errno, path, "open directory");
  if (retry_eintr(::fsync, fd.get()) != 0) throw SysError(errno, path, "fsync of directory");
  fd.close(path);
}

}  // namespace gpumem::io
