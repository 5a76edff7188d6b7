// KV events: the replay buffer, the page allocator's events, and the gRPC stream on 127.0.0.1
// (a late subscriber sees the buffered recent events, then live ones, each exactly once).
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <mutex>
#include <thread>

#include "examples/kv_events/kv_event_server.h"
#include "examples/scheduler/kv_events.h"
#include "examples/scheduler/pools.h"

namespace pdlib::sched {
namespace {

KVEvent Stored(uint64_t seq, uint64_t room) {
  return {.seq = seq,
          .timestamp_us = 0,
          .type = KVEventType::kBlockStored,
          .room = room,
          .pages = {static_cast<int32_t>(seq)},
          .page_size = 16};
}

std::vector<uint64_t> Seqs(const std::vector<KVEvent>& events) {
  std::vector<uint64_t> out;
  for (const auto& e : events) out.push_back(e.seq);
  return out;
}

// Waits up to 10 s for `cond`.
template <typename Cond>
bool WaitFor(Cond cond) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace

TEST_CASE("scheduler: KV event replay buffer keeps the most recent events") {
  KVEventReplayBuffer buffer(3);
  uint64_t missed = 99;
  CHECK(buffer.Since(0, &missed).empty());
  CHECK(missed == 0);
  for (uint64_t seq = 1; seq <= 5; ++seq) buffer.Append(Stored(seq, seq));
  CHECK(Seqs(buffer.Since(0, &missed)) == std::vector<uint64_t>{3, 4, 5});
  CHECK(missed == 2);  // seqs 1 and 2 are gone
  CHECK(Seqs(buffer.Since(2, &missed)) == std::vector<uint64_t>{3, 4, 5});
  CHECK(missed == 1);
  CHECK(Seqs(buffer.Since(4, &missed)) == std::vector<uint64_t>{4, 5});
  CHECK(missed == 0);
  CHECK(buffer.Since(6, &missed).empty());
  CHECK(missed == 0);
  CHECK(buffer.last_seq() == 5);
}

TEST_CASE("scheduler: the page allocator publishes stored, removed and cleared events") {
  KVEventPublisher publisher(16);
  std::vector<KVEvent> live;
  auto sub = publisher.Subscribe(0, [&](const KVEvent& e) { live.push_back(e); });
  CHECK(sub.replay.empty());
  PageAllocator pages(8, 16, &publisher);
  std::vector<int32_t> a, b;
  REQUIRE(pages.Alloc(3, 7, &a));
  REQUIRE(pages.Alloc(2, 8, &b));
  CHECK_FALSE(pages.Alloc(4, 9, &b));  // 3 left: refused, nothing published
  CHECK(pages.Free(a, 7).ok());
  CHECK(pages.Free(a, 7).code() == StatusCode::kFailedPrecondition);  // double free
  CHECK(pages.Free(std::vector<int32_t>{8}, 8).code() == StatusCode::kOutOfRange);
  pages.Clear();
  CHECK(pages.free_pages() == 8);
  REQUIRE(live.size() == 4);
  CHECK(FormatKVEvent(live[0]) == "seq=1 BlockStored room=7 page_size=16 pages=[0,1,2]");
  CHECK(FormatKVEvent(live[1]) == "seq=2 BlockStored room=8 page_size=16 pages=[3,4]");
  CHECK(FormatKVEvent(live[2]) == "seq=3 BlockRemoved room=7 page_size=16 pages=[0,1,2]");
  CHECK(FormatKVEvent(live[3]) == "seq=4 AllBlocksCleared");
  // Freed pages are reused lowest first.
  std::vector<int32_t> c;
  REQUIRE(pages.Alloc(2, 10, &c));
  CHECK(c == std::vector<int32_t>{0, 1});
  publisher.Unsubscribe(sub.id);
  CHECK(publisher.subscribers() == 0);
}

TEST_CASE("scheduler: a late gRPC subscriber replays recent events, then follows live ones") {
  KVEventPublisher publisher(/*replay_capacity=*/4);
  std::vector<KVEvent> all;  // everything published, as the publisher numbered it
  auto recorder = publisher.Subscribe(0, [&](const KVEvent& e) { all.push_back(e); });
  PageAllocator pages(64, 16, &publisher);
  std::vector<int32_t> held;
  for (uint64_t room = 1; room <= 6; ++room) REQUIRE(pages.Alloc(1, room, &held));

  auto server = KVEventServer::Start({.host = "127.0.0.1", .port = 0}, &publisher);
  REQUIRE(server.ok());
  const std::string target = (*server)->address();

  // The late subscriber: 4 buffered events (seq 3..6, two missed), then 3 live ones.
  std::mutex mu;
  std::vector<KVEvent> got;
  uint64_t missed = 0;
  Status result;
  std::thread subscriber([&] {
    result = SubscribeKVEvents(
        {.target = target, .from_seq = 0, .idle_timeout = std::chrono::seconds(20)},
        [&](const KVEvent& e) {
          std::lock_guard<std::mutex> lock(mu);
          got.push_back(e);
          return got.size() < 7;
        },
        [&](uint64_t m) { missed = m; });
  });
  // Live events only once the subscription is registered (recorder + stream).
  REQUIRE(WaitFor([&] { return publisher.subscribers() == 2; }));
  REQUIRE(pages.Free(std::vector<int32_t>{held[0]}, 1).ok());
  REQUIRE(pages.Free(std::vector<int32_t>{held[1]}, 2).ok());
  pages.Clear();
  subscriber.join();
  CHECK(result.ok());
  CHECK(missed == 2);
  REQUIRE(all.size() == 9);
  const std::vector<KVEvent> expected(all.begin() + 2, all.end());
  CHECK(got == expected);  // every field, timestamps included, each event once, in order

  // A subscriber from a seq beyond the last one sees live events only. (The first stream
  // unsubscribes once gRPC has finished it: wait for that, so the count below means the new one.)
  REQUIRE(WaitFor([&] { return publisher.subscribers() == 1; }));
  got.clear();
  const uint64_t next_seq = publisher.last_seq() + 1;
  std::thread live_only([&] {
    result = SubscribeKVEvents(
        {.target = target, .from_seq = next_seq, .idle_timeout = std::chrono::seconds(20)},
        [&](const KVEvent& e) {
          std::lock_guard<std::mutex> lock(mu);
          got.push_back(e);
          return false;
        });
  });
  REQUIRE(WaitFor([&] { return publisher.subscribers() == 2; }));
  REQUIRE(pages.Alloc(2, 42, &held));
  live_only.join();
  CHECK(result.ok());
  REQUIRE(got.size() == 1);
  CHECK(got[0] == all.back());
  CHECK(got[0].room == 42u);
  CHECK(got[0].seq == 10u);

  // Shutting the server down ends a subscription that is still waiting, with an error.
  REQUIRE(WaitFor([&] { return publisher.subscribers() == 1; }));
  std::atomic<bool> ended{false};
  std::thread waiting([&] {
    result = SubscribeKVEvents(
        {.target = target, .from_seq = 1000, .idle_timeout = std::chrono::seconds(20)},
        [](const KVEvent&) { return true; });
    ended = true;
  });
  REQUIRE(WaitFor([&] { return publisher.subscribers() == 2; }));
  (*server)->Shutdown();
  waiting.join();
  CHECK(ended);
  CHECK_FALSE(result.ok());
  CHECK(publisher.subscribers() == 1);  // the stream unsubscribed itself
  publisher.Unsubscribe(recorder.id);
}

TEST_CASE("scheduler: the KV event client gives up after its idle timeout") {
  KVEventPublisher publisher(4);
  auto server = KVEventServer::Start({.host = "127.0.0.1", .port = 0}, &publisher);
  REQUIRE(server.ok());
  Status s = SubscribeKVEvents({.target = (*server)->address(),
                                .from_seq = 0,
                                .idle_timeout = std::chrono::milliseconds(300)},
                               [](const KVEvent&) { return true; });
  CHECK(s.code() == StatusCode::kDeadlineExceeded);
  CHECK(KVEventServer::Start({.host = "127.0.0.1", .port = 70000}, &publisher).status().code() ==
        StatusCode::kInvalidArgument);
}

}  // namespace pdlib::sched
