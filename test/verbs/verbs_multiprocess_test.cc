// Two-process tests over the verbs backend, run inside the Soft-RoCE VM (test/rxe) on rxe0: a
// prefill and a decode process (pdlib_test_peer --backend verbs) on one device, the control
// plane on 127.0.0.1, the KV cache over RC QPs.
//  - Byte compare (pdlib_test_peer --verify, kv_pattern.h): prefill fills every page of every K
//    and V buffer it sends with a pattern of (room, buffer, page position, byte offset) and
//    writes the aux slot; decode checks every destination byte and the aux slot when a room
//    reaches Success. Several layouts, also under tight work-request limits (2 SGEs, 4 KiB
//    messages, an 8-deep send queue) and with two devices per side (rxe0 opened twice).
//  - Rails (issue #31): striped over rxe0+rxe1 and rxe0+rxe1+rxe2 (each on a netdev of its own),
//    every byte compared and each device's share of the sent packets checked.
//  - Negative control: a spoiled source byte or aux slot fails the room on decode.
//  - Kill: decode is killed while the last chunks of 8 rooms are being written; every one of
//    those prefill rooms ends (Failed, with a reason, unless it finished first), nothing is left
//    behind, and a restarted decode is served. Rooms with writes in flight fail with the RDMA
//    work-completion error (the gRPC stream reports the dead process first, but prefill waits for
//    the in-flight writes to resolve); the reasons are printed.
#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "test/multiprocess/byte_compare_pair.h"
#include "test/multiprocess/peer_harness.h"

using pdlib_test::Layout;
using pdlib_test::milliseconds;
using pdlib_test::PairResult;
using pdlib_test::PairTransport;
using pdlib_test::PeerArgs;
using pdlib_test::PeerProcess;
using pdlib_test::Scene;

namespace {

constexpr uint64_t kRooms = 24;
// The VM emulates its CPUs (about 60 MB/s through rxe): generous bounds.
constexpr milliseconds kRunTimeout{90000};

// A pair over verbs with `options`.
PairTransport Verbs(std::vector<std::string> options) {
  return {"verbs",     std::move(options),  milliseconds(60000),
          kRunTimeout, milliseconds(30000), {"--max-seconds", "200"}};
}

void RunLayouts(const std::vector<Layout>& layouts, const std::vector<std::string>& options) {
  pdlib_test::RunLayouts(Verbs(options), layouts, kRooms);
}

// Layer counts 1-32, items 64 B-256 KiB, up to 1024 pages per request, 1-4 chunks. Each layout
// starts a pair of processes, which takes seconds in the emulated VM: few layouts, varied.
const std::vector<Layout> kLayouts = {
    {16, 1024, 256, 32, 3}, {2, 65536, 64, 16, 3}, {32, 256, 256, 64, 4},
    {1, 64, 2048, 1024, 4}, {1, 262144, 16, 8, 2},
};

}  // namespace

TEST_CASE("verbs 1P1D on rxe: every room's KV pages and aux slot arrive byte for byte") {
  RunLayouts(kLayouts, {});
}

TEST_CASE("verbs 1P1D under tight work-request limits: 2 SGEs, 4 KiB messages, 8-deep queue") {
  RunLayouts({{2, 65536, 64, 16, 3}, {1, 64, 2048, 1024, 4}},
             {"verbs.max_sge=2", "verbs.max_message_bytes=4096", "verbs.sq_depth=8",
              "verbs.cq_depth=32", "verbs.signal_every=3", "verbs.max_chain=4"});
}

TEST_CASE("verbs 1P1D with two devices per side: layers spread over two QPs") {
  // One device opened twice gives each side two contexts, PDs, CQs and QPs.
  RunLayouts({{3, 4096, 256, 64, 2}}, {"verbs.devices=rxe0,rxe0"});
}

namespace {

// Packets device `name` has sent so far (rxe's hw counter), or -1 when it cannot be read.
int64_t SentPackets(const std::string& name) {
  std::FILE* f =
      std::fopen(("/sys/class/infiniband/" + name + "/ports/1/hw_counters/sent_pkts").c_str(), "r");
  if (f == nullptr) return -1;
  long long n = -1;
  if (std::fscanf(f, "%lld", &n) != 1) n = -1;
  std::fclose(f);
  return n;
}

// Rails (issue #31): every byte over `devices` (rxe0, rxe1, ... each on a netdev of its own in
// the VM), and each device carried a share of the packets: the batches are striped by bytes.
void CheckStripedOver(const std::vector<std::string>& devices) {
  std::vector<int64_t> before;
  for (const std::string& d : devices) {
    before.push_back(SentPackets(d));
    if (before.back() < 0) {
      WARN("SKIP: no " << d << " here (the VM brings up rxe0, rxe1 and rxe2)");
      return;
    }
  }
  std::string list;
  for (const std::string& d : devices) list += (list.empty() ? "" : ",") + d;
  // One layer, K pages of 64 KiB and V pages of 16 KiB, up to 32 pages a room: spreading whole
  // regions over the devices (as before striping) would put 80% on one device and leave a third
  // idle; striping by bytes evens them out.
  RunLayouts({{1, 65536, 64, 32, 2, 16384}}, {"verbs.devices=" + list});
  int64_t total = 0;
  std::vector<int64_t> sent;
  for (size_t i = 0; i < devices.size(); ++i) {
    sent.push_back(SentPackets(devices[i]) - before[i]);
    total += sent.back();
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    INFO(devices[i] << " sent " << sent[i] << " of " << total << " packets");
    std::printf("%s sent %lld packets of %lld\n", devices[i].c_str(),
                static_cast<long long>(sent[i]), static_cast<long long>(total));
    // Each device carries its share within a third (acks and control traffic aside).
    CHECK(sent[i] * int64_t(devices.size()) * 3 > total * 2);
  }
}

}  // namespace

TEST_CASE("verbs rails: a batch striped over two devices, each on its own netdev") {
  CheckStripedOver({"rxe0", "rxe1"});
}

TEST_CASE("verbs rails: a batch striped over three devices") {
  CheckStripedOver({"rxe0", "rxe1", "rxe2"});
}

TEST_CASE("verbs byte-compare negative control: a spoiled source byte or aux slot fails the room") {
  Scene scene;
  const Layout l{2, 1024, 256, 8, 2};
  const PairResult r = pdlib_test::RunPair(scene, l, Verbs({}), 0, 8,
                                           {"--corrupt-kv-room", "3", "--corrupt-aux-room", "5"});
  pdlib_test::CheckSpoiledRooms(r, 8, {{3, "BADBYTES buffer="}, {5, "BADBYTES aux.output_ids[0]="}},
                                scene);
}

TEST_CASE("verbs kill -9 decode mid-transfer: prefill rooms fail, a restarted decode is served") {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  // Rooms of 4 layers x 2 x 16 pages x 64 KiB = 8 MiB, in two chunks; every room's first chunk
  // is sent and its last one held (--hold transferring), then released just before the kill.
  auto args = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"--backend",
                                  "verbs",
                                  "--verify",
                                  "--layers",
                                  "4",
                                  "--item-bytes",
                                  "65536",
                                  "--pages-per-pool",
                                  "160",
                                  "--pages-per-request",
                                  "16",
                                  "--chunks",
                                  "2",
                                  "--concurrency",
                                  "8",
                                  "--max-seconds",
                                  "200",
                                  "--backend-option",
                                  "verbs.timeout=12",
                                  "--backend-option",
                                  "verbs.retry_cnt=3"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  PeerProcess& prefill =
      scene.Start("prefill", PeerArgs("prefill", bootstrap, args({"--start-bootstrap"})));
  SCENE_REQUIRE(scene, prefill.WaitReady(milliseconds(60000))["role"] == "prefill");
  PeerProcess& decode = scene.Start("decode", PeerArgs("decode", bootstrap, args({})));
  SCENE_REQUIRE(scene, decode.WaitReady(milliseconds(60000))["role"] == "decode");
  // A first batch succeeds, so the connection (and its QPs) exist.
  SCENE_REQUIRE(scene, prefill.Send("RUN 0 4"));
  SCENE_REQUIRE(scene, decode.RunBatch(0, 4, kRunTimeout) == 4);
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=0 ", kRunTimeout).has_value());

  constexpr uint64_t kHeld = 8;
  SCENE_REQUIRE(scene, prefill.Send("RUN 10 8 transferring") && decode.Send("RUN 10 8"));
  auto held = prefill.Expect("HELD first=10 ", kRunTimeout);
  SCENE_REQUIRE(scene, held.has_value());
  SCENE_REQUIRE(scene, pdlib_test::ParseCounters(*held)["held"] == kHeld);
  // The last chunks (32 MiB together) start to move; decode dies while they do.
  SCENE_REQUIRE(scene, prefill.Send("RESUME"));
  std::this_thread::sleep_for(milliseconds(30));
  decode.Kill(SIGKILL);
  SCENE_REQUIRE(scene, decode.Wait(milliseconds(10000)) == 128 + SIGKILL);

  SCENE_REQUIRE(scene, prefill.WaitRooms(10, kHeld, milliseconds(30000)));
  std::map<std::string, int> reasons;
  size_t failed = 0;
  for (uint64_t room = 10; room < 10 + kHeld; ++room) {
    const auto& outcome = prefill.rooms().at(room);
    if (outcome.state == "Success") continue;  // finished before the kill
    SCENE_CHECK(scene, outcome.state == "Failed");
    SCENE_CHECK(scene, outcome.reason.size() > 10);
    ++failed;
    // "UNAVAILABLE: room 12: ..." -> without the room, to group the rooms by cause.
    std::string reason = outcome.reason;
    if (size_t room_at = reason.find("room "); room_at != std::string::npos) {
      if (size_t colon = reason.find(": ", room_at); colon != std::string::npos) {
        reason.erase(room_at, colon + 2 - room_at);
      }
    }
    ++reasons[reason];
  }
  for (const auto& [reason, n] : reasons) {
    std::printf("verbs_multiprocess_test: %d of %d prefill rooms in flight failed with: %s\n", n,
                int(kHeld), reason.c_str());
  }
  SCENE_CHECK(scene, failed >= 1);
  // Rooms with writes in flight fail with the RDMA completion error (prefill keeps the dead
  // decode's QP until those writes resolve); a chunk still queued when the stream ended is not
  // sent; a room whose last chunk the test peer had not handed over yet fails with the stream.
  int completion_errors = 0;
  for (const auto& [reason, n] : reasons) {
    const bool wc = reason.find("work completion status") != std::string::npos;
    completion_errors += wc ? n : 0;
    INFO("reason: " << reason);
    SCENE_CHECK(scene, (wc || reason.find("(chunk not sent)") != std::string::npos ||
                        reason.find(": stream closed") != std::string::npos));
  }
  std::printf("verbs_multiprocess_test: %d of %zu failed rooms carry the work-completion error\n",
              completion_errors, failed);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitized prefill may not have posted any last chunk 30 ms after RESUME; then every room
  // fails with the stream or "chunk not sent".
#else
  SCENE_CHECK(scene, completion_errors >= 1);
#endif
  auto m = prefill.Metrics();
  SCENE_CHECK(scene, m["live_rooms"] == 0);
  SCENE_CHECK(scene, m["connections"] == 0);
  SCENE_CHECK(scene, m["aux_free"] == m["aux_capacity"]);

  // A restarted decode registers again: new QPs, and new requests succeed byte for byte.
  PeerProcess& decode2 = scene.Start("decode2", PeerArgs("decode", bootstrap, args({})));
  SCENE_REQUIRE(scene, decode2.WaitReady(milliseconds(60000))["role"] == "decode");
  SCENE_REQUIRE(scene, prefill.Send("RUN 100 6"));
  SCENE_REQUIRE(scene, decode2.RunBatch(100, 6, kRunTimeout) == 6);
  auto done = prefill.Expect("DONE first=100 ", kRunTimeout);
  SCENE_REQUIRE(scene, done.has_value());
  SCENE_CHECK(scene, pdlib_test::ParseCounters(*done)["ok"] == 6);
  SCENE_CHECK(scene, decode2.Quit(milliseconds(30000)) == 0);
  SCENE_CHECK(scene, prefill.Quit(milliseconds(30000)) == 0);
}
