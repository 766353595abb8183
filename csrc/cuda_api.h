// The CUDA runtime, loaded at run time with dlopen (never linked): reuse the libcudart torch already
// loaded, else the one GPUMEM_CUDA_LIBRARY names, else whatever the loader finds. Without it only the
// CUDA paths (pinned host memory) are off; the reason is kept for one clear message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem::cuda {

struct Status {
  bool attempted = false;  // load() has run
  bool available = false;  // runtime loaded, symbols resolved, at least one device
  std::string library;     // path of the loaded libcudart
  int device_count = 0;
  std::string reason;      // why not available (empty when available)
};

// Loads the runtime on the first call and returns that answer on every later call.
// `disabled` is GPUMEM_DISABLE_CUDA; `library` is GPUMEM_CUDA_LIBRARY ("" when unset): when set it
// is the only library tried, so a wrong path is reported instead of silently using another copy.
const Status& load(bool disabled, const std::string& library);

// The answer of load(), or a default (attempted == false) Status before it ran.
Status status();

// Wrappers: 0 on success; else the CUDA error code, with the runtime's text in *err, after clearing
// this thread's last-error slot so torch's later launch checks do not trip on our failure.
int host_register(void* ptr, size_t nbytes, std::string* err);
int host_unregister(void* ptr, std::string* err);
int get_device(int* device, std::string* err);
int set_device(int device, std::string* err);
// cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream): enqueued on `stream` (a
// cudaStream_t as an integer, torch.cuda.Stream.cuda_stream), returns without waiting.
int memcpy_d2h_async(void* dst, const void* src, size_t n, uintptr_t stream, std::string* err);

}  // namespace gpumem::cuda
