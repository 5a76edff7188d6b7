// A transport connection that fails while the control stream stays up (a QP in the error state, a
// UCX endpoint whose rail died, a cuda_ipc target gone): the transport never recovers that peer
// (spi::Transport::PeerStatus), so the side that initiates replaces it. Push: prefill closes the
// session's stream and decode registers again for its next request; pull: decode drops its
// connection and connects again. Before, every later request to that decode rank failed with
// the old reason. The tests run an in-process "breakable" backend that copies bytes (the test
// compares them) and whose connections the test breaks, over both control planes.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/kv_manager.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/spi/transport.h"

namespace {

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::Status;
using pdlib::StatusOr;
using pdlib::TransferDirection;
namespace spi = pdlib::spi;

// What every "breakable" transport of the process shares: the connections made so far and the
// ones the test broke.
struct Wire {
  std::mutex mu;
  std::map<spi::PeerId, bool> broken;  // every peer ever connected: broken or not
  std::atomic<int> connects{0};
  std::atomic<spi::PeerId> next_peer{1};
  // Breaks every connected peer: its posts are refused, PeerStatus reports it.
  void BreakAll() {
    std::lock_guard lock(mu);
    for (auto& [peer, b] : broken) b = true;
  }
};
Wire& TheWire() {
  static auto* wire = new Wire();
  return *wire;
}

// Registers memory by address; a remote region is the peer's address; a batch is copied by a
// progress thread (callbacks never run inside PostWrites).
class BreakableTransport final : public spi::Transport {
 public:
  BreakableTransport() : progress_([this] { Run(); }) {}
  ~BreakableTransport() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    progress_.join();
  }
  std::string_view name() const override { return "breakable"; }
  spi::TransportCapabilities capabilities() const override {
    spi::TransportCapabilities caps;
    caps.reads = true;
    return caps;
  }
  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              spi::Blob* key) override {
    std::lock_guard lock(mu_);
    local_.push_back(reinterpret_cast<uint64_t>(region.addr));
    if (key != nullptr) *key = {7};
    return static_cast<spi::LocalRegionId>(local_.size() - 1);
  }
  Status DeregisterMemory(spi::LocalRegionId) override { return Status::OK(); }
  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override {
    return spi::TargetEndpoint{next_target_++, {1}};
  }
  void CloseTargetEndpoint(spi::TargetId) override {}
  StatusOr<spi::Connection> Connect(const spi::Blob&) override {
    Wire& w = TheWire();
    const spi::PeerId peer = w.next_peer++;
    {
      std::lock_guard lock(w.mu);
      w.broken[peer] = false;
    }
    ++w.connects;
    return spi::Connection{peer, {}};
  }
  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override {
    if (Status s = PeerStatus(peer); !s.ok()) return s;
    std::lock_guard lock(mu_);
    remote_.push_back(region.addr);
    return static_cast<spi::RemoteRegionId>(remote_.size() - 1);
  }
  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override {
    return Post(peer, ops, std::move(done), false);
  }
  Status PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                   spi::ReadCallback done) override {
    return Post(peer, ops, std::move(done), true);
  }
  Status PeerStatus(spi::PeerId peer) override {
    Wire& w = TheWire();
    std::lock_guard lock(w.mu);
    auto it = w.broken.find(peer);
    if (it == w.broken.end()) return Status::NotFound("breakable: unknown peer");
    if (it->second) {
      return Status::Unavailable("breakable: peer " + std::to_string(peer) +
                                 " was broken by the test");
    }
    return Status::OK();
  }
  void Disconnect(spi::PeerId peer) override {
    Wire& w = TheWire();
    std::lock_guard lock(w.mu);
    w.broken.erase(peer);
  }

 private:
  Status Post(spi::PeerId peer, std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              bool reads) {
    if (Status s = PeerStatus(peer); !s.ok()) return s;
    std::function<void()> copy;
    {
      std::lock_guard lock(mu_);
      std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> moves;  // to, from, length
      for (const spi::WriteOp& op : ops) {
        const uint64_t mine = local_.at(op.local_region) + op.local_offset;
        const uint64_t theirs = remote_.at(op.remote_region) + op.remote_offset;
        moves.emplace_back(reads ? mine : theirs, reads ? theirs : mine, op.length);
      }
      queue_.push_back([moves = std::move(moves), done = std::move(done)] {
        for (auto [to, from, length] : moves) {
          std::memcpy(reinterpret_cast<void*>(to), reinterpret_cast<const void*>(from), length);
        }
        done(Status::OK());
      });
    }
    cv_.notify_all();
    return Status::OK();
  }
  void Run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      auto work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<std::function<void()>> queue_;
  std::vector<uint64_t> local_, remote_;
  std::atomic<spi::TargetId> next_target_{1};
  std::thread progress_;
};

void RegisterBreakable() {
  static const bool once =
      spi::RegisterTransport("breakable", [](const spi::TransportOptions&) {
        return StatusOr<std::unique_ptr<spi::Transport>>(std::make_unique<BreakableTransport>());
      }).ok();
  REQUIRE(once);
}

pdlib::ControlPlane g_plane = pdlib::ControlPlane::kInProcess;

uint16_t NextPort() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(37000 + (::getpid() % 500) * 8)};
  return next++;
}

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit = 10000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

constexpr uint32_t kPageTokens = 4;
constexpr uint64_t kPageBytes = 64;
constexpr uint64_t kPoolPages = 16;

struct Rank {
  std::vector<uint8_t> kv;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;
};

void Start(Rank& r, pdlib::Mode mode, uint16_t bootstrap, TransferDirection direction) {
  RegisterBreakable();
  r.kv.assign(kPageBytes * kPoolPages, 0);
  r.aux = std::move(*pdlib::MetadataBuffers::Create(4, 0, 0));
  pdlib::KVManagerOptions o;
  o.mode = mode;
  o.backend = "breakable";
  o.direction = direction;
  o.control_plane = g_plane;
  o.start_bootstrap_server = mode == pdlib::Mode::kPrefill;
  o.bootstrap_port = bootstrap;
  o.liveness_timeout = 2000ms;
  o.connect_timeout = 5000ms;
  o.args.kv = {{reinterpret_cast<uint64_t>(r.kv.data())}, {r.kv.size()}, {kPageBytes}};
  o.args.aux = r.aux->Describe();
  o.args.page_size = kPageTokens;
  o.args.fingerprint = {1, 1, 16, 1, 1, "peer-failure-test"};
  auto m = pdlib::KVManager::Create(o);
  REQUIRE(m.ok());
  r.manager = std::move(*m);
}

// One request from prefill pages `src` into decode pages `dst`; every byte of prefill's pool is
// stamped with `stamp` first. Returns the two sides' outcomes (decode's reason when it failed).
struct Outcome {
  KVPoll prefill = KVPoll::kFailed, decode = KVPoll::kFailed;
  Status decode_reason;
};
Outcome Request(Rank& p, Rank& d, uint16_t port, uint64_t room, uint8_t stamp,
                const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                const std::function<void()>& before_send = {}) {
  for (size_t i = 0; i < p.kv.size(); ++i) p.kv[i] = static_cast<uint8_t>(stamp + i * 7);
  auto s = p.manager->CreateSender(room);
  auto r = d.manager->CreateReceiver({"127.0.0.1", port}, room);
  REQUIRE((s.ok() && r.ok()));
  REQUIRE(WaitFor(
      [&] { return (*r)->Poll() == KVPoll::kWaitingForInput || (*r)->Poll() == KVPoll::kFailed; }));
  Outcome out;
  if ((*r)->Poll() == KVPoll::kWaitingForInput) {
    pdlib::ReceiveRequest req;
    req.kv_page_indices = dst;
    req.aux_index = 1;
    REQUIRE((*r)->Init(req).ok());
    REQUIRE(WaitFor([&] {
      return (*s)->Poll() == KVPoll::kWaitingForInput || (*s)->Poll() == KVPoll::kFailed;
    }));
    if ((*s)->Poll() == KVPoll::kWaitingForInput) {
      p.aux->bootstrap_room(1)[0] = room;  // what decode checks in its metadata slot
      REQUIRE((*s)->Init(src.size(), 1).ok());
      if (before_send) before_send();
      (void)(*s)->Send(src, true);
    }
  }
  REQUIRE(
      WaitFor([&] { return pdlib::IsTerminal((*s)->Poll()) && pdlib::IsTerminal((*r)->Poll()); }));
  out.prefill = (*s)->Poll();
  out.decode = (*r)->Poll();
  out.decode_reason = (*r)->FailureReason();
  if (out.decode == KVPoll::kSuccess) {
    for (size_t i = 0; i < src.size(); ++i) {
      INFO("page " << i);
      CHECK(std::memcmp(d.kv.data() + dst[i] * kPageBytes, p.kv.data() + src[i] * kPageBytes,
                        kPageBytes) == 0);
    }
  }
  // Both handles gone before the next request (a failed room's pages wait for its drain).
  s->reset();
  r->reset();
  return out;
}

}  // namespace

TEST_CASE("peer failure: a failed transport connection is replaced and the next request works") {
  g_plane = GENERATE(pdlib::ControlPlane::kInProcess, pdlib::ControlPlane::kGrpc);
  const TransferDirection direction = GENERATE(TransferDirection::kPush, TransferDirection::kPull);
  INFO("control plane " << (g_plane == pdlib::ControlPlane::kGrpc ? "grpc" : "in-process") << ", "
                        << (direction == TransferDirection::kPush ? "push" : "pull"));
  const uint16_t port = NextPort();
  Rank p, d;
  Start(p, pdlib::Mode::kPrefill, port, direction);
  Start(d, pdlib::Mode::kDecode, port, direction);
  const int connects_before = TheWire().connects;

  Outcome first = Request(p, d, port, 1, 11, {2, 5, 7}, {9, 3, 12});
  REQUIRE(first.decode == KVPoll::kSuccess);
  CHECK(first.prefill == KVPoll::kSuccess);
  CHECK(TheWire().connects == connects_before + 1);
  CHECK(d.manager->metrics().connections == 1);

  // The connection breaks while the control stream stays up: the side that initiates notices
  // (within a reaper tick) and decode's connection goes.
  TheWire().BreakAll();
  CHECK(WaitFor([&] { return d.manager->metrics().connections == 0; }, 5000ms));

  // The next request connects again and moves every byte.
  Outcome second = Request(p, d, port, 2, 29, {1, 4}, {6, 14});
  CHECK(second.decode == KVPoll::kSuccess);
  CHECK(second.prefill == KVPoll::kSuccess);
  CHECK(TheWire().connects == connects_before + 2);
  CHECK(d.manager->metrics().connections == 1);
}

TEST_CASE("peer failure: a request on the failed connection fails naming why") {
  g_plane = GENERATE(pdlib::ControlPlane::kInProcess, pdlib::ControlPlane::kGrpc);
  INFO("control plane " << (g_plane == pdlib::ControlPlane::kGrpc ? "grpc" : "in-process"));
  const uint16_t port = NextPort();
  Rank p, d;
  Start(p, pdlib::Mode::kPrefill, port, TransferDirection::kPush);
  Start(d, pdlib::Mode::kDecode, port, TransferDirection::kPush);
  REQUIRE(Request(p, d, port, 1, 3, {0}, {1}).decode == KVPoll::kSuccess);
  // Broken right before prefill posts: the post is refused, or the stream is closed first;
  // either way decode's reason carries the transport's.
  Outcome broken = Request(p, d, port, 2, 4, {2, 3}, {4, 5}, [] { TheWire().BreakAll(); });
  CHECK(broken.decode == KVPoll::kFailed);
  CHECK(broken.prefill == KVPoll::kFailed);
  CHECK_THAT(broken.decode_reason.ToString(),
             Catch::Contains("breakable: peer") && Catch::Contains("was broken by the test"));
  // Once the connection is replaced (within a reaper tick), the next one works.
  CHECK(WaitFor([&] { return d.manager->metrics().connections == 0; }, 5000ms));
  Outcome after = Request(p, d, port, 3, 5, {6, 7}, {8, 9});
  CHECK(after.decode == KVPoll::kSuccess);
  CHECK(after.prefill == KVPoll::kSuccess);
}
