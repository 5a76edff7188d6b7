// The backend conformance suite: every registered built-in backend must pass it (STYLE.md
// habit 8). Backends that move bytes are also checked byte for byte; the fake backend, which
// by design moves none, says so and is checked on everything else.
//
// Every case runs for writes (PostWrites) and, on backends that claim capabilities().reads, for
// reads (PostReads): the data then flows from the target's region into the initiator's, and the
// same rules hold (bytes exact, nothing outside the ops touched, bounds refused, one callback per
// batch, Disconnect and the destructor cancel, a dead peer fails). A backend without reads must
// answer PostReads with kUnimplemented.
//
// PDLIB_CONFORMANCE_BACKENDS=a,b restricts the run to those backends, each of which must then
// run. PDLIB_CONFORMANCE_OPTIONS=k=v,k=v adds backend options (e.g. ucx.tls=tcp) to every
// transport the suite creates. Otherwise a backend that needs hardware this machine lacks (verbs
// without an RDMA device) is skipped with the reason; the Soft-RoCE VM test verbs_conformance_rxe
// (test/verbs) runs the suite on rxe0 with PDLIB_CONFORMANCE_BACKENDS=verbs.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/backends.h"
#include "pdlib/spi/transport.h"
#include "test/support/device_buffer.h"
#include "test/support/write_completions.h"

namespace spi = pdlib::spi;
using pdlib::MemoryKind;
using pdlib::Status;
using pdlib::StatusCode;

namespace {

using Completions = pdlib::testing::WriteCompletions;

// The backends to run: PDLIB_CONFORMANCE_BACKENDS (comma-separated) or every built-in one.
std::vector<std::string> BackendsUnderTest() {
  const char* env = std::getenv("PDLIB_CONFORMANCE_BACKENDS");
  if (env == nullptr || *env == '\0') return pdlib::BuiltinBackends();
  std::vector<std::string> names;
  std::stringstream list(env);
  for (std::string name; std::getline(list, name, ',');) {
    if (!name.empty()) names.push_back(name);
  }
  return names;
}

// Why `name` cannot run on this machine (empty: it can). Only hardware backends can be absent,
// and only when the run did not ask for them by name.
std::string WhyUnavailable(const std::string& name) {
  const char* env = std::getenv("PDLIB_CONFORMANCE_BACKENDS");
  if (name != "verbs" || (env != nullptr && *env != '\0')) return "";
  auto probe = spi::CreateTransport(name, {});
  return probe.ok() ? "" : probe.status().ToString();
}

// Extra backend options for every transport: PDLIB_CONFORMANCE_OPTIONS (k=v,k=v).
std::map<std::string, std::string> SuiteOptions() {
  std::map<std::string, std::string> options;
  const char* env = std::getenv("PDLIB_CONFORMANCE_OPTIONS");
  if (env == nullptr) return options;
  std::stringstream list(env);
  for (std::string item; std::getline(list, item, ',');) {
    const size_t eq = item.find('=');
    if (eq != std::string::npos) options[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return options;
}

enum class Direction { kWrite, kRead };

// A transport for `name`; reads are pull (TransportOptions::direction), as a manager has them.
std::unique_ptr<spi::Transport> Create(const std::string& name, Direction direction,
                                       const std::map<std::string, std::string>& extra = {}) {
  spi::TransportOptions options;
  options.direction = direction == Direction::kRead ? pdlib::TransferDirection::kPull
                                                    : pdlib::TransferDirection::kPush;
  options.options = SuiteOptions();
  for (const auto& [k, v] : extra) options.options[k] = v;
  auto t = spi::CreateTransport(name, options);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

struct Pair {
  Direction direction = Direction::kWrite;
  // GPU regions (kCuda): declared first, so that they are freed after the transports.
  std::unique_ptr<pdlib_test::DeviceBuffer> init_dev, target_dev;
  // The initiator is destroyed first, closing its endpoints while the target still answers:
  // UCX 1.13 over tcp aborts a process whose endpoint fails with a wireup reply pending
  // (openucx/ucx#8175, backends/ucx/README.md), which a target destroyed under an idle
  // initiator's half-wired endpoint causes.
  std::unique_ptr<spi::Transport> target, initiator;
  // The bytes, in host memory: `init` is the initiator's region, `tgt` the target's. The source
  // of the data (init for writes, tgt for reads) holds a pattern, the destination zeros. With GPU
  // regions the host vector of the source is also what the device holds and Dst() refreshes the
  // destination from the device.
  std::vector<uint8_t> init, tgt;
  spi::LocalRegionId init_region = 0, target_region = 0;
  spi::PeerId peer = 0;
  spi::RemoteRegionId remote = 0;
  spi::TargetId target_id = 0;

  bool reads() const { return direction == Direction::kRead; }
  const std::vector<uint8_t>& Src() const { return reads() ? tgt : init; }
  // Posts `ops` the pair's way: writes into the target, or reads from it.
  Status Post(std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              spi::PeerId to = 0) const {
    const spi::PeerId id = to == 0 ? peer : to;
    return reads() ? initiator->PostReads(id, ops, std::move(done))
                   : initiator->PostWrites(id, ops, std::move(done));
  }
};

// The destination's bytes as they are now (copied back from the device for GPU regions).
const std::vector<uint8_t>& Dst(Pair& p) {
  pdlib_test::DeviceBuffer* dev = p.reads() ? p.init_dev.get() : p.target_dev.get();
  std::vector<uint8_t>& host = p.reads() ? p.init : p.tgt;
  if (dev != nullptr) {
    const std::string why = dev->Download(host.data());
    INFO(why);
    REQUIRE(why.empty());
  }
  return host;
}

bool AllZero(const std::vector<uint8_t>& v, size_t from = 0, size_t to = SIZE_MAX) {
  to = std::min(to, v.size());
  return std::all_of(v.begin() + from, v.begin() + to, [](uint8_t b) { return b == 0; });
}

// Why regions of `memory` ("host", "cuda") cannot be tested with `name` here (empty: they can).
std::string WhyNoMemory(const std::string& name, const std::string& memory) {
  if (memory == "host") return "";
  auto probe = spi::CreateTransport(name, {});
  if (!probe.ok()) return probe.status().ToString();
  if (!(*probe)->capabilities().supports_cuda_memory) {
    return "the backend cannot reach GPU memory here (capabilities().supports_cuda_memory)";
  }
  return pdlib_test::WhyNoCudaDevice();
}

Pair Connect(const std::string& name, size_t bytes, bool cuda, Direction direction,
             const std::map<std::string, std::string>& extra = {}) {
  Pair p;
  p.direction = direction;
  p.initiator = Create(name, direction, extra);
  p.target = Create(name, direction, extra);
  p.init.assign(bytes, 0);
  p.tgt.assign(bytes, 0);
  std::vector<uint8_t>& src = p.reads() ? p.tgt : p.init;
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 31 + 7 + (i >> 12));
  const void* init_addr = p.init.data();
  const void* target_addr = p.tgt.data();
  const MemoryKind kind = cuda ? MemoryKind::kCuda : MemoryKind::kHost;
  if (cuda) {
    for (auto [dev, host] : {std::pair{&p.init_dev, &p.init}, std::pair{&p.target_dev, &p.tgt}}) {
      std::string why = pdlib_test::DeviceBuffer::Allocate(bytes, dev);
      if (why.empty()) why = (*dev)->Upload(host->data());
      INFO(why);
      REQUIRE(why.empty());
    }
    init_addr = p.init_dev->data();
    target_addr = p.target_dev->data();
  }
  spi::Blob init_key, target_key;
  auto ir = p.initiator->RegisterMemory({init_addr, bytes, kind, 0}, &init_key);
  auto tr = p.target->RegisterMemory({target_addr, bytes, kind, 0}, &target_key);
  INFO(ir.status().ToString() << " / " << tr.status().ToString());
  REQUIRE(ir.ok());
  REQUIRE(tr.ok());
  p.init_region = *ir;
  p.target_region = *tr;
  auto ep = p.target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  p.target_id = ep->id;
  auto conn = p.initiator->Connect(ep->blob);
  REQUIRE(conn.ok());
  if (p.target->capabilities().needs_reply) {
    REQUIRE(p.target->CompleteTargetEndpoint(ep->id, conn->reply).ok());
  }
  p.peer = conn->peer;
  auto remote = p.initiator->ImportRemoteRegion(
      p.peer, {reinterpret_cast<uint64_t>(target_addr), bytes, target_key});
  REQUIRE(remote.ok());
  p.remote = *remote;
  return p;
}

// The op moving `length` bytes between initiator offset `local` and target offset `remote`.
spi::WriteOp Op(const Pair& p, uint64_t local, uint64_t remote, uint64_t length) {
  return {p.init_region, local, p.remote, remote, length};
}

// Whether the destination holds the source's bytes for `op` (offsets per direction).
bool Moved(Pair& p, const spi::WriteOp& op) {
  const uint64_t from = p.reads() ? op.remote_offset : op.local_offset;
  const uint64_t to = p.reads() ? op.local_offset : op.remote_offset;
  const auto& dst = Dst(p);
  return std::equal(p.Src().begin() + from, p.Src().begin() + from + op.length, dst.begin() + to);
}

}  // namespace

TEST_CASE("backend conformance") {
  auto name = GENERATE(from_range(BackendsUnderTest()));
  // Regions in host memory, then in GPU memory where the backend and this machine can (issue
  // #19: cuda_ipc over GPU pools; ucx built with CUDA).
  const std::string memory = GENERATE(as<std::string>{}, "host", "cuda");
  // Writes (push), then reads (pull, issue #29) where the backend claims them.
  const Direction direction = GENERATE(Direction::kWrite, Direction::kRead);
  const char* verb = direction == Direction::kRead ? "reads" : "writes";
  INFO("backend " << name << ", " << memory << " memory, " << verb);
  if (const std::string why = WhyUnavailable(name); !why.empty()) {
    WARN("backend " << name << " skipped: no device here (" << why << ")");
    return;
  }
  if (const std::string why = WhyNoMemory(name, memory); !why.empty()) {
    WARN("backend " << name << " with " << memory << " memory skipped: " << why);
    return;
  }
  // Long enough for ops longer than every backend's chunk (ucx.am_chunk_bytes 32 KiB,
  // ucx.chunk_bytes 1 MiB).
  constexpr size_t kBytes = size_t{3} << 20;
  constexpr uint64_t kPage = 4096;
  Pair p = Connect(name, kBytes, memory == "cuda", direction);
  auto caps = p.initiator->capabilities();
  CHECK(p.initiator->name() == name);
  if (direction == Direction::kRead && !caps.reads) {
    // A backend without reads says so, and never calls back.
    Completions done;
    spi::WriteOp op = Op(p, 0, 0, kPage);
    Status s = p.initiator->PostReads(p.peer, std::span(&op, 1), done.Callback());
    INFO(s.ToString());
    CHECK(s.code() == StatusCode::kUnimplemented);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(done.statuses().empty());
    WARN("backend " << name << " cannot read (capabilities().reads is false): read cases skipped");
    return;
  }

  SECTION("a batch completes exactly once, with OK; bytes outside the ops are untouched") {
    // 16 pages in reverse order, each into every other page of the destination's first 128 KiB.
    std::vector<spi::WriteOp> ops;
    for (uint64_t i = 0; i < 16; ++i) {
      const uint64_t src_page = i, dst_page = 2 * (15 - i);
      ops.push_back(p.reads() ? Op(p, dst_page * kPage, src_page * kPage, kPage)
                              : Op(p, src_page * kPage, dst_page * kPage, kPage));
    }
    Completions done;
    REQUIRE(p.Post(ops, done.Callback()).ok());
    REQUIRE(done.Wait(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto st = done.statuses();
    REQUIRE(st.size() == 1);
    INFO(st[0].ToString());
    CHECK(st[0].ok());
    if (caps.moves_bytes) {
      for (const auto& op : ops) CHECK(Moved(p, op));
      const auto& d = Dst(p);
      for (uint64_t page = 0; page < kBytes / kPage; ++page) {
        if (page < 32 && page % 2 == 0) continue;
        INFO("page " << page);
        CHECK(AllZero(d, page * kPage, (page + 1) * kPage));
      }
    } else {
      WARN("backend " << name << " moves no bytes by design: byte comparison not applicable");
      CHECK(AllZero(Dst(p)));
    }
  }

  SECTION("an empty batch completes") {
    Completions done;
    REQUIRE(p.Post({}, done.Callback()).ok());
    REQUIRE(done.Wait(1));
    CHECK(done.statuses()[0].ok());
  }

  SECTION("ops outside a region are refused with a reason before anything moves") {
    Completions done;
    std::vector<spi::WriteOp> past_end = {{p.init_region, 0, p.remote, kBytes - 10, 20}};
    std::vector<spi::WriteOp> local_past_end = {{p.init_region, kBytes - 8, p.remote, 0, 16}};
    std::vector<spi::WriteOp> overflow = {{p.init_region, ~uint64_t{0} - 5, p.remote, 0, 16}};
    std::vector<spi::WriteOp> remote_overflow = {{p.init_region, 0, p.remote, ~uint64_t{0}, 2}};
    std::vector<spi::WriteOp> bad_region = {{p.init_region, 0, p.remote + 99, 0, 16}};
    std::vector<spi::WriteOp> bad_local = {{p.init_region + 99, 0, p.remote, 0, 16}};
    // A good op first: the whole batch is refused, the good op does not move either.
    std::vector<spi::WriteOp> second_bad = {Op(p, 0, 0, kPage),
                                            {p.init_region, 0, p.remote, kBytes, 1}};
    for (auto* ops : {&past_end, &local_past_end, &overflow, &remote_overflow, &bad_region,
                      &bad_local, &second_bad}) {
      Status s = p.Post(*ops, done.Callback());
      INFO(s.ToString());
      CHECK_FALSE(s.ok());
      CHECK((s.code() == StatusCode::kOutOfRange || s.code() == StatusCode::kInvalidArgument));
      // The reason names the op the way it was posted.
      CHECK(std::string(s.message()).find(p.reads() ? "read" : "write") != std::string::npos);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(done.statuses().empty());  // a refused batch never calls back
    CHECK(AllZero(Dst(p)));
  }

  SECTION("unknown peers and foreign blobs are refused") {
    Completions done;
    CHECK_FALSE(p.Post({}, done.Callback(), p.peer + 1000).ok());
    CHECK_FALSE(p.initiator->Connect(spi::Blob{1, 2, 3}).ok());
    CHECK_FALSE(p.initiator->ImportRemoteRegion(p.peer, {1, 16, spi::Blob{9}}).ok());
    CHECK_FALSE(p.initiator->DeregisterMemory(p.init_region + 1000).ok());
  }

  SECTION("after Disconnect the peer is gone") {
    p.initiator->Disconnect(p.peer);
    Completions done;
    CHECK_FALSE(p.Post({}, done.Callback()).ok());
  }

  SECTION("many threads post concurrently; every batch completes once") {
    constexpr int kThreads = 4, kBatches = 200;
    Completions done;
    std::atomic<int> post_errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kBatches; ++i) {
          uint64_t off = ((t * kBatches + i) % 16) * kPage;
          spi::WriteOp op = Op(p, off, off, kPage);
          if (!p.Post(std::span(&op, 1), done.Callback()).ok()) post_errors++;
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(post_errors == 0);
    REQUIRE(done.Wait(kThreads * kBatches));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto st = done.statuses();
    CHECK(st.size() == size_t{kThreads * kBatches});
    CHECK(std::all_of(st.begin(), st.end(), [](const Status& s) { return s.ok(); }));
    if (caps.moves_bytes) {
      CHECK(Moved(p, Op(p, 0, 0, 16 * kPage)));
      CHECK(AllZero(Dst(p), 16 * kPage));
    }
  }

  SECTION("many ops and ops longer than a chunk move byte for byte") {
    // One batch of 512 small ops (odd sizes, scattered), one of three long ones (1 MiB + 3,
    // 64 KiB + 1, and the rest of the region less a page): every byte lands where it should.
    std::vector<spi::WriteOp> many;
    for (uint64_t i = 0; i < 512; ++i) {
      many.push_back(Op(p, i * 1024 + (i % 7), (511 - i) * 1024 + (i % 5), 1000 + i % 13));
    }
    const uint64_t long1 = (uint64_t{1} << 20) + 3;
    const uint64_t long2 = (uint64_t{64} << 10) + 1;
    const uint64_t base = 512 * 1024 + kPage;  // after the small ops' bytes
    const uint64_t long3 = kBytes - base - long1 - long2 - kPage;
    std::vector<spi::WriteOp> longs = {
        Op(p, base + long2 + long3, base, long1),  // crossed, so a mix-up shows
        Op(p, base, base + long1, long2),
        Op(p, base + long2, base + long1 + long2, long3),
    };
    Completions done;
    REQUIRE(p.Post(many, done.Callback()).ok());
    REQUIRE(p.Post(longs, done.Callback()).ok());
    REQUIRE(done.Wait(2));
    for (const Status& s : done.statuses()) {
      INFO(s.ToString());
      CHECK(s.ok());
    }
    if (caps.moves_bytes) {
      // Build the expected image of the destination and compare all of it.
      std::vector<uint8_t> expected(kBytes, 0);
      for (const auto* ops : {&many, &longs}) {
        for (const auto& op : *ops) {
          const uint64_t from = p.reads() ? op.remote_offset : op.local_offset;
          const uint64_t to = p.reads() ? op.local_offset : op.remote_offset;
          std::copy_n(p.Src().begin() + from, op.length, expected.begin() + to);
        }
      }
      const auto& d = Dst(p);
      auto [a, b] = std::mismatch(d.begin(), d.end(), expected.begin());
      INFO("first difference at byte " << (a - d.begin()));
      CHECK(a == d.end());
    }
  }

  SECTION("Disconnect and the destructor end every batch once; nothing lands afterwards") {
    for (bool destroy : {false, true}) {
      INFO((destroy ? "destructor" : "Disconnect"));
      Pair q = Connect(name, kBytes, memory == "cuda", direction);
      // 24 batches, each one page-sized op per 64 KiB of the region: enough in flight that some
      // are still outstanding when the connection goes (for wires that move bytes).
      std::vector<std::vector<spi::WriteOp>> batches(24);
      for (size_t b = 0; b < batches.size(); ++b) {
        for (uint64_t off = b * kPage; off + kPage <= kBytes; off += 64 * 1024) {
          batches[b].push_back(Op(q, off, off, kPage));
        }
      }
      Completions done;
      for (const auto& ops : batches) REQUIRE(q.Post(ops, done.Callback()).ok());
      if (destroy) {
        q.initiator.reset();
        // The destructor returns after every callback ran.
        CHECK(done.statuses().size() == batches.size());
      } else {
        q.initiator->Disconnect(q.peer);
        CHECK_FALSE(q.Post({}, done.Callback()).ok());
      }
      REQUIRE(done.Wait(batches.size(), std::chrono::seconds(30)));
      const std::vector<uint8_t> after = Dst(q);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      auto statuses = done.statuses();
      CHECK(statuses.size() == batches.size());
      size_t ok = 0;
      for (size_t b = 0; b < statuses.size(); ++b) {
        INFO(statuses[b].ToString());
        CHECK((statuses[b].ok() || statuses[b].code() == StatusCode::kCancelled));
        ok += statuses[b].ok();
      }
      if (caps.moves_bytes) {
        // Once every callback ran, the destination no longer changes, and the batches that
        // completed OK (callbacks run in no particular order: any of them) moved their bytes.
        // Compared as a position, not as vectors: Catch would print a megabyte on failure.
        const auto& now = Dst(q);
        const size_t changed = static_cast<size_t>(
            std::mismatch(now.begin(), now.end(), after.begin()).first - now.begin());
        INFO("the destination changed at byte " << changed << " after every callback ran");
        CHECK(changed == now.size());
        for (size_t b = 0; b < batches.size() && ok == batches.size(); ++b) {
          for (const auto& op : batches[b]) CHECK(Moved(q, op));
        }
      }
    }
  }

  SECTION("a batch to a dead peer fails with kUnavailable, or is refused so, within a bound") {
    if (!caps.moves_bytes || name == "cuda_ipc") {
      WARN("backend " << name
                      << ": a target's death inside this process is not observable on its wire "
                         "(cuda_ipc watches the target process: cuda_ipc_transport_test kills "
                         "a forked target); section not applicable");
      return;
    }
    // Short failure detection: a target destroyed inside this process leaves no dead pid for
    // shared memory to notice (ucx: the stall timeout bounds it), and verbs retries briefly.
    Pair q = Connect(
        name, kBytes, memory == "cuda", direction,
        {{"ucx.stall_timeout_ms", "1000"}, {"verbs.timeout", "8"}, {"verbs.retry_cnt", "1"}});
    {
      Completions first;
      spi::WriteOp op = Op(q, 0, 0, kPage);
      REQUIRE(q.Post(std::span(&op, 1), first.Callback()).ok());
      REQUIRE(first.Wait(1));
      REQUIRE(first.statuses()[0].ok());
    }
    q.target.reset();
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < kBytes; off += 64 * 1024) ops.push_back(Op(q, off, off, kPage));
    // One batch, then nothing more: the wire alone must notice (new posts would count as
    // activity for ucx's stall timeout).
    const auto start = std::chrono::steady_clock::now();
    Completions done;
    Status why = q.Post(ops, done.Callback());
    if (why.ok()) {
      REQUIRE(done.Wait(1, std::chrono::seconds(30)));
      why = done.statuses()[0];
      // The peer stays failed: the next batch is refused, or fails, the same way.
      Status again = q.Post(ops, done.Callback());
      if (again.ok()) {
        REQUIRE(done.Wait(2, std::chrono::seconds(30)));
        again = done.statuses()[1];
      }
      INFO(again.ToString());
      CHECK(again.code() == StatusCode::kUnavailable);
    }
    INFO(why.ToString());
    CHECK(why.code() == StatusCode::kUnavailable);
    CHECK(std::string(why.message()).find("peer") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  }

  SECTION("no op after a fence moves; a fence never completes a batch OK") {
    if (!caps.fences) {
      WARN("backend " << name
                      << " cannot fence (capabilities().fences is false): decode "
                         "quarantines pages instead; section not applicable");
      CHECK_FALSE(p.target->FenceTarget(p.target_id).ok());
      return;
    }
    REQUIRE(p.target->FenceTarget(p.target_id).ok());
    CHECK_FALSE(p.target->FenceTarget(p.target_id + 1000).ok());
    // Whatever the initiator posts now (a batch it had queued before the fence would behave the
    // same way) must not move bytes between the two memories, and must not complete OK.
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < 64 * kPage; off += kPage) ops.push_back(Op(p, off, off, kPage));
    Completions done;
    int posted = 0;
    for (int i = 0; i < 8; ++i) posted += p.Post(ops, done.Callback()).ok() ? 1 : 0;
    REQUIRE(done.Wait(posted, std::chrono::seconds(20)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (const Status& st : done.statuses()) {
      INFO(st.ToString());
      CHECK_FALSE(st.ok());
    }
    CHECK(AllZero(Dst(p)));
    p.target->CloseTargetEndpoint(p.target_id);
  }

  SECTION("regions deregister and endpoints close cleanly") {
    CHECK(p.initiator->DeregisterMemory(p.init_region).ok());
    CHECK(p.target->DeregisterMemory(p.target_region).ok());
    CHECK_FALSE(p.target->DeregisterMemory(p.target_region).ok());
    p.target->CloseTargetEndpoint(p.target_id);
  }
}
