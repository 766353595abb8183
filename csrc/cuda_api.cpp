// dlopen-based CUDA runtime loader (the pattern of drjit-core's cuda_api.cpp).
#include "cuda_api.h"

#include <dlfcn.h>

#include <mutex>

namespace gpumem::cuda {
namespace {

constexpr unsigned kHostRegisterPortable = 1;  // cudaHostRegisterPortable: pinned for every context

using HostRegisterFn = int (*)(void*, size_t, unsigned);
using HostUnregisterFn = int (*)(void*);
using GetDeviceCountFn = int (*)(int*);
using GetErrorStringFn = const char* (*)(int);
using GetDeviceFn = int (*)(int*);
using SetDeviceFn = int (*)(int);
using GetLastErrorFn = int (*)();
using MemcpyAsyncFn = int (*)(void*, const void*, size_t, int, void*);
constexpr int kMemcpyDeviceToHost = 2;  // cudaMemcpyDeviceToHost

struct Api {
  HostRegisterFn host_register = nullptr;
  HostUnregisterFn host_unregister = nullptr;
  GetDeviceCountFn get_device_count = nullptr;
  GetErrorStringFn get_error_string = nullptr;
  GetDeviceFn get_device = nullptr;
  SetDeviceFn set_device = nullptr;
  GetLastErrorFn get_last_error = nullptr;
  MemcpyAsyncFn memcpy_async = nullptr;
};

std::mutex g_mu;
Status g_status;
Api g_api;

// The sonames torch wheels load (CUDA 12, 13, 11) and the unversioned development name.
constexpr const char* kNames[] = {"libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0",
                                  "libcudart.so"};

void* open_runtime(const std::string& library, std::string* why) {
  if (!library.empty()) {
    void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h) h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      *why = "GPUMEM_CUDA_LIBRARY=" + library + " could not be loaded (" +
             (e ? e : "unknown dlopen error") + ")";
    }
    return h;
  }
  for (const char* name : kNames)  // a copy already in the process (torch's) first
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) return h;
  for (const char* name : kNames)
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  dlerror();
  *why = "libcudart.so not found";
  return nullptr;
}

template <typename Fn>
bool resolve(void* handle, const char* name, Fn* out, std::string* why) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr && why->empty()) *why = std::string("libcudart lacks the symbol ") + name;
  return *out != nullptr;
}

std::string error_text(int code) {
  const char* s = g_api.get_error_string ? g_api.get_error_string(code) : nullptr;
  return std::string(s ? s : "unknown CUDA error") + " (cudaError " + std::to_string(code) + ")";
}

int checked(int code, std::string* err) {
  if (code != 0) {
    if (err) *err = error_text(code);
    if (g_api.get_last_error) g_api.get_last_error();
  }
  return code;
}

bool ready() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_status.available;
}

}  // namespace

const Status& load(bool disabled, const std::string& library) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_status.attempted) return g_status;
  g_status.attempted = true;
  if (disabled) {
    g_status.reason = "disabled by GPUMEM_DISABLE_CUDA=1";
    return g_status;
  }
  std::string why;
  void* h = open_runtime(library, &why);
  if (!h) {
    g_status.reason = why;
    return g_status;
  }
  Api api;
  bool ok = resolve(h, "cudaHostRegister", &api.host_register, &why);
  ok = resolve(h, "cudaHostUnregister", &api.host_unregister, &why) && ok;
  ok = resolve(h, "cudaGetDeviceCount", &api.get_device_count, &why) && ok;
  ok = resolve(h, "cudaGetErrorString", &api.get_error_string, &why) && ok;
  ok = resolve(h, "cudaGetDevice", &api.get_device, &why) && ok;
  ok = resolve(h, "cudaSetDevice", &api.set_device, &why) && ok;
  ok = resolve(h, "cudaGetLastError", &api.get_last_error, &why) && ok;
  ok = resolve(h, "cudaMemcpyAsync", &api.memcpy_async, &why) && ok;
  Dl_info info{};
  if (api.get_device_count && dladdr(reinterpret_cast<void*>(api.get_device_count), &info) &&
      info.dli_fname)
    g_status.library = info.dli_fname;
  if (!ok) {
    g_status.reason = why;  // the handle stays open: it may be torch's copy
    return g_status;
  }
  g_api = api;
  int count = 0;
  const int rc = api.get_device_count(&count);
  if (rc != 0) {
    g_status.reason = "cudaGetDeviceCount failed: " + error_text(rc);
    api.get_last_error();
    return g_status;
  }
  g_status.device_count = count;
  if (count <= 0) {
    g_status.reason = "no CUDA device is visible";
    return g_status;
  }
  g_status.available = true;
  return g_status;
}

Status status() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_status;
}

int host_register(void* ptr, size_t nbytes, std::string* err) {
  if (!ready()) {
    if (err) *err = "CUDA runtime not available";
    return -1;
  }
  return checked(g_api.host_register(ptr, nbytes, kHostRegisterPortable), err);
}

int host_unregister(void* ptr, std::string* err) {
  if (!ready()) {
    if (err) *err = "CUDA runtime not available";
    return -1;
  }
  return checked(g_api.host_unregister(ptr), err);
}

int get_device(int* device, std::string* err) {
  if (!ready()) {
    if (err) *err = "CUDA runtime not available";
    return -1;
  }
  return checked(g_api.get_device(device), err);
}

int set_device(int device, std::string* err) {
  if (!ready()) {
    if (err) *err = "CUDA runtime not available";
    return -1;
  }
  return checked(g_api.set_device(device), err);
}

int memcpy_d2h_async(void* dst, const void* src, size_t n, uintptr_t stream, std::string* err) {
  if (!ready()) {
    if (err) *err = "CUDA runtime not available";
    return -1;
  }
  return checked(g_api.memcpy_async(dst, src, n, kMemcpyDeviceToHost, reinterpret_cast<void*>(stream)),
                 err);
}

}  // namespace gpumem::cuda
