// Small helpers the API-level tests share: polling with a limit, and whether a backend is built.
#ifndef PDLIB_TEST_SUPPORT_TEST_WAIT_H_
#define PDLIB_TEST_SUPPORT_TEST_WAIT_H_

#include <chrono>
#include <string_view>
#include <thread>

#include "pdlib/backends.h"

namespace pdlib_test {

// Polls `pred` every 200 us until it holds (true) or `limit` passes (false).
template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit = std::chrono::milliseconds(10000)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

inline bool HaveBackend(std::string_view name) {
  for (const auto& b : pdlib::BuiltinBackends()) {
    if (b == name) return true;
  }
  return false;
}

}  // namespace pdlib_test

#endif  // PDLIB_TEST_SUPPORT_TEST_WAIT_H_
