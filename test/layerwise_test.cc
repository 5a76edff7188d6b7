// Layer-wise streaming (KVSender::SendLayers) through the public API: what each announcement
// writes, what misuse is refused with (changing nothing), and bytes that land layer by layer.
// The fake backend moves no bytes, so there the prefill manager's byte count says what was
// written; over ucx (shared memory, in-process control plane) decode's pool is checked: after an
// announcement of l layers lands, layers [l, L) still hold decode's poison. Multi-process byte
// checks over every layout and transport are planner_e2e_test's "layerwise" cases.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/pdlib.h"

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::StatusCode;

namespace {

constexpr int kLayers = 4;
constexpr uint64_t kPages = 32;
constexpr uint64_t kPageBytes = 512;
std::atomic<uint16_t> g_next_bootstrap{31700};

bool HaveBackend(const std::string& name) {
  const auto all = pdlib::BuiltinBackends();
  return std::find(all.begin(), all.end(), name) != all.end();
}

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

// One side: K of every layer, then V of every layer (KVArgs order), kPages pages each.
struct Side {
  std::vector<std::vector<uint8_t>> kv;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;

  uint8_t* page(int buffer, int32_t index) {
    return kv[static_cast<size_t>(buffer)].data() + static_cast<uint64_t>(index) * kPageBytes;
  }
};

// The byte prefill holds at (layer, K/V, page position in the request, offset).
uint8_t Pattern(int layer, int kind, size_t position, uint64_t offset) {
  return static_cast<uint8_t>(layer * 37 + kind * 101 + position * 13 + offset * 7 + 1);
}

struct Pair {
  Side prefill, decode;
  uint16_t bootstrap = g_next_bootstrap++;

  explicit Pair(const std::string& backend) {
    for (auto [side, mode] :
         {std::pair{&prefill, pdlib::Mode::kPrefill}, std::pair{&decode, pdlib::Mode::kDecode}}) {
      pdlib::KVManagerOptions o;
      o.mode = mode;
      o.backend = backend;
      if (backend == "ucx") o.backend_options["ucx.tls"] = "shm";
      o.control_plane = pdlib::ControlPlane::kInProcess;
      o.bootstrap_port = bootstrap;
      o.start_bootstrap_server = mode == pdlib::Mode::kPrefill;
      side->kv.assign(2 * kLayers, std::vector<uint8_t>(kPages * kPageBytes,
                                                        mode == pdlib::Mode::kDecode ? 0xA5 : 0));
      for (auto& b : side->kv) {
        o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(b.data()));
        o.args.kv.lens.push_back(b.size());
        o.args.kv.item_lens.push_back(kPageBytes);
      }
      side->aux = std::move(*pdlib::MetadataBuffers::Create(4, 0, 0));
      o.args.aux = side->aux->Describe();
      o.args.page_size = 4;
      o.args.kv_head_num = 2;
      o.args.fingerprint = {kLayers, 2, 64, 1, 1, "layerwise-test"};
      auto m = pdlib::KVManager::Create(o);
      REQUIRE(m.ok());
      side->manager = std::move(*m);
    }
  }

  // A sender and a receiver for `room`, both past the handshake; decode's pages `dst`.
  std::pair<std::unique_ptr<pdlib::KVSender>, std::unique_ptr<pdlib::KVReceiver>> Open(
      uint64_t room, const std::vector<int32_t>& dst, uint64_t num_pages) {
    auto s = prefill.manager->CreateSender(room);
    REQUIRE(s.ok());
    auto r = decode.manager->CreateReceiver({"127.0.0.1", bootstrap}, room);
    REQUIRE(r.ok());
    decode.aux->bootstrap_room(0)[0] = 0;
    REQUIRE(WaitFor([&] { return (*r)->Poll() >= KVPoll::kWaitingForInput; }));
    REQUIRE((*r)->Init(dst, 0).ok());
    REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
    prefill.aux->bootstrap_room(0)[0] = room;
    REQUIRE((*s)->Init(num_pages, 0).ok());
    return {std::move(*s), std::move(*r)};
  }

  uint64_t SentBytes() const { return prefill.manager->metrics().bytes_transferred; }
};

uint64_t LayerBytes(size_t pages) { return pages * 2 * kPageBytes; }  // K and V of one layer

}  // namespace

TEST_CASE("layerwise fake: each announcement writes exactly the newly announced layers") {
  Pair pair("fake");
  const std::vector<int32_t> src = {3, 4, 5, 9, 10, 11}, dst = {20, 21, 7, 8, 1, 2};
  auto [sender, receiver] = pair.Open(500, dst, src.size());
  CHECK(sender->num_layers() == kLayers);
  const auto first = std::span(src).first(4), second = std::span(src).subspan(4);
  uint64_t expect = 0;
  // Chunk 1 (4 pages, not last): 0 (nothing), 1, 1 again (nothing), 3, then all 4.
  for (int32_t l : {0, 1, 1, 3, 4}) {
    REQUIRE(sender->SendLayers(first, l, false).ok());
    expect = LayerBytes(first.size()) * static_cast<uint64_t>(l);
    REQUIRE(WaitFor([&] { return pair.SentBytes() >= expect; }));
    std::this_thread::sleep_for(2ms);  // anything more would show up by now
    CHECK(pair.SentBytes() == expect);
  }
  CHECK(sender->Poll() == KVPoll::kTransferring);
  // Chunk 2 (last): 2 layers, then everything through Send().
  REQUIRE(sender->SendLayers(second, 2, true).ok());
  REQUIRE(WaitFor([&] { return pair.SentBytes() >= expect + LayerBytes(2) * 2; }));
  CHECK(pair.SentBytes() == expect + LayerBytes(2) * 2);
  CHECK(receiver->Poll() != KVPoll::kSuccess);  // the last chunk is not complete yet
  REQUIRE(sender->Send(second, true).ok());
  REQUIRE(WaitFor([&] { return receiver->Poll() == KVPoll::kSuccess; }));
  CHECK(sender->Poll() == KVPoll::kSuccess);
  const auto m = pair.prefill.manager->metrics();
  CHECK(m.bytes_transferred == LayerBytes(src.size()) * kLayers);  // KV bytes, each once
  CHECK(m.pages_transferred == src.size());                        // pages count once per chunk
}

TEST_CASE("layerwise misuse is refused with a clear error and changes nothing") {
  Pair pair("fake");
  const std::vector<int32_t> src = {3, 4, 5, 9}, dst = {20, 21, 7, 8};
  auto [sender, receiver] = pair.Open(501, dst, src.size());
  const auto chunk = std::span(src).first(2), rest = std::span(src).subspan(2);
  REQUIRE(sender->SendLayers(chunk, 2, false).ok());
  REQUIRE(WaitFor([&] { return pair.SentBytes() == LayerBytes(2) * 2; }));

  auto refused = [&](pdlib::Status s, StatusCode code, const std::string& words) {
    INFO(s.ToString());
    CHECK(s.code() == code);
    CHECK(s.ToString().find(words) != std::string::npos);
  };
  refused(sender->SendLayers(chunk, 1, false), StatusCode::kInvalidArgument,
          "announces 1 layers after 2 were announced");
  refused(sender->SendLayers(chunk, kLayers + 1, false), StatusCode::kOutOfRange,
          "this rank has 4 KV layers");
  refused(sender->SendLayers(chunk, -1, false), StatusCode::kOutOfRange, "announces -1 layers");
  refused(sender->SendLayers(rest, 3, false), StatusCode::kInvalidArgument,
          "differing from the 2 pages of the chunk");
  refused(sender->SendLayers(chunk, 3, true), StatusCode::kInvalidArgument,
          "is_last_chunk true for a chunk announced with false");
  // Send() is SendLayers with every layer: also refused for other pages while a chunk is open.
  refused(sender->Send(rest, true), StatusCode::kInvalidArgument, "finish a chunk");
  std::this_thread::sleep_for(2ms);
  CHECK(pair.SentBytes() == LayerBytes(2) * 2);  // nothing of that was written
  CHECK(sender->Poll() == KVPoll::kTransferring);

  // The request goes on as if none of that had happened.
  REQUIRE(sender->SendLayers(chunk, kLayers, false).ok());
  REQUIRE(sender->SendLayers(rest, kLayers, true).ok());
  REQUIRE(WaitFor([&] { return receiver->Poll() == KVPoll::kSuccess; }));
  CHECK(pair.SentBytes() == LayerBytes(src.size()) * kLayers);
  refused(sender->SendLayers(rest, 1, true), StatusCode::kFailedPrecondition, "");
}

TEST_CASE("layerwise: announcing after the last chunk is refused") {
  Pair pair("fake");
  const std::vector<int32_t> src = {1, 2}, dst = {5, 6};
  auto [sender, receiver] = pair.Open(502, dst, src.size());
  REQUIRE(sender->SendLayers(src, kLayers, true).ok());
  const pdlib::Status again = sender->SendLayers(src, 1, false);
  CHECK(again.code() == StatusCode::kFailedPrecondition);
  REQUIRE(WaitFor([&] { return receiver->Poll() == KVPoll::kSuccess; }));
  CHECK(pair.SentBytes() == LayerBytes(src.size()) * kLayers);
}

TEST_CASE("layerwise: an abort while a chunk is half announced fails both sides cleanly") {
  Pair pair("fake");
  const std::vector<int32_t> src = {1, 2, 3}, dst = {5, 6, 7};
  auto [sender, receiver] = pair.Open(503, dst, src.size());
  REQUIRE(sender->SendLayers(src, 2, true).ok());
  sender->Abort("engine gave up");
  CHECK(sender->Poll() == KVPoll::kFailed);
  CHECK(sender->SendLayers(src, 3, true).code() == StatusCode::kAborted);
  REQUIRE(WaitFor([&] { return receiver->Poll() == KVPoll::kFailed; }));
  CHECK(receiver->FailureReason().ToString().find("engine gave up") != std::string::npos);
  REQUIRE(WaitFor([&] { return sender->PagesReusable() && receiver->PagesReusable(); }));
}

TEST_CASE("layerwise ucx shm: layers land as announced, later layers untouched until then") {
  if (!HaveBackend("ucx")) {
    WARN("SKIP: this build has no ucx backend");
    return;
  }
  Pair pair("ucx");
  const std::vector<int32_t> src = {3, 4, 5, 9, 10, 11, 12}, dst = {20, 21, 7, 8, 1, 2, 30};
  for (int l = 0; l < kLayers; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      for (size_t p = 0; p < src.size(); ++p) {
        uint8_t* page = pair.prefill.page(kind * kLayers + l, src[p]);
        for (uint64_t off = 0; off < kPageBytes; ++off) page[off] = Pattern(l, kind, p, off);
      }
    }
  }
  auto landed = [&](int layer, size_t from, size_t to) {
    for (int kind = 0; kind < 2; ++kind) {
      for (size_t p = from; p < to; ++p) {
        const uint8_t* page = pair.decode.page(kind * kLayers + layer, dst[p]);
        for (uint64_t off = 0; off < kPageBytes; ++off) {
          if (page[off] != Pattern(layer, kind, p, off)) return false;
        }
      }
    }
    return true;
  };
  auto untouched = [&](int layer, size_t from, size_t to) {
    for (int kind = 0; kind < 2; ++kind) {
      for (size_t p = from; p < to; ++p) {
        const uint8_t* page = pair.decode.page(kind * kLayers + layer, dst[p]);
        if (std::any_of(page, page + kPageBytes, [](uint8_t b) { return b != 0xA5; })) {
          return false;
        }
      }
    }
    return true;
  };
  auto [sender, receiver] = pair.Open(600, dst, src.size());
  size_t at = 0;
  for (size_t n : {size_t{4}, size_t{3}}) {
    const bool last = at + n == src.size();
    const auto chunk = std::span(src).subspan(at, n);
    for (int32_t l = 1; l <= kLayers; ++l) {
      INFO("chunk at " << at << ", " << l << " layers announced");
      REQUIRE(sender->SendLayers(chunk, l, last).ok());
      if (l == kLayers && last) break;
      REQUIRE(WaitFor([&] { return landed(l - 1, at, at + n); }));
      std::this_thread::sleep_for(2ms);
      for (int later = l; later < kLayers; ++later) CHECK(untouched(later, at, at + n));
    }
    at += n;
  }
  REQUIRE(WaitFor([&] { return receiver->Poll() == KVPoll::kSuccess; }));
  for (int l = 0; l < kLayers; ++l) CHECK(landed(l, 0, src.size()));
  CHECK(pair.decode.aux->bootstrap_room(0)[0] == 600);
}
