#include "pdlib/log.h"

#include <catch2/catch.hpp>
#include <mutex>
#include <string>
#include <vector>

#include "lib/base/log_internal.h"

TEST_CASE("log lines go to the installed sink, filtered by level") {
  struct Line {
    pdlib::LogLevel level;
    std::string message;
  };
  std::mutex mu;
  std::vector<Line> lines;
  pdlib::SetLogSink(
      [&](pdlib::LogLevel level, std::string_view file, int line, std::string_view message) {
        std::lock_guard lock(mu);
        CHECK(line > 0);
        CHECK(file.find("log_test.cc") != std::string_view::npos);
        lines.push_back({level, std::string(message)});
      });
  pdlib::LogLevel saved = pdlib::GetLogLevel();
  pdlib::SetLogLevel(pdlib::LogLevel::kInfo);
  PDLIB_LOG(kDebug, "dropped %d", 1);
  PDLIB_LOG(kInfo, "room=%d created", 7);
  PDLIB_LOG(kError, "room=%d failed: %s", 8, "reason");
  pdlib::SetLogLevel(pdlib::LogLevel::kOff);
  PDLIB_LOG(kError, "dropped too");
  pdlib::SetLogLevel(saved);
  pdlib::SetLogSink(nullptr);

  REQUIRE(lines.size() == 2);
  CHECK(lines[0].level == pdlib::LogLevel::kInfo);
  CHECK(lines[0].message == "room=7 created");
  CHECK(lines[1].level == pdlib::LogLevel::kError);
  CHECK(lines[1].message == "room=8 failed: reason");
}
