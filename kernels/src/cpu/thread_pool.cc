#include "cpu/thread_pool.h"

#include <algorithm>

namespace pdlib::kernels::internal {
namespace {

// Below this much work a wake-up of the workers costs more than it saves.
constexpr int64_t kMinParallelCost = 1 << 18;

}  // namespace

ThreadPool::ThreadPool(int32_t num_threads) {
  for (int32_t i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunRanges() {
  while (true) {
    const int64_t begin = next_.fetch_add(range_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*fn_)(begin, std::min(n_, begin + range_));
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunRanges();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t cost_per_item, const RangeFn& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1 || n * std::max<int64_t>(cost_per_item, 1) < kMinParallelCost) {
    fn(0, n);
    return;
  }
  const int64_t threads = num_threads();
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    // About four ranges per thread balances uneven ranges without much claiming traffic.
    range_ = std::max<int64_t>(1, n / (threads * 4));
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<int32_t>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  RunRanges();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return busy_ == 0; });
  fn_ = nullptr;
}

}  // namespace pdlib::kernels::internal
