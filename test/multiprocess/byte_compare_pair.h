// The byte-compare runs that every backend's multi-process test makes: a prefill and a decode
// process (pdlib_test_peer --verify --backend <name>) on 127.0.0.1 move rooms of one KV layout;
// prefill fills every page it sends with a pattern of (room, buffer, page position, byte offset)
// and decode checks every destination byte, the aux slot and the state slots (kv_pattern.h).
// Used by test/multiprocess/ucx_multiprocess_test.cc and test/verbs/verbs_multiprocess_test.cc;
// a backend's test says only which transport options and time bounds its pairs run with.
// Header-only: its assertions are Catch2's, made in the including test binary.
#ifndef PDLIB_TEST_MULTIPROCESS_BYTE_COMPARE_PAIR_H_
#define PDLIB_TEST_MULTIPROCESS_BYTE_COMPARE_PAIR_H_

#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test/multiprocess/peer_harness.h"

namespace pdlib_test {

// One KV shape run by a prefill/decode pair.
struct Layout {
  int layers;
  int item_bytes;
  int pages_per_pool;
  int max_pages;  // per request; each room takes 1..max_pages (--vary-layout)
  int max_chunks;
  int v_item_bytes = 0;  // 0: item_bytes
  int state_buffers = 0;
  int state_item_bytes = 0;
  int state_per_request = 1;
  int concurrency = 4;
  uint64_t layout_seed = 0;  // 0: room shapes from the room ids alone
};

inline std::string Describe(const Layout& l) {
  std::ostringstream out;
  out << "layers=" << l.layers << " item_bytes=" << l.item_bytes
      << " v_item_bytes=" << (l.v_item_bytes ? l.v_item_bytes : l.item_bytes)
      << " pages_per_pool=" << l.pages_per_pool << " max_pages=" << l.max_pages
      << " max_chunks=" << l.max_chunks << " concurrency=" << l.concurrency;
  if (l.state_buffers > 0) {
    out << " state=" << l.state_buffers << "x" << l.state_item_bytes << "B x" << l.state_per_request
        << "/request";
  }
  if (l.layout_seed != 0) out << " layout_seed=" << l.layout_seed;
  return out.str();
}

// The backend a pair runs over, and how long the pair may take.
struct PairTransport {
  std::string backend;
  std::vector<std::string> options = {};    // --backend-option values
  milliseconds start = kStartTimeout;       // each process's start
  milliseconds run = milliseconds(30000);   // one RUN on each side
  milliseconds quit = milliseconds(0);      // each process's exit; 0: `start`
  std::vector<std::string> peer_args = {};  // after every other flag (a later flag wins)
};

// The peer flags of a --verify run of `l` over `t`, followed by `extra`.
inline std::vector<std::string> VerifyArgs(const Layout& l, const PairTransport& t,
                                           std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--backend",
                                   t.backend,
                                   "--verify",
                                   "--vary-layout",
                                   "--layers",
                                   std::to_string(l.layers),
                                   "--item-bytes",
                                   std::to_string(l.item_bytes),
                                   "--pages-per-pool",
                                   std::to_string(l.pages_per_pool),
                                   "--pages-per-request",
                                   std::to_string(l.max_pages),
                                   "--chunks",
                                   std::to_string(l.max_chunks),
                                   "--concurrency",
                                   std::to_string(l.concurrency)};
  if (l.v_item_bytes != 0) {
    args.insert(args.end(), {"--v-item-bytes", std::to_string(l.v_item_bytes)});
  }
  if (l.state_buffers > 0) {
    // Twice the slots the rooms in flight need, so that placement varies.
    const int slots = 2 * l.concurrency * l.state_per_request;
    args.insert(args.end(),
                {"--state-buffers", std::to_string(l.state_buffers), "--state-item-bytes",
                 std::to_string(l.state_item_bytes), "--state-slots", std::to_string(slots),
                 "--state-per-request", std::to_string(l.state_per_request)});
  }
  if (l.layout_seed != 0) {
    args.insert(args.end(), {"--layout-seed", std::to_string(l.layout_seed)});
  }
  for (const std::string& o : t.options) {
    args.push_back("--backend-option");
    args.push_back(o);
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Both sides' ROOM outcomes (room -> state and reason).
struct PairResult {
  std::map<uint64_t, RoomOutcome> decode_rooms;
  std::map<uint64_t, RoomOutcome> prefill_rooms;
};

// Runs rooms [first, first + count) through a fresh pair of processes with `l` over `t`, kept in
// `scene`; prefill_extra goes to prefill only (the corruption flags).
inline PairResult RunPair(Scene& scene, const Layout& l, const PairTransport& t, uint64_t first,
                          uint64_t count, std::vector<std::string> prefill_extra = {}) {
  const uint16_t bootstrap = UnusedLocalPort();
  std::vector<std::string> pextra = VerifyArgs(l, t, std::move(prefill_extra));
  pextra.push_back("--start-bootstrap");
  pextra.insert(pextra.end(), t.peer_args.begin(), t.peer_args.end());
  std::vector<std::string> dextra = VerifyArgs(l, t, t.peer_args);
  PeerProcess& prefill = scene.Start("prefill", PeerArgs("prefill", bootstrap, pextra));
  SCENE_REQUIRE(scene, prefill.WaitReady(t.start)["role"] == "prefill");
  PeerProcess& decode = scene.Start("decode", PeerArgs("decode", bootstrap, dextra));
  SCENE_REQUIRE(scene, decode.WaitReady(t.start)["role"] == "decode");

  const std::string run = "RUN " + std::to_string(first) + " " + std::to_string(count);
  SCENE_REQUIRE(scene, prefill.Send(run) && decode.Send(run));
  SCENE_REQUIRE(scene, decode.Expect("DONE first=" + std::to_string(first) + " ", t.run));
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=" + std::to_string(first) + " ", t.run));
  const milliseconds quit = t.quit.count() > 0 ? t.quit : t.start;
  SCENE_CHECK(scene, decode.Quit(quit) == 0);
  SCENE_CHECK(scene, prefill.Quit(quit) == 0);
  return {decode.rooms(), prefill.rooms()};
}

// Runs `rooms` rooms of every layout through a fresh pair each and checks that every room
// succeeded on both sides, decode having compared every byte.
inline void RunLayouts(const PairTransport& t, const std::vector<Layout>& layouts, uint64_t rooms) {
  uint64_t first = 0;
  for (const Layout& l : layouts) {
    Scene scene;
    INFO(Describe(l));
    const PairResult r = RunPair(scene, l, t, first, rooms);
    for (uint64_t room = first; room < first + rooms; ++room) {
      auto it = r.decode_rooms.find(room);
      SCENE_CHECK(scene, it != r.decode_rooms.end() && it->second.state == "Success" &&
                             it->second.reason == "OK");
      auto pit = r.prefill_rooms.find(room);
      SCENE_CHECK(scene, pit != r.prefill_rooms.end() && pit->second.state == "Success");
    }
    first += 1000;
  }
}

// Checks the rooms of a negative-control run: `spoiled` maps a room to the start of the reason
// its decode must fail with ("BADBYTES buffer="); every other room succeeds.
inline void CheckSpoiledRooms(const PairResult& r, uint64_t rooms,
                              const std::map<uint64_t, std::string>& spoiled, Scene& scene) {
  for (uint64_t room = 0; room < rooms; ++room) {
    auto it = r.decode_rooms.find(room);
    SCENE_REQUIRE(scene, it != r.decode_rooms.end());
    INFO("room " << room << ": " << it->second.state << " " << it->second.reason);
    if (auto s = spoiled.find(room); s != spoiled.end()) {
      CHECK(it->second.state == "Failed");
      CHECK(it->second.reason.starts_with(s->second));
    } else {
      CHECK(it->second.state == "Success");
      CHECK(it->second.reason == "OK");
    }
  }
}

}  // namespace pdlib_test

#endif  // PDLIB_TEST_MULTIPROCESS_BYTE_COMPARE_PAIR_H_
