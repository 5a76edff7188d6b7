// KV integrity (issue #42, SPEC R12.3) through the public API: a digest of every transfer,
// compared where it landed. The in-process control plane with the fake backend moving bytes
// (fake.copy) and corrupting them on purpose (fake.corrupt); push and pull, M:N TP, a decode
// prefix, aux and two state families. The same over ucx (shared memory) where it is built.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/fake/fake_faults.h"
#include "lib/core/manager_common.h"
#include "pdlib/backends.h"
#include "pdlib/kv_manager.h"
#include "pdlib/metadata_buffers.h"
#include "test/support/test_wait.h"

namespace {

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::StatusCode;

uint16_t NextPort() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(36000 + (::getpid() % 500) * 8)};
  return next++;
}

using pdlib_test::WaitFor;
bool HaveUcx() { return pdlib_test::HaveBackend("ucx"); }

constexpr uint32_t kPageTokens = 4;
constexpr int32_t kHeads = 4, kHeadBytes = 8, kLayers = 2;
constexpr uint64_t kPoolPages = 32, kSlots = 8, kMambaItem = 64, kSwaItem = 24;

struct Setup {
  std::string backend = "fake";
  std::string corrupt;  // fake.corrupt
  pdlib::TransferDirection direction = pdlib::TransferDirection::kPush;
  pdlib::KvChecksum checksum = pdlib::KvChecksum::kAll;
  uint32_t sample_every = 64;
  bool families = false;
  double inject = 0;  // failure injection stage `corrupt`, through the real transport
  // KV and state pools registered as GPU memory (MemoryKind::kCuda): with the fake, host memory
  // standing in for a GPU's, digested through the transport's DigestRanges as a GPU pool is.
  bool cuda = false;
  std::string extra_option;  // one more backend option, "key=value"
};

// One rank: K and V pools per layer ([token][head][byte], NHD: heads slice per token), the
// metadata buffers, and optionally a mamba slot pool and a swa page pool.
struct Rank {
  int32_t tp_size = 1, tp_rank = 0;
  std::vector<std::vector<uint8_t>> kv;  // K of each layer, then V of each layer
  std::vector<uint8_t> mamba, swa;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;
  uint64_t page_bytes() const {
    return uint64_t{kPageTokens} * static_cast<uint64_t>(kHeads / tp_size) * kHeadBytes;
  }
};

pdlib::Status Start(Rank& r, pdlib::Mode mode, uint16_t bootstrap, const Setup& s,
                    pdlib::KvChecksum checksum) {
  const uint64_t pb = r.page_bytes();
  r.kv.assign(2 * kLayers, std::vector<uint8_t>(pb * kPoolPages, 0));
  r.aux = std::move(*pdlib::MetadataBuffers::Create(kSlots, 0, 0));
  pdlib::KVManagerOptions o;
  o.mode = mode;
  o.backend = s.backend;
  if (s.backend == "ucx") o.backend_options = {{"ucx.tls", "shm"}};
  if (s.backend == "fake") {
    o.backend_options = {{"fake.copy", "true"}};
    if (!s.corrupt.empty()) o.backend_options["fake.corrupt"] = s.corrupt;
  }
  if (!s.extra_option.empty()) {
    const size_t eq = s.extra_option.find('=');
    o.backend_options[s.extra_option.substr(0, eq)] = s.extra_option.substr(eq + 1);
  }
  o.control_plane = pdlib::ControlPlane::kInProcess;
  o.bootstrap_port = bootstrap;
  o.direction = s.direction;
  o.checksum = checksum;
  o.checksum_sample_every = s.sample_every;
  if (s.inject > 0) {
    o.failure_injection_prob = s.inject;
    o.failure_injection_stages = "corrupt";
  }
  pdlib::KVArgs& a = o.args;
  for (auto& buf : r.kv) {
    a.kv.ptrs.push_back(reinterpret_cast<uint64_t>(buf.data()));
    a.kv.lens.push_back(buf.size());
    a.kv.item_lens.push_back(pb);
  }
  a.aux = r.aux->Describe();
  a.page_size = kPageTokens;
  if (s.cuda) a.memory_kind = pdlib::MemoryKind::kCuda;
  a.kv_head_num = kHeads / r.tp_size;
  a.kv_layout = pdlib::KVLayout::kNHD;
  a.parallel.tp_size = r.tp_size;
  a.parallel.tp_rank = r.tp_rank;
  a.fingerprint = {kLayers, kHeads, kHeadBytes, 1, 1, "integrity-test"};
  if (s.families) {
    r.mamba.assign(kSlots * kMambaItem, 0);
    r.swa.assign(kPoolPages * kSwaItem, 0);
    pdlib::StateFamily m;
    m.type = pdlib::StateType::kMamba;
    m.buffers = {{reinterpret_cast<uint64_t>(r.mamba.data())}, {r.mamba.size()}, {kMambaItem}};
    pdlib::StateFamily w;
    w.type = pdlib::StateType::kSwa;
    w.buffers = {{reinterpret_cast<uint64_t>(r.swa.data())}, {r.swa.size()}, {kSwaItem}};
    a.state_families = {m, w};
  }
  auto m = pdlib::KVManager::Create(o);
  if (!m.ok()) return m.status();
  r.manager = std::move(*m);
  return pdlib::Status::OK();
}

// Prefill TP `ptp` -> decode TP 1, one room per call.
struct Pair {
  Setup setup;
  uint16_t port = NextPort();
  std::vector<Rank> prefill;
  Rank decode;
  explicit Pair(Setup s, int32_t ptp = 1,
                pdlib::KvChecksum decode_checksum = pdlib::KvChecksum::kAll)
      : setup(std::move(s)), prefill(ptp) {
    for (int32_t t = 0; t < ptp; ++t) {
      prefill[t].tp_size = ptp;
      prefill[t].tp_rank = t;
      REQUIRE(Start(prefill[t], pdlib::Mode::kPrefill, port, setup, setup.checksum).ok());
    }
    if (setup.checksum != pdlib::KvChecksum::kAll) decode_checksum = setup.checksum;
    REQUIRE(Start(decode, pdlib::Mode::kDecode, port, setup, decode_checksum).ok());
  }
  // Fills prefill's source pages (positions `pages_src`) with a pattern of `room`.
  void Fill(uint64_t room, const std::vector<int32_t>& src) {
    for (auto& p : prefill) {
      for (size_t b = 0; b < p.kv.size(); ++b) {
        for (int32_t page : src) {
          for (uint64_t i = 0; i < p.page_bytes(); ++i) {
            p.kv[b][page * p.page_bytes() + i] =
                static_cast<uint8_t>(room * 31 + b * 7 + page * 3 + i + p.tp_rank * 101);
          }
        }
      }
    }
  }
  struct Outcome {
    KVPoll decode = KVPoll::kBootstrapping, prefill = KVPoll::kBootstrapping;
    std::string reason;
    std::vector<int32_t> invalid;
  };
  // One request: `dst` pages on decode (after a prefix of `prefix_pages` pages), prefill's
  // `src` pages, aux slot 2 -> 3, and with families a mamba slot and the swa pages.
  Outcome Run(uint64_t room, std::vector<int32_t> src, std::vector<int32_t> dst,
              uint32_t prefix_pages = 0, bool layerwise = false) {
    Fill(room, src);
    auto recv = decode.manager->CreateReceiver({"127.0.0.1", port}, room);
    REQUIRE(recv.ok());
    std::vector<std::unique_ptr<pdlib::KVSender>> senders;
    for (auto& p : prefill) {
      auto s = p.manager->CreateSender(room);
      REQUIRE(s.ok());
      senders.push_back(std::move(*s));
    }
    const std::vector<int32_t> dst_state = {5, 9, 10};  // mamba slot 5; swa pages 9, 10
    const std::vector<uint32_t> dst_counts = {1, 2};
    const std::vector<int32_t> src_state = {1, 3, 4};
    const std::vector<uint32_t> src_counts = {1, 2};
    for (auto& p : prefill) {
      for (size_t i = 0; i < p.mamba.size(); ++i) p.mamba[i] = static_cast<uint8_t>(room + i);
      for (size_t i = 0; i < p.swa.size(); ++i) p.swa[i] = static_cast<uint8_t>(room * 3 + i);
    }
    pdlib::ReceiveRequest req;
    req.kv_page_indices = dst;
    req.aux_index = 3;
    req.decode_prefix_len = uint64_t{prefix_pages} * kPageTokens;
    if (setup.families) req.state = {dst_state, dst_counts};
    REQUIRE(WaitFor([&] { return (*recv)->Poll() >= KVPoll::kWaitingForInput; }));
    REQUIRE((*recv)->Init(req).ok());
    // Pull publishes the whole prompt; push sends the pages after the prefix.
    const bool pull = setup.direction == pdlib::TransferDirection::kPull;
    std::vector<int32_t> send = src;
    if (!pull) send.erase(send.begin(), send.begin() + prefix_pages);
    for (size_t t = 0; t < senders.size(); ++t) {
      REQUIRE(WaitFor([&] { return senders[t]->Poll() >= KVPoll::kWaitingForInput; }));
      REQUIRE(senders[t]->Init(send.size(), 2).ok());
      // Every field of the metadata slot holds something of this room (a fault that drops its
      // bytes must leave something else), then the room's number in its bootstrap_room field,
      // as an engine writes it.
      for (int f = 0; f <= static_cast<int>(pdlib::MetadataField::kBootstrapRoom); ++f) {
        auto row = prefill[t].aux->Row(static_cast<pdlib::MetadataField>(f), 2);
        for (size_t i = 0; i < row.size(); ++i) row[i] = std::byte(room * 13 + f + i);
      }
      prefill[t].aux->bootstrap_room(2)[0] = room;
      pdlib::StateIndices st;
      if (setup.families) st = {src_state, src_counts};
      // Two chunks: the first page, then the rest.
      std::span<const int32_t> all(send);
      if (layerwise) {  // each chunk announced a layer at a time (SendLayers)
        for (int32_t layers = 1; layers <= kLayers; ++layers) {
          REQUIRE(senders[t]->SendLayersStates(all.subspan(0, 1), layers, false, {}).ok());
        }
        for (int32_t layers = 1; layers <= kLayers; ++layers) {
          REQUIRE(senders[t]->SendLayersStates(all.subspan(1), layers, true, st).ok());
        }
        continue;
      }
      REQUIRE(senders[t]->SendStates(all.subspan(0, 1), false, {}).ok());
      REQUIRE(senders[t]->SendStates(all.subspan(1), true, st).ok());
    }
    Outcome out;
    REQUIRE(WaitFor([&] {
      bool done = pdlib::IsTerminal((*recv)->Poll());
      for (auto& s : senders) done &= pdlib::IsTerminal(s->Poll());
      return done;
    }));
    out.decode = (*recv)->Poll();
    out.prefill = senders[0]->Poll();
    out.reason = (*recv)->FailureReason().ToString();
    out.invalid = (*recv)->InvalidPages();
    if (out.decode == KVPoll::kSuccess) {
      // Every byte decode holds for the request is prefill's (each rank its heads).
      const uint64_t db = decode.page_bytes();
      const uint64_t per = db / kPageTokens / static_cast<uint64_t>(prefill.size());  // a slice
      for (size_t b = 0; b < decode.kv.size(); ++b) {
        for (size_t k = 0; k < dst.size(); ++k) {
          for (uint64_t tok = 0; tok < kPageTokens; ++tok) {
            for (size_t t = 0; t < prefill.size(); ++t) {
              const uint8_t* want = prefill[t].kv[b].data() +
                                    src[k + prefix_pages] * prefill[t].page_bytes() + tok * per;
              const uint8_t* got =
                  decode.kv[b].data() + dst[k] * db + tok * (db / kPageTokens) + t * per;
              REQUIRE(std::memcmp(want, got, per) == 0);
            }
          }
        }
      }
    }
    return out;
  }
};

}  // namespace

TEST_CASE("kv integrity: every room digested, push and pull, 1:1 and TP 2 -> 1: all succeed") {
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  const int32_t ptp = GENERATE(1, 2);
  const bool families = GENERATE(false, true);
  // The fake digests what it sends (PostWritesDigested) unless told not to: then the prefill
  // core digests the source itself.
  const bool core_pass = GENERATE(false, true);
  INFO((dir == pdlib::TransferDirection::kPull ? "pull" : "push")
       << " prefill TP " << ptp << (families ? " with state families" : "")
       << (core_pass ? ", the core's own pass" : ", send digests"));
  Setup s;
  s.direction = dir;
  s.families = families;
  if (core_pass) s.extra_option = "fake.digests_sends=false";
  Pair pair(s, ptp);
  for (uint64_t room = 100; room < 106; ++room) {
    auto out = pair.Run(room, {1, 2, 3}, {7, static_cast<int32_t>(room % 20 + 10), 4});
    INFO(out.reason);
    CHECK(out.decode == KVPoll::kSuccess);
    CHECK(out.prefill == KVPoll::kSuccess);
  }
  CHECK(pair.decode.manager->metrics().rooms_checksummed == 6);
  CHECK(pair.decode.manager->metrics().checksum_mismatches == 0);
  CHECK(pair.prefill[0].manager->metrics().rooms_checksummed == 6);
  // Push with send digests: no KV batch needed the core's pass (pull offers digest the source).
  const bool by_sends = dir == pdlib::TransferDirection::kPush && !core_pass;
  for (auto& p : pair.prefill) {
    CHECK(p.manager->metrics().rooms_checksummed_in_flight == (by_sends ? 6u : 0u));
  }
}

TEST_CASE("kv integrity: a decode prefix: only the pages after it are covered") {
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  Setup s;
  s.direction = dir;
  Pair pair(s, 2);
  auto out = pair.Run(200, {1, 2, 3, 5}, {8, 9}, 2);
  INFO(out.reason);
  CHECK(out.decode == KVPoll::kSuccess);
}

TEST_CASE("kv integrity: layer-wise streaming: each layer's batch digested, the room whole") {
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  Setup s;
  s.direction = dir;
  s.families = true;
  Pair pair(s, 2);
  for (uint64_t room = 250; room < 253; ++room) {
    auto out = pair.Run(room, {1, 2, 3}, {7, 12, 4}, 0, true);
    INFO(out.reason);
    CHECK(out.decode == KVPoll::kSuccess);
  }
  Setup bad = s;
  bad.corrupt = "byte:1";
  Pair corrupt(bad, 1);
  auto out = corrupt.Run(260, {1, 2, 3}, {7, 12, 4}, 0, true);
  CHECK(out.decode == KVPoll::kFailed);
  CHECK(out.reason.find("KV checksum mismatch") != std::string::npos);
}

TEST_CASE("kv integrity: corruption in flight never reaches Success, and is narrowed down") {
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  const std::string kind =
      GENERATE(std::string("byte"), std::string("page"), std::string("misplace"));
  INFO((dir == pdlib::TransferDirection::kPull ? "pull " : "push ") << kind);
  Setup s;
  s.direction = dir;
  s.families = true;
  s.corrupt = kind + ":0.3";
  Pair pair(s, 2);
  // Rooms run one at a time: the corruptions injected during a room are that room's. A room is
  // hit exactly when it fails, and then DATA_LOSS with the checksum's message: none is missed,
  // none is a false alarm.
  int failed = 0, hit = 0;
  for (uint64_t room = 300; room < 316; ++room) {
    const uint64_t before = pdlib::FakeCorruptionsInjected();
    auto out = pair.Run(room, {1, 2, 3}, {7, 12, 4});
    const bool corrupted = pdlib::FakeCorruptionsInjected() > before;
    hit += corrupted ? 1 : 0;
    INFO("room " << room << ": " << out.reason);
    CHECK((out.decode == KVPoll::kFailed) == corrupted);
    if (out.decode == KVPoll::kFailed) {
      ++failed;
      CHECK(out.reason.find("DATA_LOSS") != std::string::npos);
      CHECK(out.reason.find("KV checksum mismatch on decode rank tp 0") != std::string::npos);
    }
  }
  CHECK(hit > 0);
  CHECK(failed == hit);
  CHECK(pair.decode.manager->metrics().checksum_mismatches == static_cast<uint64_t>(failed));
  const auto by_peer = pair.decode.manager->metrics().checksum_mismatches_by_peer;
  CHECK(by_peer.size() == 2);  // both prefill ranks wrote to every failed room
}

TEST_CASE("kv integrity: GPU pools are digested by the transport, aux rows by the CPU") {
  // The core hands every KV and state range of GPU pools to the transport's DigestRanges (the
  // kernel of cuda_ipc; the fake's CPU stand-in here, which refuses anything outside a kCuda
  // region) and digests the aux rows (host memory) itself; both sides, push and pull, M:N TP.
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  INFO((dir == pdlib::TransferDirection::kPull ? "pull" : "push"));
  Setup s;
  s.direction = dir;
  s.families = true;
  s.cuda = true;
  Pair pair(s, 2);
  const uint64_t before = pdlib::FakeDeviceRangesDigested();
  for (uint64_t room = 280; room < 284; ++room) {
    auto out = pair.Run(room, {1, 2, 3}, {7, 12, 4});
    INFO(out.reason);
    CHECK(out.decode == KVPoll::kSuccess);
  }
  // Per room: decode's pass over 2 layers x K,V x 3 pages + 3 state slots (12 + 3 = 15 ranges),
  // and each of the 2 senders' ranges of its heads of the 12 KV cells (at least one a cell).
  CHECK(pdlib::FakeDeviceRangesDigested() - before >= 4 * (15 + 2 * 12));
  CHECK(pair.decode.manager->metrics().rooms_checksummed == 4);
  // Corrupted in flight: caught the same way.
  Setup bad = s;
  bad.corrupt = "byte:1";
  Pair corrupt(bad, 1);
  auto out = corrupt.Run(290, {1, 2, 3}, {7, 12, 4});
  CHECK(out.decode == KVPoll::kFailed);
  CHECK(out.reason.find("KV checksum mismatch") != std::string::npos);
}

TEST_CASE("kv integrity: GPU pools on a backend that cannot digest GPU memory are refused") {
  Setup s;
  s.cuda = true;
  s.extra_option = "fake.digests_cuda=false";
  Rank r;
  pdlib::Status st = Start(r, pdlib::Mode::kDecode, NextPort(), s, pdlib::KvChecksum::kAll);
  INFO(st.ToString());
  CHECK(st.code() == pdlib::StatusCode::kFailedPrecondition);
  CHECK(st.message().find("backend 'fake' cannot digest GPU memory") != std::string::npos);
  // Without checksums the same pools are fine.
  Rank plain;
  CHECK(Start(plain, pdlib::Mode::kDecode, NextPort(), s, pdlib::KvChecksum::kOff).ok());
}

TEST_CASE("kv integrity: the message names the layer and the pages, pull lists only those") {
  Setup s;
  s.direction = pdlib::TransferDirection::kPull;
  s.corrupt = "byte:1";
  Pair pair(s, 1);
  std::vector<int32_t> dst;
  for (int32_t i = 0; i < 10; ++i) dst.push_back(20 - i);
  std::vector<int32_t> src = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto out = pair.Run(400, src, dst);
  REQUIRE(out.decode == KVPoll::kFailed);
  INFO(out.reason);
  CHECK(out.reason.find("layer ") != std::string::npos);
  CHECK(out.reason.find("request pages [") != std::string::npos);
  // One op of one batch was hit: pull's invalid pages are the corrupted pages only, not all 10.
  CHECK(!out.invalid.empty());
  CHECK(out.invalid.size() < dst.size());
}

TEST_CASE("kv integrity: both sides must agree on the setting, sampled picks the same rooms") {
  SECTION("a decode that checks and a prefill that does not are refused, naming both") {
    Setup s;
    s.checksum = pdlib::KvChecksum::kOff;
    Pair pair(s, 1, pdlib::KvChecksum::kOff);
    Rank d2;
    Setup all;
    REQUIRE(Start(d2, pdlib::Mode::kDecode, pair.port, all, pdlib::KvChecksum::kAll).ok());
    auto r = d2.manager->CreateReceiver({"127.0.0.1", pair.port}, 9);
    REQUIRE(r.ok());
    REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
    CHECK((*r)->FailureReason().ToString().find("checksum 'all' vs 'off'") != std::string::npos);
  }
  SECTION("sampled: 1 room in 4, the same rooms on both sides") {
    Setup s;
    s.checksum = pdlib::KvChecksum::kSampled;
    s.sample_every = 4;
    Pair pair(s, 1);
    pdlib::KVManagerOptions o;
    o.checksum = pdlib::KvChecksum::kSampled;
    o.checksum_sample_every = 4;
    uint64_t want = 0;
    for (uint64_t room = 500; room < 540; ++room) {
      want += pdlib::ChecksumRoom(o, room) ? 1 : 0;
      auto out = pair.Run(room, {1, 2}, {3, 4});
      CHECK(out.decode == KVPoll::kSuccess);
    }
    CHECK(want > 2);
    CHECK(want < 30);
    CHECK(pair.decode.manager->metrics().rooms_checksummed == want);
    CHECK(pair.prefill[0].manager->metrics().rooms_checksummed == want);
  }
  SECTION("bad settings") {
    Rank r;
    Setup s;
    s.checksum = pdlib::KvChecksum::kSampled;
    s.sample_every = 0;
    CHECK(Start(r, pdlib::Mode::kDecode, NextPort(), s, s.checksum).code() ==
          StatusCode::kInvalidArgument);
    s.backend = "fake";
    s.corrupt = "byte:2";
    CHECK(!Start(r, pdlib::Mode::kDecode, NextPort(), s, pdlib::KvChecksum::kAll).ok());
  }
}

TEST_CASE("kv integrity over ucx (shared memory): no false alarm, push and pull") {
  if (!HaveUcx()) {
    WARN("skipped: this build has no ucx backend");
    return;
  }
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  Setup s;
  s.backend = "ucx";
  s.direction = dir;
  s.families = true;
  Pair pair(s, 2);
  for (uint64_t room = 600; room < 604; ++room) {
    auto out = pair.Run(room, {1, 2, 3}, {7, 12, 4});
    INFO(out.reason);
    CHECK(out.decode == KVPoll::kSuccess);
  }
  CHECK(pair.decode.manager->metrics().checksum_mismatches == 0);
  // The am path (memory UCX did not allocate) digested every cell as it copied it: no second
  // pass over the pages.
  CHECK(pair.decode.manager->metrics().rooms_checksummed_in_flight == 4);
  // Push: prefill's KV digest came from the transport's sends (each piece before its send).
  for (auto& p : pair.prefill) {
    CHECK(p.manager->metrics().rooms_checksummed_in_flight ==
          (dir == pdlib::TransferDirection::kPush ? 4u : 0u));
  }
}

TEST_CASE("kv integrity over ucx: corruption through the real transport is caught, each time") {
  if (!HaveUcx()) {
    WARN("skipped: this build has no ucx backend");
    return;
  }
  auto dir = GENERATE(pdlib::TransferDirection::kPush, pdlib::TransferDirection::kPull);
  INFO((dir == pdlib::TransferDirection::kPull ? "pull" : "push"));
  Setup s;
  s.backend = "ucx";
  s.direction = dir;
  s.families = true;
  s.inject = 0.3;
  Pair pair(s, 2);
  auto injected = [&] {
    uint64_t n = pair.decode.manager->metrics().corruptions_injected;
    for (auto& p : pair.prefill) n += p.manager->metrics().corruptions_injected;
    return n;
  };
  int hit = 0;
  for (uint64_t room = 700; room < 716; ++room) {
    const uint64_t before = injected();
    auto out = pair.Run(room, {1, 2, 3}, {7, 12, 4});
    const bool corrupted = injected() > before;
    hit += corrupted ? 1 : 0;
    INFO("room " << room << ": " << out.reason);
    CHECK((out.decode == KVPoll::kFailed) == corrupted);
    if (corrupted) CHECK(out.reason.find("KV checksum mismatch") != std::string::npos);
  }
  CHECK(hit > 0);
  CHECK(pair.decode.manager->metrics().checksum_mismatches == static_cast<uint64_t>(hit));
  // The clean rooms' cells were all digested by the am path's copies; a corrupted op lands one
  // byte off, so its cells do not get exactly their length and are read again instead.
  CHECK(pair.decode.manager->metrics().rooms_checksummed_in_flight >=
        static_cast<uint64_t>(16 - hit));
}
