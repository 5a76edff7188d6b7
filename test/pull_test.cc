// Decode pull (issue #29, SPEC R11.4) through the public API, over both control planes: prefill
// publishes (before or after decode comes), decode reads, both succeed only once the reads are
// done; the lease and its heartbeats; refusals; a failed read's unread pages. The state machine
// runs over the fake backend here (bytes are compared over ucx and verbs by planner_e2e_test's
// pull cases and the backend conformance suite).
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/kv_manager.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/spi/transport.h"

namespace {

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::StatusCode;
using pdlib::TransferDirection;

pdlib::ControlPlane g_plane = pdlib::ControlPlane::kInProcess;
#define FOR_EACH_CONTROL_PLANE()                                                   \
  g_plane = GENERATE(pdlib::ControlPlane::kInProcess, pdlib::ControlPlane::kGrpc); \
  INFO("control plane " << (g_plane == pdlib::ControlPlane::kGrpc ? "grpc" : "in-process"))

uint16_t NextPort() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(33000 + (::getpid() % 500) * 8)};
  return next++;
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
constexpr uint64_t kPageBytes = 64;
constexpr uint64_t kPoolPages = 32;

struct Rank {
  std::vector<uint8_t> k, v;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;
};

struct StartOptions {
  TransferDirection direction = TransferDirection::kPull;
  std::chrono::milliseconds lease{30000};
  std::string backend = "fake";
};

pdlib::Status Start(Rank& r, pdlib::Mode mode, uint16_t bootstrap, const StartOptions& so = {}) {
  r.k.assign(kPageBytes * kPoolPages, 0);
  r.v.assign(kPageBytes * kPoolPages, 0);
  r.aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));
  pdlib::KVManagerOptions o;
  o.mode = mode;
  o.backend = so.backend;
  o.direction = so.direction;
  o.pull_lease = so.lease;
  o.control_plane = g_plane;
  o.start_bootstrap_server = mode == pdlib::Mode::kPrefill;
  o.bootstrap_port = bootstrap;
  o.liveness_timeout = 2000ms;
  o.connect_timeout = 5000ms;
  pdlib::KVArgs& a = o.args;
  a.kv = {{reinterpret_cast<uint64_t>(r.k.data()), reinterpret_cast<uint64_t>(r.v.data())},
          {r.k.size(), r.v.size()},
          {kPageBytes, kPageBytes}};
  a.aux = r.aux->Describe();
  a.page_size = kPageTokens;
  a.fingerprint = {1, 1, 16, 1, 1, "pull-test"};
  auto m = pdlib::KVManager::Create(o);
  if (!m.ok()) return m.status();
  r.manager = std::move(*m);
  return pdlib::Status::OK();
}

pdlib::Status InitReceiver(pdlib::KVReceiver& r, const std::vector<int32_t>& pages,
                           uint64_t prefix_pages = 0) {
  pdlib::ReceiveRequest req;
  req.kv_page_indices = pages;
  req.aux_index = 2;
  req.decode_prefix_len = prefix_pages * kPageTokens;
  return r.Init(req);
}

TEST_CASE("pull: prefill publishes before decode comes, both succeed once decode has read") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto s = p.manager->CreateSender(5);
  REQUIRE(s.ok());
  // Pull: Send() needs no TransferInfo; prefill publishes every page of the prompt.
  REQUIRE((*s)->Init(3, 1).ok());
  const std::vector<int32_t> src = {4, 9, 2};
  REQUIRE((*s)->Send(std::span(src).first(2), false).ok());
  REQUIRE((*s)->Send(std::span(src).subspan(2), true).ok());
  CHECK((*s)->Poll() == KVPoll::kTransferring);
  std::this_thread::sleep_for(100ms);
  // Held for decode: not done, not reusable.
  CHECK((*s)->Poll() == KVPoll::kTransferring);
  CHECK(!(*s)->PagesReusable());
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 5);
  REQUIRE(r.ok());
  const std::vector<int32_t> dst = {30, 29, 28};
  REQUIRE(InitReceiver(**r, dst).ok());
  REQUIRE(WaitFor(
      [&] { return (*s)->Poll() == KVPoll::kSuccess && (*r)->Poll() == KVPoll::kSuccess; }));
  CHECK((*s)->PagesReusable());
  CHECK((*r)->PagesReusable());
  CHECK((*r)->InvalidPages().empty());
  CHECK((*s)->decode_prefix_len() == uint64_t{0});
  // Decode counts what it read (prefill moved nothing itself).
  CHECK(d.manager->metrics().bytes_transferred >= 3 * 2 * kPageBytes);
  CHECK(p.manager->metrics().rooms_succeeded == 1);
}

TEST_CASE("pull: decode first, then prefill publishes, a prefix is skipped by the reader") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto s = p.manager->CreateSender(6);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 6);
  REQUIRE((s.ok() && r.ok()));
  const std::vector<int32_t> dst = {20, 21};  // the prompt's pages 1 and 2; decode holds page 0
  REQUIRE(InitReceiver(**r, dst, 1).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  CHECK((*s)->decode_prefix_len() == uint64_t{4});
  // In pull the engine publishes the whole prompt: PagesAfterPrefix counts every page.
  auto n = (*s)->PagesAfterPrefix(12);
  REQUIRE(n.ok());
  CHECK(*n == 3);
  const std::vector<int32_t> src = {1, 2, 3};
  // More pages than the prompt's three are refused, and change nothing.
  const std::vector<int32_t> four = {1, 2, 3, 4};
  CHECK((*s)->Send(four, true).code() == StatusCode::kOutOfRange);
  REQUIRE((*s)->Send(src, true).ok());
  REQUIRE(WaitFor(
      [&] { return (*s)->Poll() == KVPoll::kSuccess && (*r)->Poll() == KVPoll::kSuccess; }));
  CHECK(d.manager->metrics().bytes_transferred >= 2 * 2 * kPageBytes);
  CHECK(d.manager->metrics().bytes_transferred < 3 * 2 * kPageBytes);
}

TEST_CASE("pull: a lease that expires without decode fails the room and frees the pages") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, {TransferDirection::kPull, 1000ms}).ok());
  auto s = p.manager->CreateSender(7);
  REQUIRE(s.ok());
  const std::vector<int32_t> src = {1, 2};
  REQUIRE((*s)->Send(src, true).ok());
  CHECK(!(*s)->PagesReusable());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kFailed; }, 5000ms));
  const std::string why = (*s)->FailureReason().ToString();
  INFO(why);
  CHECK(why.find("DEADLINE_EXCEEDED") != std::string::npos);
  CHECK(why.find("pull lease of 1000 ms expired (no decode rank came to read the pages)") !=
        std::string::npos);
  CHECK(WaitFor([&] { return (*s)->PagesReusable(); }, 2000ms));
  // A sender nobody touches (no publication, no decode) runs out of lease too: a pull room has
  // no other timeout on prefill, and nothing hangs.
  auto idle = p.manager->CreateSender(17);
  REQUIRE(idle.ok());
  REQUIRE(WaitFor([&] { return (*idle)->Poll() == KVPoll::kFailed; }, 5000ms));
  CHECK((*idle)->FailureReason().ToString().find(
            "(the engine published nothing and no decode rank came)") != std::string::npos);
  // A decode that comes too late fails with prefill's reason.
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 7);
  REQUIRE(r.ok());
  const std::vector<int32_t> dst = {3, 4};
  (void)InitReceiver(**r, dst);
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  CHECK((*r)->FailureReason().ToString().find("pull lease") != std::string::npos);
  CHECK(WaitFor([&] { return (*r)->PagesReusable(); }));
}

TEST_CASE("pull: heartbeats keep a room whose decode waits for memory alive past the lease") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, {TransferDirection::kPull, 1000ms}).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto s = p.manager->CreateSender(8);
  REQUIRE(s.ok());
  const std::vector<int32_t> src = {1, 2};
  REQUIRE((*s)->Send(src, true).ok());
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 8);
  REQUIRE(r.ok());
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kWaitingForInput; }));
  // Decode has no memory yet (no Init) for 2.5 leases: its heartbeats hold the pages.
  std::this_thread::sleep_for(2500ms);
  CHECK((*s)->Poll() == KVPoll::kTransferring);
  const std::vector<int32_t> dst = {5, 6};
  REQUIRE(InitReceiver(**r, dst).ok());
  REQUIRE(WaitFor(
      [&] { return (*s)->Poll() == KVPoll::kSuccess && (*r)->Poll() == KVPoll::kSuccess; }));
  // Negative control: without a receiver there is no heartbeat, and the lease runs out.
  auto s2 = p.manager->CreateSender(9);
  REQUIRE(s2.ok());
  REQUIRE((*s2)->Send(src, true).ok());
  CHECK(WaitFor([&] { return (*s2)->Poll() == KVPoll::kFailed; }, 5000ms));
}

TEST_CASE("pull: both sides must agree on the direction") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, {TransferDirection::kPull}).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port, {TransferDirection::kPush}).ok());
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 10);
  REQUIRE(r.ok());
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  const std::string why = (*r)->FailureReason().ToString();
  INFO(why);
  CHECK(why.find("direction mismatch: decode uses push, prefill uses pull") != std::string::npos);
}

// An out-of-tree backend that writes but cannot read (the fake, with reads switched off).
class NoReads final : public pdlib::spi::Transport {
 public:
  explicit NoReads(std::unique_ptr<pdlib::spi::Transport> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return "noreads"; }
  pdlib::spi::TransportCapabilities capabilities() const override {
    auto c = inner_->capabilities();
    c.reads = false;
    return c;
  }
  pdlib::StatusOr<pdlib::spi::LocalRegionId> RegisterMemory(const pdlib::spi::MemoryRegion& r,
                                                            pdlib::spi::Blob* key) override {
    return inner_->RegisterMemory(r, key);
  }
  pdlib::Status DeregisterMemory(pdlib::spi::LocalRegionId r) override {
    return inner_->DeregisterMemory(r);
  }
  pdlib::StatusOr<pdlib::spi::TargetEndpoint> CreateTargetEndpoint() override {
    return inner_->CreateTargetEndpoint();
  }
  void CloseTargetEndpoint(pdlib::spi::TargetId t) override { inner_->CloseTargetEndpoint(t); }
  pdlib::StatusOr<pdlib::spi::Connection> Connect(const pdlib::spi::Blob& b) override {
    return inner_->Connect(b);
  }
  pdlib::StatusOr<pdlib::spi::RemoteRegionId> ImportRemoteRegion(
      pdlib::spi::PeerId peer, const pdlib::spi::RemoteRegion& r) override {
    return inner_->ImportRemoteRegion(peer, r);
  }
  pdlib::Status PostWrites(pdlib::spi::PeerId peer, std::span<const pdlib::spi::WriteOp> ops,
                           pdlib::spi::WriteCallback done) override {
    return inner_->PostWrites(peer, ops, std::move(done));
  }
  void Disconnect(pdlib::spi::PeerId peer) override { inner_->Disconnect(peer); }

 private:
  std::unique_ptr<pdlib::spi::Transport> inner_;
};

TEST_CASE("pull: a backend that cannot read is refused at Create, naming it") {
  static const bool registered =
      pdlib::spi::RegisterTransport("noreads",
                                    [](const pdlib::spi::TransportOptions& o)
                                        -> pdlib::StatusOr<std::unique_ptr<pdlib::spi::Transport>> {
                                      auto inner = pdlib::spi::CreateTransport("fake", o);
                                      if (!inner.ok()) return inner.status();
                                      return std::unique_ptr<pdlib::spi::Transport>(
                                          std::make_unique<NoReads>(std::move(*inner)));
                                    })
          .ok();
  REQUIRE(registered);
  g_plane = pdlib::ControlPlane::kInProcess;
  Rank d;
  pdlib::Status st =
      Start(d, pdlib::Mode::kDecode, NextPort(), {TransferDirection::kPull, 30000ms, "noreads"});
  INFO(st.ToString());
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message().find("backend 'noreads' cannot read a peer's memory") != std::string::npos);
  // The same backend pushes fine.
  Rank d2;
  CHECK(Start(d2, pdlib::Mode::kDecode, NextPort(), {TransferDirection::kPush, 30000ms, "noreads"})
            .ok());
}

TEST_CASE("pull: a request that fails after part of it was read reports only the unread pages") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto s = p.manager->CreateSender(12);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 12);
  REQUIRE((s.ok() && r.ok()));
  const std::vector<int32_t> dst = {10, 11, 12, 13};
  REQUIRE(InitReceiver(**r, dst).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  CHECK((*r)->InvalidPages().empty());  // live: nothing to report
  const std::vector<int32_t> first = {1, 2};
  REQUIRE((*s)->Send(first, false).ok());
  // Decode has read the first chunk (its reads are counted once complete).
  REQUIRE(WaitFor([&] { return d.manager->metrics().bytes_transferred >= 2 * 2 * kPageBytes; }));
  (*s)->Abort("the engine gave up");
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  CHECK((*r)->FailureReason().ToString().find("the engine gave up") != std::string::npos);
  CHECK((*r)->InvalidPages() == std::vector<int32_t>{12, 13});
  CHECK(WaitFor([&] { return (*r)->PagesReusable() && (*s)->PagesReusable(); }));
}

TEST_CASE(
    "pull: decode's abort fails prefill, whose pages come back once decode's reads are over") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port).ok());
  auto s = p.manager->CreateSender(13);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 13);
  REQUIRE((s.ok() && r.ok()));
  const std::vector<int32_t> dst = {10, 11};
  REQUIRE(InitReceiver(**r, dst).ok());
  // Decode's TransferInfo is in (an Abort before its connection exists reaches nobody).
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  const std::vector<int32_t> first = {1};
  REQUIRE((*s)->Send(first, false).ok());
  (*r)->Abort("decode ran out of time");
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kFailed; }));
  CHECK((*s)->FailureReason().ToString().find("decode ran out of time") != std::string::npos);
  CHECK(WaitFor([&] { return (*s)->PagesReusable() && (*r)->PagesReusable(); }));
}

TEST_CASE("push: a failed request reports every page invalid (decode cannot tell what landed)") {
  FOR_EACH_CONTROL_PLANE();
  const uint16_t port = NextPort();
  Rank p, d;
  REQUIRE(Start(p, pdlib::Mode::kPrefill, port, {TransferDirection::kPush}).ok());
  REQUIRE(Start(d, pdlib::Mode::kDecode, port, {TransferDirection::kPush}).ok());
  auto s = p.manager->CreateSender(14);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, 14);
  REQUIRE((s.ok() && r.ok()));
  const std::vector<int32_t> dst = {10, 11};
  REQUIRE(InitReceiver(**r, dst).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  CHECK((*r)->InvalidPages().empty());
  (*s)->Abort("gave up");
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }));
  CHECK((*r)->InvalidPages() == dst);
}

}  // namespace
