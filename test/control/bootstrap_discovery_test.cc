// Discovery through the bootstrap server (lib/control/discovery.cc): the prefill rank's
// publisher keeps its registration on a server that forgot it. A bootstrap server holds
// registrations in memory only, so one restarted on the same port starts empty; the publisher
// checks every liveness_timeout and registers again (issue #18, found by pdlib-chaos's
// bootstrap_restart fault: decode's lookups failed NOT_FOUND until every prefill restarted).
// And a CANCELLED the caller did not ask for (the server giving up at the deadline, under packet
// loss) is retried like a deadline, not taken as the end: it failed KVManager::Create.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "lib/control/bootstrap_client.h"
#include "lib/control/bootstrap_server.h"
#include "lib/control/discovery.h"
#include "lib/proto/pdlib.grpc.pb.h"
#include "test/control/bootstrap_test_util.h"

namespace pdlib::control {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::TestRank;

constexpr milliseconds kLiveness{1000};
// How long the publisher may take to notice: one period, the RPCs, and the client channel's
// reconnect backoff (at most 2 s), with room for sanitizer builds.
constexpr milliseconds kBound = kLiveness + milliseconds(6000);

// A server on 127.0.0.1:port (0: any), retried while the old one's port is still being let go.
std::unique_ptr<BootstrapServer> StartServer(int32_t port) {
  BootstrapServerOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  const auto deadline = Clock::now() + milliseconds(10000);
  while (true) {
    auto server = BootstrapServer::Start(o);
    if (server.ok()) return std::move(server).value();
    INFO(server.status().ToString());
    REQUIRE(Clock::now() < deadline);
    std::this_thread::sleep_for(milliseconds(50));
  }
}

KVManagerOptions PrefillOptions(int32_t port) {
  KVManagerOptions o;
  o.mode = Mode::kPrefill;
  o.bootstrap_host = "127.0.0.1";
  o.bootstrap_port = port;
  o.liveness_timeout = kLiveness;
  o.connect_timeout = milliseconds(1000);
  return o;
}

// Where the server has `reg`'s rank: "host:port", or the error's code name.
std::string Holder(int32_t port, const RankRegistration& reg) {
  BootstrapClientOptions o;
  o.rpc_timeout = milliseconds(2000);
  auto client = BootstrapClient::Create("127.0.0.1", port, o);
  REQUIRE(client.ok());
  auto held = (*client)->GetRankAddress(reg.rank_id());
  if (!held.ok()) return std::string(StatusCodeName(held.status().code()));
  return held->host + ":" + std::to_string(held->port);
}

// Waits until the server has the rank at `want` (or `bound` passes); returns what it has.
std::string WaitForHolder(int32_t port, const RankRegistration& reg, const std::string& want,
                          milliseconds bound) {
  const auto deadline = Clock::now() + bound;
  std::string holder = Holder(port, reg);
  while (holder != want && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(50));
    holder = Holder(port, reg);
  }
  return holder;
}

TEST_CASE("a bootstrap server restarted on the same port gets the rank back within a bound") {
  auto server = StartServer(0);
  const int32_t port = server->port();
  auto discovery = DiscoveryBackend::Create(PrefillOptions(port));
  REQUIRE(discovery.ok());
  const RankRegistration reg = TestRank(0, 0, 0, 1, 1, 1, 7001);
  auto publisher = (*discovery)->Publish(reg);
  REQUIRE(publisher.ok());
  CHECK(Holder(port, reg) == "127.0.0.1:7001");  // the quick first registration

  for (int restart = 0; restart < 2; ++restart) {
    INFO("restart " << restart);
    server.reset();
    server = StartServer(port);
    CHECK(server->ranks_registered() == 0);  // a new server knows nobody
    const auto restarted = Clock::now();
    CHECK(WaitForHolder(port, reg, "127.0.0.1:7001", kBound) == "127.0.0.1:7001");
    CHECK(Clock::now() - restarted <= kBound);
    CHECK(server->ranks_registered() == 1);
  }

  // Destroying the publisher withdraws the rank and stops its thread promptly.
  const auto destroying = Clock::now();
  publisher->reset();
  CHECK(Clock::now() - destroying < milliseconds(3000));
  CHECK(server->ranks_registered() == 0);
}

TEST_CASE("a publisher does not register over a successor that holds its rank") {
  auto server = StartServer(0);
  const int32_t port = server->port();
  auto discovery = DiscoveryBackend::Create(PrefillOptions(port));
  REQUIRE(discovery.ok());
  const RankRegistration old_rank = TestRank(0, 0, 0, 1, 1, 1, 7001);
  auto publisher = (*discovery)->Publish(old_rank);
  REQUIRE(publisher.ok());
  REQUIRE(Holder(port, old_rank) == "127.0.0.1:7001");

  // A successor (a restarted rank at another port) registers the same rank.
  const RankRegistration successor = TestRank(0, 0, 0, 1, 1, 1, 7002);
  BootstrapClientOptions o;
  o.rpc_timeout = milliseconds(2000);
  auto client = BootstrapClient::Create("127.0.0.1", port, o);
  REQUIRE(client.ok());
  REQUIRE((*client)->RegisterRank(successor).ok());
  // Several of the old publisher's checks later the successor still holds it.
  std::this_thread::sleep_for(kLiveness * 3);
  CHECK(Holder(port, old_rank) == "127.0.0.1:7002");

  // Once the successor withdraws, the rank is free and the live old rank takes it again.
  auto gone = (*client)->UnregisterRank(successor.rank_id(), "127.0.0.1", 7002);
  REQUIRE(gone.ok());
  CHECK(*gone);
  CHECK(WaitForHolder(port, old_rank, "127.0.0.1:7001", kBound) == "127.0.0.1:7001");
}

TEST_CASE("a publisher started before its bootstrap server registers once it is up") {
  const int32_t port = testing::UnusedLocalPort();
  REQUIRE(port > 0);
  auto discovery = DiscoveryBackend::Create(PrefillOptions(port));
  REQUIRE(discovery.ok());
  const RankRegistration reg = TestRank(0, 0, 0, 1, 1, 1, 7003);
  auto publisher = (*discovery)->Publish(reg);  // nothing listens: retried in the background
  REQUIRE(publisher.ok());
  std::this_thread::sleep_for(milliseconds(300));
  auto server = StartServer(port);
  CHECK(WaitForHolder(port, reg, "127.0.0.1:7003", kBound) == "127.0.0.1:7003");
}

// A bootstrap service that cancels every call, as a server whose copy of a call's deadline
// passed first does (its RST_STREAM CANCEL can reach the client before the client's own timer).
class CancellingBootstrap final : public ::pdlib::wire::v1::Bootstrap::Service {
 public:
  CancellingBootstrap() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
  }
  ~CancellingBootstrap() override { server_->Shutdown(); }
  grpc::Status RegisterRank(grpc::ServerContext*, const ::pdlib::wire::v1::RegisterRankRequest*,
                            ::pdlib::wire::v1::RegisterRankResponse*) override {
    ++calls_;
    return grpc::Status(grpc::StatusCode::CANCELLED, "deadline passed on the server");
  }
  grpc::Status GetParallelInfo(grpc::ServerContext*,
                               const ::pdlib::wire::v1::GetParallelInfoRequest*,
                               ::pdlib::wire::v1::GetParallelInfoResponse*) override {
    ++calls_;
    return grpc::Status(grpc::StatusCode::CANCELLED, "deadline passed on the server");
  }
  int32_t port() const { return port_; }
  int calls() const { return calls_.load(); }

 private:
  int port_ = 0;
  std::atomic<int> calls_{0};  // relaxed is enough: read after the calls it counts returned
  std::unique_ptr<grpc::Server> server_;
};

TEST_CASE("a CANCELLED from the server is retried like a deadline, not the end") {
  CancellingBootstrap fake;
  auto discovery = DiscoveryBackend::Create(PrefillOptions(fake.port()));
  REQUIRE(discovery.ok());
  // Prefill: the quick attempt is cancelled; Publish still succeeds and keeps trying.
  auto publisher = (*discovery)->Publish(TestRank(0, 0, 0, 1, 1, 1, 7004));
  REQUIRE(publisher.ok());
  const auto deadline = Clock::now() + milliseconds(10000);
  while (fake.calls() < 3 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  CHECK(fake.calls() >= 3);
  // Decode: a lookup cancelled by the server reads as DEADLINE_EXCEEDED, which decode retries.
  KVManagerOptions decode = PrefillOptions(fake.port());
  decode.mode = Mode::kDecode;
  auto decode_discovery = DiscoveryBackend::Create(decode);
  REQUIRE(decode_discovery.ok());
  auto directory = (*decode_discovery)->Open("127.0.0.1", static_cast<uint16_t>(fake.port()));
  REQUIRE(directory.ok());
  auto info = (*directory)->GetParallelInfo();
  CHECK(info.status().code() == StatusCode::kDeadlineExceeded);
  // Cancel() still reads as CANCELLED.
  (*directory)->Cancel();
  CHECK((*directory)->GetParallelInfo().status().code() == StatusCode::kCancelled);
}

}  // namespace
}  // namespace pdlib::control
