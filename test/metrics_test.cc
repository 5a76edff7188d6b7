#include <catch2/catch.hpp>
#include <string>

#include "pdlib/kv_manager.h"

TEST_CASE("Prometheus rendering carries every counter with its labels") {
  pdlib::KVManagerMetrics m;
  m.live_rooms = 3;
  m.rooms_failed = 5;
  m.bytes_transferred = 123456789;
  m.failed_by_cause = {{"DEADLINE_EXCEEDED", 2}, {"UNAVAILABLE", 3}};
  m.transfer_latency_us_sum = 1500000;
  m.transfer_latency_count = 3;
  std::string text = pdlib::RenderPrometheus(m, {{"role", "prefill"}, {"tp_rank", "0"}});
  CHECK(text.find("# TYPE pdlib_live_rooms gauge\n") != std::string::npos);
  CHECK(text.find("pdlib_live_rooms{role=\"prefill\",tp_rank=\"0\"} 3\n") != std::string::npos);
  CHECK(text.find("pdlib_failed_reqs_total{role=\"prefill\",tp_rank=\"0\"} 5\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_transferred_bytes_total{role=\"prefill\",tp_rank=\"0\"} 123456789\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_failed_reqs_by_cause_total{role=\"prefill\",tp_rank=\"0\",cause="
                  "\"UNAVAILABLE\"} 3\n") != std::string::npos);
  CHECK(
      text.find("pdlib_transfer_latency_seconds_sum{role=\"prefill\",tp_rank=\"0\"} 1.500000\n") !=
      std::string::npos);
  // Without labels there are no braces, and label values are escaped.
  CHECK(pdlib::RenderPrometheus(m).find("pdlib_live_rooms 3\n") != std::string::npos);
  CHECK(pdlib::RenderPrometheus(m, {{"x", "a\"b"}}).find("x=\"a\\\"b\"") != std::string::npos);
}
