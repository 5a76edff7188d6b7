// The verbs backend on a real RDMA device (the Soft-RoCE VM's rxe0, see test/rxe): writes under
// tight limits (few SGEs, short messages, a small send queue, short chains) compared byte for
// byte, layers spread over two devices, memory deregistered with writes in flight, Disconnect and
// destruction with writes outstanding, refused blobs, a fence with writes in flight (nothing lands
// after it), and a target process killed mid-transfer: its batches fail with the work-completion
// status, and a new connection works.
//
// Needs a device: the test fails (it does not skip) without one, so it is registered only as a VM
// test (pdlib_add_vm_test, which skips with the reason where the VM cannot run).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "backends/verbs/verbs_transport.h"
#include "test/multiprocess/peer_harness.h"
#include "test/support/write_completions.h"
#include "test/verbs/verbs_test_util.h"

namespace spi = pdlib::spi;
using pdlib::Status;
using pdlib::StatusCode;
using pdlib::verbs::VerbsTransport;
using Completions = pdlib::testing::WriteCompletions;

namespace {

std::unique_ptr<VerbsTransport> MakeTransport(std::map<std::string, std::string> options = {}) {
  spi::TransportOptions o;
  o.options = std::move(options);
  auto t = VerbsTransport::Create(o);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

// An initiator and a target transport in this process, connected, with a source buffer on the
// initiator (`regions` local regions of `bytes` each) and one destination buffer of `bytes`.
struct Pair {
  std::unique_ptr<VerbsTransport> initiator, target;
  std::vector<std::vector<uint8_t>> src;
  std::vector<spi::LocalRegionId> src_regions;
  std::vector<uint8_t> dst;
  spi::LocalRegionId dst_region = 0;
  spi::TargetId target_id = 0;
  spi::PeerId peer = 0;
  spi::RemoteRegionId remote = 0;

  Pair(size_t bytes, const std::map<std::string, std::string>& options, size_t regions = 1,
       const std::map<std::string, std::string>& target_options = {}) {
    initiator = MakeTransport(options);
    target = MakeTransport(target_options.empty() ? options : target_options);
    src.resize(regions);
    for (size_t r = 0; r < regions; ++r) {
      src[r].resize(bytes);
      verbs_test::FillPattern(src[r].data(), bytes, uint32_t(100 + r));
      auto id = initiator->RegisterMemory({src[r].data(), bytes}, nullptr);
      REQUIRE(id.ok());
      src_regions.push_back(*id);
    }
    dst.assign(bytes, 0);
    spi::Blob key;
    auto d = target->RegisterMemory({dst.data(), bytes}, &key);
    REQUIRE(d.ok());
    dst_region = *d;
    auto ep = target->CreateTargetEndpoint();
    REQUIRE(ep.ok());
    target_id = ep->id;
    auto conn = initiator->Connect(ep->blob);
    INFO(conn.status().ToString());
    REQUIRE(conn.ok());
    REQUIRE(target->CompleteTargetEndpoint(ep->id, conn->reply).ok());
    peer = conn->peer;
    auto rr =
        initiator->ImportRemoteRegion(peer, {reinterpret_cast<uint64_t>(dst.data()), bytes, key});
    REQUIRE(rr.ok());
    remote = *rr;
  }
};

void RequireAllOk(Completions& done, size_t n) {
  REQUIRE(done.Wait(n, std::chrono::seconds(60)));
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  auto st = done.statuses();
  REQUIRE(st.size() == n);  // exactly once each
  for (const Status& s : st) {
    INFO(s.ToString());
    CHECK(s.ok());
  }
}

}  // namespace

TEST_CASE("verbs device: the transport opens a device and reports it") {
  auto t = MakeTransport();
  const auto labels = t->device_labels();
  REQUIRE(labels.size() == 1);
  std::printf("verbs_device_test: running on %s (max_sge %u, max message %llu bytes)\n",
              labels[0].c_str(), t->limits(0).max_sge,
              static_cast<unsigned long long>(t->limits(0).max_message_bytes));
  CHECK(t->capabilities().needs_reply);
  CHECK(t->capabilities().moves_bytes);
  auto by_name = spi::CreateTransport("verbs", {});  // what a KVManager naming "verbs" gets
  REQUIRE(by_name.ok());
  CHECK((*by_name)->name() == "verbs");
  spi::TransportOptions bad;
  bad.options = {{"verbs.devices", "no_such_device0"}};
  auto missing = VerbsTransport::Create(bad);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains(labels[0].substr(0, 4)));
}

TEST_CASE("verbs device: scattered pages and long writes under tight limits arrive byte for byte") {
  // 2 SGEs, 4 KiB messages, 8-deep send queue signalled every 3rd request, chains of 4 and a CQ
  // of 16: a batch needs many chains, waits for room often and wraps every counter.
  const std::map<std::string, std::string> tight = {
      {"verbs.max_sge", "2"},     {"verbs.max_message_bytes", "4096"}, {"verbs.sq_depth", "8"},
      {"verbs.cq_depth", "16"},   {"verbs.signal_every", "3"},         {"verbs.max_chain", "4"},
      {"verbs.busy_poll_us", "0"}};
  constexpr size_t kBytes = 1 << 20;
  Pair p(kBytes, tight);
  CHECK(p.initiator->limits(0).max_sge == 2);
  CHECK(p.initiator->limits(0).max_message_bytes == 4096);
  // 1 KiB pages: source page i (scattered, stride 3) goes to destination page i, so consecutive
  // destinations gather from scattered sources (SGE lists); then one 200 KiB write (split).
  constexpr uint64_t kPage = 1024, kPages = 256;
  std::vector<spi::WriteOp> ops;
  for (uint64_t i = 0; i < kPages; ++i) {
    ops.push_back({p.src_regions[0], (i * 3 % kPages) * kPage, p.remote, i * kPage, kPage});
  }
  const uint64_t long_off = kPages * kPage;
  ops.push_back({p.src_regions[0], long_off, p.remote, long_off + 1000, 200 * 1024});
  Completions done;
  constexpr int kBatches = 5;  // several batches queued at once share the small queue
  for (int b = 0; b < kBatches; ++b)
    REQUIRE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
  RequireAllOk(done, kBatches);
  for (uint64_t i = 0; i < kPages; ++i) {
    INFO("page " << i);
    REQUIRE(std::equal(p.dst.begin() + i * kPage, p.dst.begin() + (i + 1) * kPage,
                       p.src[0].begin() + (i * 3 % kPages) * kPage));
  }
  CHECK(std::equal(p.dst.begin() + long_off + 1000, p.dst.begin() + long_off + 1000 + 200 * 1024,
                   p.src[0].begin() + long_off));
  CHECK(std::all_of(p.dst.begin() + long_off, p.dst.begin() + long_off + 1000,
                    [](uint8_t b) { return b == 0; }));  // nothing outside the writes
}

TEST_CASE("verbs device: layers spread over two devices (rxe0 opened twice)") {
  // Two devices on each side: two QPs per peer; local regions alternate between them.
  auto probe = MakeTransport();
  const std::string name = probe->device_labels()[0];
  probe.reset();
  const std::string two = name + "," + name;
  constexpr size_t kBytes = 256 * 1024;
  Pair p(kBytes, {{"verbs.devices", two}}, 4);
  REQUIRE(p.initiator->device_labels().size() == 2);
  // Region r writes its quarter of the destination.
  std::vector<spi::WriteOp> ops;
  for (size_t r = 0; r < 4; ++r) {
    ops.push_back({p.src_regions[r], r * kBytes / 4, p.remote, r * kBytes / 4, kBytes / 4});
  }
  Completions done;
  REQUIRE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
  RequireAllOk(done, 1);
  for (size_t r = 0; r < 4; ++r) {
    INFO("region " << r);
    CHECK(!verbs_test::FindMismatch(p.dst.data() + r * kBytes / 4, kBytes / 4, uint32_t(100 + r),
                                    r * kBytes / 4));
  }
  // A key blob with one rkey cannot be imported for a two-QP peer.
  auto single = MakeTransport();
  std::vector<uint8_t> other(4096);
  spi::Blob one_key;
  REQUIRE(single->RegisterMemory({other.data(), other.size()}, &one_key).ok());
  auto refused = p.initiator->ImportRemoteRegion(p.peer, {1, 16, one_key});
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("has 2 devices"));
}

TEST_CASE("verbs device: deregistering memory with writes in flight is safe") {
  constexpr size_t kBytes = 2 << 20;
  Pair p(kBytes, {});
  Completions done;
  std::vector<spi::WriteOp> ops = {{p.src_regions[0], 0, p.remote, 0, kBytes}};
  for (int i = 0; i < 4; ++i) REQUIRE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
  REQUIRE(p.initiator->DeregisterMemory(p.src_regions[0]).ok());  // the batches keep their MRs
  CHECK_FALSE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
  RequireAllOk(done, 4);
  CHECK(!verbs_test::FindMismatch(p.dst.data(), kBytes, 100));
}

TEST_CASE("verbs device: Disconnect and destruction complete outstanding batches exactly once") {
  constexpr size_t kBytes = 4 << 20;
  Pair p(kBytes, {});
  std::vector<spi::WriteOp> ops = {{p.src_regions[0], 0, p.remote, 0, kBytes}};
  Completions done;
  constexpr int kBatches = 8;
  for (int i = 0; i < kBatches; ++i) {
    REQUIRE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
  }
  p.initiator->Disconnect(p.peer);  // returns once every callback has run
  auto st = done.statuses();
  CHECK(st.size() == size_t{kBatches});
  for (const Status& s : st) CHECK((s.ok() || s.code() == StatusCode::kCancelled));
  CHECK_FALSE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());

  Pair q(kBytes, {});
  Completions done2;
  for (int i = 0; i < kBatches; ++i) {
    REQUIRE(q.initiator->PostWrites(q.peer, ops, done2.Callback()).ok());
  }
  q.initiator.reset();
  auto st2 = done2.statuses();
  CHECK(st2.size() == size_t{kBatches});
  for (const Status& s : st2) CHECK((s.ok() || s.code() == StatusCode::kCancelled));
}

TEST_CASE("verbs device: blobs are checked against the connection") {
  Pair p(4096, {});
  auto ep = p.target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  // The endpoint is not a reply; a reply cannot complete a connected endpoint twice.
  CHECK_FALSE(p.target->CompleteTargetEndpoint(ep->id, ep->blob).ok());
  auto conn = p.initiator->Connect(ep->blob);
  REQUIRE(conn.ok());
  CHECK_FALSE(p.target->CompleteTargetEndpoint(ep->id + 100, conn->reply).ok());
  REQUIRE(p.target->CompleteTargetEndpoint(ep->id, conn->reply).ok());
  auto twice = p.target->CompleteTargetEndpoint(ep->id, conn->reply);
  CHECK(twice.code() == StatusCode::kFailedPrecondition);
  CHECK_FALSE(p.initiator->Connect(conn->reply).ok());  // a reply is not an endpoint
  p.target->CloseTargetEndpoint(ep->id);
}

TEST_CASE(
    "verbs device: a fence mid-transfer stops the writes, the fenced endpoint stays until closed") {
  // Default options: on rxe this also checks that retry_cnt 7 is not "retry forever" there.
  constexpr size_t kSlice = 1 << 20;
  constexpr int kBatches = 32;
  Pair p(kSlice * kBatches, {});
  REQUIRE(p.target->capabilities().fences);
  Completions done;
  for (int i = 0; i < kBatches; ++i) {  // each batch its own slice, so a late write shows
    const spi::WriteOp op{p.src_regions[0], i * kSlice, p.remote, i * kSlice, kSlice};
    REQUIRE(p.initiator->PostWrites(p.peer, std::span(&op, 1), done.Callback()).ok());
  }
  REQUIRE(done.Wait(1, std::chrono::seconds(60)));  // the rest are queued or in flight
  const Status fenced = p.target->FenceTarget(p.target_id);
  INFO(fenced.ToString());
  REQUIRE(fenced.ok());
  CHECK(p.target->FenceTarget(p.target_id).ok());  // idempotent
  CHECK(p.target->FenceTarget(p.target_id + 1000).code() == StatusCode::kNotFound);
  // rxe may still finish the one packet its responder is executing as the QP changes state; what
  // must never land is anything later: queued requests and retransmissions.
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::vector<uint8_t> at_fence = p.dst;
  REQUIRE(done.Wait(kBatches, std::chrono::seconds(20)));  // retries run out (~0.5 s)
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto statuses = done.statuses();
  REQUIRE(statuses.size() == size_t{kBatches});
  size_t failed = 0;
  for (const Status& s : statuses) {
    if (s.ok()) continue;
    ++failed;
    INFO(s.ToString());
    CHECK(s.code() == StatusCode::kUnavailable);
    CHECK_THAT(std::string(s.message()), Catch::Contains("retry counter exceeded"));
  }
  std::printf("verbs_device_test: %zu of %d batches failed after the fence\n", failed, kBatches);
  CHECK(failed >= 1);
  CHECK(p.dst == at_fence);
  CHECK(std::all_of(p.dst.end() - kSlice, p.dst.end(), [](uint8_t b) { return b == 0; }));
  Status later = p.initiator->PostWrites(p.peer, {}, done.Callback());
  CHECK(later.code() == StatusCode::kUnavailable);
  p.initiator->Disconnect(p.peer);
  p.target->CloseTargetEndpoint(p.target_id);
  CHECK(p.target->FenceTarget(p.target_id).code() == StatusCode::kNotFound);

  // An endpoint fenced before it is connected cannot be connected afterwards.
  auto ep = p.target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  REQUIRE(p.target->FenceTarget(ep->id).ok());
  auto conn = p.initiator->Connect(ep->blob);
  REQUIRE(conn.ok());
  CHECK(p.target->CompleteTargetEndpoint(ep->id, conn->reply).code() ==
        StatusCode::kFailedPrecondition);
  p.initiator->Disconnect(conn->peer);
  p.target->CloseTargetEndpoint(ep->id);
}

TEST_CASE(
    "verbs device: a target killed mid-transfer fails the batches with the work-completion "
    "status, a new connection succeeds") {
  // Short ACK timeout and few retries: the dead peer is found in well under a second.
  const std::vector<std::string> peer_options = {"verbs.timeout=12", "verbs.retry_cnt=3"};
  constexpr size_t kBytes = 4 << 20;
  pdlib_test::Scene scene;
  auto start_target = [&](const std::string& name) -> pdlib_test::PeerProcess& {
    std::vector<std::string> args = {std::to_string(kBytes)};
    args.insert(args.end(), peer_options.begin(), peer_options.end());
    return scene.Start(name, args, VERBS_TARGET_PEER_BINARY);
  };
  pdlib_test::PeerProcess& a = start_target("target-a");
  auto ready = a.WaitReady();
  SCENE_REQUIRE(scene, ready.count("endpoint") == 1);

  auto initiator = MakeTransport({{"verbs.timeout", "12"}, {"verbs.retry_cnt", "3"}});
  std::vector<uint8_t> src(kBytes);
  verbs_test::FillPattern(src.data(), kBytes, 7);
  auto src_region = initiator->RegisterMemory({src.data(), kBytes}, nullptr);
  REQUIRE(src_region.ok());

  // Connects to a target process; returns the peer and its remote region.
  auto connect = [&](pdlib_test::PeerProcess& t, std::map<std::string, std::string> fields) {
    auto endpoint = verbs_test::FromHex(fields["endpoint"]);
    auto key = verbs_test::FromHex(fields["key"]);
    SCENE_REQUIRE(scene, endpoint && key);
    auto conn = initiator->Connect(*endpoint);
    INFO(conn.status().ToString());
    SCENE_REQUIRE(scene, conn.ok());
    SCENE_REQUIRE(scene, t.Send("REPLY " + verbs_test::ToHex(conn->reply)));
    SCENE_REQUIRE(scene, t.Expect("CONNECTED").has_value());
    auto remote = initiator->ImportRemoteRegion(
        conn->peer, {std::stoull(fields["addr"]), std::stoull(fields["len"]), *key});
    SCENE_REQUIRE(scene, remote.ok());
    return std::make_pair(conn->peer, *remote);
  };
  auto [peer_a, remote_a] = connect(a, ready);
  const std::vector<spi::WriteOp> whole = {{*src_region, 0, remote_a, 0, kBytes}};
  {
    Completions first;
    REQUIRE(initiator->PostWrites(peer_a, whole, first.Callback()).ok());
    RequireAllOk(first, 1);
    SCENE_REQUIRE(scene, a.Send("CHECK 7"));
    SCENE_REQUIRE(scene, a.Expect("OK").has_value());
  }

  // Keep 1 MiB batches going, kill the target while they are in flight.
  Completions done;
  std::vector<spi::WriteOp> mib;
  for (uint64_t off = 0; off < kBytes; off += 1 << 20) {
    mib.push_back({*src_region, off, remote_a, off, 1 << 20});
  }
  constexpr int kBatches = 32;
  for (int i = 0; i < kBatches; ++i) {
    REQUIRE(
        initiator->PostWrites(peer_a, std::span(&mib[i % mib.size()], 1), done.Callback()).ok());
  }
  a.Kill(SIGKILL);
  SCENE_REQUIRE(scene, a.Wait(std::chrono::milliseconds(10000)) == 128 + SIGKILL);
  REQUIRE(done.Wait(kBatches, std::chrono::seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto statuses = done.statuses();
  REQUIRE(statuses.size() == size_t{kBatches});  // every batch completes, exactly once
  size_t failed = 0;
  std::string reason;
  for (const Status& s : statuses) {
    if (s.ok()) continue;
    ++failed;
    INFO(s.ToString());
    CHECK(s.code() == StatusCode::kUnavailable);
    CHECK_THAT(std::string(s.message()), Catch::Contains("work completion status"));
    if (reason.empty()) reason = s.ToString();
  }
  std::printf("verbs_device_test: %zu of %d batches in flight failed when the target died: %s\n",
              failed, kBatches, reason.c_str());
  CHECK(failed >= 1);
  // Later batches on the dead connection are refused with the same reason.
  Status later = initiator->PostWrites(peer_a, whole, done.Callback());
  CHECK(later.code() == StatusCode::kUnavailable);
  CHECK_THAT(std::string(later.message()), Catch::Contains("work completion status"));
  initiator->Disconnect(peer_a);

  // A new target process: a new connection, new QPs, and writes arrive.
  pdlib_test::PeerProcess& b = start_target("target-b");
  auto ready_b = b.WaitReady();
  SCENE_REQUIRE(scene, ready_b.count("endpoint") == 1);
  auto [peer_b, remote_b] = connect(b, ready_b);
  Completions after;
  const std::vector<spi::WriteOp> whole_b = {{*src_region, 0, remote_b, 0, kBytes}};
  REQUIRE(initiator->PostWrites(peer_b, whole_b, after.Callback()).ok());
  RequireAllOk(after, 1);
  SCENE_REQUIRE(scene, b.Send("CHECK 7"));
  SCENE_REQUIRE(scene, b.Expect("OK").has_value());
}
