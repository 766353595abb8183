// A small persistent thread pool shared by the CRC, writer and arena code.
#pragma once

#include <cstddef>
#include <functional>

namespace gpumem {

// Threads parallel work may use: set_num_threads(n) if n > 0 (Python passes GPUMEM_THREADS),
// else std::thread::hardware_concurrency().
int num_threads();
void set_num_threads(int n);

// Runs fn(i) for every i in [0, n) on up to `threads` threads (<= 0: num_threads()). The caller
// takes part and claims work itself, so a call finishes even when every pool worker is busy with
// another caller's batch. An exception from fn does not stop the other items: after all items
// have run, the first exception fn raised is rethrown. One thread (or one item) runs them in
// order on the caller's thread, with the same contract.
void parallel_for(size_t n, const std::function<void(size_t)>& fn, int threads = 0);

}  // namespace gpumem
