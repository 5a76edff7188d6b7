// WriteCompletions: collects a transport's batch completions for tests. Wait returns false on
// timeout, so a lost completion fails a test instead of hanging it.
#ifndef PDLIB_TEST_SUPPORT_WRITE_COMPLETIONS_H_
#define PDLIB_TEST_SUPPORT_WRITE_COMPLETIONS_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "pdlib/spi/transport.h"

namespace pdlib::testing {

class WriteCompletions {
 public:
  spi::WriteCallback Callback() {
    return [this](Status s) {
      std::lock_guard lock(mu_);
      statuses_.push_back(std::move(s));
      cv_.notify_all();
    };
  }
  bool Wait(size_t n, std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return statuses_.size() >= n; });
  }
  std::vector<Status> statuses() {
    std::lock_guard lock(mu_);
    return statuses_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Status> statuses_;
};

}  // namespace pdlib::testing

#endif  // PDLIB_TEST_SUPPORT_WRITE_COMPLETIONS_H_
