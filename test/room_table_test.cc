#include "lib/core/room_table.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <random>
#include <thread>
#include <vector>

#include "lib/core/manager_common.h"

using pdlib::KVPoll;
using pdlib::RoomState;
using pdlib::RoomTable;
using pdlib::Status;

TEST_CASE("states only move forward") {
  RoomState r(5);
  CHECK(r.Poll() == KVPoll::kBootstrapping);
  CHECK(r.Advance(KVPoll::kTransferring));
  CHECK_FALSE(r.Advance(KVPoll::kWaitingForInput));  // backwards
  CHECK_FALSE(r.Advance(KVPoll::kTransferring));     // same
  CHECK(r.Poll() == KVPoll::kTransferring);
  CHECK_FALSE(r.Advance(KVPoll::kFailed));  // failing needs a reason
  CHECK(r.Advance(KVPoll::kSuccess));
  CHECK(r.Poll() == KVPoll::kSuccess);
}

TEST_CASE("terminal states never change") {
  RoomState ok(1);
  REQUIRE(ok.Advance(KVPoll::kSuccess));
  CHECK_FALSE(ok.Fail(Status::Internal("late")));
  CHECK(ok.Poll() == KVPoll::kSuccess);
  CHECK(ok.FailureReason().ok());

  RoomState failed(2);
  REQUIRE(failed.Fail(Status::Unavailable("peer died")));
  CHECK_FALSE(failed.Advance(KVPoll::kSuccess));
  CHECK_FALSE(failed.Fail(Status::Internal("second")));
  CHECK(failed.Poll() == KVPoll::kFailed);
  CHECK(failed.FailureReason().ToString() == "UNAVAILABLE: peer died");
  CHECK(failed.failed_from() == KVPoll::kBootstrapping);
}

TEST_CASE("table rejects a second live room with the same id") {
  RoomTable table;
  auto a = table.Insert(9);
  REQUIRE(a.ok());
  auto b = table.Insert(9);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == pdlib::StatusCode::kAlreadyExists);
  CHECK(b.status().message().find("room 9") != std::string_view::npos);
  CHECK(table.Find(9) == *a);
  // Erase only removes the matching object.
  RoomState other(9);
  table.Erase(9, &other);
  CHECK(table.size() == 1);
  table.Erase(9, a->get());
  CHECK(table.size() == 0);
  CHECK(table.Insert(9).ok());
}

// Many threads race to advance and fail the same rooms. Invariants: every observer sees a
// monotonic sequence (Failed counted as "after" everything), exactly one Fail() wins per failed
// room, and a failed room always has its reason. Run under TSan in CI.
TEST_CASE("racing transitions keep the state machine consistent") {
  constexpr int kRooms = 2000;
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<RoomState>> rooms;
  for (int i = 0; i < kRooms; ++i) rooms.push_back(std::make_unique<RoomState>(i));
  std::atomic<int> fail_wins{0};
  std::atomic<int> violations{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!go.load(std::memory_order_acquire)) {
      }
      for (int i = 0; i < kRooms; ++i) {
        RoomState& r = *rooms[i];
        int rank_seen = 0;
        for (int step = 0; step < 4; ++step) {
          int pick = rng() % 5;
          if (pick == 0 && i % 3 == 0) {
            if (r.Fail(Status::Aborted("thread " + std::to_string(t)))) fail_wins++;
          } else {
            r.Advance(static_cast<KVPoll>(1 + rng() % 4));
          }
          KVPoll s = r.Poll();
          int rank = s == KVPoll::kFailed ? 5 : static_cast<int>(s);
          if (rank < rank_seen) violations++;
          rank_seen = rank;
          if (s == KVPoll::kFailed && r.FailureReason().ok()) violations++;
        }
      }
    });
  }
  go.store(true, std::memory_order_release);
  for (auto& th : threads) th.join();
  CHECK(violations.load() == 0);
  int failed = 0;
  for (auto& r : rooms) {
    if (r->Poll() == KVPoll::kFailed) {
      ++failed;
      CHECK(r->FailureReason().code() == pdlib::StatusCode::kAborted);
    }
  }
  CHECK(failed == fail_wins.load());
}

// Issue #20: which rooms get per-room info lines (KVManagerOptions::room_log_every).
TEST_CASE(
    "room log sampling: auto logs every room up to the budget, then the same rooms as the peer") {
  using pdlib::KVManagerOptions;
  pdlib::RoomLogSampler every(1), tenth(10), auto_(0);
  for (uint64_t room = 1; room <= 50; ++room) {
    CHECK(every.SampleAt(room, 0));
    CHECK(tenth.SampleAt(room, 0) == (room % 10 == 0));
  }
  // Auto, second 7: the first kRoomLogAutoPerSecond rooms are logged whatever their ids ...
  uint64_t room = 1;
  for (uint32_t i = 0; i < KVManagerOptions::kRoomLogAutoPerSecond; ++room) {
    if (room % KVManagerOptions::kRoomLogAutoEvery == 0) continue;  // these do not count
    REQUIRE(auto_.SampleAt(room, 7));
    ++i;
  }
  // ... past the budget only multiples of kRoomLogAutoEvery, which the peer logs too ...
  size_t logged = 0;
  for (uint64_t end = room + 10 * KVManagerOptions::kRoomLogAutoEvery; room < end; ++room) {
    const bool sampled = auto_.SampleAt(room, 7);
    CHECK(sampled == (room % KVManagerOptions::kRoomLogAutoEvery == 0));
    logged += sampled;
  }
  CHECK(logged == 10);
  // ... and a new second starts a new budget.
  CHECK(auto_.SampleAt(room | 1, 8));  // odd: never a multiple of kRoomLogAutoEvery
  CHECK(auto_.SampleAt((room + 2) | 1, 8));
}
