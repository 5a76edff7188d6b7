// The page-reuse rule (include/pdlib/kv_manager.h, "Page reuse"; issue #13): a failed request's
// pages stay out of use until no write for it can land. The tests run a "held" backend whose
// write batches complete only when the test releases them, so a write is "in flight" for as long
// as a test wants, through both control planes.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>

#include "pdlib/pdlib.h"
#include "pdlib/spi/transport.h"

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::Status;
namespace spi = pdlib::spi;

namespace {

// Batches of every "held" transport wait here until Release().
struct HeldBatches {
  std::mutex mu;
  std::deque<spi::WriteCallback> waiting;
  size_t size() {
    std::lock_guard lock(mu);
    return waiting.size();
  }
  void Release() {
    std::deque<spi::WriteCallback> go;
    {
      std::lock_guard lock(mu);
      go.swap(waiting);
    }
    for (auto& done : go) done(Status::OK());
  }
};
HeldBatches& Held() {
  static auto* held = new HeldBatches();
  return *held;
}

// Moves no bytes; accepts everything; completes a batch when the test releases it (or with
// kCancelled when the transport is destroyed or the peer disconnected, as the SPI says).
class HeldTransport final : public spi::Transport {
 public:
  ~HeldTransport() override {
    std::deque<spi::WriteCallback> mine;
    {
      std::lock_guard lock(Held().mu);
      mine.swap(Held().waiting);  // tests run one deployment at a time
    }
    for (auto& done : mine) done(Status::Cancelled("held transport destroyed"));
  }
  std::string_view name() const override { return "held"; }
  spi::TransportCapabilities capabilities() const override {
    spi::TransportCapabilities caps;
    caps.moves_bytes = false;
    return caps;
  }
  pdlib::StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion&,
                                                     spi::Blob* key) override {
    if (key) *key = {1};
    return next_++;
  }
  Status DeregisterMemory(spi::LocalRegionId) override { return Status::OK(); }
  pdlib::StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override {
    return spi::TargetEndpoint{next_++, {2}};
  }
  void CloseTargetEndpoint(spi::TargetId) override {}
  pdlib::StatusOr<spi::Connection> Connect(const spi::Blob&) override {
    return spi::Connection{next_++, {}};
  }
  pdlib::StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId,
                                                          const spi::RemoteRegion&) override {
    return static_cast<spi::RemoteRegionId>(next_++);
  }
  Status PostWrites(spi::PeerId, std::span<const spi::WriteOp>, spi::WriteCallback done) override {
    std::lock_guard lock(Held().mu);
    Held().waiting.push_back(std::move(done));
    return Status::OK();
  }
  void Disconnect(spi::PeerId) override {}

 private:
  std::atomic<uint32_t> next_{1};
};

void RegisterHeld() {
  static const bool once = [] {
    return spi::RegisterTransport("held",
                                  [](const spi::TransportOptions&) {
                                    return pdlib::StatusOr<std::unique_ptr<spi::Transport>>(
                                        std::make_unique<HeldTransport>());
                                  })
        .ok();
  }();
  REQUIRE(once);
}

pdlib::ControlPlane g_plane = pdlib::ControlPlane::kInProcess;
std::atomic<uint16_t> g_next_local{31000};

uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

#define FOR_EACH_CONTROL_PLANE()                                                   \
  g_plane = GENERATE(pdlib::ControlPlane::kInProcess, pdlib::ControlPlane::kGrpc); \
  INFO("control plane " << (g_plane == pdlib::ControlPlane::kGrpc ? "grpc" : "in-process"))

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

struct Deployment {
  std::vector<uint8_t> pk, dk;
  std::unique_ptr<pdlib::MetadataBuffers> paux, daux;
  uint16_t bootstrap;
  std::unique_ptr<pdlib::KVManager> prefill, decode;

  // `tune` adjusts both managers' options (the room clocks' tests).
  std::function<void(pdlib::KVManagerOptions&)> tune;

  explicit Deployment(std::function<void(pdlib::KVManagerOptions&)> t = {}) : tune(std::move(t)) {
    RegisterHeld();
    Held().Release();
    bootstrap = g_plane == pdlib::ControlPlane::kGrpc ? FreePort() : g_next_local++;
    prefill = Make(pdlib::Mode::kPrefill, pk, paux);
    decode = Make(pdlib::Mode::kDecode, dk, daux);
  }
  std::unique_ptr<pdlib::KVManager> Make(pdlib::Mode mode, std::vector<uint8_t>& pool,
                                         std::unique_ptr<pdlib::MetadataBuffers>& aux) {
    pool.assign(64 * 256, 0);
    aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));
    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.backend = "held";
    o.control_plane = g_plane;
    o.start_bootstrap_server = mode == pdlib::Mode::kPrefill;
    o.liveness_timeout = 1000ms;
    o.connect_timeout = 2000ms;
    o.bootstrap_port = bootstrap;
    o.args.kv = {{reinterpret_cast<uint64_t>(pool.data())}, {pool.size()}, {256}};
    o.args.aux = aux->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {1, 8, 128, 2, 1, "page-reuse"};
    if (tune) tune(o);
    auto m = pdlib::KVManager::Create(o);
    REQUIRE(m.ok());
    return std::move(*m);
  }
  pdlib::BootstrapAddress addr() const { return {"127.0.0.1", bootstrap}; }
};

// A request whose first batch of KV writes is posted and held by the transport.
struct InFlight {
  std::unique_ptr<pdlib::KVSender> sender;
  std::unique_ptr<pdlib::KVReceiver> receiver;
};

InFlight StartHeld(Deployment& dep, uint64_t room) {
  InFlight r;
  auto s = dep.prefill->CreateSender(room);
  REQUIRE(s.ok());
  r.sender = std::move(*s);
  auto d = dep.decode->CreateReceiver(dep.addr(), room);
  REQUIRE(d.ok());
  r.receiver = std::move(*d);
  const std::vector<int32_t> pages = {3, 4, 5};
  REQUIRE(WaitFor([&] { return r.receiver->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE(r.receiver->Init(pages, 1).ok());
  REQUIRE(WaitFor([&] { return r.sender->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE(r.sender->Init(pages.size(), 1).ok());
  const size_t before = Held().size();
  REQUIRE(r.sender->Send(pages, true).ok());
  REQUIRE(WaitFor([&] { return Held().size() > before; }));
  return r;
}

}  // namespace

TEST_CASE("page reuse: a failed request's pages stay quarantined until prefill drains") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  InFlight r = StartHeld(dep, 501);
  r.receiver->Abort("the engine gave up");
  REQUIRE(r.receiver->Poll() == KVPoll::kFailed);
  // Prefill hears of the abort, but its KV batch is still in flight: nobody may reuse pages.
  REQUIRE(WaitFor([&] { return r.sender->Poll() == KVPoll::kFailed; }));
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(r.receiver->PagesReusable());
  CHECK_FALSE(r.sender->PagesReusable());
  auto dm = dep.decode->metrics();
  CHECK(dm.quarantined_rooms == 1);
  CHECK(dm.quarantined_pages == 4);  // 3 KV pages and the metadata slot
  CHECK(dm.quarantine_oldest_ms >= 300);
  CHECK(dep.prefill->metrics().quarantined_rooms == 1);
  const std::string text = pdlib::RenderPrometheus(dm);
  CHECK(text.find("pdlib_quarantined_pages 4\n") != std::string::npos);

  Held().Release();  // the write completes: prefill reports the room drained
  REQUIRE(WaitFor([&] { return r.receiver->PagesReusable(); }));
  CHECK(r.sender->PagesReusable());
  dm = dep.decode->metrics();
  CHECK(dm.quarantined_rooms == 0);
  CHECK(dm.quarantined_pages == 0);
  CHECK(dm.quarantine_released_drained == 1);
  CHECK(dm.quarantine_max_hold_ms >= 300);
  CHECK(dep.prefill->metrics().quarantined_rooms == 0);
}

TEST_CASE("page reuse: Success is reusable the moment it is seen") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  InFlight r = StartHeld(dep, 502);
  CHECK_FALSE(r.sender->PagesReusable());  // its writes are in flight
  Held().Release();                        // the KV batch...
  REQUIRE(WaitFor([&] { return Held().size() > 0 || r.sender->Poll() == KVPoll::kSuccess; }));
  Held().Release();  // ...then the aux batch
  bool saw_success = false, reusable_at_success = true;
  REQUIRE(WaitFor([&] {
    for (pdlib::KVPollable* h : {static_cast<pdlib::KVPollable*>(r.sender.get()),
                                 static_cast<pdlib::KVPollable*>(r.receiver.get())}) {
      if (h->Poll() == KVPoll::kSuccess) {
        saw_success = true;
        reusable_at_success &= h->PagesReusable();
      }
    }
    return r.sender->Poll() == KVPoll::kSuccess && r.receiver->Poll() == KVPoll::kSuccess;
  }));
  CHECK(saw_success);
  CHECK(reusable_at_success);
  CHECK(dep.decode->metrics().quarantined_rooms == 0);
}

TEST_CASE("page reuse: a failure before the pages went out needs no quarantine") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  auto d = dep.decode->CreateReceiver(dep.addr(), 503);
  REQUIRE(d.ok());
  REQUIRE(WaitFor([&] { return (*d)->Poll() == KVPoll::kWaitingForInput; }));
  (*d)->Abort("before Init");
  CHECK((*d)->PagesReusable());
  CHECK(dep.decode->metrics().quarantined_rooms == 0);
}

TEST_CASE("page reuse: destroyed handles come out of TakeReusableRooms once drained") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  InFlight r = StartHeld(dep, 504);
  r.receiver.reset();  // destroying a live receiver fails (aborts) the request
  REQUIRE(WaitFor([&] { return r.sender->Poll() == KVPoll::kFailed; }));
  r.sender.reset();
  std::this_thread::sleep_for(200ms);
  CHECK(dep.decode->TakeReusableRooms().empty());
  CHECK(dep.prefill->TakeReusableRooms().empty());
  CHECK(dep.decode->metrics().quarantined_rooms == 1);
  Held().Release();
  std::vector<uint64_t> d, p;
  REQUIRE(WaitFor([&] {
    for (uint64_t x : dep.decode->TakeReusableRooms()) d.push_back(x);
    for (uint64_t x : dep.prefill->TakeReusableRooms()) p.push_back(x);
    return !d.empty() && !p.empty();
  }));
  std::this_thread::sleep_for(100ms);
  for (uint64_t x : dep.decode->TakeReusableRooms()) d.push_back(x);
  CHECK(d == std::vector<uint64_t>{504});  // once
  CHECK(p == std::vector<uint64_t>{504});
}

// An engine that destroys a failed receiver the moment it sees Failed, before pdlib has marked
// its pages reusable (a failure before the pages went out: no quarantine), must still get the
// room from TakeReusableRooms. The reaper fails the rooms (bootstrap timeout) while this thread
// polls and drops them, so the drop lands anywhere in FailRoom.
TEST_CASE("page reuse: a receiver dropped as it fails still comes out of TakeReusableRooms") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  pdlib::KVManagerOptions o;
  std::vector<uint8_t> pool(64 * 256);
  auto aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));
  o.mode = pdlib::Mode::kDecode;
  o.backend = "held";
  o.control_plane = g_plane;
  o.bootstrap_timeout = 50ms;
  o.connect_timeout = 50ms;
  o.args.kv = {{reinterpret_cast<uint64_t>(pool.data())}, {pool.size()}, {256}};
  o.args.aux = aux->Describe();
  o.args.page_size = 16;
  o.args.fingerprint = {1, 8, 128, 2, 1, "page-reuse"};
  auto decode = pdlib::KVManager::Create(o);
  REQUIRE(decode.ok());
  // Nothing bootstraps there: every room fails in Bootstrapping, its pages never out.
  const pdlib::BootstrapAddress nowhere{
      "127.0.0.1", g_plane == pdlib::ControlPlane::kGrpc ? FreePort() : uint16_t(g_next_local++)};
  constexpr uint64_t kRooms = 300;
  std::vector<std::unique_ptr<pdlib::KVReceiver>> live;
  for (uint64_t room = 1; room <= kRooms; ++room) {
    auto r = (*decode)->CreateReceiver(nowhere, 9000 + room);
    REQUIRE(r.ok());
    live.push_back(std::move(*r));
  }
  std::set<uint64_t> dropped_unreusable, taken;
  size_t reusable_when_seen = 0;
  const auto end = std::chrono::steady_clock::now() + 20s;
  while (!live.empty() && std::chrono::steady_clock::now() < end) {
    for (size_t i = 0; i < live.size();) {
      if (live[i]->Poll() != KVPoll::kFailed) {
        ++i;
        continue;
      }
      if (live[i]->PagesReusable()) {
        ++reusable_when_seen;
      } else {
        dropped_unreusable.insert(live[i]->room());
      }
      live.erase(live.begin() + std::ptrdiff_t(i));  // destroyed at once
    }
  }
  REQUIRE(live.empty());
  REQUIRE(WaitFor([&] {
    for (uint64_t x : (*decode)->TakeReusableRooms()) taken.insert(x);
    return std::includes(taken.begin(), taken.end(), dropped_unreusable.begin(),
                         dropped_unreusable.end());
  }));
  INFO(dropped_unreusable.size() << " rooms dropped before their pages were reusable, "
                                 << reusable_when_seen << " reusable when seen");
  CHECK(taken.size() == kRooms);  // every failed room, exactly the destroyed ones
  CHECK((*decode)->metrics().quarantined_rooms == 0);
}

TEST_CASE("page reuse: a prefill manager that is gone ends the quarantine") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep;
  InFlight r = StartHeld(dep, 505);
  r.receiver->Abort("the engine gave up");
  REQUIRE(WaitFor([&] { return r.sender->Poll() == KVPoll::kFailed; }));
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(r.receiver->PagesReusable());
  // The prefill manager shuts down with its write still in flight (its transport cancels it):
  // nothing of it can write any more. gRPC: decode finds nothing listening at its address.
  r.sender.reset();
  dep.prefill.reset();
  REQUIRE(WaitFor([&] { return r.receiver->PagesReusable(); }));
  auto dm = dep.decode->metrics();
  CHECK(dm.quarantined_rooms == 0);
  CHECK(dm.quarantine_released_gone == 1);
}

// A sender and a receiver of `room`, decode Init()ed with `pages`, prefill waiting for input.
static std::pair<std::unique_ptr<pdlib::KVSender>, std::unique_ptr<pdlib::KVReceiver>> Paired(
    Deployment& dep, uint64_t room, const std::vector<int32_t>& pages) {
  auto s = dep.prefill->CreateSender(room);
  auto d = dep.decode->CreateReceiver(dep.addr(), room);
  REQUIRE((s.ok() && d.ok()));
  REQUIRE(WaitFor([&] { return (*d)->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE((*d)->Init(pages, 1).ok());
  REQUIRE(WaitFor([&] { return (*s)->Poll() == KVPoll::kWaitingForInput; }));
  return {std::move(*s), std::move(*d)};
}

// The room clocks (kv_args.h): waiting for the transfer to start is not a transfer, and a
// transfer's deadline is about progress, not the room's age.

TEST_CASE("room clocks: a stuck transfer fails by its progress deadline") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep([](pdlib::KVManagerOptions& o) {
    o.transfer_timeout = 300ms;
    o.waiting_timeout = 20000ms;
  });
  InFlight r = StartHeld(dep, 601);  // its KV batch is held: no progress after the Send
  REQUIRE(WaitFor([&] { return r.sender->Poll() == KVPoll::kFailed; }));
  CHECK(r.sender->FailureReason().ToString() ==
        "DEADLINE_EXCEEDED: room 601: no transfer progress for 300 ms in state Transferring "
        "(transfer_timeout)");
  // Decode (push: it sees no bytes move, so its own clock is the 20 s wait) hears it at once.
  REQUIRE(WaitFor([&] { return r.receiver->Poll() == KVPoll::kFailed; }, 3000ms));
  CHECK(std::string(r.receiver->FailureReason().message()).find("no transfer progress") !=
        std::string::npos);
  Held().Release();
}

TEST_CASE("room clocks: a transfer that keeps progressing outlives transfer_timeout") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep([](pdlib::KVManagerOptions& o) {
    o.transfer_timeout = 300ms;
    o.waiting_timeout = 20000ms;
  });
  const std::vector<int32_t> pages = {1, 2, 3, 4, 5, 6};
  auto [s, d] = Paired(dep, 602, pages);
  REQUIRE(s->Init(pages.size(), 1).ok());
  const auto started = std::chrono::steady_clock::now();
  // One page a chunk, one every 150 ms, each batch completing before the next: 0.9 s in all,
  // three times transfer_timeout, never 300 ms without progress.
  for (size_t i = 0; i < pages.size(); ++i) {
    const size_t before = Held().size();
    REQUIRE(s->Send(std::span(pages).subspan(i, 1), i + 1 == pages.size()).ok());
    REQUIRE(WaitFor([&] { return Held().size() > before; }));
    std::this_thread::sleep_for(150ms);
    Held().Release();
  }
  REQUIRE(WaitFor([&] {
    Held().Release();  // the aux batch
    return s->Poll() == KVPoll::kSuccess && d->Poll() == KVPoll::kSuccess;
  }));
  CHECK(std::chrono::steady_clock::now() - started > 800ms);
}

TEST_CASE("room clocks: a long wait for prefill to start is not a transfer") {
  FOR_EACH_CONTROL_PLANE();
  Deployment dep([](pdlib::KVManagerOptions& o) {
    o.transfer_timeout = 200ms;
    o.waiting_timeout = 20000ms;
  });
  const std::vector<int32_t> pages = {7, 8};
  auto [s, d] = Paired(dep, 603, pages);
  REQUIRE(WaitFor([&] { return d->Poll() == KVPoll::kTransferring; }));
  // A busy prefill: decode's TransferInfo is out, prefill starts this request 1 s later (five
  // times transfer_timeout). Neither side may fail meanwhile.
  std::this_thread::sleep_for(1000ms);
  CHECK(d->Poll() == KVPoll::kTransferring);
  CHECK(s->Poll() == KVPoll::kWaitingForInput);
  REQUIRE(s->Init(pages.size(), 1).ok());
  REQUIRE(s->Send(pages, true).ok());
  REQUIRE(WaitFor([&] {
    Held().Release();
    return s->Poll() == KVPoll::kSuccess && d->Poll() == KVPoll::kSuccess;
  }));
}
