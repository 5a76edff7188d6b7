// Decode prefix reuse and several state families through the public API (issue #27, SPEC
// R11.1, R11.2): what an engine sees on both sides, over both control planes. Bytes are
// compared over the ucx backend (shared memory) where it is built; the control-plane cases run
// over fake.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/backends.h"
#include "pdlib/kv_manager.h"
#include "pdlib/metadata_buffers.h"

namespace {

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::StatusCode;

pdlib::ControlPlane g_plane = pdlib::ControlPlane::kInProcess;
#define FOR_EACH_CONTROL_PLANE()                                                   \
  g_plane = GENERATE(pdlib::ControlPlane::kInProcess, pdlib::ControlPlane::kGrpc); \
  INFO("control plane " << (g_plane == pdlib::ControlPlane::kGrpc ? "grpc" : "in-process"))

uint16_t NextPort() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(31000 + (::getpid() % 500) * 8)};
  return next++;
}

bool HaveUcx() {
  for (const auto& b : pdlib::BuiltinBackends()) {
    if (b == "ucx") return true;
  }
  return false;
}

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit = 10000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(200us);
  }
  return true;
}

constexpr uint32_t kPageTokens = 4;
constexpr int32_t kHeads = 4, kHeadBytes = 2;
constexpr uint64_t kPoolPages = 32;

// One rank: K and V pools (one layer), metadata, and optionally two state families (a mamba
// slot pool and a swa page pool).
struct Rank {
  int32_t tp_size = 1, tp_rank = 0;
  std::vector<uint8_t> k, v, mamba, swa;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;
  uint64_t page_bytes() const {
    return uint64_t{kPageTokens} * static_cast<uint64_t>(kHeads / tp_size) * kHeadBytes;
  }
};

pdlib::Status Start(Rank& r, pdlib::Mode mode, uint16_t bootstrap, const std::string& backend,
                    bool families) {
  const uint64_t pb = r.page_bytes();
  r.k.assign(pb * kPoolPages, 0);
  r.v.assign(pb * kPoolPages, 0);
  r.aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));
  pdlib::KVManagerOptions o;
  o.mode = mode;
  o.backend = backend;
  if (backend == "ucx") o.backend_options = {{"ucx.tls", "shm"}};
  o.control_plane = g_plane;
  o.start_bootstrap_server = mode == pdlib::Mode::kPrefill && r.tp_rank == 0;
  o.bootstrap_port = bootstrap;
  o.liveness_timeout = 2000ms;
  o.connect_timeout = 5000ms;
  pdlib::KVArgs& a = o.args;
  a.kv = {{reinterpret_cast<uint64_t>(r.k.data()), reinterpret_cast<uint64_t>(r.v.data())},
          {r.k.size(), r.v.size()},
          {pb, pb}};
  a.aux = r.aux->Describe();
  a.page_size = kPageTokens;
  a.kv_head_num = kHeads / r.tp_size;
  a.kv_layout = pdlib::KVLayout::kHND;
  a.parallel.tp_size = r.tp_size;
  a.parallel.tp_rank = r.tp_rank;
  a.fingerprint = {1, kHeads, kHeadBytes, 1, 1, "prefix-test"};
  if (families) {
    r.mamba.assign(8 * 16, 0);
    r.swa.assign(kPoolPages * 12, 0);
    pdlib::StateFamily m;
    m.type = pdlib::StateType::kMamba;
    m.buffers = {{reinterpret_cast<uint64_t>(r.mamba.data())}, {r.mamba.size()}, {16}};
    pdlib::StateFamily w;
    w.type = pdlib::StateType::kSwa;
    w.buffers = {{reinterpret_cast<uint64_t>(r.swa.data())}, {r.swa.size()}, {12}};
    a.state_families = {m, w};
  }
  auto m = pdlib::KVManager::Create(o);
  if (!m.ok()) return m.status();
  r.manager = std::move(*m);
  return pdlib::Status::OK();
}

TEST_CASE("decode prefix: a prefix is whole pages and no longer than the prompt") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, "fake", false).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port, "fake", false).ok());
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 7);
  REQUIRE(r.ok());
  const std::vector<int32_t> pages = {5, 6};
  pdlib::ReceiveRequest req;
  req.kv_page_indices = pages;
  req.aux_index = 1;
  req.decode_prefix_len = 6;  // not a multiple of 4
  pdlib::Status s = (*r)->Init(req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("decode_prefix_len 6 is not a multiple of page_size 4") !=
        std::string::npos);
  req.decode_prefix_len = 12;
  req.prompt_len = 10;
  s = (*r)->Init(req);
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message().find("decode_prefix_len 12 is longer than the prompt's 10 tokens") !=
        std::string::npos);
  req.decode_prefix_len = 4;  // tokens [4, 10): 2 pages, the last one partial
  req.prompt_len = 10;
  const std::vector<int32_t> three = {5, 6, 7};
  req.kv_page_indices = three;
  s = (*r)->Init(req);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("3 kv pages given for tokens [4, 10): expected 2 pages") !=
        std::string::npos);
  // Refused calls changed nothing: a good Init is still accepted.
  req.kv_page_indices = pages;
  CHECK((*r)->Init(req).ok());
}

TEST_CASE("decode prefix: prefill learns it at WaitingForInput and counts only the tail") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, "fake", false).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port, "fake", false).ok());
  auto s = p.manager->CreateSender(9);
  REQUIRE(s.ok());
  CHECK(!(*s)->decode_prefix_len().has_value());
  CHECK((*s)->PagesAfterPrefix(10).status().code() == StatusCode::kFailedPrecondition);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 9);
  REQUIRE(r.ok());
  const std::vector<int32_t> pages = {3, 4};
  pdlib::ReceiveRequest req;
  req.kv_page_indices = pages;
  req.aux_index = 2;
  req.decode_prefix_len = 8;
  req.prompt_len = 15;  // [8, 15): 2 pages
  REQUIRE((*r)->Init(req).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE((*s)->decode_prefix_len().has_value());
  CHECK(*(*s)->decode_prefix_len() == 8);
  auto n = (*s)->PagesAfterPrefix(15);
  REQUIRE(n.ok());
  CHECK(*n == 2);
  pdlib::Status longer = (*s)->PagesAfterPrefix(6).status();
  CHECK(longer.code() == StatusCode::kOutOfRange);
  CHECK(longer.message().find("decode_prefix_len 8 is longer than the prompt's 6 tokens") !=
        std::string::npos);
  REQUIRE((*s)->Init(*n, 2).ok());
  // Sending the whole prompt's 4 pages would be more than decode handed over.
  const std::vector<int32_t> all = {10, 11, 12, 13};
  CHECK((*s)->Send(all, true).code() == StatusCode::kOutOfRange);
  REQUIRE((*s)->Send(std::span(all).subspan(2), true).ok());
  CHECK(WaitFor(
      [&] { return (*s)->Poll() == KVPoll::kSuccess && (*r)->Poll() == KVPoll::kSuccess; }));
}

TEST_CASE("decode prefix: decode ranks that disagree fail the room with both values") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p;
  Rank d0, d1;
  d0.tp_size = d1.tp_size = 2;
  d1.tp_rank = 1;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, "fake", false).ok());
  REQUIRE(Start(d0, pdlib::Mode::kDecode, port, "fake", false).ok());
  REQUIRE(Start(d1, pdlib::Mode::kDecode, port, "fake", false).ok());
  auto s = p.manager->CreateSender(11);
  REQUIRE(s.ok());
  auto r0 = d0.manager->CreateReceiver({"127.0.0.1", port}, 11);
  auto r1 = d1.manager->CreateReceiver({"127.0.0.1", port}, 11);
  REQUIRE((r0.ok() && r1.ok()));
  const std::vector<int32_t> pages = {1};
  pdlib::ReceiveRequest a;
  a.kv_page_indices = pages;
  a.aux_index = 0;
  a.decode_prefix_len = 4;
  pdlib::ReceiveRequest b = a;
  b.decode_prefix_len = 8;
  REQUIRE((*r0)->Init(a).ok());
  REQUIRE((*r1)->Init(b).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kFailed; }));
  const std::string why = (*s)->FailureReason().ToString();
  INFO(why);
  CHECK(why.find("decode ranks disagree on the decode prefix") != std::string::npos);
  CHECK(why.find("4 tokens") != std::string::npos);
  CHECK(why.find("8 tokens") != std::string::npos);
  // Decode hears of it too.
  CHECK(WaitFor(
      [&] { return (*r0)->Poll() == KVPoll::kFailed || (*r1)->Poll() == KVPoll::kFailed; }));
}

uint8_t KvByte(uint64_t room, int kv, uint64_t position_page, uint64_t offset) {
  return static_cast<uint8_t>(room * 13 + static_cast<uint64_t>(kv) * 101 + position_page * 7 +
                              offset * 3 + 1);
}

// One request over ucx shm: prefill holds the whole prompt's pages, decode holds the first
// `prefix_pages` and hands over the rest; two state families go along. Every byte of decode's
// pools is checked: handed-over pages and indexed state hold prefill's bytes, the rest the fill.
void MoveWithPrefix(int32_t prefix_pages, uint64_t prompt_len) {
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, "ucx", true).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port, "ucx", true).ok());
  const uint64_t room = 40 + static_cast<uint64_t>(prefix_pages);
  const uint64_t total = (prompt_len + kPageTokens - 1) / kPageTokens;
  const uint64_t pb = p.page_bytes();
  std::vector<int32_t> src, dst_all;
  for (uint64_t i = 0; i < total; ++i) {
    src.push_back(static_cast<int32_t>(2 * i + 1));
    dst_all.push_back(static_cast<int32_t>(kPoolPages - 1 - 3 * i));
  }
  for (uint64_t i = 0; i < total; ++i) {
    for (uint64_t o = 0; o < pb; ++o) {
      p.k[static_cast<uint64_t>(src[i]) * pb + o] = KvByte(room, 0, i, o);
      p.v[static_cast<uint64_t>(src[i]) * pb + o] = KvByte(room, 1, i, o);
    }
  }
  for (uint64_t o = 0; o < 16; ++o) p.mamba[2 * 16 + o] = static_cast<uint8_t>(0x40 + o);
  for (uint64_t o = 0; o < 12; ++o) {
    p.swa[5 * 12 + o] = static_cast<uint8_t>(0x80 + o);
    p.swa[6 * 12 + o] = static_cast<uint8_t>(0x90 + o);
  }
  constexpr uint8_t kFill = 0xA5;
  for (auto* b : {&d.k, &d.v, &d.mamba, &d.swa}) std::memset(b->data(), kFill, b->size());
  p.aux->bootstrap_room(1)[0] = room;
  p.aux->output_ids(1)[0] = 77;

  auto s = p.manager->CreateSender(room);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, room);
  REQUIRE((s.ok() && r.ok()));
  const std::vector<int32_t> dst(dst_all.begin() + prefix_pages, dst_all.end());
  const std::vector<int32_t> dstate = {7, 20, 21};  // mamba slot 7; swa pages 20, 21
  const std::vector<uint32_t> dcounts = {1, 2};
  pdlib::ReceiveRequest req;
  req.kv_page_indices = dst;
  req.aux_index = 3;
  req.state = {dstate, dcounts};
  req.decode_prefix_len = static_cast<uint64_t>(prefix_pages) * kPageTokens;
  req.prompt_len = prompt_len;
  REQUIRE((*r)->Init(req).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE((*s)->decode_prefix_len() == req.decode_prefix_len);
  auto n = (*s)->PagesAfterPrefix(prompt_len);
  REQUIRE(n.ok());
  REQUIRE(*n == dst.size());
  REQUIRE((*s)->Init(*n, 1).ok());
  const std::vector<int32_t> sstate = {2, 5, 6};
  const std::vector<uint32_t> scounts = {1, 2};
  const std::span<const int32_t> tail = std::span(src).subspan(static_cast<size_t>(prefix_pages));
  if (tail.size() > 1) REQUIRE((*s)->Send(tail.first(1), false).ok());
  REQUIRE((*s)->SendStates(tail.size() > 1 ? tail.subspan(1) : tail, true, {sstate, scounts}).ok());
  REQUIRE(WaitFor(
      [&] { return (*s)->Poll() == KVPoll::kSuccess && (*r)->Poll() == KVPoll::kSuccess; }));
  for (uint64_t q = 0; q < kPoolPages; ++q) {
    int64_t pos = -1;
    for (size_t k = 0; k < dst.size(); ++k) {
      if (static_cast<uint64_t>(dst[k]) == q) pos = prefix_pages + static_cast<int64_t>(k);
    }
    for (int kv = 0; kv < 2; ++kv) {
      const auto& pool = kv == 0 ? d.k : d.v;
      for (uint64_t o = 0; o < pb; ++o) {
        const uint8_t want = pos < 0 ? kFill : KvByte(room, kv, static_cast<uint64_t>(pos), o);
        INFO("pool page " << q << " position " << pos << " kv " << kv << " byte " << o);
        REQUIRE(pool[q * pb + o] == want);
      }
    }
  }
  for (uint64_t i = 0; i < d.mamba.size(); ++i) {
    const bool slot = i / 16 == 7;
    REQUIRE(d.mamba[i] == (slot ? static_cast<uint8_t>(0x40 + i % 16) : kFill));
  }
  for (uint64_t i = 0; i < d.swa.size(); ++i) {
    const uint64_t item = i / 12;
    const uint8_t want = item == 20   ? static_cast<uint8_t>(0x80 + i % 12)
                         : item == 21 ? static_cast<uint8_t>(0x90 + i % 12)
                                      : kFill;
    REQUIRE(d.swa[i] == want);
  }
  CHECK(d.aux->output_ids(3)[0] == 77);
}

TEST_CASE("decode prefix over ucx: none, one page, all but a partial last page, the whole prompt") {
  if (!HaveUcx()) {
    WARN("SKIP: this build has no ucx backend");
    return;
  }
  g_plane = pdlib::ControlPlane::kGrpc;
  SECTION("no prefix") { MoveWithPrefix(0, 18); }
  SECTION("one page") { MoveWithPrefix(1, 18); }
  SECTION("all but the last, partial, page") { MoveWithPrefix(4, 18); }
  SECTION("the whole prompt: only aux and state move") { MoveWithPrefix(4, 16); }
}

}  // namespace
