// What the writer and the reader share: errors that keep errno and path, a descriptor that closes
// itself on every way out (exceptions included), the open that refuses anything but a regular
// file, and the bookkeeping of a parallel job's first failure.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace gpumem::io {

// errno, the path it concerns, and what we were doing ("pwrite of 8388608 bytes at offset 0").
class SysError : public std::runtime_error {
 public:
  SysError(int err, std::string path, const std::string& what);
  int err;
  std::string path;
};

// The file is not what the caller asked for: a symbolic link, not a regular file (a FIFO, a
// device, a directory, a socket), not of the expected size, or replaced while it was opened.
// Its contents were never read, so nothing blocked and nothing outside was touched.
class UnexpectedFile : public SysError {
 public:
  using SysError::SysError;
};

constexpr int kCwd = AT_FDCWD;  // dir_fd meaning "paths are relative to the working directory"

// Owns one descriptor. Closing reports errors (a write-back failure can surface at close on
// network file systems); the destructor closes silently, for the paths that already failed.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close(const std::string& path);  // throws SysError if close(2) fails

 private:
  int fd_ = -1;
};

// open(2) relative to dir_fd (kCwd: the working directory), O_CLOEXEC, EINTR retried. Returns
// the descriptor or -1 with errno set.
int open_at(int dir_fd, const std::string& path, int flags, mode_t mode = 0644);

// call(fd) (fsync, fdatasync) again while it fails with EINTR, as CPython does (PEP 475): a signal
// that arrives during the call is no reason to fail it. Returns its result, errno set on -1.
int retry_eintr(int (*call)(int), int fd);

// Opens `path` (relative to dir_fd) for `flags` only if it is a regular file: never follows a
// symbolic link (O_NOFOLLOW), never opens a FIFO or a device (fstatat checks the type first, the
// open does not block, fstat checks the opened inode is the one checked), and, when
// expect_size >= 0, only if it holds exactly that many bytes. Throws UnexpectedFile otherwise,
// SysError for the system's own errors (ENOENT, EACCES, ...).
Fd open_regular(int dir_fd, const std::string& path, int flags, int64_t expect_size);

// Throws UnexpectedFile unless `a` and `b` are the same file (a second descriptor of one file).
void require_same_file(const Fd& a, const Fd& b, const std::string& path);

constexpr size_t kSplit = size_t(8) << 20;  // sub-range per task: big enough for the disk queue
constexpr uint64_t kAlign = 4096;           // O_DIRECT alignment of address, offset and length

std::string describe(const char* call, size_t size, uint64_t offset);

// The first failure of a parallel job; later ones are dropped (they are usually its echoes).
class FirstError {
 public:
  bool set() const { return failed_.load(std::memory_order_relaxed); }
  void record(int err, const std::string& what);
  void raise(const std::string& path) const;

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  int err_ = 0;
  std::string what_;
};

}  // namespace gpumem::io
