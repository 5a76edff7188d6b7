// The UCX backend's own tests, beyond the conformance suite every backend passes: byte-exact
// writes with random layouts over shared memory and tcp, UCX-allocated memory, and the failure
// paths (a dead peer, Disconnect and destruction with writes in flight), which must end every
// batch exactly once and never hang. The pure pieces are in ucx_options_test.cc.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "lib/base/crc32c.h"
#include "pdlib/kv_pool.h"
#include "pdlib/spi/transport.h"
#include "test/support/write_completions.h"

namespace spi = pdlib::spi;
using pdlib::Status;
using pdlib::StatusCode;

namespace {

using Clock = std::chrono::steady_clock;

using Completions = pdlib::testing::WriteCompletions;

std::unique_ptr<spi::Transport> MakeUcx(const std::string& tls,
                                        std::map<std::string, std::string> extra = {}) {
  spi::TransportOptions options;
  options.options = std::move(extra);
  options.options["ucx.tls"] = tls;
  if (tls == "tcp") options.options["ucx.net_devices"] = "lo";
  auto transport = spi::CreateTransport("ucx", options);
  INFO(transport.status().ToString());
  REQUIRE(transport.ok());
  return std::move(*transport);
}

// An initiator connected to a target, with the target's regions imported.
struct Link {
  std::unique_ptr<spi::Transport> initiator, target;
  spi::PeerId peer = 0;
  spi::TargetId target_id = 0;
};

Link Connect(std::unique_ptr<spi::Transport> initiator, std::unique_ptr<spi::Transport> target) {
  Link link{std::move(initiator), std::move(target)};
  auto ep = link.target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  link.target_id = ep->id;
  auto conn = link.initiator->Connect(ep->blob);
  INFO(conn.status().ToString());
  REQUIRE(conn.ok());
  link.peer = conn->peer;
  return link;
}

// Registers `bytes` at `data` on the target and imports it on the initiator.
spi::RemoteRegionId ExportRegion(Link& link, uint8_t* data, size_t bytes) {
  spi::Blob key;
  auto local = link.target->RegisterMemory({data, bytes}, &key);
  REQUIRE(local.ok());
  auto remote =
      link.initiator->ImportRemoteRegion(link.peer, {reinterpret_cast<uint64_t>(data), bytes, key});
  INFO(remote.status().ToString());
  REQUIRE(remote.ok());
  return *remote;
}

void FillRandom(std::vector<uint8_t>& v, std::mt19937_64& rng) {
  for (size_t i = 0; i + 8 <= v.size(); i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (size_t i = v.size() & ~size_t{7}; i < v.size(); ++i) v[i] = static_cast<uint8_t>(rng());
}

// Index of the first byte where `a` and `b` differ (a.size() when equal), so a failure
// says where instead of printing megabytes.
size_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return static_cast<size_t>(ia - a.begin());
}

}  // namespace

TEST_CASE("ucx transports refuse bad options and CUDA memory this UCX cannot map") {
  spi::TransportOptions bogus;
  bogus.options["ucx.bogus"] = "1";
  auto bad = spi::CreateTransport("ucx", bogus);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);

  spi::TransportOptions no_tls;
  no_tls.options["ucx.tls"] = "no_such_transport";
  auto none = spi::CreateTransport("ucx", no_tls);
  if (none.ok()) {  // some UCX versions accept the context and fail at endpoint creation
    auto ep = (*none)->CreateTargetEndpoint();
    if (ep.ok()) CHECK_FALSE((*none)->Connect(ep->blob).ok());
  }

  auto t = MakeUcx("shm");
  if (!t->capabilities().supports_cuda_memory) {
    std::vector<uint8_t> buffer(4096);
    spi::Blob key;
    auto r = t->RegisterMemory({buffer.data(), buffer.size(), pdlib::MemoryKind::kCuda, 0}, &key);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    auto m = pdlib::AllocateKVPool("ucx", 4096, pdlib::MemoryKind::kCuda, {{"ucx.tls", "shm"}});
    CHECK(m.status().code() == StatusCode::kFailedPrecondition);
  } else {
    WARN("this UCX supports CUDA memory: exercised only where a GPU is present");
  }
}

// The endpoint blob lists one worker address per rail (ucx.rails); Connect checks the list
// before it hands anything to UCX.
TEST_CASE("ucx refuses endpoint blobs whose rail list is malformed") {
  auto target = MakeUcx("shm");
  auto initiator = MakeUcx("shm");
  auto ep = target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  constexpr size_t kRailsAt = 8 + 12;  // blob header, then target id and flags
  auto with_rails = [&](uint32_t rails) {
    spi::Blob blob = ep->blob;
    std::memcpy(blob.data() + kRailsAt, &rails, sizeof(rails));
    return blob;
  };
  spi::Blob trailing = ep->blob;
  trailing.push_back(0);
  spi::Blob cut = ep->blob;
  cut.erase(cut.end() - 3, cut.end());
  for (const auto& [what, blob] :
       std::vector<std::pair<std::string, spi::Blob>>{{"no rail", with_rails(0)},
                                                      {"too many rails", with_rails(9)},
                                                      {"a rail past the end", with_rails(2)},
                                                      {"bytes after the last rail", trailing},
                                                      {"an address cut short", cut}}) {
    INFO(what);
    auto conn = initiator->Connect(blob);
    REQUIRE_FALSE(conn.ok());
    CHECK(conn.status().code() == StatusCode::kInvalidArgument);
    CHECK(std::string(conn.status().message()).find("rail") != std::string::npos);
  }
  CHECK(initiator->Connect(ep->blob).ok());
}

// Random layouts: several source regions, one destination region per batch in flight, ops of
// 64 B to 256 KiB, 1 to 4096 per batch, scattered or contiguous, and the whole destination
// compared with an expected image (so stray writes are caught, not just missing ones).
TEST_CASE("ucx writes are byte-exact for random layouts over shm and tcp") {
  struct Config {
    std::string tls;
    std::map<std::string, std::string> extra;
  };
  const std::vector<Config> configs = {
      {"shm", {}},
      {"tcp", {}},
      // Small chunks and window: every 256 KiB op is split and most of each batch waits.
      {"shm", {{"ucx.chunk_bytes", "48k"}, {"ucx.max_inflight_bytes", "160k"}}},
      {"tcp", {{"ucx.chunk_bytes", "48k"}, {"ucx.max_inflight_bytes", "160k"}}},
      {"shm", {{"ucx.flush", "worker"}}},
      // UCX puts (emulated here) instead of pdlib's active messages; odd message sizes.
      {"shm", {{"ucx.data_path", "put"}}},
      {"tcp", {{"ucx.data_path", "put"}}},
      {"tcp", {{"ucx.am_chunk_bytes", "5000"}, {"ucx.max_inflight_bytes", "64k"}}},
  };
  constexpr size_t kSources = 3, kSourceBytes = size_t{4} << 20;
  constexpr size_t kBatches = 8, kDestBytes = size_t{4} << 20;
  const uint64_t sizes[] = {64, 100, 4096, 32768, 65536 + 3, 262144};

  for (size_t c = 0; c < configs.size(); ++c) {
    const Config& config = configs[c];
    std::mt19937_64 rng(1000 + c);
    INFO("tls " << config.tls << ", config " << c);
    Link link = Connect(MakeUcx(config.tls, config.extra), MakeUcx(config.tls, config.extra));

    std::vector<std::vector<uint8_t>> src(kSources, std::vector<uint8_t>(kSourceBytes));
    std::vector<spi::LocalRegionId> src_ids;
    for (auto& s : src) {
      FillRandom(s, rng);
      spi::Blob unused;
      auto id = link.initiator->RegisterMemory({s.data(), s.size()}, &unused);
      REQUIRE(id.ok());
      src_ids.push_back(*id);
    }
    std::vector<std::vector<uint8_t>> dst(kBatches, std::vector<uint8_t>(kDestBytes, 0));
    std::vector<spi::RemoteRegionId> dst_ids;
    for (auto& d : dst) dst_ids.push_back(ExportRegion(link, d.data(), d.size()));

    for (int round = 0; round < 4; ++round) {
      std::vector<std::vector<uint8_t>> expected = dst;
      std::vector<std::vector<spi::WriteOp>> batches(kBatches);
      for (size_t b = 0; b < kBatches; ++b) {
        const uint64_t size = sizes[rng() % std::size(sizes)];
        const uint64_t slots = kDestBytes / size;
        const uint64_t count = 1 + rng() % std::min<uint64_t>(4096, slots);
        const bool contiguous = rng() % 2 == 0;
        std::vector<uint64_t> slot(slots);
        std::iota(slot.begin(), slot.end(), 0);
        if (!contiguous) std::shuffle(slot.begin(), slot.end(), rng);
        const uint64_t first = contiguous ? rng() % (slots - count + 1) : 0;
        for (uint64_t i = 0; i < count; ++i) {
          size_t s = rng() % kSources;
          uint64_t src_offset = rng() % (kSourceBytes - size + 1);
          uint64_t dst_offset = slot[first + i] * size;
          batches[b].push_back({src_ids[s], src_offset, dst_ids[b], dst_offset, size});
          std::memcpy(expected[b].data() + dst_offset, src[s].data() + src_offset, size);
        }
      }
      Completions done;
      for (auto& ops : batches) {
        REQUIRE(link.initiator->PostWrites(link.peer, ops, done.Callback()).ok());
      }
      REQUIRE(done.Wait(kBatches));
      for (const Status& s : done.statuses()) CHECK(s.ok());
      for (size_t b = 0; b < kBatches; ++b) {
        INFO("round " << round << " batch " << b << ": " << batches[b].size() << " ops of "
                      << batches[b][0].length << " bytes");
        CHECK(FirstDifference(dst[b], expected[b]) == kDestBytes);
      }
    }
  }
}

// The "am" data path (the default here: no RDMA transport): the target applies each message
// itself, so it refuses what lies outside memory it registered, and a fence drops everything
// the initiator sends afterwards. Neither holds for puts, which the target does not see.
TEST_CASE("ucx am path: the target refuses writes outside its memory and fences a peer") {
  for (std::string tls : {"shm", "tcp"}) {
    INFO("tls " << tls);
    Link link = Connect(MakeUcx(tls), MakeUcx(tls));
    CHECK(link.target->capabilities().fences);
    constexpr size_t kBytes = 65536;
    std::vector<uint8_t> src(2 * kBytes), dst(2 * kBytes, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
    spi::Blob unused;
    auto src_id = link.initiator->RegisterMemory({src.data(), src.size()}, &unused);
    REQUIRE(src_id.ok());
    // The target registers the first half only; the initiator is told (falsely) it may write
    // both halves, as a buggy or hostile prefill would believe.
    spi::Blob key;
    auto local = link.target->RegisterMemory({dst.data(), kBytes}, &key);
    REQUIRE(local.ok());
    auto forged = link.initiator->ImportRemoteRegion(
        link.peer, {reinterpret_cast<uint64_t>(dst.data()), 2 * kBytes, key});
    REQUIRE(forged.ok());

    {  // inside: lands
      Completions done;
      spi::WriteOp op{*src_id, 0, *forged, 0, kBytes};
      REQUIRE(link.initiator->PostWrites(link.peer, std::span(&op, 1), done.Callback()).ok());
      REQUIRE(done.Wait(1));
      CHECK(done.statuses()[0].ok());
      CHECK(std::memcmp(dst.data(), src.data(), kBytes) == 0);
    }
    {  // straddling the end of the registered half: refused, and not a byte past it written
      Completions done;
      spi::WriteOp op{*src_id, 0, *forged, kBytes - 4096, 3 * 4096};
      REQUIRE(link.initiator->PostWrites(link.peer, std::span(&op, 1), done.Callback()).ok());
      REQUIRE(done.Wait(1));
      const Status st = done.statuses()[0];
      INFO(st.ToString());
      CHECK_FALSE(st.ok());
      CHECK(std::string(st.message()).find("outside its registered memory") != std::string::npos);
      CHECK(std::all_of(dst.begin() + kBytes, dst.end(), [](uint8_t b) { return b == 0; }));
    }
    // Fenced: nothing lands any more and no batch completes OK; the connection is failed.
    REQUIRE(link.target->FenceTarget(link.target_id).ok());
    std::fill(dst.begin(), dst.end(), 0);
    Completions done;
    int posted = 0;
    for (int i = 0; i < 4; ++i) {
      spi::WriteOp op{*src_id, 0, *forged, 0, kBytes};
      posted += link.initiator->PostWrites(link.peer, std::span(&op, 1), done.Callback()).ok();
    }
    REQUIRE(done.Wait(posted, std::chrono::seconds(20)));
    for (const Status& st : done.statuses()) {
      INFO(st.ToString());
      CHECK_FALSE(st.ok());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
  }
}

// Reads on the "am" path (pull over tcp, or shm into memory UCX did not allocate): the target
// answers each read request itself, so it refuses a range outside the region the request names
// (and discloses nothing of the memory around it), keeps serving the connection afterwards, and
// a fence makes it refuse every later request: a target in pull claims to fence.
TEST_CASE("ucx am path reads: byte-exact, refused outside the region, fenced by the target") {
  for (std::string tls : {"shm", "tcp"}) {
    INFO("tls " << tls);
    spi::TransportOptions target_options;
    target_options.options["ucx.tls"] = tls;
    if (tls == "tcp") target_options.options["ucx.net_devices"] = "lo";
    target_options.direction = pdlib::TransferDirection::kPull;
    auto target = spi::CreateTransport("ucx", target_options);
    REQUIRE(target.ok());
    Link link = Connect(MakeUcx(tls), std::move(*target));
    CHECK(link.target->capabilities().fences);
    constexpr size_t kBytes = 256 * 1024;
    // The target's memory: a registered first half, a secret second half.
    std::vector<uint8_t> memory(2 * kBytes);
    for (size_t i = 0; i < memory.size(); ++i) memory[i] = static_cast<uint8_t>(i * 11 + 3);
    std::fill(memory.begin() + kBytes, memory.end(), 0x5e);
    std::vector<uint8_t> dst(2 * kBytes, 0xee);
    spi::Blob unused;
    auto dst_id = link.initiator->RegisterMemory({dst.data(), dst.size()}, &unused);
    REQUIRE(dst_id.ok());
    spi::Blob key;
    auto local = link.target->RegisterMemory({memory.data(), kBytes}, &key);
    REQUIRE(local.ok());
    // The initiator believes (falsely) it may read both halves, as a hostile decode would claim.
    auto forged = link.initiator->ImportRemoteRegion(
        link.peer, {reinterpret_cast<uint64_t>(memory.data()), 2 * kBytes, key});
    REQUIRE(forged.ok());
    auto read = [&](const std::vector<spi::ReadOp>& ops) {
      Completions done;
      REQUIRE(link.initiator->PostReads(link.peer, ops, done.Callback()).ok());
      REQUIRE(done.Wait(1, std::chrono::seconds(20)));
      return done.statuses()[0];
    };

    {  // inside, in 32 KiB pages in reverse order and one long read: byte-exact
      std::vector<spi::ReadOp> ops;
      for (uint64_t off = 0; off < kBytes / 2; off += 32768) {
        ops.push_back({*dst_id, off, *forged, kBytes / 2 - 32768 - off, 32768});
      }
      ops.push_back({*dst_id, kBytes / 2, *forged, kBytes / 2, kBytes / 2});
      const Status st = read(ops);
      INFO(st.ToString());
      REQUIRE(st.ok());
      for (uint64_t off = 0; off < kBytes / 2; off += 32768) {
        CHECK(std::memcmp(dst.data() + off, memory.data() + kBytes / 2 - 32768 - off, 32768) == 0);
      }
      CHECK(std::memcmp(dst.data() + kBytes / 2, memory.data() + kBytes / 2, kBytes / 2) == 0);
    }
    std::fill(dst.begin(), dst.end(), 0xee);
    {  // straddling the end of the region: refused, nothing of the secret half disclosed
      const Status st = read({{*dst_id, 0, *forged, kBytes - 4096, 3 * 4096}});
      INFO(st.ToString());
      CHECK(st.code() == StatusCode::kUnavailable);
      CHECK(std::string(st.message()).find("outside its registered memory") != std::string::npos);
      CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0xee; }));
    }
    {  // a key naming a region the target never registered: refused the same way
      spi::Blob bogus = key;
      const uint32_t region = 999;
      std::memcpy(bogus.data() + 12, &region, sizeof(region));  // header (8), flags (4), id
      auto id = link.initiator->ImportRemoteRegion(
          link.peer, {reinterpret_cast<uint64_t>(memory.data()), kBytes, bogus});
      REQUIRE(id.ok());
      const Status st = read({{*dst_id, 0, *id, 0, 4096}});
      CHECK(st.code() == StatusCode::kUnavailable);
      CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0xee; }));
    }
    {  // the connection still serves reads inside the region
      const Status st = read({{*dst_id, 0, *forged, 0, kBytes}});
      INFO(st.ToString());
      CHECK(st.ok());
      CHECK(std::memcmp(dst.data(), memory.data(), kBytes) == 0);
    }
    // Fenced: every later read fails, nothing more lands, and the connection is failed.
    REQUIRE(link.target->FenceTarget(link.target_id).ok());
    std::fill(dst.begin(), dst.end(), 0xee);
    Completions done;
    int posted = 0;
    for (int i = 0; i < 4; ++i) {
      spi::ReadOp op{*dst_id, 0, *forged, 0, kBytes};
      posted += link.initiator->PostReads(link.peer, std::span(&op, 1), done.Callback()).ok();
    }
    REQUIRE(done.Wait(posted, std::chrono::seconds(20)));
    for (const Status& st : done.statuses()) {
      INFO(st.ToString());
      CHECK_FALSE(st.ok());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0xee; }));
  }
}

// Disconnect and destruction with "am" reads in flight: every batch ends exactly once (OK or
// cancelled), and no reply lands after its callback.
TEST_CASE("ucx am reads: Disconnect and destruction end every read batch exactly once") {
  for (std::string tls : {"shm", "tcp"}) {
    for (bool destroy : {false, true}) {
      INFO("tls " << tls << (destroy ? ", destroy" : ", disconnect"));
      Link link = Connect(MakeUcx(tls, {{"ucx.max_inflight_bytes", "256k"}}), MakeUcx(tls));
      constexpr size_t kBytes = size_t{8} << 20;
      std::vector<uint8_t> src(kBytes, 3), dst(kBytes, 0);
      spi::Blob unused;
      auto dst_id = link.initiator->RegisterMemory({dst.data(), kBytes}, &unused);
      REQUIRE(dst_id.ok());
      spi::RemoteRegionId remote = ExportRegion(link, src.data(), kBytes);
      std::vector<spi::ReadOp> ops;
      for (uint64_t off = 0; off < kBytes; off += 32768)
        ops.push_back({*dst_id, off, remote, off, 32768});
      Completions done;
      constexpr size_t kPosted = 16;
      for (size_t i = 0; i < kPosted; ++i) {
        REQUIRE(link.initiator->PostReads(link.peer, ops, done.Callback()).ok());
      }
      if (destroy) {
        link.initiator.reset();
      } else {
        link.initiator->Disconnect(link.peer);
        CHECK(done.statuses().size() == kPosted);
      }
      REQUIRE(done.Wait(kPosted, std::chrono::seconds(30)));
      // Nothing lands after the callbacks: a reply still in flight is dropped.
      std::fill(dst.begin(), dst.end(), 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
      for (const Status& s : done.statuses()) {
        INFO(s.ToString());
        CHECK((s.ok() || s.code() == StatusCode::kCancelled));
      }
    }
  }
}

TEST_CASE("ucx claims to fence only where no peer writes its memory directly") {
  CHECK_FALSE(MakeUcx("shm", {{"ucx.data_path", "put"}})->capabilities().fences);
  {
    auto t = MakeUcx("shm", {{"ucx.data_path", "put"}});
    auto ep = t->CreateTargetEndpoint();
    REQUIRE(ep.ok());
    CHECK(t->FenceTarget(ep->id).code() == StatusCode::kUnimplemented);
  }
  // A pool UCX allocated over posix/sysv is memcpy'd into by the peer itself: puts, no fence.
  auto t = MakeUcx("shm");
  CHECK(t->capabilities().fences);
  auto pool = pdlib::AllocateKVPool("ucx", 1 << 20, pdlib::MemoryKind::kHost, {{"ucx.tls", "shm"}});
  REQUIRE(pool.ok());
  spi::Blob key;
  auto id = t->RegisterMemory({(*pool)->data(), (*pool)->size()}, &key);
  REQUIRE(id.ok());
  CHECK_FALSE(t->capabilities().fences);
  auto ep = t->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  CHECK(t->FenceTarget(ep->id).code() == StatusCode::kFailedPrecondition);
  REQUIRE(t->DeregisterMemory(*id).ok());
  CHECK(t->capabilities().fences);
  t.reset();
}

// KV pools allocated with the transports' options share their UCP context, so registering a
// range inside one reuses UCX's mapping (ucx_context.h); a pool allocated with other options is
// mapped again by the transport and must work all the same.
TEST_CASE("ucx registers ranges of KV pools, allocated with the same options or not") {
  for (bool same_options : {true, false}) {
    INFO((same_options ? "pool options = transport options" : "pool options differ"));
    Link link = Connect(MakeUcx("shm"), MakeUcx("shm"));
    constexpr size_t kBytes = size_t{1} << 20;
    const std::map<std::string, std::string> pool_options =
        same_options ? std::map<std::string, std::string>{{"ucx.tls", "shm"}}
                     : std::map<std::string, std::string>{{"ucx.tls", "shm,self"}};
    auto src_mem = pdlib::AllocateKVPool("ucx", kBytes, pdlib::MemoryKind::kHost, pool_options);
    auto dst_mem = pdlib::AllocateKVPool("ucx", kBytes, pdlib::MemoryKind::kHost, pool_options);
    REQUIRE(src_mem.ok());
    REQUIRE(dst_mem.ok());
    REQUIRE((*dst_mem)->size() >= kBytes);
    auto* src = static_cast<uint8_t*>((*src_mem)->data());
    auto* dst = static_cast<uint8_t*>((*dst_mem)->data());
    for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
    std::memset(dst, 0, kBytes);

    spi::Blob unused;
    auto src_id = link.initiator->RegisterMemory({src, kBytes}, &unused);
    REQUIRE(src_id.ok());
    // A range inside the allocation, not at its start.
    const size_t half = kBytes / 2;
    spi::RemoteRegionId remote = ExportRegion(link, dst + half, half);
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < half; off += 4096) {
      ops.push_back({*src_id, off, remote, off, 4096});
    }
    Completions done;
    REQUIRE(link.initiator->PostWrites(link.peer, ops, done.Callback()).ok());
    REQUIRE(done.Wait(1));
    CHECK(done.statuses()[0].ok());
    CHECK(std::memcmp(dst + half, src, half) == 0);
    CHECK(std::all_of(dst, dst + half, [](uint8_t b) { return b == 0; }));

    // Pools may outlive their transports: the UCP context stays until the last user goes.
    link.initiator.reset();
    link.target.reset();
    std::memset(src, 1, kBytes);
    src_mem->reset();
    dst_mem->reset();
  }
}

TEST_CASE("ucx fails writes to a dead peer within a bound") {
  for (std::string tls : {"shm", "tcp"}) {
    INFO("tls " << tls);
    // Inside one process UCX cannot tell a destroyed worker on shared memory from a slow one
    // (the peer pid is alive): the stall timeout is what bounds the wait there.
    Link link = Connect(MakeUcx(tls, {{"ucx.stall_timeout_ms", "1000"}}), MakeUcx(tls));
    constexpr size_t kBytes = size_t{4} << 20;
    std::vector<uint8_t> src(kBytes, 7), dst(kBytes, 0);
    spi::Blob unused;
    auto src_id = link.initiator->RegisterMemory({src.data(), kBytes}, &unused);
    REQUIRE(src_id.ok());
    spi::RemoteRegionId remote = ExportRegion(link, dst.data(), kBytes);
    {  // the connection works before the peer dies
      Completions done;
      spi::WriteOp op{*src_id, 0, remote, 0, 4096};
      REQUIRE(link.initiator->PostWrites(link.peer, std::span(&op, 1), done.Callback()).ok());
      REQUIRE(done.Wait(1));
      REQUIRE(done.statuses()[0].ok());
    }
    link.target.reset();

    const auto start = Clock::now();
    Completions done;
    size_t posted = 0;
    Status refused;
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < kBytes; off += 65536)
      ops.push_back({*src_id, off, remote, off, 65536});
    // Keep posting until the transport either refuses (it knows the peer is dead) or a batch
    // fails; both must happen within the bound.
    while (Clock::now() - start < std::chrono::seconds(30)) {
      Status s = link.initiator->PostWrites(link.peer, ops, done.Callback());
      if (!s.ok()) {
        refused = s;
        break;
      }
      ++posted;
      if (done.Wait(posted, std::chrono::seconds(1))) {
        auto st = done.statuses();
        if (!st.back().ok()) break;
      }
    }
    REQUIRE(done.Wait(posted, std::chrono::seconds(30)));
    auto statuses = done.statuses();
    CHECK(statuses.size() == posted);
    bool failed = !refused.ok();
    for (const Status& s : statuses) {
      if (s.ok()) continue;
      failed = true;
      INFO(s.ToString());
      CHECK((s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCancelled));
      CHECK(std::string(s.message()).find("peer") != std::string::npos);
    }
    if (!refused.ok()) {
      INFO(refused.ToString());
      CHECK(refused.code() == StatusCode::kUnavailable);
    }
    CHECK(failed);
    CHECK(Clock::now() - start < std::chrono::seconds(40));
  }
}

TEST_CASE("ucx Disconnect and destruction end every batch in flight exactly once") {
  for (std::string tls : {"shm", "tcp"}) {
    for (bool destroy : {false, true}) {
      INFO("tls " << tls << (destroy ? ", destroy" : ", disconnect"));
      Link link = Connect(MakeUcx(tls, {{"ucx.max_inflight_bytes", "256k"}}), MakeUcx(tls));
      constexpr size_t kBytes = size_t{8} << 20;
      std::vector<uint8_t> src(kBytes, 3), dst(kBytes, 0);
      spi::Blob unused;
      auto src_id = link.initiator->RegisterMemory({src.data(), kBytes}, &unused);
      REQUIRE(src_id.ok());
      spi::RemoteRegionId remote = ExportRegion(link, dst.data(), kBytes);
      std::vector<spi::WriteOp> ops;
      for (uint64_t off = 0; off < kBytes; off += 32768)
        ops.push_back({*src_id, off, remote, off, 32768});

      Completions done;
      constexpr size_t kPosted = 16;
      for (size_t i = 0; i < kPosted; ++i) {
        REQUIRE(link.initiator->PostWrites(link.peer, ops, done.Callback()).ok());
      }
      if (destroy) {
        link.initiator.reset();
      } else {
        link.initiator->Disconnect(link.peer);
        // Disconnect returns once the peer's batches have all called back.
        CHECK(done.statuses().size() == kPosted);
        CHECK_FALSE(link.initiator->PostWrites(link.peer, ops, done.Callback()).ok());
      }
      REQUIRE(done.Wait(kPosted, std::chrono::seconds(30)));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto statuses = done.statuses();
      CHECK(statuses.size() == kPosted);
      for (const Status& s : statuses) {
        INFO(s.ToString());
        CHECK((s.ok() || s.code() == StatusCode::kCancelled));
      }
    }
  }
}

TEST_CASE("ucx completion callbacks may post, register and disconnect") {
  Link link = Connect(MakeUcx("shm"), MakeUcx("shm"));
  constexpr size_t kBytes = size_t{1} << 20;
  std::vector<uint8_t> src(kBytes), dst(kBytes, 0), extra(4096);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i ^ (i >> 8));
  spi::Blob unused;
  auto src_id = link.initiator->RegisterMemory({src.data(), kBytes}, &unused);
  REQUIRE(src_id.ok());
  spi::RemoteRegionId remote = ExportRegion(link, dst.data(), kBytes);

  // A chain: each callback posts the next 64 KiB, the last one also registers memory and
  // disconnects from inside the callback (on the progress thread). Catch2 is not thread-safe, so
  // the callbacks only record what happened.
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<Status> statuses;  // written by the progress thread only, read after `finished`
  std::atomic<int> failures{0};
  std::function<void(uint64_t)> post_from = [&](uint64_t off) {
    spi::WriteOp op{*src_id, off, remote, off, 65536};
    Status s = link.initiator->PostWrites(link.peer, std::span(&op, 1), [&, off](Status st) {
      statuses.push_back(st);
      if (off + 65536 < kBytes) {
        post_from(off + 65536);
        return;
      }
      if (!link.initiator->RegisterMemory({extra.data(), extra.size()}, nullptr).ok()) {
        failures++;
      }
      link.initiator->Disconnect(link.peer);
      std::lock_guard lock(mu);
      ++finished;
      cv.notify_all();
    });
    if (!s.ok()) failures++;
  };
  post_from(0);
  std::unique_lock lock(mu);
  REQUIRE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return finished == 1; }));
  CHECK(failures == 0);
  CHECK(statuses.size() == kBytes / 65536);
  CHECK(std::all_of(statuses.begin(), statuses.end(), [](const Status& s) { return s.ok(); }));
  CHECK(FirstDifference(dst, src) == kBytes);
}

TEST_CASE("ucx landing digests: the am path digests what it copies, pushed and read") {
  // WatchLandings (capabilities().digests_landings): each watched cell's LandingDigest is the
  // raw CRC32C of what the handler copied into it, placed in the cell, and its byte count; a
  // cell written twice or partly shows in the count; memory the am path does not write is refused.
  auto raw = [](const uint8_t* p, size_t n) { return pdlib::Crc32cRaw(0, p, n); };
  for (std::string tls : {"shm", "tcp"}) {
    for (bool pull : {false, true}) {
      INFO("tls " << tls << (pull ? " pull" : " push"));
      constexpr size_t kCell = 32768, kCells = 8;
      std::mt19937_64 rng(pull ? 5 : 4);
      std::vector<uint8_t> src(kCells * kCell), dst(kCells * kCell, 0);
      FillRandom(src, rng);
      spi::TransportOptions target_options;
      target_options.options["ucx.tls"] = tls;
      if (tls == "tcp") target_options.options["ucx.net_devices"] = "lo";
      if (pull) target_options.direction = pdlib::TransferDirection::kPull;
      auto target = spi::CreateTransport("ucx", target_options);
      REQUIRE(target.ok());
      Link link = Connect(MakeUcx(tls), std::move(*target));
      // Push: the target's handler copies into dst; pull: the initiator's copies the replies.
      spi::Transport& lands = pull ? *link.initiator : *link.target;
      REQUIRE(lands.capabilities().digests_landings);
      spi::Blob key;
      spi::RemoteRegionId remote = 0;
      spi::LocalRegionId local = 0;
      if (pull) {
        remote = ExportRegion(link, src.data(), src.size());
        auto id = link.initiator->RegisterMemory({dst.data(), dst.size()}, &key);
        REQUIRE(id.ok());
        local = *id;
      } else {
        remote = ExportRegion(link, dst.data(), dst.size());
        auto id = link.initiator->RegisterMemory({src.data(), src.size()}, &key);
        REQUIRE(id.ok());
        local = *id;
      }
      const uint64_t base = reinterpret_cast<uint64_t>(dst.data());
      std::vector<spi::DigestRange> cells;
      for (size_t c = 0; c < kCells; ++c) cells.push_back({base + c * kCell, kCell, 0});
      auto watch = lands.WatchLandings(cells);
      INFO(watch.status().ToString());
      REQUIRE(watch.ok());
      // A cell another watch holds, and memory nobody registered: refused.
      const std::vector<spi::DigestRange> again = {{base + kCell / 2, kCell, 0}};
      CHECK(lands.WatchLandings(again).status().code() == StatusCode::kFailedPrecondition);
      std::vector<uint8_t> stray(kCell);
      const std::vector<spi::DigestRange> outside = {
          {reinterpret_cast<uint64_t>(stray.data()), kCell, 0}};
      CHECK(lands.WatchLandings(outside).status().code() == StatusCode::kFailedPrecondition);
      // Cells 0..5 whole (cell 1 in two pieces, in reverse), cell 6 half, cell 7 not at all;
      // cell 5 twice.
      std::vector<spi::WriteOp> ops = {
          {local, 0, remote, 0, kCell},
          {local, kCell + kCell / 2, remote, kCell + kCell / 2, kCell / 2},
          {local, kCell, remote, kCell, kCell / 2},
          {local, 2 * kCell, remote, 2 * kCell, 3 * kCell},
          {local, 5 * kCell, remote, 5 * kCell, kCell},
          {local, 6 * kCell, remote, 6 * kCell, kCell / 2}};
      for (int round = 0; round < 2; ++round) {
        Completions done;
        const Status posted = pull ? link.initiator->PostReads(link.peer, ops, done.Callback())
                                   : link.initiator->PostWrites(link.peer, ops, done.Callback());
        REQUIRE(posted.ok());
        REQUIRE(done.Wait(1, std::chrono::seconds(20)));
        REQUIRE(done.statuses()[0].ok());
        ops = {{local, 5 * kCell, remote, 5 * kCell, kCell}};  // the second round: cell 5 again
      }
      auto took = lands.TakeLandings(*watch);
      REQUIRE(took.ok());
      REQUIRE(took->size() == kCells);
      for (size_t c = 0; c < 5; ++c) {
        INFO("cell " << c);
        CHECK((*took)[c].bytes == kCell);
        CHECK((*took)[c].crc == raw(dst.data() + c * kCell, kCell));
      }
      CHECK((*took)[5].bytes == 2 * kCell);  // written twice: not this cell's contents
      CHECK((*took)[5].crc == 0);            // the same bytes XORed twice
      CHECK((*took)[6].bytes == kCell / 2);
      CHECK((*took)[7].bytes == 0);
      CHECK(std::memcmp(src.data(), dst.data(), 5 * kCell) == 0);
      CHECK(lands.TakeLandings(*watch).status().code() == StatusCode::kNotFound);
      // The cells are free again once taken.
      auto next = lands.WatchLandings(again);
      CHECK(next.ok());
      if (next.ok()) lands.DropLandings(*next);
    }
  }
}

TEST_CASE("ucx send digests: each write's CRC is what was sent, piece by piece") {
  // PostWritesDigested (capabilities().digests_sends): crcs[i] is the raw CRC32C of op i's
  // source bytes, continued over the pieces the op is sent in (ucx.am_chunk_bytes), set by the
  // time the batch completes; a zero-length op's is 0.
  for (std::string tls : {"shm", "tcp"}) {
    INFO("tls " << tls);
    constexpr size_t kBytes = size_t{3} << 20;
    std::mt19937_64 rng(11);
    std::vector<uint8_t> src(kBytes), dst(kBytes, 0);
    FillRandom(src, rng);
    spi::TransportOptions options;
    options.options["ucx.tls"] = tls;
    options.options["ucx.am_chunk_bytes"] = "65536";
    if (tls == "tcp") options.options["ucx.net_devices"] = "lo";
    auto initiator = spi::CreateTransport("ucx", options);
    REQUIRE(initiator.ok());
    REQUIRE((*initiator)->capabilities().digests_sends);
    Link link = Connect(std::move(*initiator), MakeUcx(tls));
    spi::RemoteRegionId remote = ExportRegion(link, dst.data(), kBytes);
    spi::Blob key;
    auto local = link.initiator->RegisterMemory({src.data(), kBytes}, &key);
    REQUIRE(local.ok());
    // Many pieces (1 MiB + 17 over 64 KiB messages), one piece, odd offsets, an empty op.
    std::vector<spi::WriteOp> ops = {{*local, 0, remote, 0, (size_t{1} << 20) + 17},
                                     {*local, 2 << 20, remote, 2 << 20, 4096},
                                     {*local, 1234567, remote, 1234567, 99999},
                                     {*local, 3000000, remote, 3000000, 0},
                                     {*local, kBytes - 33, remote, kBytes - 33, 33}};
    std::vector<uint32_t> crcs(ops.size(), 0xDEADBEEF);
    std::vector<uint32_t> too_few(ops.size() - 1);
    CHECK(link.initiator->PostWritesDigested(link.peer, ops, too_few, [](Status) {}).code() ==
          StatusCode::kInvalidArgument);
    Completions done;
    REQUIRE(link.initiator->PostWritesDigested(link.peer, ops, crcs, done.Callback()).ok());
    REQUIRE(done.Wait(1, std::chrono::seconds(20)));
    REQUIRE(done.statuses()[0].ok());
    for (size_t i = 0; i < ops.size(); ++i) {
      INFO("op " << i);
      CHECK(crcs[i] == pdlib::Crc32cRaw(0, src.data() + ops[i].local_offset, ops[i].length));
      CHECK(std::memcmp(dst.data() + ops[i].remote_offset, src.data() + ops[i].local_offset,
                        ops[i].length) == 0);
    }
    CHECK(crcs[3] == 0);
  }
}
