// ThreadPool: a fixed set of worker threads that run one ParallelFor at a time.
//
// ParallelFor splits [0, n) into contiguous ranges that threads claim dynamically; the caller
// works too and returns when every range is done. Which thread runs a range never changes what
// is computed (callers give each output element to exactly one range), so results do not depend
// on the thread count. Owned by one CPU model; ParallelFor must not be called concurrently or
// from inside itself.
#ifndef PDLIB_KERNELS_SRC_CPU_THREAD_POOL_H_
#define PDLIB_KERNELS_SRC_CPU_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pdlib::kernels::internal {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 runs everything inline.
  explicit ThreadPool(int32_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int32_t num_threads() const { return static_cast<int32_t>(workers_.size()) + 1; }

  using RangeFn = std::function<void(int64_t begin, int64_t end)>;
  // Runs fn over [0, n) in ranges. `cost_per_item` (rough work units) lets tiny loops run inline
  // instead of paying for a wake-up.
  void ParallelFor(int64_t n, int64_t cost_per_item, const RangeFn& fn);

 private:
  void WorkerLoop();
  void RunRanges();

  std::mutex mu_;
  std::condition_variable work_cv_;  // workers wait here for a new generation or stop
  std::condition_variable done_cv_;  // the caller waits here for busy_ == 0
  uint64_t generation_ = 0;          // guarded by mu_
  bool stop_ = false;                // guarded by mu_
  int32_t busy_ = 0;                 // workers still inside the current job; guarded by mu_
  // The current job. Written by the caller under mu_ before generation_ moves, read by workers
  // after they observe the new generation under mu_, so the mutex orders these plain fields.
  const RangeFn* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t range_ = 1;
  // Next unclaimed index. Relaxed is enough: it only hands out disjoint ranges; the data the
  // ranges write is published to the caller by mu_ when busy_ drops to zero.
  std::atomic<int64_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CPU_THREAD_POOL_H_
