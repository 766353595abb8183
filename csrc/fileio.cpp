#include "fileio.h"

#include <unistd.h>

#include <cerrno>

namespace gpumem::io {

SysError::SysError(int e, std::string p, const std::string& what)
    : std::runtime_error(what), err(e), path(std::move(p)) {}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Fd::close(const std::string& path) {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;  // closed (or lost) either way: close(2) must not be retried
  // EINTR: Linux has released the descriptor and the data were synced before (as CPython's
  // os.close, which ignores EINTR: PEP 475); anything else is a write-back error reported late.
  if (::close(fd) != 0 && errno != EINTR) throw SysError(errno, path, "close");
}

int retry_eintr(int (*call)(int), int fd) {
  for (;;) {
    const int rc = call(fd);
    if (rc == 0 || errno != EINTR) return rc;
  }
}

int open_at(int dir_fd, const std::string& path, int flags, mode_t mode) {
  for (;;) {
    const int fd = ::openat(dir_fd, path.c_str(), flags | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EINTR) return fd;
  }
}

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void check_regular(const struct stat& st, const std::string& path, int64_t expect_size) {
  if (!S_ISREG(st.st_mode))
    throw UnexpectedFile(EINVAL, path,
                         std::string("is ") + kind_of(st.st_mode) + ", not a regular file: refused");
  if (expect_size >= 0 && st.st_size != expect_size)
    throw UnexpectedFile(EINVAL, path,
                         "is " + std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(expect_size));
}

}  // namespace

Fd open_regular(int dir_fd, const std::string& path, int flags, int64_t expect_size) {
  struct stat before {};
  if (::fstatat(dir_fd, path.c_str(), &before, AT_SYMLINK_NOFOLLOW) != 0)
    throw SysError(errno, path, "stat");
  check_regular(before, path, expect_size);
  // O_NONBLOCK: should a FIFO be swapped in after the check, the open returns instead of waiting
  // for a writer (regular files ignore the flag); O_NOCTTY: a terminal never becomes ours.
  Fd fd(open_at(dir_fd, path, flags | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
  if (!fd.valid()) {
    if (errno == ELOOP) throw UnexpectedFile(ELOOP, path, "is a symbolic link, not a regular file: refused");
    throw SysError(errno, path, "open");
  }
  struct stat after {};
  if (::fstat(fd.get(), &after) != 0) throw SysError(errno, path, "fstat");
  check_regular(after, path, expect_size);
  if (after.st_dev != before.st_dev || after.st_ino != before.st_ino)
    throw UnexpectedFile(EINVAL, path, "was replaced while it was being opened: refused");
  // Reads and writes of a regular file block as usual; clear the flag anyway so that nothing
  // downstream sees EAGAIN.
  const int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl >= 0) ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

void require_same_file(const Fd& a, const Fd& b, const std::string& path) {
  struct stat sa {}, sb {};
  if (::fstat(a.get(), &sa) != 0 || ::fstat(b.get(), &sb) != 0) throw SysError(errno, path, "fstat");
  if (sa.st_dev != sb.st_dev || sa.st_ino != sb.st_ino)
    throw UnexpectedFile(EINVAL, path, "was replaced while it was being opened: refused");
}

std::string describe(const char* call, size_t size, uint64_t offset) {
  return std::string(call) + " of " + std::to_string(size) + " bytes at offset " +
         std::to_string(offset);
}

void FirstError::record(int err, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load()) return;
  err_ = err;
  what_ = what;
  failed_.store(true);
}

void FirstError::raise(const std::string& path) const {
  if (failed_.load()) throw SysError(err_, path, what_);
}

}  // namespace gpumem::io
