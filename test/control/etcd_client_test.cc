// EtcdClient (lib/control/etcd_client.h) against real etcd members (test/support/
// etcd_launcher.h) and, for answers etcd would never send, against a fake member. Cases that
// need etcd print why and pass where it is not installed.
#include "lib/control/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lib/proto/etcd/rpc.grpc.pb.h"
#include "test/support/etcd_launcher.h"
#include "tools/common/child_process.h"

namespace pdlib::control {
namespace {

using pdlib::testing::EtcdCluster;
using pdlib::testing::EtcdClusterOptions;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

#define SKIP_WITHOUT_ETCD()                         \
  do {                                              \
    if (auto why = pdlib::testing::EtcdMissing()) { \
      WARN("skipped: " << *why);                    \
      return;                                       \
    }                                               \
  } while (0)

std::unique_ptr<EtcdCluster> StartCluster(EtcdClusterOptions options = {}) {
  auto cluster = EtcdCluster::Start(options);
  INFO(cluster.status().message());
  REQUIRE(cluster.ok());
  return std::move(*cluster);
}

std::unique_ptr<EtcdClient> Connect(std::vector<std::string> endpoints,
                                    EtcdClientOptions options = {}) {
  options.endpoints = std::move(endpoints);
  auto client = EtcdClient::Create(options);
  INFO(client.status().message());
  REQUIRE(client.ok());
  return std::move(*client);
}

// Collects a watch's updates for the test thread to wait on.
class Updates {
 public:
  EtcdWatch::Callback Callback() {
    return [this](const EtcdWatchUpdate& u) {
      std::lock_guard<std::mutex> lock(mu_);
      updates_.push_back(u);
      for (const EtcdWatchEvent& e : u.events) events_.push_back(e);
      cv_.notify_all();
    };
  }

  // Waits until at least `n` events arrived; a copy of them.
  std::vector<EtcdWatchEvent> WaitEvents(size_t n, milliseconds timeout = milliseconds(10000)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return events_.size() >= n; });
    return events_;
  }

  std::vector<EtcdWatchUpdate> WaitUpdates(size_t n, milliseconds timeout = milliseconds(10000)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return updates_.size() >= n; });
    return updates_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<EtcdWatchUpdate> updates_;
  std::vector<EtcdWatchEvent> events_;
};

bool IsPut(const EtcdWatchEvent& e, const std::string& key, const std::string& value) {
  return e.type == EtcdWatchEvent::Type::kPut && e.kv.key == key && e.kv.value == value;
}
bool IsDelete(const EtcdWatchEvent& e, const std::string& key) {
  return e.type == EtcdWatchEvent::Type::kDelete && e.kv.key == key;
}

// --- Without etcd ---

TEST_CASE("etcd client: prefix range ends") {
  CHECK(EtcdPrefixRangeEnd("a") == "b");
  CHECK(EtcdPrefixRangeEnd("/pdlib/") == "/pdlib0");
  CHECK(EtcdPrefixRangeEnd("a\xff") == "b");
  CHECK(EtcdPrefixRangeEnd("a\xfe\xff") == "a\xff");
  CHECK(EtcdPrefixRangeEnd("\xff\xff") == std::string(1, '\0'));
  CHECK(EtcdPrefixRangeEnd("") == std::string(1, '\0'));
}

TEST_CASE("etcd client: options and arguments are checked before any call") {
  auto create = [](EtcdClientOptions o) { return EtcdClient::Create(o).status().code(); };
  EtcdClientOptions o;
  CHECK(create(o) == StatusCode::kInvalidArgument);  // no endpoints
  for (const char* bad :
       {"localhost", "http://127.0.0.1:2379", ":2379", "h:0", "h:70000", "h:12x"}) {
    o.endpoints = {bad};
    INFO(bad);
    CHECK(create(o) == StatusCode::kInvalidArgument);
  }
  o.endpoints = {"127.0.0.1:2379", "[::1]:2379"};
  CHECK(create(o) == StatusCode::kOk);
  EtcdClientOptions no_user = o;
  no_user.password = "secret";
  CHECK(create(no_user) == StatusCode::kInvalidArgument);
  EtcdClientOptions tls = o;
  tls.tls_ca_file = "/nonexistent/ca.pem";
  CHECK(create(tls) == StatusCode::kInvalidArgument);

  auto client = Connect(o.endpoints);
  CHECK(client->Put("", "v").status().code() == StatusCode::kInvalidArgument);
  CHECK(client->Put("k", std::string((1 << 20) + 1, 'x')).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(client->Get(std::string(5000, 'k')).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->GrantLease(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->PutIf("k", "v", 0, -1).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->MemberStatus("10.0.0.1:1").status().code() == StatusCode::kInvalidArgument);
  CHECK(client->WatchPrefix("p", {}, nullptr).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("etcd client: unreachable endpoints fail within the deadline, naming them") {
  const std::string a = "127.0.0.1:" + std::to_string(pdlib_tools::UnusedLocalPort());
  const std::string b = "127.0.0.1:" + std::to_string(pdlib_tools::UnusedLocalPort());
  auto client = Connect({a, b});
  const auto start = steady_clock::now();
  auto got = client->Get("k", milliseconds(1000));
  const auto elapsed = steady_clock::now() - start;
  INFO(got.status().message());
  CHECK(got.status().code() == StatusCode::kUnavailable);
  CHECK(got.status().message().find(a) != std::string_view::npos);
  CHECK(got.status().message().find(b) != std::string_view::npos);
  CHECK(elapsed >= milliseconds(900));  // it kept trying until the deadline
  CHECK(elapsed < milliseconds(2500));

  // Cancel() ends a call that would otherwise wait for its deadline.
  std::thread canceller([&] {
    std::this_thread::sleep_for(milliseconds(200));
    client->Cancel();
  });
  const auto cancel_start = steady_clock::now();
  auto cancelled = client->Put("k", "v", 0, milliseconds(20000));
  canceller.join();
  CHECK(cancelled.status().code() == StatusCode::kCancelled);
  CHECK(steady_clock::now() - cancel_start < milliseconds(2000));
  CHECK(client->Get("k").status().code() == StatusCode::kCancelled);
}

// A member that answers whatever the test sets, for answers a real etcd never sends. The mutex
// orders the test's settings with the handlers (TSan does not see gRPC's own ordering).
class FakeKv final : public etcdserverpb::KV::Service, public etcdserverpb::Lease::Service {
 public:
  template <typename Response>
  using Answer = std::function<void(Response*)>;

  void SetRange(Answer<etcdserverpb::RangeResponse> a) { Set(&range_, std::move(a)); }
  void SetTxn(Answer<etcdserverpb::TxnResponse> a) { Set(&txn_, std::move(a)); }
  void SetGrant(Answer<etcdserverpb::LeaseGrantResponse> a) { Set(&grant_, std::move(a)); }

  grpc::Status Range(grpc::ServerContext*, const etcdserverpb::RangeRequest*,
                     etcdserverpb::RangeResponse* response) override {
    return Reply(range_, response);
  }
  grpc::Status Txn(grpc::ServerContext*, const etcdserverpb::TxnRequest*,
                   etcdserverpb::TxnResponse* response) override {
    return Reply(txn_, response);
  }
  grpc::Status LeaseGrant(grpc::ServerContext*, const etcdserverpb::LeaseGrantRequest*,
                          etcdserverpb::LeaseGrantResponse* response) override {
    return Reply(grant_, response);
  }

 private:
  template <typename Response>
  void Set(Answer<Response>* slot, Answer<Response> a) {
    std::lock_guard<std::mutex> lock(mu_);
    *slot = std::move(a);
  }
  template <typename Response>
  grpc::Status Reply(const Answer<Response>& slot, Response* response) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!slot) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not set");
    slot(response);
    return grpc::Status::OK;
  }

  std::mutex mu_;
  Answer<etcdserverpb::RangeResponse> range_;
  Answer<etcdserverpb::TxnResponse> txn_;
  Answer<etcdserverpb::LeaseGrantResponse> grant_;
};

void SetKv(mvccpb::KeyValue* kv, const std::string& key, size_t value_bytes, int64_t create,
           int64_t mod) {
  kv->set_key(key);
  kv->set_value(std::string(value_bytes, 'v'));
  kv->set_create_revision(create);
  kv->set_mod_revision(mod);
  kv->set_version(1);
}

TEST_CASE("etcd client: malformed answers are errors naming the member, never a crash") {
  FakeKv fake;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(static_cast<etcdserverpb::KV::Service*>(&fake));
  builder.RegisterService(static_cast<etcdserverpb::Lease::Service*>(&fake));
  builder.SetMaxSendMessageSize(16 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  auto client = Connect({endpoint});

  auto expect_internal = [&](const Status& s, const char* words) {
    INFO(s.message());
    CHECK(s.code() == StatusCode::kInternal);
    CHECK(s.message().find(endpoint) != std::string_view::npos);
    CHECK(s.message().find(words) != std::string_view::npos);
  };
  fake.SetRange([](etcdserverpb::RangeResponse* r) { SetKv(r->add_kvs(), "k", 2 << 20, 1, 1); });
  expect_internal(client->Get("k").status(), "max_value_bytes");
  fake.SetRange([](etcdserverpb::RangeResponse* r) { SetKv(r->add_kvs(), "other", 1, 1, 1); });
  expect_internal(client->Get("k").status(), "outside");
  fake.SetRange([](etcdserverpb::RangeResponse* r) { SetKv(r->add_kvs(), "/q/x", 1, 1, 1); });
  expect_internal(client->GetPrefix("/p/").status(), "outside");
  fake.SetRange([](etcdserverpb::RangeResponse* r) { SetKv(r->add_kvs(), "k", 1, 5, 3); });
  expect_internal(client->Get("k").status(), "inconsistent revisions");
  fake.SetRange([](etcdserverpb::RangeResponse* r) { SetKv(r->add_kvs(), "", 1, 1, 1); });
  expect_internal(client->GetPrefix("").status(), "empty key");
  fake.SetRange([](etcdserverpb::RangeResponse* r) { r->set_more(true); });
  CHECK(client->GetPrefix("/p/").status().code() == StatusCode::kResourceExhausted);
  fake.SetTxn([](etcdserverpb::TxnResponse* r) { r->set_succeeded(true); });
  expect_internal(client->PutIfAbsent("k", "v", 0).status(), "Txn");
  fake.SetTxn([](etcdserverpb::TxnResponse* r) { r->add_responses()->mutable_response_put(); });
  expect_internal(client->PutIf("k", "v", 0, 3).status(), "failure branch");
  fake.SetGrant([](etcdserverpb::LeaseGrantResponse* r) { r->set_ttl(5); });
  expect_internal(client->GrantLease(5).status(), "lease 0");

  // A well-formed answer still goes through.
  fake.SetRange([](etcdserverpb::RangeResponse* r) {
    r->mutable_header()->set_revision(9);
    SetKv(r->add_kvs(), "/p/a", 3, 2, 4);
    SetKv(r->add_kvs(), "/p/b", 3, 5, 5);
  });
  auto range = client->GetPrefix("/p/");
  REQUIRE(range.ok());
  CHECK(range->revision == 9);
  REQUIRE(range->kvs.size() == 2);
  CHECK(range->kvs[1].key == "/p/b");
  server->Shutdown();
}

// --- Against etcd ---

TEST_CASE("etcd client: put, get, prefix and delete") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());

  auto rev1 = client->Put("/t/a", "1");
  REQUIRE(rev1.ok());
  auto rev2 = client->Put("/t/b", std::string("bin\0ary", 7));
  REQUIRE(rev2.ok());
  CHECK(*rev2 > *rev1);
  REQUIRE(client->Put("/u/c", "3").ok());

  auto a = client->Get("/t/a");
  REQUIRE(a.ok());
  REQUIRE(a->has_value());
  CHECK((*a)->value == "1");
  CHECK((*a)->create_revision == *rev1);
  CHECK((*a)->mod_revision == *rev1);
  CHECK((*a)->version == 1);
  CHECK((*a)->lease == 0);
  auto missing = client->Get("/t/none");
  REQUIRE(missing.ok());
  CHECK(!missing->has_value());

  auto prefix = client->GetPrefix("/t/");
  REQUIRE(prefix.ok());
  REQUIRE(prefix->kvs.size() == 2);
  CHECK(prefix->kvs[0].key == "/t/a");
  CHECK(prefix->kvs[1].value == std::string("bin\0ary", 7));
  CHECK(prefix->revision >= *rev2);
  auto all = client->GetPrefix("");
  REQUIRE(all.ok());
  CHECK(all->kvs.size() == 3);

  auto deleted = client->Delete("/t/a");
  REQUIRE(deleted.ok());
  CHECK(*deleted == 1);
  CHECK(*client->Delete("/t/a") == 0);
  auto prefix_deleted = client->DeletePrefix("/t/");
  REQUIRE(prefix_deleted.ok());
  CHECK(*prefix_deleted == 1);
  CHECK(client->GetPrefix("/t/")->kvs.empty());
  CHECK(client->GetPrefix("/u/")->kvs.size() == 1);

  auto status = client->MemberStatus(cluster->endpoint(0));
  REQUIRE(status.ok());
  CHECK(status->version.rfind("3.", 0) == 0);
  CHECK(status->leader != 0);
  CHECK(status->leader == status->member_id);
}

TEST_CASE("etcd client: compare-and-swap through Txn") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());

  auto created = client->PutIfAbsent("/cas/k", "first", 0);
  REQUIRE(created.ok());
  CHECK(created->succeeded);
  auto again = client->PutIfAbsent("/cas/k", "second", 0);
  REQUIRE(again.ok());
  CHECK(!again->succeeded);
  REQUIRE(again->current.has_value());
  CHECK(again->current->value == "first");
  const int64_t mod = again->current->mod_revision;
  CHECK(mod == created->revision);

  auto stale = client->PutIf("/cas/k", "stale", 0, mod - 1);
  REQUIRE(stale.ok());
  CHECK(!stale->succeeded);
  auto swapped = client->PutIf("/cas/k", "swapped", 0, mod);
  REQUIRE(swapped.ok());
  CHECK(swapped->succeeded);
  CHECK(client->Get("/cas/k")->value().value == "swapped");

  auto bad_delete = client->DeleteIf("/cas/k", mod);
  REQUIRE(bad_delete.ok());
  CHECK(!bad_delete->succeeded);
  CHECK(bad_delete->current->mod_revision == swapped->revision);
  auto good_delete = client->DeleteIf("/cas/k", swapped->revision);
  REQUIRE(good_delete.ok());
  CHECK(good_delete->succeeded);
  CHECK(!client->Get("/cas/k")->has_value());
  // Absent again: the failure branch reports no current pair.
  auto absent = client->PutIf("/cas/k", "x", 0, 12345);
  REQUIRE(absent.ok());
  CHECK(!absent->succeeded);
  CHECK(!absent->current.has_value());
}

TEST_CASE("etcd client: a lease kept alive keeps its key, and once left alone it expires") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());

  auto lease = client->GrantLease(2);
  REQUIRE(lease.ok());
  CHECK(lease->ttl_seconds >= 2);
  REQUIRE(client->Put("/lease/k", "v", lease->id).ok());
  CHECK(client->Get("/lease/k")->value().lease == lease->id);

  // Past the TTL, kept alive every 500 ms.
  auto last_renewal = steady_clock::now();
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(milliseconds(500));
    auto ttl = client->KeepAliveOnce(lease->id);
    INFO(ttl.status().message());
    REQUIRE(ttl.ok());
    CHECK(*ttl >= 1);
    last_renewal = steady_clock::now();
  }
  REQUIRE(client->Get("/lease/k")->has_value());
  auto left = client->LeaseTimeToLive(lease->id);
  REQUIRE(left.ok());
  CHECK(*left >= 1);

  // Left alone: gone within TTL + 1 s of the last renewal.
  const auto limit = last_renewal + std::chrono::seconds(lease->ttl_seconds + 1);
  while (client->Get("/lease/k")->has_value() && steady_clock::now() < limit) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  const auto after = std::chrono::duration_cast<milliseconds>(steady_clock::now() - last_renewal);
  INFO("key still there " << after.count() << " ms after the last renewal");
  CHECK(!client->Get("/lease/k")->has_value());
  CHECK(client->KeepAliveOnce(lease->id).status().code() == StatusCode::kNotFound);
  CHECK(client->LeaseTimeToLive(lease->id).status().code() == StatusCode::kNotFound);
}

TEST_CASE("etcd client: revoking a lease deletes its keys at once") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());

  auto lease = client->GrantLease(60);
  REQUIRE(lease.ok());
  REQUIRE(client->Put("/revoke/a", "1", lease->id).ok());
  REQUIRE(client->Put("/revoke/b", "2", lease->id).ok());
  REQUIRE(client->GetPrefix("/revoke/")->kvs.size() == 2);
  REQUIRE(client->RevokeLease(lease->id).ok());
  CHECK(client->GetPrefix("/revoke/")->kvs.empty());
  Status again = client->RevokeLease(lease->id);
  INFO(again.message());
  CHECK(again.code() == StatusCode::kNotFound);
  // A put on a lease that is gone is refused by etcd, with its message.
  auto orphan = client->Put("/revoke/c", "3", lease->id);
  INFO(orphan.status().message());
  CHECK(orphan.status().code() == StatusCode::kNotFound);
  CHECK(orphan.status().message().find("lease not found") != std::string_view::npos);
}

TEST_CASE("etcd client: a watch delivers puts and deletes in order, and replays history") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());
  REQUIRE(client->Put("/w/before", "0").ok());

  // The usual pattern: read the prefix, then watch from the revision after that read.
  auto snapshot = client->GetPrefix("/w/");
  REQUIRE(snapshot.ok());
  CHECK(snapshot->kvs.size() == 1);
  Updates live;
  EtcdWatchOptions options;
  options.prev_kv = true;
  options.start_revision = snapshot->revision + 1;
  auto watch = client->WatchPrefix("/w/", options, live.Callback());
  REQUIRE(watch.ok());

  auto first = client->Put("/w/a", "1");
  REQUIRE(first.ok());
  REQUIRE(client->Put("/w/a", "2").ok());
  REQUIRE(client->Put("/other", "x").ok());  // outside the prefix
  REQUIRE(client->Delete("/w/a").ok());
  auto last = client->Put("/w/b", "3");
  REQUIRE(last.ok());

  auto events = live.WaitEvents(4);
  REQUIRE(events.size() == 4);
  CHECK(IsPut(events[0], "/w/a", "1"));
  CHECK(IsPut(events[1], "/w/a", "2"));
  REQUIRE(events[1].prev_kv.has_value());
  CHECK(events[1].prev_kv->value == "1");
  CHECK(IsDelete(events[2], "/w/a"));
  CHECK(IsPut(events[3], "/w/b", "3"));
  CHECK(events[0].kv.mod_revision == *first);
  for (size_t i = 1; i < events.size(); ++i) {
    CHECK(events[i].kv.mod_revision > events[i - 1].kv.mod_revision);
  }
  CHECK((*watch)->revision() == *last);
  (*watch)->Stop();

  // From a past revision: the same history again, the put before it excluded.
  Updates replay;
  options.start_revision = *first;
  auto replaying = client->WatchPrefix("/w/", options, replay.Callback());
  REQUIRE(replaying.ok());
  auto replayed = replay.WaitEvents(4);
  REQUIRE(replayed.size() == 4);
  CHECK(IsPut(replayed[0], "/w/a", "1"));
  CHECK(IsDelete(replayed[2], "/w/a"));
  CHECK(IsPut(replayed[3], "/w/b", "3"));

  // Stop() is prompt, also from another thread while the stream is idle.
  const auto stop_start = steady_clock::now();
  replaying->reset();
  CHECK(steady_clock::now() - stop_start < milliseconds(1000));

  // A callback may stop its own watch: nothing arrives after that. (It replays history at once:
  // the lock holds the first callback back until the watch is stored.)
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  std::unique_ptr<EtcdWatch> self_stopping;
  {
    std::unique_lock<std::mutex> lock(mu);
    auto created = client->WatchPrefix("/w/", options, [&](const EtcdWatchUpdate&) {
      std::lock_guard<std::mutex> callback_lock(mu);
      ++calls;
      self_stopping->Stop();
      cv.notify_all();
    });
    REQUIRE(created.ok());
    self_stopping = std::move(*created);
    CHECK(cv.wait_for(lock, milliseconds(10000), [&] { return calls > 0; }));
  }
  REQUIRE(client->Put("/w/c", "4").ok());
  std::this_thread::sleep_for(milliseconds(300));
  std::lock_guard<std::mutex> lock(mu);
  CHECK(calls == 1);
  CHECK(self_stopping->last_error().ok());
}

TEST_CASE("etcd client: a watch whose history was compacted resyncs from a snapshot") {
  SKIP_WITHOUT_ETCD();
  if (auto why = pdlib::testing::EtcdctlMissing()) {
    WARN("skipped: " << *why);
    return;
  }
  auto cluster = StartCluster();
  auto client = Connect(cluster->endpoints());
  auto start = client->Put("/c/a", "1");
  REQUIRE(start.ok());
  REQUIRE(client->Put("/c/b", "2").ok());
  REQUIRE(client->Delete("/c/a").ok());
  auto compact_at = client->Put("/c/c", "3");
  REQUIRE(compact_at.ok());
  auto compacted = cluster->Etcdctl({"compaction", std::to_string(*compact_at)});
  INFO(compacted.status().message());
  REQUIRE(compacted.ok());

  Updates updates;
  EtcdWatchOptions options;
  options.start_revision = *start;  // compacted away
  auto watch = client->WatchPrefix("/c/", options, updates.Callback());
  REQUIRE(watch.ok());
  auto got = updates.WaitUpdates(1);
  REQUIRE(got.size() == 1);
  CHECK(got[0].resynced);
  CHECK(got[0].events.empty());
  CHECK(got[0].revision >= *compact_at);
  REQUIRE(got[0].snapshot.size() == 2);
  CHECK(got[0].snapshot[0].key == "/c/b");
  CHECK(got[0].snapshot[1].key == "/c/c");

  // And goes on from the snapshot.
  REQUIRE(client->Put("/c/d", "4").ok());
  auto events = updates.WaitEvents(1);
  REQUIRE(events.size() == 1);
  CHECK(IsPut(events[0], "/c/d", "4"));
}

TEST_CASE("etcd client: calls move past a dead endpoint to a live one") {
  SKIP_WITHOUT_ETCD();
  auto cluster = StartCluster();
  const std::string dead = "127.0.0.1:" + std::to_string(pdlib_tools::UnusedLocalPort());
  auto client = Connect({dead, cluster->endpoint(0)});
  CHECK(client->preferred_endpoint() == dead);
  auto put = client->Put("/f/k", "v", 0, milliseconds(3000));
  INFO(put.status().message());
  REQUIRE(put.ok());
  CHECK(client->preferred_endpoint() == cluster->endpoint(0));
  auto status = client->MemberStatus(dead, milliseconds(500));
  CHECK(status.status().code() == StatusCode::kUnavailable);
  CHECK(status.status().message().find(dead) != std::string_view::npos);
}

TEST_CASE("etcd client: calls and watches survive a killed member of three") {
  SKIP_WITHOUT_ETCD();
  EtcdClusterOptions three;
  three.members = 3;
  auto cluster = StartCluster(three);
  auto client = Connect(cluster->endpoints());

  Updates updates;
  auto watch = client->WatchPrefix("/k3/", {}, updates.Callback());
  REQUIRE(watch.ok());
  // Once the watch has seen one event, its stream is up: find which member carries it.
  std::string watched;
  for (int i = 0; i < 100 && updates.WaitEvents(1, milliseconds(0)).empty(); ++i) {
    REQUIRE(client->Put("/k3/probe", std::to_string(i)).ok());
    updates.WaitEvents(1, milliseconds(100));
  }
  REQUIRE(!updates.WaitEvents(1, milliseconds(0)).empty());
  watched = (*watch)->endpoint();
  REQUIRE(!watched.empty());
  int victim = 0;
  while (cluster->endpoint(victim) != watched) ++victim;
  const size_t seen = updates.WaitEvents(1, milliseconds(0)).size();
  REQUIRE(cluster->Kill(victim).ok());

  // Writes go on through the others (a new leader is elected if the victim led), and the watch
  // reconnects elsewhere without losing or repeating anything.
  auto put = client->Put("/k3/after", "1", 0, milliseconds(10000));
  INFO(put.status().message());
  REQUIRE(put.ok());
  auto events = updates.WaitEvents(seen + 1, milliseconds(15000));
  REQUIRE(events.size() == seen + 1);
  CHECK(IsPut(events.back(), "/k3/after", "1"));
  CHECK((*watch)->streams_created() >= 2);
  CHECK((*watch)->endpoint() != watched);
  CHECK((*watch)->last_error().ok());

  // The member comes back and serves again.
  Status restarted = cluster->Restart(victim);
  INFO(restarted.message());
  REQUIRE(restarted.ok());
  auto status = client->MemberStatus(cluster->endpoint(victim), milliseconds(5000));
  INFO(status.status().message());
  CHECK(status.ok());
}

TEST_CASE("etcd client: authentication, and a new token after the old one expired") {
  SKIP_WITHOUT_ETCD();
  if (auto why = pdlib::testing::EtcdctlMissing()) {
    WARN("skipped: " << *why);
    return;
  }
  EtcdClusterOptions options;
  options.extra_args = {"--auth-token-ttl", "1"};
  auto cluster = StartCluster(options);
  for (std::vector<std::string> args :
       {std::vector<std::string>{"user", "add", "root", "--new-user-password=rootpw"},
        std::vector<std::string>{"auth", "enable"}}) {
    auto out = cluster->Etcdctl(args);
    INFO(out.status().message());
    REQUIRE(out.ok());
  }

  auto anonymous = Connect(cluster->endpoints());
  Status refused = anonymous->Put("/auth/k", "v").status();
  INFO(refused.message());
  CHECK(!refused.ok());
  CHECK(refused.message().find(cluster->endpoint(0)) != std::string_view::npos);

  EtcdClientOptions wrong;
  wrong.username = "root";
  wrong.password = "nope";
  auto impostor = Connect(cluster->endpoints(), wrong);
  Status denied = impostor->Get("/auth/k").status();
  INFO(denied.message());
  CHECK(denied.code() == StatusCode::kInvalidArgument);
  CHECK(denied.message().find("authentication failed") != std::string_view::npos);

  EtcdClientOptions root;
  root.username = "root";
  root.password = "rootpw";
  auto client = Connect(cluster->endpoints(), root);
  REQUIRE(client->Put("/auth/k", "v").ok());
  Updates updates;
  auto watch = client->WatchPrefix("/auth/", {}, updates.Callback());
  REQUIRE(watch.ok());
  // The token expires after 1 s unused: the client authenticates again.
  std::this_thread::sleep_for(milliseconds(2500));
  auto got = client->Get("/auth/k");
  INFO(got.status().message());
  REQUIRE(got.ok());
  CHECK(got->value().value == "v");
  REQUIRE(client->Put("/auth/k", "w").ok());
  auto events = updates.WaitEvents(1);
  REQUIRE(!events.empty());
  CHECK(IsPut(events.back(), "/auth/k", "w"));
}

}  // namespace
}  // namespace pdlib::control
