// Two-process byte-compare tests over the UCX backend: a prefill and a decode process
// (pdlib_test_peer --verify --backend ucx) on 127.0.0.1. Prefill fills every page of every K and V
// buffer it sends with a pattern of (room, buffer, page position, byte offset) and writes the aux
// slot; decode checks every destination byte and the aux slot once a room reaches Success
// (kv_pattern.h). Source and destination pages differ (each side hands out its own pages), so a
// wrong offset, page, buffer or room is caught. Runs with UCX_TLS=shm and with tcp over lo, for
// several layer counts and item sizes, with per-room page counts, placements (scattered or
// contiguous) and chunk counts. Negative controls: the verifier catches a flipped byte, and a
// room whose source byte or aux slot prefill spoils fails on decode with BADBYTES.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "test/multiprocess/kv_pattern.h"
#include "test/multiprocess/peer_harness.h"

using pdlib_test::milliseconds;
using pdlib_test::PeerArgs;
using pdlib_test::PeerProcess;
using pdlib_test::Scene;

namespace {

// One KV shape run by a prefill/decode pair. Pools stay small (at most 32 MiB per side) so that
// the whole binary runs in well under a minute in a sanitizer build on two busy cores.
struct Layout {
  int layers;
  int item_bytes;
  int pages_per_pool;
  int max_pages;  // per request; each room takes 1..max_pages (--vary-layout)
  int max_chunks;
};

constexpr uint64_t kRooms = 32;
constexpr milliseconds kRunTimeout{30000};

std::vector<std::string> VerifyArgs(const Layout& l, const std::vector<std::string>& ucx_options,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--backend",
                                   "ucx",
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
                                   "4"};
  for (const std::string& o : ucx_options) {
    args.push_back("--backend-option");
    args.push_back(o);
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Runs rooms [first, first + count) through a fresh pair of processes with `layout`; returns
// decode's ROOM outcomes (room -> "state reason") through `scene`'s peers. prefill_extra goes to
// prefill only (the corruption flags).
struct PairResult {
  std::map<uint64_t, pdlib_test::RoomOutcome> decode_rooms;
  std::map<uint64_t, pdlib_test::RoomOutcome> prefill_rooms;
};

PairResult RunPair(Scene& scene, const Layout& l, const std::vector<std::string>& ucx_options,
                   uint64_t first, uint64_t count, std::vector<std::string> prefill_extra = {}) {
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  std::vector<std::string> pextra = VerifyArgs(l, ucx_options, std::move(prefill_extra));
  pextra.push_back("--start-bootstrap");
  PeerProcess& prefill = scene.Start("prefill", PeerArgs("prefill", bootstrap, pextra));
  SCENE_REQUIRE(scene, prefill.WaitReady()["role"] == "prefill");
  PeerProcess& decode =
      scene.Start("decode", PeerArgs("decode", bootstrap, VerifyArgs(l, ucx_options)));
  SCENE_REQUIRE(scene, decode.WaitReady()["role"] == "decode");

  const std::string run = "RUN " + std::to_string(first) + " " + std::to_string(count);
  SCENE_REQUIRE(scene, prefill.Send(run) && decode.Send(run));
  SCENE_REQUIRE(scene, decode.Expect("DONE first=" + std::to_string(first) + " ", kRunTimeout));
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=" + std::to_string(first) + " ", kRunTimeout));
  SCENE_CHECK(scene, decode.Quit() == 0);
  SCENE_CHECK(scene, prefill.Quit() == 0);
  return {decode.rooms(), prefill.rooms()};
}

void RunLayouts(const std::vector<std::string>& ucx_options) {
  // Layer counts 1-64, item sizes 64 B-256 KiB, 1-4096 pages per request, 1-4 chunks; each
  // room's page count, placement and chunking come from its id.
  const std::vector<Layout> layouts = {
      {1, 64, 256, 64, 3},   {16, 1024, 256, 32, 3}, {3, 4096, 256, 64, 2}, {2, 65536, 128, 16, 3},
      {64, 256, 256, 64, 4}, {1, 64, 8192, 4096, 4}, {1, 262144, 32, 8, 2},
  };
  uint64_t first = 0;
  for (const Layout& l : layouts) {
    Scene scene;
    INFO("layers=" << l.layers << " item_bytes=" << l.item_bytes << " max_pages=" << l.max_pages
                   << " max_chunks=" << l.max_chunks);
    const PairResult r = RunPair(scene, l, ucx_options, first, kRooms);
    for (uint64_t room = first; room < first + kRooms; ++room) {
      auto it = r.decode_rooms.find(room);
      SCENE_CHECK(scene, it != r.decode_rooms.end() && it->second.state == "Success" &&
                             it->second.reason == "OK");
      auto pit = r.prefill_rooms.find(room);
      SCENE_CHECK(scene, pit != r.prefill_rooms.end() && pit->second.state == "Success");
    }
    first += 1000;
  }
}

}  // namespace

TEST_CASE("ucx byte-compare helper: a flipped byte, wrong room, buffer or position is caught") {
  const size_t len = 4096 + 5;  // not a multiple of 8: the tail is checked too
  std::vector<uint8_t> page(len);
  pdlib_test::FillPage(page.data(), len, 7, 3, 11);
  REQUIRE_FALSE(pdlib_test::VerifyPage(page.data(), len, 7, 3, 11).has_value());
  CHECK(page[100] == pdlib_test::PatternByte(7, 3, 11, 100));
  CHECK(page[len - 1] == pdlib_test::PatternByte(7, 3, 11, len - 1));
  // Any other room, buffer or page position has a different pattern.
  CHECK(pdlib_test::VerifyPage(page.data(), len, 8, 3, 11).has_value());
  CHECK(pdlib_test::VerifyPage(page.data(), len, 7, 4, 11).has_value());
  CHECK(pdlib_test::VerifyPage(page.data(), len, 7, 3, 12).has_value());

  for (size_t offset : {size_t{0}, size_t{1234}, len - 1}) {
    std::vector<uint8_t> bad = page;
    bad[offset] ^= 0x01;
    auto what = pdlib_test::VerifyPage(bad.data(), len, 7, 3, 11);
    INFO("offset " << offset);
    REQUIRE(what.has_value());
    CHECK(what->find("offset=" + std::to_string(offset) + ",") != std::string::npos);
    CHECK(what->find("buffer=3,page_pos=11") != std::string::npos);
  }
}

TEST_CASE("ucx byte-compare helper: chunks and page placement") {
  for (uint64_t room = 0; room < 200; ++room) {
    const auto shape = pdlib_test::ShapeOf(room, 64, true, 3, true);
    REQUIRE(shape.pages >= 1);
    REQUIRE(shape.pages <= 64);
    REQUIRE(shape.chunks >= 1);
    REQUIRE(shape.chunks <= 3);
    size_t total = 0;
    for (size_t c = 0; c < shape.chunks; ++c) {
      REQUIRE(pdlib_test::ChunkPages(shape, c) >= 1);
      total += pdlib_test::ChunkPages(shape, c);
    }
    REQUIRE(total == shape.pages);
  }
  // Pages in flight never overlap; prefill and decode place the same room differently.
  pdlib_test::PagePool a(256, 1), b(256, 2);
  std::vector<bool> used(256, false);
  for (uint64_t room = 0; room < 4; ++room) {
    const bool scattered = room >= 2;  // two contiguous runs of 32 always fit in 256 pages
    auto pa = a.Alloc(room, 32, scattered);
    auto pb = b.Alloc(room, 32, scattered);
    REQUIRE(pa.has_value());
    REQUIRE(pb.has_value());
    CHECK(*pa != *pb);
    for (size_t i = 0; i < pa->size(); ++i) {
      const int32_t p = (*pa)[i];
      REQUIRE_FALSE(used[size_t(p)]);
      used[size_t(p)] = true;
      if (!scattered && i > 0) CHECK(p == (*pa)[i - 1] + 1);
    }
  }
  auto rest = a.Alloc(8, 256 - 4 * 32, true);  // every page left
  REQUIRE(rest.has_value());
  CHECK_FALSE(a.Alloc(9, 1, true).has_value());  // full
  a.Free(*rest);
  CHECK(a.Alloc(9, 1, true).has_value());
}

TEST_CASE("ucx 1P1D over shm: every room's KV pages and aux slot arrive byte for byte") {
  RunLayouts({"ucx.tls=shm"});
}

TEST_CASE("ucx 1P1D over tcp on lo: every room's KV pages and aux slot arrive byte for byte") {
  RunLayouts({"ucx.tls=tcp", "ucx.net_devices=lo"});
}

TEST_CASE("ucx byte-compare negative control: a spoiled source byte or aux slot fails the room") {
  Scene scene;
  const Layout l{2, 1024, 256, 8, 2};
  const PairResult r = RunPair(scene, l, {"ucx.tls=shm"}, 0, 8,
                               {"--corrupt-kv-room", "3", "--corrupt-aux-room", "5"});
  for (uint64_t room = 0; room < 8; ++room) {
    auto it = r.decode_rooms.find(room);
    SCENE_REQUIRE(scene, it != r.decode_rooms.end());
    INFO("room " << room << ": " << it->second.state << " " << it->second.reason);
    if (room == 3) {
      CHECK(it->second.state == "Failed");
      CHECK(it->second.reason.starts_with("BADBYTES buffer="));
    } else if (room == 5) {
      CHECK(it->second.state == "Failed");
      CHECK(it->second.reason.starts_with("BADBYTES aux.output_ids[0]="));
    } else {
      CHECK(it->second.state == "Success");
      CHECK(it->second.reason == "OK");
    }
  }
}
