// BootstrapTable: the bootstrap server's rules, without a network.
#include "lib/control/bootstrap_table.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "test/control/bootstrap_test_util.h"

namespace pdlib::control {
namespace {

using testing::TestRank;

std::string Message(const Status& s) { return std::string(s.message()); }

TEST_CASE("valid registration passes validation") {
  CHECK(ValidateRankRegistration(TestRank(0, 1, 0)).ok());
}

TEST_CASE("validation names the bad field and its value") {
  struct Case {
    const char* what;
    void (*mutate)(RankRegistration&);
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"negative tp_rank", [](RankRegistration& r) { r.parallel.tp_rank = -1; },
       "tp_rank -1 out of range [0, 2)"},
      {"tp_rank == size", [](RankRegistration& r) { r.parallel.tp_rank = 2; },
       "tp_rank 2 out of range [0, 2)"},
      {"negative dp_rank", [](RankRegistration& r) { r.parallel.dp_rank = -3; },
       "dp_rank -3 out of range [0, 1)"},
      {"pp_rank too big", [](RankRegistration& r) { r.parallel.pp_rank = 5; },
       "pp_rank 5 out of range [0, 1)"},
      {"tp_size 0", [](RankRegistration& r) { r.parallel.tp_size = 0; }, "tp_size 0 out of range"},
      {"dp_size negative", [](RankRegistration& r) { r.parallel.dp_size = -2; },
       "dp_size -2 out of range"},
      {"pp_size huge", [](RankRegistration& r) { r.parallel.pp_size = 1 << 20; },
       "pp_size 1048576 out of range"},
      {"too many ranks",
       [](RankRegistration& r) {
         r.parallel.tp_size = 4096;
         r.parallel.dp_size = 4096;
       },
       "exceeds"},
      {"empty host", [](RankRegistration& r) { r.host = ""; }, "host is empty"},
      {"wildcard host", [](RankRegistration& r) { r.host = "0.0.0.0"; }, "wildcard"},
      {"host with space", [](RankRegistration& r) { r.host = "a b"; }, "space or control"},
      {"host too long", [](RankRegistration& r) { r.host = std::string(300, 'h'); },
       "host of 300 bytes"},
      {"port 0", [](RankRegistration& r) { r.port = 0; }, "port 0 out of range [1, 65535]"},
      {"port too big", [](RankRegistration& r) { r.port = 65536; },
       "port 65536 out of range [1, 65535]"},
      {"page_size 0", [](RankRegistration& r) { r.page_size = 0; }, "page_size 0"},
      {"negative num_layers", [](RankRegistration& r) { r.fingerprint.num_layers = -1; },
       "fingerprint.num_layers -1 is negative"},
      {"model name too long",
       [](RankRegistration& r) { r.fingerprint.model_name = std::string(5000, 'm'); },
       "fingerprint.model_name of 5000 bytes"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    RankRegistration reg = TestRank(0, 1, 0);
    c.mutate(reg);
    const Status s = ValidateRankRegistration(reg);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s), Catch::Contains(c.expected));
    // The table applies the same validation and stores nothing.
    BootstrapTable table;
    CHECK(table.Register(reg).status().code() == StatusCode::kInvalidArgument);
    CHECK(table.ranks_registered() == 0);
  }
}

TEST_CASE("registered ranks are found and parallel info reflects them") {
  BootstrapTable table;
  auto first = table.Register(TestRank(0, 0, 0, /*dp_size=*/2, /*tp_size=*/2, 1, 7000));
  REQUIRE(first.ok());
  CHECK(first->ranks_registered == 1);
  CHECK(first->ranks_expected == 4);
  CHECK_FALSE(first->replaced);
  auto second = table.Register(TestRank(1, 1, 0, 2, 2, 1, 7003));
  REQUIRE(second.ok());
  CHECK(second->ranks_registered == 2);
  CHECK(second->registration_id > first->registration_id);

  auto info = table.GetParallelInfo();
  REQUIRE(info.ok());
  CHECK(info->tp_size == 2);
  CHECK(info->dp_size == 2);
  CHECK(info->pp_size == 1);
  CHECK(info->page_size == 16);
  CHECK(info->fingerprint.num_layers == 32);
  CHECK(info->fingerprint.model_name == "test-model");
  CHECK(info->ranks_registered == 2);
  CHECK(info->ranks_expected == 4);

  auto address = table.GetRankAddress({1, 1, 0});
  REQUIRE(address.ok());
  CHECK(address->host == "127.0.0.1");
  CHECK(address->port == 7003);
  CHECK(address->registration_id == second->registration_id);
}

TEST_CASE("queries before any registration are NOT_FOUND") {
  BootstrapTable table;
  const Status info = table.GetParallelInfo().status();
  CHECK(info.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(info), Catch::Contains("no prefill rank has registered"));
  const Status address = table.GetRankAddress({0, 0, 0}).status();
  CHECK(address.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(address), Catch::Contains("(dp 0, tp 0, pp 0) is not registered"));
}

TEST_CASE("rank address errors: unregistered, out of range, negative") {
  BootstrapTable table;
  REQUIRE(table.Register(TestRank(0, 0, 0, 1, 2, 1)).ok());

  const Status missing = table.GetRankAddress({0, 1, 0}).status();
  CHECK(missing.code() == StatusCode::kNotFound);
  CHECK_THAT(Message(missing), Catch::Contains("(dp 0, tp 1, pp 0) is not registered (1 of 2"));

  const Status tp = table.GetRankAddress({0, 2, 0}).status();
  CHECK(tp.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(tp), Catch::Contains("tp_rank 2 out of range [0, 2)"));
  CHECK_THAT(Message(tp), Catch::Contains("tp_size 2, dp_size 1, pp_size 1"));

  const Status dp = table.GetRankAddress({1, 0, 0}).status();
  CHECK(dp.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(dp), Catch::Contains("dp_rank 1 out of range [0, 1)"));

  const Status pp = table.GetRankAddress({0, 0, 3}).status();
  CHECK(pp.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(pp), Catch::Contains("pp_rank 3 out of range [0, 1)"));

  const Status negative = table.GetRankAddress({0, -1, 0}).status();
  CHECK(negative.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(negative), Catch::Contains("tp_rank -1 is negative"));
}

TEST_CASE("a later rank that disagrees on the layout is rejected naming both values") {
  BootstrapTable table;
  REQUIRE(table.Register(TestRank(0, 0, 0, 1, 2, 1, 7000)).ok());

  SECTION("page size") {
    RankRegistration reg = TestRank(0, 1, 0, 1, 2, 1, 7001);
    reg.page_size = 64;
    const Status s = table.Register(reg).status();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(s), Catch::Contains("reports page_size 64"));
    CHECK_THAT(Message(s), Catch::Contains("has page_size 16"));
    CHECK_THAT(Message(s), Catch::Contains("set by rank (dp 0, tp 0, pp 0) at 127.0.0.1:7000"));
  }
  SECTION("tp size") {
    const Status s = table.Register(TestRank(0, 1, 0, 1, 4, 1, 7001)).status();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(s), Catch::Contains("reports tp_size 4"));
    CHECK_THAT(Message(s), Catch::Contains("has tp_size 2"));
  }
  SECTION("dp size") {
    const Status s = table.Register(TestRank(0, 1, 0, 3, 2, 1, 7001)).status();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(s), Catch::Contains("reports dp_size 3"));
  }
  SECTION("fingerprint") {
    RankRegistration reg = TestRank(0, 1, 0, 1, 2, 1, 7001);
    reg.fingerprint.head_dim = 64;
    const Status s = table.Register(reg).status();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(s), Catch::Contains("head_dim 64 vs 128"));
  }
  CHECK(table.ranks_registered() == 1);
  auto info = table.GetParallelInfo();
  REQUIRE(info.ok());
  CHECK(info->page_size == 16);
  CHECK(info->tp_size == 2);
}

TEST_CASE("re-registering a rank replaces its address") {
  BootstrapTable table;
  REQUIRE(table.Register(TestRank(0, 0, 0, 1, 2, 1, 7000)).ok());
  auto before = table.Register(TestRank(0, 1, 0, 1, 2, 1, 7001));
  REQUIRE(before.ok());
  RankRegistration restarted = TestRank(0, 1, 0, 1, 2, 1, 7101);
  restarted.host = "127.0.0.2";
  auto after = table.Register(restarted);
  REQUIRE(after.ok());
  CHECK(after->replaced);
  CHECK(after->ranks_registered == 2);
  CHECK(after->registration_id > before->registration_id);
  auto address = table.GetRankAddress({0, 1, 0});
  REQUIRE(address.ok());
  CHECK(address->host == "127.0.0.2");
  CHECK(address->port == 7101);
  CHECK(address->registration_id == after->registration_id);
}

TEST_CASE("a rank that is the only one registered may change the layout") {
  BootstrapTable table;
  REQUIRE(table.Register(TestRank(0, 0, 0, 1, 2, 1)).ok());
  RankRegistration reconfigured = TestRank(0, 0, 0, 1, 4, 1);
  reconfigured.page_size = 32;
  REQUIRE(table.Register(reconfigured).ok());
  auto info = table.GetParallelInfo();
  REQUIRE(info.ok());
  CHECK(info->tp_size == 4);
  CHECK(info->page_size == 32);
  CHECK(info->ranks_expected == 4);
}

TEST_CASE("unregister removes only a matching address") {
  BootstrapTable table;
  REQUIRE(table.Register(TestRank(0, 0, 0, 1, 2, 1, 7000)).ok());
  REQUIRE(table.Register(TestRank(0, 1, 0, 1, 2, 1, 7001)).ok());

  auto stale = table.Unregister({0, 1, 0}, "127.0.0.1", 6999);
  REQUIRE(stale.ok());
  CHECK_FALSE(*stale);
  CHECK(table.ranks_registered() == 2);

  auto removed = table.Unregister({0, 1, 0}, "127.0.0.1", 7001);
  REQUIRE(removed.ok());
  CHECK(*removed);
  CHECK(table.GetRankAddress({0, 1, 0}).status().code() == StatusCode::kNotFound);

  CHECK(table.Unregister({0, -1, 0}, "127.0.0.1", 7001).status().code() ==
        StatusCode::kInvalidArgument);

  // Once the last rank is gone, the next registration sets a new layout.
  REQUIRE(*table.Unregister({0, 0, 0}, "127.0.0.1", 7000));
  CHECK(table.GetParallelInfo().status().code() == StatusCode::kNotFound);
  REQUIRE(table.Register(TestRank(0, 0, 0, 2, 1, 1)).ok());
  CHECK(table.GetParallelInfo()->dp_size == 2);
}

TEST_CASE("concurrent registrations and queries") {
  BootstrapTable table;
  constexpr int kTp = 8;
  std::atomic<int> failures{0};  // Catch's assertions are not thread-safe
  std::vector<std::thread> threads;
  for (int tp = 0; tp < kTp; ++tp) {
    threads.emplace_back([&table, &failures, tp] {
      for (int round = 0; round < 50; ++round) {
        auto result =
            table.Register(TestRank(0, tp, 0, 1, kTp, 1, static_cast<uint32_t>(7000 + tp)));
        if (!result.ok()) failures.fetch_add(1, std::memory_order_relaxed);
        table.GetParallelInfo().status().IgnoreError();
        table.GetRankAddress({0, (tp + 1) % kTp, 0}).status().IgnoreError();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(failures.load() == 0);
  CHECK(table.ranks_registered() == kTp);
  for (int tp = 0; tp < kTp; ++tp) {
    auto address = table.GetRankAddress({0, tp, 0});
    REQUIRE(address.ok());
    CHECK(address->port == 7000 + tp);
  }
}

TEST_CASE("fingerprint comparison and description") {
  ModelFingerprint a = testing::TestFingerprint();
  ModelFingerprint b = a;
  CHECK(FingerprintsMatch(a, b));
  b.model_name = "";
  CHECK(FingerprintsMatch(a, b));  // an empty name matches any
  b.model_name = "other";
  b.num_layers = 40;
  CHECK_FALSE(FingerprintsMatch(a, b));
  CHECK(FingerprintDifference(a, b) == "num_layers 32 vs 40, model_name 'test-model' vs 'other'");
  CHECK_THAT(FingerprintString(a), Catch::Contains("num_layers 32"));
  // Issue #20: element types by name, page layout, engine tag and wire version, exactly.
  b = a;
  b.kv_dtype = "bf16";
  CHECK(FingerprintDifference(a, b) == "kv_dtype '' vs 'bf16'");
  a.kv_dtype = "fp16";
  CHECK(FingerprintDifference(a, b) == "kv_dtype 'fp16' vs 'bf16'");
  b = a;
  b.state_dtype = "fp32";
  b.page_layout = "hnd";
  b.engine_tag = "x";
  b.wire_version = a.wire_version + 1;
  CHECK(FingerprintDifference(a, b) ==
        absl::StrFormat("wire_version %d vs %d, state_dtype '' vs 'fp32', page_layout '' vs "
                        "'hnd', engine_tag '' vs 'x'",
                        a.wire_version, b.wire_version));
  CHECK_THAT(FingerprintString(b), Catch::Contains("page_layout 'hnd'"));
}

TEST_CASE("room failures: kept, looked up, bounded, expired") {
  BootstrapTable t;
  const absl::Time now = absl::FromUnixSeconds(1000000);
  REQUIRE(
      t.ReportRoomFailures({{7, "refused: wrong DP rank"}, {9, std::string(5000, 'x')}}, now).ok());
  auto got = t.RoomFailures({7, 8, 9}, now + absl::Seconds(1));
  REQUIRE(got.ok());
  REQUIRE(got->size() == 2);
  CHECK((*got)[0].room == 7);
  CHECK((*got)[0].reason == "refused: wrong DP rank");
  CHECK((*got)[1].reason.size() == kMaxRoomFailureReason);  // cut, not refused
  // A second report of a room keeps the first reason.
  REQUIRE(t.ReportRoomFailures({{7, "another"}}, now).ok());
  CHECK((*t.RoomFailures({7}, now))[0].reason == "refused: wrong DP rank");
  // Bad input is refused whole, nothing stored.
  CHECK(t.ReportRoomFailures({{0, "room 0"}}, now).code() == StatusCode::kInvalidArgument);
  std::vector<RoomFailure> many(kMaxRoomFailuresPerCall + 1, RoomFailure{11, "x"});
  CHECK(t.ReportRoomFailures(many, now).code() == StatusCode::kInvalidArgument);
  CHECK(t.RoomFailures({11}, now)->empty());
  CHECK(
      t.RoomFailures(std::vector<uint64_t>(kMaxRoomFailuresPerCall + 1, 1), now).status().code() ==
      StatusCode::kInvalidArgument);
  // Expired after the TTL (and dropped at the next report).
  const absl::Time later = now + absl::Seconds(kRoomFailureTtlSeconds + 1);
  CHECK(t.RoomFailures({7, 9}, later)->empty());
  REQUIRE(t.ReportRoomFailures({{12, "new"}}, later).ok());
  CHECK(t.RoomFailures({12}, later)->size() == 1);
  // At most kMaxRoomFailuresKept: the oldest go first.
  for (uint64_t base = 100; base < 100 + kMaxRoomFailuresKept; base += kMaxRoomFailuresPerCall) {
    std::vector<RoomFailure> batch;
    for (uint64_t r = base; r < base + kMaxRoomFailuresPerCall; ++r) batch.push_back({r, "b"});
    REQUIRE(t.ReportRoomFailures(batch, later).ok());
  }
  CHECK(t.RoomFailures({12}, later)->empty());
  CHECK(t.RoomFailures({100 + kMaxRoomFailuresKept - 1}, later)->size() == 1);
}

}  // namespace
}  // namespace pdlib::control
