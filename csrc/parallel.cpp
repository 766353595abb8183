// Work-claiming thread pool: helpers and the caller pull item indices from one atomic counter.
#include "parallel.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace gpumem {
namespace {

constexpr size_t kMaxThreads = 256;  // workers are never joined, so bound what one call may create

struct Batch {
  const std::function<void(size_t)>* fn;  // valid until done == n (the caller waits for that)
  size_t n;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;

  Batch(const std::function<void(size_t)>* f, size_t count) : fn(f), n(count) {}

  void run() {
    for (;;) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

class Pool {
 public:
  // Make sure at least `count` workers exist (they are never joined: the pool lives until exit).
  void ensure_workers(size_t count) {
    std::lock_guard<std::mutex> lock(mu_);
    while (workers_ < count) {
      std::thread([this] { work(); }).detach();
      ++workers_;
    }
  }

  void submit(const std::shared_ptr<Batch>& batch, size_t helpers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < helpers; ++i) queue_.push_back(batch);
    }
    if (helpers == 1) cv_.notify_one(); else cv_.notify_all();
  }

 private:
  void work() {
    for (;;) {
      std::shared_ptr<Batch> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        batch = std::move(queue_.front());
        queue_.pop_front();
      }
      batch->run();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Batch>> queue_;
  size_t workers_ = 0;
};

// Leaked on purpose: no destructor runs at interpreter exit while workers sleep on the queue.
std::mutex* g_mu = new std::mutex;
Pool* g_pool = nullptr;
std::atomic<int> g_threads{0};

// A forked child has none of the parent's worker threads (and maybe a locked mutex): start over.
void after_fork_in_child() {
  g_mu = new std::mutex;
  g_pool = nullptr;
}

Pool& pool() {
  std::lock_guard<std::mutex> lock(*g_mu);
  if (g_pool == nullptr) {
    static const int registered = pthread_atfork(nullptr, nullptr, after_fork_in_child);
    (void)registered;
    g_pool = new Pool;
  }
  return *g_pool;
}

}  // namespace

int num_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void parallel_for(size_t n, const std::function<void(size_t)>& fn, int threads) {
  if (n == 0) return;
  size_t t = static_cast<size_t>(threads > 0 ? threads : num_threads());
  if (t > n) t = n;
  if (t > kMaxThreads) t = kMaxThreads;
  if (t <= 1) {
    // The pool's contract, so that a caller sees the same effects whatever the thread count: a
    // failed item does not stop the others, and the first error is rethrown after the last item.
    std::exception_ptr error;
    for (size_t i = 0; i < n; ++i) {
      try {
        fn(i);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  auto batch = std::make_shared<Batch>(&fn, n);
  Pool& p = pool();
  p.ensure_workers(t - 1);
  p.submit(batch, t - 1);
  batch->run();
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->cv.wait(lock, [&] { return batch->done.load(std::memory_order_acquire) == n; });
  // Taken out of the batch, whose last reference a worker may drop after we return: the exception
  // is then freed by the thread that handles it, not behind libstdc++'s refcount (which
  // ThreadSanitizer cannot see, and reported as a race).
  const std::exception_ptr error = std::move(batch->error);
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace gpumem
