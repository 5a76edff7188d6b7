// Fault tests between real processes (SPEC R7): a prefill or decode process is killed (-9) or
// frozen (SIGSTOP) while its peer's rooms sit in a given state. Every room bound to the dead
// peer must fail within the liveness bound, with a reason; the survivor must be left with no
// live room, connection or metadata slot; and a restarted peer must serve new requests (no
// stale connection or cached address).
//
// The peers run with liveness_timeout = 1000 ms (PeerArgs). A killed process closes its
// sockets at once, so its peer should notice well within that; a frozen one is only found by
// keepalive, within liveness_timeout.
#include <signal.h>

#include <catch2/catch.hpp>
#include <string>

#include "test/multiprocess/peer_harness.h"

using pdlib_test::Clock;
using pdlib_test::milliseconds;
using pdlib_test::PeerArgs;
using pdlib_test::PeerProcess;
using pdlib_test::Scene;

namespace {

constexpr milliseconds kLiveness{1000};  // what PeerArgs passes
// Scheduling slack on a busy 2-core machine in a sanitizer build.
constexpr milliseconds kSlack{2000};
constexpr uint64_t kHeldRooms = 12;

std::string Run(uint64_t first, uint64_t count, std::string_view hold = "none") {
  return "RUN " + std::to_string(first) + " " + std::to_string(count) + " " + std::string(hold);
}

// A prefill process (hosting the bootstrap server unless `bootstrap_binary_port`) and a decode
// process that have already completed a few requests, so their connection exists.
struct Pair {
  Scene scene;
  uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  PeerProcess* prefill = nullptr;
  PeerProcess* decode = nullptr;
  int generation = 0;

  // Returns the port of the new prefill's control endpoint.
  std::string StartPrefill(std::vector<std::string> extra = {"--start-bootstrap"}) {
    prefill = &scene.Start("prefill" + std::to_string(generation++),
                           PeerArgs("prefill", bootstrap, std::move(extra)));
    auto ready = prefill->WaitReady();
    SCENE_REQUIRE(scene, ready["role"] == "prefill");
    return ready["port"];
  }
  void StartDecode(std::vector<std::string> extra = {}) {
    decode = &scene.Start("decode" + std::to_string(generation++),
                          PeerArgs("decode", bootstrap, std::move(extra)));
    SCENE_REQUIRE(scene, decode->WaitReady()["role"] == "decode");
  }
  // Runs rooms [first, first + count) on both sides and requires every one to succeed.
  void RunOk(uint64_t first, uint64_t count) {
    SCENE_REQUIRE(scene, prefill->Send(Run(first, count)));
    SCENE_REQUIRE(scene, decode->RunBatch(first, count) == int64_t(count));
    auto done = prefill->Expect("DONE first=" + std::to_string(first) + " ");
    SCENE_REQUIRE(scene, done.has_value());
    SCENE_REQUIRE(scene, pdlib_test::ParseCounters(*done)["ok"] == count);
  }
  // Starts rooms held as asked and waits until `holder` reports them all held.
  void Hold(uint64_t first, std::string_view prefill_hold, std::string_view decode_hold) {
    SCENE_REQUIRE(scene, prefill->Send(Run(first, kHeldRooms, prefill_hold)));
    SCENE_REQUIRE(scene, decode->Send(Run(first, kHeldRooms, decode_hold)));
    for (PeerProcess* p : {prefill, decode}) {
      if ((p == prefill ? prefill_hold : decode_hold) == "none") continue;
      auto held = p->Expect("HELD first=" + std::to_string(first) + " ");
      SCENE_REQUIRE(scene, held.has_value());
      SCENE_REQUIRE(scene, pdlib_test::ParseCounters(*held)["held"] == kHeldRooms);
    }
  }
  // Every room of `survivor` in [first, first + kHeldRooms) failed, with a reason, within
  // `bound` of `since`.
  void ExpectAllFailed(PeerProcess& survivor, uint64_t first, Clock::time_point since,
                       milliseconds bound) {
    SCENE_REQUIRE(scene, survivor.WaitRooms(first, kHeldRooms, bound + kSlack + kSlack));
    for (uint64_t r = first; r < first + kHeldRooms; ++r) {
      const auto& outcome = survivor.rooms().at(r);
      const auto after = std::chrono::duration_cast<milliseconds>(outcome.at - since);
      INFO("room " << r << " " << outcome.state << " after " << after.count()
                   << " ms: " << outcome.reason);
      SCENE_CHECK(scene, outcome.state == "Failed");
      SCENE_CHECK(scene, outcome.reason.size() > 10);
      SCENE_CHECK(scene, after <= bound + kSlack);
    }
  }
  // Nothing of the dead peer is left in `survivor`.
  void ExpectClean(PeerProcess& survivor) {
    auto m = survivor.Metrics();
    INFO("live_rooms " << m["live_rooms"] << " connections " << m["connections"] << " aux_free "
                       << m["aux_free"] << "/" << m["aux_capacity"]);
    SCENE_CHECK(scene, m["live_rooms"] == 0);
    SCENE_CHECK(scene, m["connections"] == 0);
    SCENE_CHECK(scene, m["handles"] == 0);
    SCENE_CHECK(scene, m["aux_free"] == m["aux_capacity"]);
  }
  void KillAndReap(PeerProcess& p) {
    p.Kill(SIGKILL);
    SCENE_REQUIRE(scene, p.Wait(milliseconds(10000)) == 128 + SIGKILL);
  }
};

// Kills prefill while rooms are held as asked; decode's rooms fail, a new prefill on the same
// bootstrap port serves new requests.
void KillPrefill(std::string_view prefill_hold, std::string_view decode_hold) {
  Pair pair;
  pair.StartPrefill();
  pair.StartDecode();
  pair.RunOk(0, 8);
  pair.Hold(100, prefill_hold, decode_hold);

  const auto killed_at = Clock::now();
  pair.KillAndReap(*pair.prefill);
  pair.ExpectAllFailed(*pair.decode, 100, killed_at, kLiveness);
  pair.ExpectClean(*pair.decode);

  pair.StartPrefill();
  pair.RunOk(200, 16);
  SCENE_CHECK(pair.scene, pair.decode->Metrics()["connections"] == 1);
  SCENE_CHECK(pair.scene, pair.decode->Quit() == 0);
  SCENE_CHECK(pair.scene, pair.prefill->Quit() == 0);
}

// Kills decode while rooms are held as asked; prefill's rooms fail, a new decode process is
// served.
void KillDecode(std::string_view prefill_hold) {
  Pair pair;
  pair.StartPrefill();
  pair.StartDecode();
  pair.RunOk(0, 8);
  pair.Hold(100, prefill_hold, "none");

  const auto killed_at = Clock::now();
  pair.KillAndReap(*pair.decode);
  pair.ExpectAllFailed(*pair.prefill, 100, killed_at, kLiveness);
  pair.ExpectClean(*pair.prefill);

  pair.StartDecode();
  pair.RunOk(200, 16);
  SCENE_CHECK(pair.scene, pair.prefill->Metrics()["connections"] == 1);
  SCENE_CHECK(pair.scene, pair.decode->Quit() == 0);
  SCENE_CHECK(pair.scene, pair.prefill->Quit() == 0);
}

}  // namespace

TEST_CASE("kill -9 prefill with its rooms in Bootstrapping: decode rooms fail, restart serves") {
  // Decode receivers are connected but never Init(): prefill has no TransferInfo yet.
  KillPrefill("bootstrapping", "waiting");
}

TEST_CASE("kill -9 prefill with its rooms in WaitingForInput: decode rooms fail, restart serves") {
  KillPrefill("waiting", "none");
}

TEST_CASE("kill -9 prefill with its rooms in Transferring: decode rooms fail, restart serves") {
  // All pages but the last were sent as a non-last chunk.
  KillPrefill("transferring", "none");
}

TEST_CASE("kill -9 decode with prefill rooms in WaitingForInput: they fail, slots are freed") {
  KillDecode("waiting");
}

TEST_CASE("kill -9 decode with prefill rooms in Transferring: they fail, slots are freed") {
  KillDecode("transferring");
}

TEST_CASE("kill -9 decode before its TransferInfo: prefill rooms time out in Bootstrapping") {
  // Nothing binds these prefill rooms to the dead decode process, so they end by
  // bootstrap_timeout, with a reason naming the state.
  Pair pair;
  constexpr milliseconds kBootstrapTimeout{2000};
  pair.StartPrefill(
      {"--start-bootstrap", "--bootstrap-timeout-ms", std::to_string(kBootstrapTimeout.count())});
  pair.StartDecode();
  pair.RunOk(0, 4);
  pair.Hold(100, "bootstrapping", "waiting");
  const auto killed_at = Clock::now();
  pair.KillAndReap(*pair.decode);
  pair.ExpectAllFailed(*pair.prefill, 100, killed_at, kBootstrapTimeout);
  for (const auto& [room, outcome] : pair.prefill->rooms()) {
    if (room < 100) continue;
    INFO("room " << room << ": " << outcome.reason);
    SCENE_CHECK(pair.scene, outcome.reason.starts_with("DEADLINE_EXCEEDED"));
    SCENE_CHECK(pair.scene, outcome.reason.find("Bootstrapping") != std::string::npos);
  }
  pair.ExpectClean(*pair.prefill);
  SCENE_CHECK(pair.scene, pair.prefill->Quit() == 0);
}

TEST_CASE("a frozen prefill (SIGSTOP) is declared dead within liveness_timeout") {
  Pair pair;
  pair.StartPrefill();
  pair.StartDecode();
  pair.RunOk(0, 4);
  pair.Hold(100, "waiting", "none");  // decode rooms are Transferring
  const auto frozen_at = Clock::now();
  pair.prefill->Kill(SIGSTOP);
  pair.ExpectAllFailed(*pair.decode, 100, frozen_at, kLiveness);
  pair.ExpectClean(*pair.decode);
  pair.KillAndReap(*pair.prefill);  // SIGKILL ends a stopped process too
  SCENE_CHECK(pair.scene, pair.decode->Quit() == 0);
}

TEST_CASE("a frozen decode (SIGSTOP) is declared dead within liveness_timeout") {
  Pair pair;
  pair.StartPrefill();
  pair.StartDecode();
  pair.RunOk(0, 4);
  pair.Hold(100, "waiting", "none");
  const auto frozen_at = Clock::now();
  pair.decode->Kill(SIGSTOP);
  pair.ExpectAllFailed(*pair.prefill, 100, frozen_at, kLiveness);
  pair.ExpectClean(*pair.prefill);
  pair.KillAndReap(*pair.decode);
  SCENE_CHECK(pair.scene, pair.prefill->Quit() == 0);
}

#ifdef PDLIB_BOOTSTRAP_BINARY
TEST_CASE("prefill restarts on a new port behind pdlib-bootstrap: decode follows the new address") {
  Pair pair;
  PeerProcess& bootstrap =
      pair.scene.Start("bootstrap", {"--host", "127.0.0.1", "--port", "0"}, PDLIB_BOOTSTRAP_BINARY);
  auto line = bootstrap.Expect("pdlib-bootstrap listening on ", pdlib_test::kStartTimeout);
  SCENE_REQUIRE(pair.scene, line.has_value());
  pair.bootstrap = uint16_t(std::stoi(line->substr(line->rfind(':') + 1)));

  const uint16_t old_port = pdlib_test::UnusedLocalPort();
  uint16_t new_port = pdlib_test::UnusedLocalPort();
  while (new_port == old_port) new_port = pdlib_test::UnusedLocalPort();
  SCENE_REQUIRE(pair.scene, pair.StartPrefill({"--listen-port", std::to_string(old_port)}) ==
                                std::to_string(old_port));
  pair.StartDecode();
  pair.RunOk(0, 8);
  pair.Hold(100, "waiting", "none");
  const auto killed_at = Clock::now();
  pair.KillAndReap(*pair.prefill);
  pair.ExpectAllFailed(*pair.decode, 100, killed_at, kLiveness);
  pair.ExpectClean(*pair.decode);

  // The new prefill listens on another port; the bootstrap server keeps running, so only a
  // re-resolved address reaches it.
  SCENE_REQUIRE(pair.scene, pair.StartPrefill({"--listen-port", std::to_string(new_port)}) ==
                                std::to_string(new_port));
  pair.RunOk(200, 16);
  SCENE_CHECK(pair.scene, pair.decode->Quit() == 0);
  SCENE_CHECK(pair.scene, pair.prefill->Quit() == 0);
  bootstrap.Kill(SIGTERM);
  SCENE_CHECK(pair.scene, bootstrap.Wait(milliseconds(10000)) == 0);
}
#endif
