// Discovery through etcd (issue #18), against real etcd members started by the test
// (test/support/etcd_launcher.h): prefill and decode KVManagers over the gRPC control plane and
// the fake backend, with `discovery = kEtcd` and no bootstrap server anywhere. Registration,
// resolution and withdrawal; lease expiry; a rank that moved; a member killed under load; etcd
// unreachable at start; bad data under the prefix. Also the key layout's pure functions.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "lib/control/discovery.h"
#include "lib/control/etcd_client.h"
#include "lib/control/proto_convert.h"
#include "pdlib/pdlib.h"
#include "test/support/etcd_launcher.h"
#include "tools/common/child_process.h"

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib::StatusCode;
using pdlib::control::EtcdClient;
using pdlib::control::EtcdClientOptions;
using pdlib::control::EtcdRankKey;
using pdlib::control::EtcdRoomFailurePrefix;
using pdlib::control::RankId;

namespace {

using Clock = std::chrono::steady_clock;

uint16_t FreePort() {
  const uint16_t port = pdlib_tools::UnusedLocalPort();
  REQUIRE(port != 0);
  return port;
}

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Skips the test case, with the reason, where etcd is not installed.
#define REQUIRE_ETCD()                            \
  if (auto why = pdlib::testing::EtcdMissing()) { \
    WARN("SKIP: " << *why);                       \
    return;                                       \
  }

std::unique_ptr<pdlib::testing::EtcdCluster> StartEtcd(int members = 1) {
  pdlib::testing::EtcdClusterOptions eo;
  eo.members = members;
  auto cluster = pdlib::testing::EtcdCluster::Start(eo);
  INFO((cluster.ok() ? std::string() : cluster.status().ToString()));
  REQUIRE(cluster.ok());
  return std::move(*cluster);
}

std::unique_ptr<EtcdClient> Client(const std::vector<std::string>& endpoints) {
  EtcdClientOptions o;
  o.endpoints = endpoints;
  o.rpc_timeout = 3000ms;
  auto c = EtcdClient::Create(o);
  REQUIRE(c.ok());
  return std::move(*c);
}

// One manager's pools (fake backend: 64 pages of 256 bytes, K and V) and its options.
struct Side {
  std::vector<uint8_t> k = std::vector<uint8_t>(64 * 256), v = std::vector<uint8_t>(64 * 256);
  std::unique_ptr<pdlib::MetadataBuffers> aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));

  pdlib::KVManagerOptions Options(pdlib::Mode mode, const std::vector<std::string>& endpoints,
                                  uint16_t deployment_port) {
    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.control_plane = pdlib::ControlPlane::kGrpc;
    o.discovery = pdlib::Discovery::kEtcd;
    o.etcd_endpoints = endpoints;
    o.etcd_prefix = "/pdlib-test";
    o.bootstrap_host = "127.0.0.1";  // names the deployment; nothing listens there
    o.bootstrap_port = deployment_port;
    o.liveness_timeout = 2000ms;
    o.connect_timeout = 3000ms;
    o.bootstrap_timeout = 8000ms;
    o.args.kv = {{reinterpret_cast<uint64_t>(k.data()), reinterpret_cast<uint64_t>(v.data())},
                 {k.size(), v.size()},
                 {256, 256}};
    o.args.aux = aux->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {2, 8, 128, 2, 1, "test-model"};
    return o;
  }
};

std::unique_ptr<pdlib::KVManager> Create(const pdlib::KVManagerOptions& o) {
  auto m = pdlib::KVManager::Create(o);
  INFO((m.ok() ? std::string() : m.status().ToString()));
  REQUIRE(m.ok());
  return std::move(*m);
}

// One request from `prefill` to `decode` through the deployment at 127.0.0.1:port: the
// decode side's final status.
pdlib::Status OneTransfer(pdlib::KVManager& prefill, pdlib::KVManager& decode, uint16_t port,
                          uint64_t room) {
  auto s = prefill.CreateSender(room);
  auto r = decode.CreateReceiver({"127.0.0.1", port}, room);
  REQUIRE((s.ok() && r.ok()));
  std::vector<int32_t> pages = {1, 2};
  (*r)->Init(pages, std::nullopt).IgnoreError();
  if (WaitFor(
          [&] {
            return (*s)->Poll() == KVPoll::kWaitingForInput || pdlib::IsTerminal((*s)->Poll());
          },
          5000ms) &&
      (*s)->Poll() == KVPoll::kWaitingForInput) {
    REQUIRE((*s)->Send(pages, true).ok());
  }
  REQUIRE(WaitFor([&] { return pdlib::IsTerminal((*r)->Poll()); }, 10000ms));
  return (*r)->FailureReason();
}

// A decode room toward a deployment: its failure reason once terminal.
pdlib::Status ReceiverOutcome(pdlib::KVManager& decode, uint16_t port, uint64_t room) {
  auto r = decode.CreateReceiver({"127.0.0.1", port}, room);
  REQUIRE(r.ok());
  REQUIRE(WaitFor([&] { return pdlib::IsTerminal((*r)->Poll()); }, 15000ms));
  return (*r)->FailureReason();
}

std::string RankKey(uint16_t port, RankId id = {}) {
  return EtcdRankKey("/pdlib-test", "127.0.0.1:" + std::to_string(port), id);
}

// What a prefill rank stores, for a rank that does not run (a dead one, or a bad layout).
std::string Registration(RankId id, int32_t tp_size, uint16_t port, uint32_t page_size = 16) {
  pdlib::control::RankRegistration reg;
  reg.parallel.tp_size = tp_size;
  reg.parallel.tp_rank = id.tp_rank;
  reg.parallel.dp_rank = id.dp_rank;
  reg.parallel.pp_rank = id.pp_rank;
  reg.host = "127.0.0.1";
  reg.port = port;
  reg.page_size = page_size;
  reg.fingerprint = {2, 8, 128, 2, 1, "test-model"};
  pdlib::wire::v1::RegisterRankRequest msg;
  pdlib::control::ToProto(reg, &msg);
  return msg.SerializeAsString();
}

}  // namespace

TEST_CASE("etcd keys: the rank key layout round-trips and bad keys are refused with a reason") {
  using pdlib::control::ParseEtcdRankKey;
  const std::string key = EtcdRankKey("/p", "10.0.0.1:8998", {3, 1, 2});
  CHECK(key == "/p/10.0.0.1:8998/rank/3/1/2");
  auto parts = ParseEtcdRankKey("/p", key);
  REQUIRE(parts.ok());
  CHECK(parts->deployment == "10.0.0.1:8998");
  CHECK(parts->rank == RankId{3, 1, 2});
  for (const char* bad : {"/q/x/rank/0/0/0", "/p/x/rank/0/0", "/p/x/rank/0/0/0/0",
                          "/p/x/rank/a/0/0", "/p/x/rank/-1/0/0", "/p/rank/0/0/0", "/p",
                          "/px/rank/0/0/0", "/p/x/rank/99999999999/0/0", "/p/x/rank//0/0"}) {
    auto r = ParseEtcdRankKey("/p", bad);
    INFO(bad);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("not a pdlib rank key") != std::string::npos);
  }
}

TEST_CASE("etcd options: each bad option is named") {
  pdlib::KVManagerOptions o;
  o.discovery = pdlib::Discovery::kEtcd;
  auto error = [&] { return std::string(pdlib::control::ValidateEtcdOptions(o).message()); };
  CHECK(error().find("etcd_endpoints") != std::string::npos);
  o.etcd_endpoints = {"127.0.0.1"};
  CHECK(error().find("'127.0.0.1'") != std::string::npos);
  o.etcd_endpoints = {"127.0.0.1:2379"};
  CHECK(pdlib::control::ValidateEtcdOptions(o).ok());
  o.etcd_prefix = "pdlib/";
  CHECK(error().find("etcd_prefix") != std::string::npos);
  o.etcd_prefix = "/pdlib";
  o.etcd_username = "u";
  CHECK(error().find("etcd_password") != std::string::npos);
  // Through KVManager::Create, before anything is started.
  Side side;
  auto opts = side.Options(pdlib::Mode::kDecode, {"nonsense"}, 1);
  auto m = pdlib::KVManager::Create(opts);
  CHECK(m.status().code() == StatusCode::kInvalidArgument);
  CHECK(m.status().message().find("'nonsense'") != std::string::npos);
}

TEST_CASE(
    "etcd discovery: prefill registers with a lease, decode resolves it, shutdown withdraws") {
  REQUIRE_ETCD();
  auto etcd = StartEtcd();
  const uint16_t port = FreePort();  // the deployment's name only
  Side ps, ds;
  auto prefill = Create(ps.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port));
  auto client = Client(etcd->endpoints());
  auto kv = client->Get(RankKey(port));
  REQUIRE(kv.ok());
  REQUIRE(kv->has_value());
  CHECK((*kv)->lease != 0);  // held by a lease, so it dies with the rank

  auto decode = Create(ds.Options(pdlib::Mode::kDecode, etcd->endpoints(), port));
  for (uint64_t room = 1; room <= 5; ++room) {
    auto s = OneTransfer(*prefill, *decode, port, room);
    INFO(s.ToString());
    CHECK(s.ok());
  }
  CHECK(prefill->metrics().rooms_succeeded == 5);

  prefill.reset();  // clean shutdown: the lease is revoked, the key is gone at once
  auto after = client->Get(RankKey(port));
  REQUIRE(after.ok());
  CHECK_FALSE(after->has_value());
  // Decode's watch dropped its cached lookup: a new room is told nobody is registered.
  auto s = ReceiverOutcome(*decode, port, 6);
  INFO(s.ToString());
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("registered in etcd") != std::string::npos);
}

TEST_CASE("etcd discovery: a room refused on another DP rank fails decode at once") {
  // The room-failure relay through etcd: DP rank 0 refuses room 3 (room 3 belongs to DP rank 1,
  // where decode binds it) before any decode came; decode learns it from the keys under
  // "<prefix>/<deployment>/failed/" within about a second, not at its waiting_timeout.
  REQUIRE_ETCD();
  auto etcd = StartEtcd();
  const uint16_t port = FreePort();
  Side p0s, p1s, ds;
  auto o0 = p0s.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port);
  auto o1 = p1s.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port);
  o0.args.parallel.dp_size = o1.args.parallel.dp_size = 2;
  o1.args.parallel.dp_rank = 1;
  auto p0 = Create(o0);
  auto p1 = Create(o1);
  auto od = ds.Options(pdlib::Mode::kDecode, etcd->endpoints(), port);
  od.waiting_timeout = 60000ms;
  od.bootstrap_timeout = 60000ms;
  auto decode = Create(od);
  auto wrong = p0->CreateSender(3);
  REQUIRE(wrong.ok());
  (*wrong)->Abort("reached prefill DP rank 0, but decode looks for it on DP rank 1");
  auto client = Client(etcd->endpoints());
  const std::string key =
      EtcdRoomFailurePrefix("/pdlib-test", "127.0.0.1:" + std::to_string(port)) + "3";
  REQUIRE(WaitFor(
      [&] {
        auto kv = client->Get(key);
        return kv.ok() && kv->has_value();
      },
      5000ms));
  CHECK((*client->Get(key))->lease != 0);  // etcd drops it by itself
  auto r = decode->CreateReceiver({"127.0.0.1", port}, 3);
  REQUIRE(r.ok());
  const auto started = std::chrono::steady_clock::now();
  REQUIRE(WaitFor([&] { return (*r)->Poll() != KVPoll::kBootstrapping; }, 5000ms));
  std::vector<int32_t> pages = {1};
  (void)(*r)->Init(pages, std::nullopt);
  REQUIRE(WaitFor([&] { return (*r)->Poll() == KVPoll::kFailed; }, 3000ms));
  CHECK(std::chrono::steady_clock::now() - started < 2000ms);
  CHECK((*r)->FailureReason().ToString().find("decode looks for it on DP rank 1") !=
        std::string::npos);
  CHECK(WaitFor([&] { return (*r)->PagesReusable(); }, 5000ms));
}

TEST_CASE("etcd discovery: a rank that stops renewing its lease disappears within the TTL") {
  REQUIRE_ETCD();
  auto etcd = StartEtcd();
  const uint16_t port = FreePort();
  auto client = Client(etcd->endpoints());
  // What a prefill that died (SIGKILL, frozen) leaves: its key under a lease nobody renews.
  auto lease = client->GrantLease(2);
  REQUIRE(lease.ok());
  REQUIRE(client->Put(RankKey(port), Registration({}, 1, FreePort()), lease->id).ok());
  const auto start = Clock::now();
  REQUIRE(WaitFor(
      [&] {
        auto kv = client->Get(RankKey(port));
        return kv.ok() && !kv->has_value();
      },
      lease->ttl_seconds * 1000ms + 2000ms));
  const auto gone_after =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  INFO("gone after " << gone_after.count() << " ms, ttl " << lease->ttl_seconds << " s");
  CHECK(gone_after <= lease->ttl_seconds * 1000ms + 1500ms);
}

TEST_CASE("etcd discovery: a prefill restarted on a new address is found, no request fails") {
  REQUIRE_ETCD();
  auto etcd = StartEtcd();
  const uint16_t port = FreePort();
  Side pa, pb, ds;
  auto first = Create(pa.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port));
  auto decode = Create(ds.Options(pdlib::Mode::kDecode, etcd->endpoints(), port));
  for (uint64_t room = 1; room <= 3; ++room) REQUIRE(OneTransfer(*first, *decode, port, room).ok());
  CHECK(decode->metrics().connections == 1);

  // The successor takes the rank (same key, new address) while the first still runs: decode's
  // watch drops the cached address, so new rooms go to the successor, not the stale address.
  auto second = Create(pb.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port));
  REQUIRE(second->endpoint() != first->endpoint());
  auto kv = Client(etcd->endpoints())->Get(RankKey(port));
  REQUIRE((kv.ok() && kv->has_value()));
  const uint64_t first_rooms = first->metrics().rooms_succeeded;
  // The watch's event arrives within milliseconds on one machine; give it ample time.
  std::this_thread::sleep_for(500ms);
  uint64_t room = 10;
  for (int i = 0; i < 6; ++i) {
    auto s = OneTransfer(*second, *decode, port, room++);
    INFO(s.ToString());
    CHECK(s.ok());
  }
  CHECK(first->metrics().rooms_succeeded == first_rooms);
  CHECK(second->metrics().rooms_succeeded >= 6);

  // The first shuts down: its lease no longer holds the key, so the successor stays registered.
  first.reset();
  auto still = Client(etcd->endpoints())->Get(RankKey(port));
  REQUIRE(still.ok());
  CHECK(still->has_value());
  auto s = OneTransfer(*second, *decode, port, room++);
  INFO(s.ToString());
  CHECK(s.ok());
  CHECK(WaitFor([&] { return decode->metrics().connections == 1; }, 5000ms));
}

TEST_CASE("etcd discovery: a member killed in a 3-member cluster fails no request") {
  REQUIRE_ETCD();
  auto etcd = StartEtcd(3);
  const uint16_t port = FreePort(), port2 = FreePort();
  Side ps, ps2, ds;
  auto prefill = Create(ps.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port));
  auto decode = Create(ds.Options(pdlib::Mode::kDecode, etcd->endpoints(), port));
  REQUIRE(OneTransfer(*prefill, *decode, port, 1).ok());
  REQUIRE(etcd->Kill(0).ok());  // the member every client started with
  // Requests go on; a second deployment registers and is resolved through the survivors; the
  // first rank's lease is renewed through them (its key outlives twice the TTL).
  auto second = Create(ps2.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port2));
  const auto until = Clock::now() + 2 * 2000ms + 1500ms;  // twice liveness_timeout (the TTL)
  uint64_t room = 2;
  int failed = 0;
  while (Clock::now() < until) {
    if (!OneTransfer(*prefill, *decode, port, room++).ok()) ++failed;
    if (!OneTransfer(*second, *decode, port2, room++).ok()) ++failed;
  }
  CHECK(failed == 0);
  auto kv = Client({etcd->endpoint(1), etcd->endpoint(2)})->Get(RankKey(port));
  REQUIRE(kv.ok());
  CHECK(kv->has_value());
}

TEST_CASE("etcd discovery: etcd unreachable at start is a clear error within connect_timeout") {
  const std::string nobody = "127.0.0.1:" + std::to_string(FreePort());
  for (auto mode : {pdlib::Mode::kPrefill, pdlib::Mode::kDecode}) {
    Side side;
    auto o = side.Options(mode, {nobody}, 1);
    o.connect_timeout = 1000ms;
    const auto start = Clock::now();
    auto m = pdlib::KVManager::Create(o);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    INFO(m.status().ToString() << " after " << took.count() << " ms");
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == StatusCode::kUnavailable);
    CHECK(m.status().message().find(nobody) != std::string::npos);
    CHECK(took < 1000ms + 1500ms);  // bounded by connect_timeout, not by a default of gRPC's
  }
}

TEST_CASE("etcd discovery: bad data under the prefix is refused with a reason, never a crash") {
  REQUIRE_ETCD();
  auto etcd = StartEtcd();
  auto client = Client(etcd->endpoints());
  const uint16_t port = FreePort();
  const std::string dep = "/pdlib-test/127.0.0.1:" + std::to_string(port) + "/rank/";
  // Garbage at the rank key, keys of the wrong shape, a registration under another rank's key.
  REQUIRE(client->Put(RankKey(port), std::string("\xff\x01garbage", 9)).ok());
  REQUIRE(client->Put(dep + "zero/0/0", Registration({}, 1, 7000)).ok());
  REQUIRE(client->Put(dep + "0/0", Registration({}, 1, 7000)).ok());
  REQUIRE(client->Put(RankKey(port, {0, 1, 0}), Registration({}, 2, 7000)).ok());
  Side ds;
  auto decode = Create(ds.Options(pdlib::Mode::kDecode, etcd->endpoints(), port));
  auto s = ReceiverOutcome(*decode, port, 1);
  INFO(s.ToString());
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("refused") != std::string::npos);

  // A real prefill rank replaces the garbage at its key; the rest stays refused and ignored.
  Side ps;
  auto prefill = Create(ps.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port));
  uint64_t room = 2;
  REQUIRE(WaitFor([&] { return OneTransfer(*prefill, *decode, port, room++).ok(); }, 5000ms));

  // A rank whose layout disagrees with the deployment's is refused at Create, naming both.
  Side bad;
  auto o = bad.Options(pdlib::Mode::kPrefill, etcd->endpoints(), port);
  o.args.page_size = 32;
  o.args.parallel.tp_size = 2;
  o.args.parallel.tp_rank = 1;
  auto refused = pdlib::KVManager::Create(o);
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK(refused.status().message().find("refuses this rank") != std::string::npos);
}
