/* An LD_PRELOAD fault injector for tests/checkpoint/fault_sweep.py (issue 39).

   Interposes the libc entry points that Python (libpython) and gpumem's native core (_C*.so)
   call for open, write, read, fsync, fdatasync, rename, close, unlink and mkdir (and opendir,
   closedir: libc opens and closes inside them). Inert until
   faultshim_arm(); armed, it counts the calls that touch a file under ROOT (by path, or by the
   descriptor's /proc/self/fd link), one counter per kind for the whole process (all threads),
   and makes the N-th call of the chosen kind fail with the chosen errno: the call is not made
   (close is: Linux releases a descriptor even when close fails). Why not strace's
   inject=...:when=N: strace counts per syscall *per thread* and from the start of the process,
   so a save whose writes run on a thread pool could not be faulted at "the N-th pwrite".

   Build: gcc -shared -fPIC -O1 -o faultshim.so faultshim.c -ldl */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { K_OPEN, K_WRITE, K_READ, K_FSYNC, K_FDATASYNC, K_RENAME, K_CLOSE, K_UNLINK, K_MKDIR, K_N };

static const char *kind_names[K_N] = {"open",  "write",  "read",   "fsync", "fdatasync",
                                      "rename", "close", "unlink", "mkdir"};

static volatile int armed;
static char root[PATH_MAX];
static size_t root_len;
static int target = -1, target_errno;
static long target_n;
static long counts[K_N];
static char hit[PATH_MAX + 64];
static int log_fd = -1;

const char *faultshim_kind_name(int k) { return k >= 0 && k < K_N ? kind_names[k] : ""; }
int faultshim_kinds(void) { return K_N; }
long faultshim_count(int k) { return k >= 0 && k < K_N ? __atomic_load_n(&counts[k], __ATOMIC_SEQ_CST) : -1; }
const char *faultshim_hit(void) { return hit; }

/* Count calls under `path` (a directory), and fail the n-th call of `kind` with `err` (kind -1:
   count only); `log` >= 0: a descriptor (outside the root) that gets "kind n path" per call.
   Counters restart at zero. */
void faultshim_arm(const char *path, int kind, int err, long n, int log) {
  snprintf(root, sizeof root, "%s", path);
  root_len = strlen(root);
  while (root_len > 1 && root[root_len - 1] == '/') root[--root_len] = 0;
  target = kind, target_errno = err, target_n = n;
  for (int k = 0; k < K_N; k++) __atomic_store_n(&counts[k], 0, __ATOMIC_SEQ_CST);
  hit[0] = 0;
  log_fd = log;
  __atomic_store_n(&armed, 1, __ATOMIC_SEQ_CST);
}

void faultshim_disarm(void) { __atomic_store_n(&armed, 0, __ATOMIC_SEQ_CST); }

static int under_root(const char *p) {
  return strncmp(p, root, root_len) == 0 && (p[root_len] == 0 || p[root_len] == '/');
}

static int fd_path(int fd, char *out, size_t size) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, out, size - 1);
  if (n < 0) return 0;
  out[n] = 0;
  return 1;
}

/* The absolute path `name` names relative to dirfd (AT_FDCWD: the working directory). */
static int at_path(int dirfd, const char *name, char *out, size_t size) {
  if (name == NULL) return 0;
  if (name[0] == '/') {
    snprintf(out, size, "%s", name);
    return 1;
  }
  char base[PATH_MAX];
  if (dirfd == AT_FDCWD) {
    if (getcwd(base, sizeof base) == NULL) return 0;
  } else if (!fd_path(dirfd, base, sizeof base)) {
    return 0;
  }
  snprintf(out, size, "%s/%s", base, name);
  return 1;
}

/* Whether this call is to fail: counts it when it touches the root. */
static int inject(int kind, const char *path) {
  if (path == NULL || !under_root(path)) return 0;
  const long n = __atomic_add_fetch(&counts[kind], 1, __ATOMIC_SEQ_CST);
  if (log_fd >= 0) { /* the raw system call: never through this shim's write() */
    char line[PATH_MAX + 64];
    const int len = snprintf(line, sizeof line, "%s %ld %s\n", kind_names[kind], n, path);
    if (len > 0) syscall(SYS_write, log_fd, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
  }
  if (kind != target || n != target_n) return 0;
  snprintf(hit, sizeof hit, "%s %ld %s", kind_names[kind], n, path);
  return 1;
}

static int inject_fd(int kind, int fd) {
  if (!__atomic_load_n(&armed, __ATOMIC_SEQ_CST)) return 0;
  char p[PATH_MAX];
  return fd_path(fd, p, sizeof p) && inject(kind, p);
}

static int inject_at(int kind, int dirfd, const char *name) {
  if (!__atomic_load_n(&armed, __ATOMIC_SEQ_CST)) return 0;
  char p[PATH_MAX];
  return at_path(dirfd, name, p, sizeof p) && inject(kind, p);
}

static int inject_at2(int kind, int d1, const char *n1, int d2, const char *n2) {
  if (!__atomic_load_n(&armed, __ATOMIC_SEQ_CST)) return 0;
  char p[PATH_MAX], q[PATH_MAX];
  int a = at_path(d1, n1, p, sizeof p), b = at_path(d2, n2, q, sizeof q);
  if (a && under_root(p)) return inject(kind, p);
  return b && inject(kind, q);
}

#define REAL(ret, name, ...)                                   \
  static ret (*real_##name)(__VA_ARGS__);                     \
  if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name);

#define FAIL(ret) \
  do {            \
    errno = target_errno; \
    return ret;   \
  } while (0)

static mode_t mode_of(int flags, va_list ap) {
  return (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? (mode_t)va_arg(ap, int) : 0;
}

/* ------------------------------------------------------------------ open */

#define OPEN_AT(name)                                                   \
  int name(int dirfd, const char *path, int flags, ...) {               \
    va_list ap;                                                         \
    va_start(ap, flags);                                                \
    const mode_t mode = mode_of(flags, ap);                             \
    va_end(ap);                                                         \
    REAL(int, name, int, const char *, int, ...)                        \
    if (inject_at(K_OPEN, dirfd, path)) FAIL(-1);                       \
    return real_##name(dirfd, path, flags, mode);                       \
  }
OPEN_AT(openat)
OPEN_AT(openat64)

#define OPEN(name)                                                      \
  int name(const char *path, int flags, ...) {                          \
    va_list ap;                                                         \
    va_start(ap, flags);                                                \
    const mode_t mode = mode_of(flags, ap);                             \
    va_end(ap);                                                         \
    REAL(int, name, const char *, int, ...)                             \
    if (inject_at(K_OPEN, AT_FDCWD, path)) FAIL(-1);                    \
    return real_##name(path, flags, mode);                              \
  }
OPEN(open)
OPEN(open64)

#define OPEN_2(name)                                                    \
  int name(const char *path, int flags) {                               \
    REAL(int, name, const char *, int)                                  \
    if (inject_at(K_OPEN, AT_FDCWD, path)) FAIL(-1);                    \
    return real_##name(path, flags);                                    \
  }
OPEN_2(__open_2)
OPEN_2(__open64_2)

#define OPENAT_2(name)                                                  \
  int name(int dirfd, const char *path, int flags) {                    \
    REAL(int, name, int, const char *, int)                             \
    if (inject_at(K_OPEN, dirfd, path)) FAIL(-1);                       \
    return real_##name(dirfd, path, flags);                             \
  }
OPENAT_2(__openat_2)
OPENAT_2(__openat64_2)

/* ------------------------------------------------------------------ write and read */

ssize_t write(int fd, const void *buf, size_t n) {
  REAL(ssize_t, write, int, const void *, size_t)
  if (inject_fd(K_WRITE, fd)) FAIL(-1);
  return real_write(fd, buf, n);
}

ssize_t read(int fd, void *buf, size_t n) {
  REAL(ssize_t, read, int, void *, size_t)
  if (inject_fd(K_READ, fd)) FAIL(-1);
  return real_read(fd, buf, n);
}

#define PIO(name, kind, buf_t)                                          \
  ssize_t name(int fd, buf_t buf, size_t n, off_t off) {                \
    REAL(ssize_t, name, int, buf_t, size_t, off_t)                      \
    if (inject_fd(kind, fd)) FAIL(-1);                                  \
    return real_##name(fd, buf, n, off);                                \
  }
PIO(pwrite, K_WRITE, const void *)
PIO(pwrite64, K_WRITE, const void *)
PIO(pread, K_READ, void *)
PIO(pread64, K_READ, void *)

#define VIO(name, kind)                                                 \
  ssize_t name(int fd, const struct iovec *iov, int cnt) {              \
    REAL(ssize_t, name, int, const struct iovec *, int)                 \
    if (inject_fd(kind, fd)) FAIL(-1);                                  \
    return real_##name(fd, iov, cnt);                                   \
  }
VIO(writev, K_WRITE)
VIO(readv, K_READ)

#define PVIO(name, kind)                                                \
  ssize_t name(int fd, const struct iovec *iov, int cnt, off_t off) {   \
    REAL(ssize_t, name, int, const struct iovec *, int, off_t)          \
    if (inject_fd(kind, fd)) FAIL(-1);                                  \
    return real_##name(fd, iov, cnt, off);                              \
  }
PVIO(pwritev, K_WRITE)
PVIO(pwritev64, K_WRITE)
PVIO(preadv, K_READ)
PVIO(preadv64, K_READ)

/* ------------------------------------------------------------------ sync, close */

int fsync(int fd) {
  REAL(int, fsync, int)
  if (inject_fd(K_FSYNC, fd)) FAIL(-1);
  return real_fsync(fd);
}

int fdatasync(int fd) {
  REAL(int, fdatasync, int)
  if (inject_fd(K_FDATASYNC, fd)) FAIL(-1);
  return real_fdatasync(fd);
}

int close(int fd) {
  REAL(int, close, int)
  if (inject_fd(K_CLOSE, fd)) {
    real_close(fd); /* released all the same, as Linux does */
    FAIL(-1);
  }
  return real_close(fd);
}

/* opendir and closedir open and close inside libc, where no interposition reaches: their own
   entry points stand for them (CPython's os.scandir and os.listdir use them). */
DIR *opendir(const char *p) {
  REAL(DIR *, opendir, const char *)
  if (inject_at(K_OPEN, AT_FDCWD, p)) FAIL(NULL);
  return real_opendir(p);
}

int closedir(DIR *d) {
  REAL(int, closedir, DIR *)
  if (inject_fd(K_CLOSE, dirfd(d))) {
    real_closedir(d);
    FAIL(-1);
  }
  return real_closedir(d);
}

/* ------------------------------------------------------------------ names */

int rename(const char *a, const char *b) {
  REAL(int, rename, const char *, const char *)
  if (inject_at2(K_RENAME, AT_FDCWD, a, AT_FDCWD, b)) FAIL(-1);
  return real_rename(a, b);
}

int renameat(int da, const char *a, int db, const char *b) {
  REAL(int, renameat, int, const char *, int, const char *)
  if (inject_at2(K_RENAME, da, a, db, b)) FAIL(-1);
  return real_renameat(da, a, db, b);
}

int renameat2(int da, const char *a, int db, const char *b, unsigned flags) {
  REAL(int, renameat2, int, const char *, int, const char *, unsigned)
  if (inject_at2(K_RENAME, da, a, db, b)) FAIL(-1);
  return real_renameat2(da, a, db, b, flags);
}

int unlink(const char *p) {
  REAL(int, unlink, const char *)
  if (inject_at(K_UNLINK, AT_FDCWD, p)) FAIL(-1);
  return real_unlink(p);
}

int unlinkat(int d, const char *p, int flags) {
  REAL(int, unlinkat, int, const char *, int)
  if (inject_at(K_UNLINK, d, p)) FAIL(-1);
  return real_unlinkat(d, p, flags);
}

int rmdir(const char *p) {
  REAL(int, rmdir, const char *)
  if (inject_at(K_UNLINK, AT_FDCWD, p)) FAIL(-1);
  return real_rmdir(p);
}

int mkdir(const char *p, mode_t m) {
  REAL(int, mkdir, const char *, mode_t)
  if (inject_at(K_MKDIR, AT_FDCWD, p)) FAIL(-1);
  return real_mkdir(p, m);
}

int mkdirat(int d, const char *p, mode_t m) {
  REAL(int, mkdirat, int, const char *, mode_t)
  if (inject_at(K_MKDIR, d, p)) FAIL(-1);
  return real_mkdirat(d, p, m);
}
