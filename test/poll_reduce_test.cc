#include "pdlib/poll_reduce.h"

#include <catch2/catch.hpp>
#include <thread>

// Catch2 assertions are not thread-safe: threads record, the main thread checks.

namespace {
class FixedPoll : public pdlib::KVPollable {
 public:
  explicit FixedPoll(pdlib::KVPoll s) : s_(s) {}
  pdlib::KVPoll Poll() const override { return s_; }
  pdlib::Status FailureReason() const override { return pdlib::Status(); }
  uint64_t room() const override { return 0; }
  bool PagesReusable() const override { return pdlib::IsTerminal(s_); }

 private:
  pdlib::KVPoll s_;
};
}  // namespace

using pdlib::KVPoll;

TEST_CASE("without a group, poll values pass through") {
  FixedPoll a(KVPoll::kTransferring), b(KVPoll::kSuccess);
  std::vector<const pdlib::KVPollable*> handles = {&a, &b};
  auto out = pdlib::PollAndAllReduce(handles, nullptr);
  REQUIRE(out.ok());
  CHECK(*out == std::vector<KVPoll>{KVPoll::kTransferring, KVPoll::kSuccess});
  handles.push_back(nullptr);
  CHECK_FALSE(pdlib::PollAndAllReduce(handles, nullptr).ok());
}

TEST_CASE("MIN across thread ranks: Failed on any rank wins, repeatedly") {
  constexpr int kRanks = 4;
  auto group = pdlib::InProcessGroup::Create(kRanks);
  REQUIRE(group.size() == kRanks);
  // Rank r sees request 0 as Success except rank 2 (Failed); request 1 as r-dependent.
  std::vector<std::vector<KVPoll>> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      for (int round = 0; round < 50; ++round) {
        FixedPoll h0(r == 2 ? KVPoll::kFailed : KVPoll::kSuccess);
        FixedPoll h1(static_cast<KVPoll>(1 + (r + round) % 4));
        std::vector<const pdlib::KVPollable*> hs = {&h0, &h1};
        auto out = pdlib::PollAndAllReduce(hs, group[r].get());
        if (!out.ok()) return;  // results[r] stays empty and the check below fails
        if (round == 49) results[r] = *out;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    CHECK(results[r] == std::vector<KVPoll>{KVPoll::kFailed, KVPoll::kBootstrapping});
  }
}
