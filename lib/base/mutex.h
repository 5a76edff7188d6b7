// pdlib::Mutex, MutexLock and CondVar: std::mutex with Abseil's thread-safety annotations.
//
// Why not absl::Mutex: Debian's Abseil is a prebuilt, uninstrumented shared library, so
// ThreadSanitizer cannot see absl::Mutex synchronise and reports races on data it guards.
// std::mutex goes through pthread, which TSan intercepts. The annotations keep
// ABSL_GUARDED_BY meaningful for clang's -Wthread-safety.
#ifndef PDLIB_LIB_BASE_MUTEX_H_
#define PDLIB_LIB_BASE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace pdlib {
inline namespace v1 {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// Waits on a Mutex the caller holds.
class CondVar {
 public:
  void Wait(Mutex* mu) {
    std::unique_lock<std::mutex> lock(mu->native(), std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held by the caller's MutexLock
  }
  // Returns false on timeout.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> d) {
    std::unique_lock<std::mutex> lock(mu->native(), std::adopt_lock);
    bool signalled = cv_.wait_for(lock, d) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_BASE_MUTEX_H_
