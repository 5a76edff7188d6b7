// The gRPC control plane between real processes: a prefill and one or two decode processes
// (pdlib_test_peer) on 127.0.0.1 over the fake backend. Requests succeed on both sides, the
// metrics add up, refusals and an unreachable bootstrap server give clear reasons, and every
// process exits cleanly (so sanitizer builds also check that nothing leaks).
#include <catch2/catch.hpp>
#include <string>

#include "test/multiprocess/peer_harness.h"

using pdlib_test::Clock;
using pdlib_test::milliseconds;
using pdlib_test::PeerArgs;
using pdlib_test::PeerProcess;
using pdlib_test::Scene;

namespace {

constexpr int kLayers = 2;        // pdlib_test_peer's default: 2 layers, K and V each
constexpr int kItemBytes = 1024;  // its default page size in bytes
constexpr int kPagesPerRequest = 4;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every room in [first, first + count) of `peer` ended in `state`.
bool AllRoomsIn(const PeerProcess& peer, uint64_t first, uint64_t count, const std::string& state) {
  for (uint64_t r = first; r < first + count; ++r) {
    auto it = peer.rooms().find(r);
    if (it == peer.rooms().end() || it->second.state != state) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("1P1D in two processes: every request reaches Success on both sides") {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  PeerProcess& prefill =
      scene.Start("prefill", PeerArgs("prefill", bootstrap, {"--start-bootstrap"}));
  auto ready = prefill.WaitReady();
  SCENE_REQUIRE(scene, ready["role"] == "prefill" && ready["port"] != "0");
  PeerProcess& decode = scene.Start("decode", PeerArgs("decode", bootstrap));
  SCENE_REQUIRE(scene, decode.WaitReady()["role"] == "decode");

  constexpr uint64_t kRooms = 200;
  SCENE_REQUIRE(scene, prefill.Send("RUN 1000 200"));
  SCENE_REQUIRE(scene, decode.RunBatch(1000, kRooms) == int64_t(kRooms));
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=1000 ").has_value());
  SCENE_CHECK(scene, AllRoomsIn(decode, 1000, kRooms, "Success"));
  SCENE_CHECK(scene, AllRoomsIn(prefill, 1000, kRooms, "Success"));

  auto dm = decode.Metrics();
  SCENE_CHECK(scene, dm["rooms_succeeded"] == kRooms && dm["requests_total"] == kRooms);
  SCENE_CHECK(scene, dm["live_rooms"] == 0 && dm["rooms_failed"] == 0);
  SCENE_CHECK(scene, dm["connections"] == 1);
  SCENE_CHECK(scene, dm["aux_free"] == dm["aux_capacity"]);
  auto pm = prefill.Metrics();
  SCENE_CHECK(scene, pm["rooms_succeeded"] == kRooms && pm["live_rooms"] == 0);
  SCENE_CHECK(scene, pm["connections"] == 1);
  SCENE_CHECK(scene, pm["pages"] == kRooms * kPagesPerRequest);
  SCENE_CHECK(scene, pm["bytes"] == kRooms * kPagesPerRequest * 2 * kLayers * kItemBytes);

  SCENE_CHECK(scene, decode.Quit() == 0);
  SCENE_CHECK(scene, prefill.Quit() == 0);
}

TEST_CASE("1P2D in three processes: rooms from two decode processes share one prefill") {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  PeerProcess& prefill =
      scene.Start("prefill", PeerArgs("prefill", bootstrap, {"--start-bootstrap"}));
  SCENE_REQUIRE(scene, !prefill.WaitReady().empty());
  PeerProcess& d1 = scene.Start("decode1", PeerArgs("decode", bootstrap));
  PeerProcess& d2 = scene.Start("decode2", PeerArgs("decode", bootstrap));
  SCENE_REQUIRE(scene, !d1.WaitReady().empty() && !d2.WaitReady().empty());

  // Both decode processes run at once; prefill serves the union of their rooms.
  SCENE_REQUIRE(scene, prefill.Send("RUN 0 100"));
  SCENE_REQUIRE(scene, d1.Send("RUN 0 50") && d2.Send("RUN 50 50"));
  SCENE_REQUIRE(scene, d1.Expect("DONE first=0 ").has_value());
  SCENE_REQUIRE(scene, d2.Expect("DONE first=50 ").has_value());
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=0 ").has_value());
  SCENE_CHECK(scene, AllRoomsIn(d1, 0, 50, "Success") && AllRoomsIn(d2, 50, 50, "Success"));
  SCENE_CHECK(scene, AllRoomsIn(prefill, 0, 100, "Success"));
  SCENE_CHECK(scene, prefill.Metrics()["connections"] == 2);

  SCENE_CHECK(scene, d1.Quit() == 0);
  // One decode process leaving does not disturb the other one's requests.
  SCENE_REQUIRE(scene, prefill.Send("RUN 100 20"));
  SCENE_CHECK(scene, d2.RunBatch(100, 20) == 20);
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=100 ").has_value());
  auto pm = prefill.Metrics();
  SCENE_CHECK(scene, pm["connections"] == 1 && pm["live_rooms"] == 0);
  SCENE_CHECK(scene, d2.Quit() == 0);
  SCENE_CHECK(scene, prefill.Quit() == 0);
}

TEST_CASE("chunked sends across processes: a held last chunk completes after RESUME") {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  PeerProcess& prefill = scene.Start(
      "prefill", PeerArgs("prefill", bootstrap, {"--start-bootstrap", "--pages-per-request", "8"}));
  SCENE_REQUIRE(scene, !prefill.WaitReady().empty());
  PeerProcess& decode =
      scene.Start("decode", PeerArgs("decode", bootstrap, {"--pages-per-request", "8"}));
  SCENE_REQUIRE(scene, !decode.WaitReady().empty());

  // Prefill sends 7 of 8 pages as a non-last chunk and holds the last one: both sides stay in
  // Transferring, and decode must not report Success early.
  SCENE_REQUIRE(scene, prefill.Send("RUN 0 16 transferring") && decode.Send("RUN 0 16"));
  auto held = prefill.Expect("HELD first=0 ");
  SCENE_REQUIRE(scene, held.has_value());
  SCENE_REQUIRE(scene, pdlib_test::ParseCounters(*held)["held"] == 16);
  SCENE_CHECK(scene, decode.rooms().empty());
  auto dm = decode.Metrics();
  SCENE_CHECK(scene, dm["live_rooms"] == 16 && dm["transfer_queue"] == 16);
  SCENE_CHECK(scene, decode.rooms().empty());

  SCENE_REQUIRE(scene, prefill.Send("RESUME"));
  SCENE_REQUIRE(scene, decode.Expect("DONE first=0 ").has_value());
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=0 ").has_value());
  SCENE_CHECK(scene, AllRoomsIn(decode, 0, 16, "Success") && AllRoomsIn(prefill, 0, 16, "Success"));
  SCENE_CHECK(scene, prefill.Metrics()["pages"] == 16 * 8);
  SCENE_CHECK(scene, decode.Quit() == 0);
  SCENE_CHECK(scene, prefill.Quit() == 0);
}

TEST_CASE("bootstrap unreachable: receivers fail with a reason naming the address") {
  Scene scene;
  const uint16_t nobody = pdlib_test::UnusedLocalPort();  // nothing listens there
  // Decode keeps retrying (prefill may come up after it) until connect_timeout has passed.
  constexpr milliseconds kConnectTimeout{1000};
  PeerProcess& decode = scene.Start(
      "decode", PeerArgs("decode", nobody,
                         {"--connect-timeout-ms", std::to_string(kConnectTimeout.count())}));
  SCENE_REQUIRE(scene, !decode.WaitReady().empty());
  const auto start = Clock::now();
  SCENE_REQUIRE(scene, decode.RunBatch(0, 4) == 0);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  INFO("took " << took.count() << " ms");
  SCENE_CHECK(scene, took < kConnectTimeout + milliseconds(2000));
  SCENE_CHECK(scene, AllRoomsIn(decode, 0, 4, "Failed"));
  for (const auto& [room, outcome] : decode.rooms()) {
    INFO("room " << room << ": " << outcome.reason);
    SCENE_CHECK(scene, Contains(outcome.reason, "127.0.0.1:" + std::to_string(nobody)));
    SCENE_CHECK(scene, (outcome.reason.starts_with("UNAVAILABLE") ||
                        outcome.reason.starts_with("DEADLINE_EXCEEDED")));
  }
  auto m = decode.Metrics();
  SCENE_CHECK(scene, m["live_rooms"] == 0 && m["connections"] == 0);
  SCENE_CHECK(scene, m["rooms_failed"] == 4);
  SCENE_CHECK(scene, decode.Quit() == 0);
}

TEST_CASE("a mismatched peer is refused with both sides' values, and leaves nothing behind") {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  PeerProcess& prefill =
      scene.Start("prefill", PeerArgs("prefill", bootstrap, {"--start-bootstrap"}));
  SCENE_REQUIRE(scene, !prefill.WaitReady().empty());

  std::vector<std::string> extra;
  std::vector<std::string> expected;
  SECTION("page size") {
    extra = {"--page-size", "32"};
    expected = {"page size mismatch", "16", "32"};
  }
  SECTION("model fingerprint") {
    extra = {"--model-name", "another-model"};
    expected = {"fingerprint mismatch", "pdlib-test-model", "another-model"};
  }
  PeerProcess& decode = scene.Start("decode", PeerArgs("decode", bootstrap, extra));
  SCENE_REQUIRE(scene, !decode.WaitReady().empty());
  SCENE_REQUIRE(scene, decode.RunBatch(0, 2) == 0);
  for (const auto& [room, outcome] : decode.rooms()) {
    for (const std::string& part : expected) {
      INFO("room " << room << " reason: " << outcome.reason << "; expected: " << part);
      SCENE_CHECK(scene, Contains(outcome.reason, part));
    }
  }
  auto dm = decode.Metrics();
  SCENE_CHECK(scene, dm["live_rooms"] == 0 && dm["connections"] == 0);
  auto pm = prefill.Metrics();
  SCENE_CHECK(scene, pm["live_rooms"] == 0 && pm["connections"] == 0);

  // The refusal is per connection: a matching decode process is served right after.
  PeerProcess& good = scene.Start("good-decode", PeerArgs("decode", bootstrap));
  SCENE_REQUIRE(scene, !good.WaitReady().empty());
  SCENE_REQUIRE(scene, prefill.Send("RUN 10 4"));
  SCENE_CHECK(scene, good.RunBatch(10, 4) == 4);
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=10 ").has_value());

  SCENE_CHECK(scene, decode.Quit() == 0);
  SCENE_CHECK(scene, good.Quit() == 0);
  SCENE_CHECK(scene, prefill.Quit() == 0);
}
