// A frozen prefill never writes into a page decode has handed out again (issue #13, the page
// reuse rule of include/pdlib/kv_manager.h). Decode runs in this process, over its own pools, so
// the test can watch its pages; prefill is a pdlib_test_peer child the test freezes (SIGSTOP)
// while its request is in flight:
//   1. decode Init()s room 1 onto canary-filled pages; prefill sends its first chunk and holds
//      the last one (RUN ... transferring, two chunks); the first chunk lands;
//   2. SIGSTOP prefill, queue "RESUME" on its stdin (it reads it when it wakes), and let decode
//      fail the room through its liveness timeout;
//   3. quarantine (UCX puts, ucx.data_path=put: capabilities().fences is false): the pages stay not
//   reusable for
//      as long as prefill is frozen; SIGCONT; prefill wakes, may still write the last page (into
//      the quarantined page: harmless), drains, and only then are the pages reusable;
//      fence (UCX's am path, and verbs in the Soft-RoCE VM): decode fences the connection, so the
//      pages are reusable while prefill is still frozen; only then SIGCONT;
//   4. the engine reuses the pages (a new pattern in every KV page and the metadata slot), and
//      not one byte of it may change afterwards, whatever prefill does.
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <thread>

#include "pdlib/pdlib.h"
#include "test/multiprocess/kv_pattern.h"
#include "test/multiprocess/peer_harness.h"

namespace {

using namespace std::chrono_literals;
using pdlib::KVPoll;
using pdlib_test::PeerProcess;
using pdlib_test::Scene;

constexpr int kLayers = 2;
constexpr size_t kItemBytes = 4096;
constexpr size_t kPagesPerPool = 32;
constexpr uint8_t kCanary = 0xc5;
constexpr uint8_t kReused = 0x3c;
constexpr uint64_t kRoom = 1;

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

struct DecodeSide {
  std::vector<std::vector<uint8_t>> pools;  // a K and a V pool per layer
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;

  pdlib::Status Start(const std::string& backend, const std::vector<std::string>& options,
                      uint16_t bootstrap) {
    pools.assign(2 * kLayers, std::vector<uint8_t>(kPagesPerPool * kItemBytes, kCanary));
    aux = std::move(*pdlib::MetadataBuffers::Create(pdlib::MetadataBuffers::SlotCountFor(16), 0,
                                                    0));  // what pdlib_test_peer registers
    pdlib::KVManagerOptions o;
    o.mode = pdlib::Mode::kDecode;
    o.backend = backend;
    for (const std::string& kv : options) {
      const size_t eq = kv.find('=');
      o.backend_options[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    o.bootstrap_host = "127.0.0.1";
    o.bootstrap_port = bootstrap;
    o.liveness_timeout = 1000ms;
    o.connect_timeout = 2000ms;
    o.transfer_timeout = 60000ms;  // only the frozen prefill's liveness fails the room
    for (auto& pool : pools) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pool.data()));
      o.args.kv.lens.push_back(pool.size());
      o.args.kv.item_lens.push_back(kItemBytes);
    }
    o.args.aux = aux->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {kLayers, 8, 128, 2, 1, "pdlib-test-model"};
    auto m = pdlib::KVManager::Create(o);
    if (!m.ok()) return m.status();
    manager = std::move(*m);
    return pdlib::Status::OK();
  }

  uint8_t* Page(size_t buffer, int32_t page) {
    return pools[buffer].data() + size_t(page) * kItemBytes;
  }
  // Pages at `positions` of `pages` that hold prefill's pattern for room kRoom in every buffer.
  size_t Landed(const std::vector<int32_t>& pages, std::vector<size_t> positions) {
    size_t n = 0;
    for (size_t pos : positions) {
      bool all = true;
      for (size_t b = 0; b < pools.size(); ++b) {
        all &= !pdlib_test::VerifyPage(Page(b, pages[pos]), kItemBytes, kRoom, uint32_t(b),
                                       uint32_t(pos))
                    .has_value();
      }
      n += all ? 1 : 0;
    }
    return n;
  }
};

// Runs the scenario over `backend`; `fences` says which path decode must take.
void FrozenPrefillNeverWritesReusedPages(const std::string& backend,
                                         const std::vector<std::string>& options, bool fences) {
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  std::vector<std::string> pextra = {"--start-bootstrap",
                                     "--backend",
                                     backend,
                                     "--verify",
                                     "--layers",
                                     std::to_string(kLayers),
                                     "--item-bytes",
                                     std::to_string(kItemBytes),
                                     "--pages-per-pool",
                                     std::to_string(kPagesPerPool),
                                     "--pages-per-request",
                                     "4",
                                     "--chunks",
                                     "2",
                                     "--transfer-timeout-ms",
                                     "60000",
                                     "--waiting-timeout-ms",
                                     "60000"};
  for (const std::string& o : options) {
    pextra.push_back("--backend-option");
    pextra.push_back(o);
  }
  PeerProcess& prefill = scene.Start("prefill", pdlib_test::PeerArgs("prefill", bootstrap, pextra));
  SCENE_REQUIRE(scene, !prefill.WaitReady().empty());

  DecodeSide decode;
  const pdlib::Status started = decode.Start(backend, options, bootstrap);
  INFO(started.ToString());
  REQUIRE(started.ok());
  auto receiver = decode.manager->CreateReceiver({"127.0.0.1", bootstrap}, kRoom);
  REQUIRE(receiver.ok());
  auto& r = *receiver;
  SCENE_REQUIRE(scene, WaitFor([&] { return r->Poll() == KVPoll::kWaitingForInput; }, 20s));
  const std::vector<int32_t> pages = {5, 17, 2, 29};
  const uint32_t slot = 3;
  REQUIRE(r->Init(pages, slot).ok());

  // 1. Everything but the last page goes; the last is held by prefill's engine.
  SCENE_REQUIRE(scene, prefill.Send("RUN 1 1 transferring"));
  SCENE_REQUIRE(scene, prefill.Expect("HELD").has_value());
  SCENE_REQUIRE(scene, WaitFor([&] { return decode.Landed(pages, {0}) == 1; }, 20s));
  CHECK(decode.Landed(pages, {3}) == 0);

  // 2. Freeze prefill with its last chunk due as soon as it wakes; decode fails the room.
  prefill.Kill(SIGSTOP);
  SCENE_REQUIRE(scene, prefill.Send("RESUME"));
  SCENE_REQUIRE(scene, WaitFor([&] { return r->Poll() == KVPoll::kFailed; }, 20s));
  INFO("decode's reason: " << r->FailureReason().ToString());

  // Fill the reused pages and slot with the new request's bytes; check that they stay.
  auto reuse = [&] {
    for (size_t b = 0; b < decode.pools.size(); ++b) {
      for (int32_t p : pages) std::memset(decode.Page(b, p), kReused, kItemBytes);
    }
    for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
      auto row = decode.aux->Row(pdlib::MetadataField(f), slot);
      std::memset(row.data(), kReused, row.size());
    }
  };
  auto changed = [&] {
    size_t bad = 0;
    for (size_t b = 0; b < decode.pools.size(); ++b) {
      for (int32_t p : pages) {
        const uint8_t* page = decode.Page(b, p);
        bad +=
            size_t(std::count_if(page, page + kItemBytes, [](uint8_t x) { return x != kReused; }));
      }
    }
    for (int f = 0; f < pdlib::kMetadataFieldCount; ++f) {
      auto row = decode.aux->Row(pdlib::MetadataField(f), slot);
      bad += size_t(std::count_if(row.begin(), row.end(),
                                  [](std::byte x) { return x != std::byte{kReused}; }));
    }
    return bad;
  };

  if (fences) {
    // 3. Fence: reusable while prefill is still frozen.
    SCENE_REQUIRE(scene, WaitFor([&] { return r->PagesReusable(); }, 10s));
    const auto m = decode.manager->metrics();
    CHECK(m.fenced_connections >= 1);
    CHECK(m.quarantine_released_fenced == 1);
    reuse();
    prefill.Kill(SIGCONT);  // it wakes and sends the last chunk into a fenced connection
    SCENE_REQUIRE(scene, prefill.WaitRooms(kRoom, 1, 30s));
    std::this_thread::sleep_for(1s);
  } else {
    // 3. Quarantine: not reusable for as long as prefill is frozen.
    std::this_thread::sleep_for(2s);
    CHECK_FALSE(r->PagesReusable());
    const auto m = decode.manager->metrics();
    CHECK(m.quarantined_rooms == 1);
    CHECK(m.quarantined_pages == pages.size() + 1);
    prefill.Kill(SIGCONT);
    SCENE_REQUIRE(scene, WaitFor([&] { return r->PagesReusable(); }, 20s));
    const auto after = decode.manager->metrics();
    CHECK(after.quarantined_rooms == 0);
    CHECK(after.quarantine_released_drained + after.quarantine_released_gone == 1);
    std::printf("%s: quarantine held %llu ms; prefill's late write of the last page %s\n",
                backend.c_str(), static_cast<unsigned long long>(after.quarantine_max_hold_ms),
                decode.Landed(pages, {3}) == 1 ? "landed in the quarantined page"
                                               : "was not made (its room failed first)");
    reuse();
    SCENE_REQUIRE(scene, prefill.WaitRooms(kRoom, 1, 30s));
    std::this_thread::sleep_for(1s);
  }
  // 4. Not one byte of the new request's pages changed.
  CHECK(changed() == 0);
  // Prefill's own view may be either: it may have finished its writes (into the quarantined
  // pages) before it noticed that decode had given up.
  CHECK(prefill.rooms().count(kRoom) == 1);
  r.reset();
  decode.manager.reset();
  SCENE_CHECK(scene, prefill.Quit() == 0);
}

}  // namespace

// UCX's default data path for memory the engine allocated is pdlib's own active messages, which
// decode fences; with UCX puts (ucx.data_path=put) it cannot and quarantines instead.
TEST_CASE("fence over ucx shm (am path): a frozen prefill never writes into a reused page") {
  FrozenPrefillNeverWritesReusedPages("ucx", {"ucx.tls=shm"}, true);
}

TEST_CASE("fence over ucx tcp (am path): a frozen prefill never writes into a reused page") {
  FrozenPrefillNeverWritesReusedPages("ucx", {"ucx.tls=tcp", "ucx.net_devices=lo"}, true);
}

TEST_CASE("quarantine over ucx shm (put path): a frozen prefill never writes into a reused page") {
  FrozenPrefillNeverWritesReusedPages("ucx", {"ucx.tls=shm", "ucx.data_path=put"}, false);
}

TEST_CASE("quarantine over ucx tcp (put path): a frozen prefill never writes into a reused page") {
  FrozenPrefillNeverWritesReusedPages(
      "ucx", {"ucx.tls=tcp", "ucx.net_devices=lo", "ucx.data_path=put"}, false);
}

// Needs an RDMA device: run in the Soft-RoCE VM (test/verbs, quarantine_stop_rxe).
TEST_CASE("fence over verbs: a frozen prefill never writes into a reused page", "[.][verbs]") {
  FrozenPrefillNeverWritesReusedPages("verbs", {}, true);
}
