/* A fake libcudart for CPU machines: the eight entry points csrc/cuda_api.cpp resolves, each
 * logged with the calling thread's current device (FAKE_CUDART_LOG), so the native core's dlopen
 * path, its chunked registration and the pinning thread run for real without a GPU.
 *
 * FAKE_CUDART_DEVICES      device count (default 4; < 0: cudaGetDeviceCount fails)
 * FAKE_CUDART_FAIL_REGISTER  the k-th cudaHostRegister fails with error 2
 * FAKE_CUDART_BLOCK_REGISTER 1: cudaHostRegister waits until fake_release() is called (logged
 *                            "register_released"), or gives up after 20 s ("register_timeout")
 * FAKE_CUDART_FAIL_MEMCPY    the k-th cudaMemcpyAsync fails with error 1 (invalid value)
 * FAKE_CUDART_BLOCK_MEMCPY   1: the first cudaMemcpyAsync waits for fake_release() likewise
 *
 * cudaMemcpyAsync copies at once with memcpy (a "device" address is a host address here) and
 * logs (destination, bytes, stream).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static __thread int current = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int registers = 0;
static int blocked = 0;
static int released = 0;
static int memcpys = 0;

static void log_call(const char* what, unsigned long long a, unsigned long long b,
                     unsigned long long c) {
  pthread_mutex_lock(&mu);
  const char* path = getenv("FAKE_CUDART_LOG");
  FILE* f = path ? fopen(path, "a") : NULL;
  if (f) {
    fprintf(f, "%s %llu %llu %llu %d\n", what, a, b, c, current);
    fclose(f);
  }
  pthread_mutex_unlock(&mu);
}

static int env_int(const char* name, int dflt) {
  const char* v = getenv(name);
  return v ? atoi(v) : dflt;
}

/* Test hooks (not CUDA API): is a registration waiting, and let it go on. */
int fake_blocked(void) {
  pthread_mutex_lock(&mu);
  int b = blocked;
  pthread_mutex_unlock(&mu);
  return b;
}

void fake_release(void) {
  pthread_mutex_lock(&mu);
  released = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
}

static void wait_for_release(const char* what, void* p, size_t n) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 20;
  int timed_out = 0;
  pthread_mutex_lock(&mu);
  blocked = 1;
  while (!released && !timed_out) timed_out = pthread_cond_timedwait(&cv, &mu, &until) != 0;
  blocked = 0;
  pthread_mutex_unlock(&mu);
  char name[64];
  snprintf(name, sizeof name, "%s_%s", what, timed_out ? "timeout" : "released");
  log_call(name, (size_t)p, n, 0);
}

int cudaGetDeviceCount(int* n) {
  int devices = env_int("FAKE_CUDART_DEVICES", 4);
  if (devices < 0) return 100; /* cudaErrorNoDevice */
  *n = devices;
  return 0;
}
int cudaGetDevice(int* d) {
  *d = current;
  return 0;
}
int cudaSetDevice(int d) {
  current = d;
  log_call("set_device", d, 0, 0);
  return 0;
}
int cudaHostRegister(void* p, size_t n, unsigned flags) {
  pthread_mutex_lock(&mu);
  int k = ++registers;
  pthread_mutex_unlock(&mu);
  if (env_int("FAKE_CUDART_BLOCK_REGISTER", 0)) wait_for_release("register", p, n);
  if (k == env_int("FAKE_CUDART_FAIL_REGISTER", 0)) {
    log_call("register_failed", (size_t)p, n, flags);
    return 2;
  }
  log_call("register", (size_t)p, n, flags);
  return 0;
}
int cudaHostUnregister(void* p) {
  log_call("unregister", (size_t)p, 0, 0);
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* stream) {
  pthread_mutex_lock(&mu);
  int k = ++memcpys;
  pthread_mutex_unlock(&mu);
  if (k == 1 && env_int("FAKE_CUDART_BLOCK_MEMCPY", 0)) wait_for_release("memcpy", dst, n);
  if (kind != 2 || k == env_int("FAKE_CUDART_FAIL_MEMCPY", 0)) {
    log_call("memcpy_failed", (size_t)dst, n, (size_t)stream);
    return 1;
  }
  memcpy(dst, src, n);
  log_call("memcpy", (size_t)dst, n, (size_t)stream);
  return 0;
}
const char* cudaGetErrorString(int e) {
  return e == 1   ? "fake: invalid value"
         : e == 2 ? "fake: out of memory"
         : e == 100 ? "fake: no device"
                    : "fake: other";
}
int cudaGetLastError(void) {
  log_call("get_last_error", 0, 0, 0);
  return 0;
}
