// The backend conformance suite: every registered built-in backend must pass it (STYLE.md
// habit 8). Backends that move bytes are also checked byte for byte; the fake backend, which
// by design moves none, says so and is checked on everything else.
//
// PDLIB_CONFORMANCE_BACKENDS=a,b restricts the run to those backends, each of which must then
// run. Otherwise a backend that needs hardware this machine lacks (verbs without an RDMA device)
// is skipped with the reason; the Soft-RoCE VM test verbs_conformance_rxe (test/verbs) runs the
// suite on rxe0 with PDLIB_CONFORMANCE_BACKENDS=verbs.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
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

struct Pair {
  // GPU regions (kCuda): declared first, so that they are freed after the transports.
  std::unique_ptr<pdlib_test::DeviceBuffer> src_dev, dst_dev;
  std::unique_ptr<spi::Transport> initiator, target;
  // The bytes, in host memory. With GPU regions src is also what the device source holds and
  // dst is refreshed from the device destination by Dst().
  std::vector<uint8_t> src, dst;
  spi::LocalRegionId src_region = 0, dst_region = 0;
  spi::PeerId peer = 0;
  spi::RemoteRegionId remote = 0;
  spi::TargetId target_id = 0;
};

// The destination's bytes as they are now (copied back from the device for GPU regions).
const std::vector<uint8_t>& Dst(Pair& p) {
  if (p.dst_dev) {
    const std::string why = p.dst_dev->Download(p.dst.data());
    INFO(why);
    REQUIRE(why.empty());
  }
  return p.dst;
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

Pair Connect(const std::string& name, size_t bytes, bool cuda) {
  Pair p;
  auto a = spi::CreateTransport(name, {});
  auto b = spi::CreateTransport(name, {});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  p.initiator = std::move(*a);
  p.target = std::move(*b);
  p.src.resize(bytes);
  p.dst.assign(bytes, 0);
  for (size_t i = 0; i < bytes; ++i) p.src[i] = static_cast<uint8_t>(i * 31 + 7);
  const void* src_addr = p.src.data();
  const void* dst_addr = p.dst.data();
  const MemoryKind kind = cuda ? MemoryKind::kCuda : MemoryKind::kHost;
  if (cuda) {
    for (auto [dev, host] : {std::pair{&p.src_dev, &p.src}, std::pair{&p.dst_dev, &p.dst}}) {
      std::string why = pdlib_test::DeviceBuffer::Allocate(bytes, dev);
      if (why.empty()) why = (*dev)->Upload(host->data());
      INFO(why);
      REQUIRE(why.empty());
    }
    src_addr = p.src_dev->data();
    dst_addr = p.dst_dev->data();
  }
  spi::Blob src_key, dst_key;
  auto sr = p.initiator->RegisterMemory({src_addr, bytes, kind, 0}, &src_key);
  auto dr = p.target->RegisterMemory({dst_addr, bytes, kind, 0}, &dst_key);
  INFO(sr.status().ToString() << " / " << dr.status().ToString());
  REQUIRE(sr.ok());
  REQUIRE(dr.ok());
  p.src_region = *sr;
  p.dst_region = *dr;
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
      p.peer, {reinterpret_cast<uint64_t>(dst_addr), bytes, dst_key});
  REQUIRE(remote.ok());
  p.remote = *remote;
  return p;
}

}  // namespace

TEST_CASE("backend conformance") {
  auto name = GENERATE(from_range(BackendsUnderTest()));
  // Regions in host memory, then in GPU memory where the backend and this machine can (issue
  // #19: cuda_ipc over GPU pools; ucx built with CUDA).
  const std::string memory = GENERATE(as<std::string>{}, "host", "cuda");
  INFO("backend " << name << ", " << memory << " memory");
  if (const std::string why = WhyUnavailable(name); !why.empty()) {
    WARN("backend " << name << " skipped: no device here (" << why << ")");
    return;
  }
  if (const std::string why = WhyNoMemory(name, memory); !why.empty()) {
    WARN("backend " << name << " with " << memory << " memory skipped: " << why);
    return;
  }
  constexpr size_t kBytes = 1 << 16;
  Pair p = Connect(name, kBytes, memory == "cuda");
  auto caps = p.initiator->capabilities();
  CHECK(p.initiator->name() == name);

  SECTION("a batch completes exactly once, with OK") {
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < kBytes; off += 4096) {
      ops.push_back({p.src_region, off, p.remote, kBytes - 4096 - off, 4096});  // reversed pages
    }
    Completions done;
    REQUIRE(p.initiator->PostWrites(p.peer, ops, done.Callback()).ok());
    REQUIRE(done.Wait(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto st = done.statuses();
    REQUIRE(st.size() == 1);
    CHECK(st[0].ok());
    if (caps.moves_bytes) {
      for (uint64_t off = 0; off < kBytes; off += 4096) {
        CHECK(std::equal(p.src.begin() + off, p.src.begin() + off + 4096,
                         Dst(p).begin() + (kBytes - 4096 - off)));
      }
    } else {
      WARN("backend " << name << " moves no bytes by design: byte comparison not applicable");
      const auto& d = Dst(p);
      CHECK(std::all_of(d.begin(), d.end(), [](uint8_t b) { return b == 0; }));
    }
  }

  SECTION("an empty batch completes") {
    Completions done;
    REQUIRE(p.initiator->PostWrites(p.peer, {}, done.Callback()).ok());
    REQUIRE(done.Wait(1));
    CHECK(done.statuses()[0].ok());
  }

  SECTION("writes outside a region are refused before anything moves") {
    Completions done;
    std::vector<spi::WriteOp> past_end = {{p.src_region, 0, p.remote, kBytes - 10, 20}};
    std::vector<spi::WriteOp> overflow = {{p.src_region, ~uint64_t{0} - 5, p.remote, 0, 16}};
    std::vector<spi::WriteOp> bad_region = {{p.src_region, 0, p.remote + 99, 0, 16}};
    std::vector<spi::WriteOp> bad_local = {{p.src_region + 99, 0, p.remote, 0, 16}};
    for (auto* ops : {&past_end, &overflow, &bad_region, &bad_local}) {
      Status s = p.initiator->PostWrites(p.peer, *ops, done.Callback());
      CHECK_FALSE(s.ok());
      CHECK((s.code() == StatusCode::kOutOfRange || s.code() == StatusCode::kInvalidArgument));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(done.statuses().empty());  // a refused batch never calls back
    const auto& d = Dst(p);
    CHECK(std::all_of(d.begin(), d.end(), [](uint8_t b) { return b == 0; }));
  }

  SECTION("unknown peers and foreign blobs are refused") {
    Completions done;
    CHECK_FALSE(p.initiator->PostWrites(p.peer + 1000, {}, done.Callback()).ok());
    CHECK_FALSE(p.initiator->Connect(spi::Blob{1, 2, 3}).ok());
    CHECK_FALSE(p.initiator->ImportRemoteRegion(p.peer, {1, 16, spi::Blob{9}}).ok());
    CHECK_FALSE(p.initiator->DeregisterMemory(p.src_region + 1000).ok());
  }

  SECTION("after Disconnect the peer is gone") {
    p.initiator->Disconnect(p.peer);
    Completions done;
    CHECK_FALSE(p.initiator->PostWrites(p.peer, {}, done.Callback()).ok());
  }

  SECTION("many threads post concurrently; every batch completes once") {
    constexpr int kThreads = 4, kBatches = 200;
    Completions done;
    std::atomic<int> post_errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kBatches; ++i) {
          uint64_t off = ((t * kBatches + i) % 16) * 4096;
          spi::WriteOp op{p.src_region, off, p.remote, off, 4096};
          if (!p.initiator->PostWrites(p.peer, std::span(&op, 1), done.Callback()).ok()) {
            post_errors++;
          }
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
    if (caps.moves_bytes) CHECK(Dst(p) == p.src);
  }

  SECTION("no write after a fence lands; a fence never completes a batch OK") {
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
    // same way) must not reach the target's memory, and must not complete OK.
    std::vector<spi::WriteOp> ops;
    for (uint64_t off = 0; off < kBytes; off += 4096) {
      ops.push_back({p.src_region, off, p.remote, off, 4096});
    }
    Completions done;
    int posted = 0;
    for (int i = 0; i < 8; ++i) {
      posted += p.initiator->PostWrites(p.peer, ops, done.Callback()).ok() ? 1 : 0;
    }
    REQUIRE(done.Wait(posted, std::chrono::seconds(20)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (const Status& st : done.statuses()) {
      INFO(st.ToString());
      CHECK_FALSE(st.ok());
    }
    const auto& d = Dst(p);
    CHECK(std::all_of(d.begin(), d.end(), [](uint8_t b) { return b == 0; }));
    p.target->CloseTargetEndpoint(p.target_id);
  }

  SECTION("regions deregister and endpoints close cleanly") {
    CHECK(p.initiator->DeregisterMemory(p.src_region).ok());
    CHECK(p.target->DeregisterMemory(p.dst_region).ok());
    CHECK_FALSE(p.target->DeregisterMemory(p.dst_region).ok());
    p.target->CloseTargetEndpoint(p.target_id);
  }
}
