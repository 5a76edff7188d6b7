// KV pools (pdlib/kv_pool.h): the errors of AllocateKVPool, plain host pools for backends without
// an allocator, and UCX pools end to end: two KVManagers of one process (in-process control
// plane) with their KV buffers carved out of pools, a transfer over shm and tcp compared byte for
// byte, and the pools destroyed before and after their managers; and the sharing of UCP contexts
// by configuration that lets a transport recognise a pool (backends/ucx/ucx_context.h).
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/ucx/ucx_context.h"
#include "pdlib/pdlib.h"
#include "pdlib/spi/transport.h"

using pdlib::KVPoll;
using pdlib::StatusCode;

namespace {

using Clock = std::chrono::steady_clock;

std::map<std::string, std::string> UcxOptions(const std::string& tls) {
  std::map<std::string, std::string> o = {{"ucx.tls", tls}};
  if (tls == "tcp") o["ucx.net_devices"] = "lo";
  return o;
}

// One side: `layers` K and V buffers of `pages` items each, consecutive in one pool.
struct Side {
  std::unique_ptr<pdlib::KVPool> pool;
  std::unique_ptr<pdlib::MetadataBuffers> aux;
  std::unique_ptr<pdlib::KVManager> manager;
  uint8_t* buffer(size_t b, uint64_t buffer_bytes) const {
    return static_cast<uint8_t*>(pool->data()) + b * buffer_bytes;
  }
};

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::seconds limit = std::chrono::seconds(20)) {
  const auto end = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

}  // namespace

TEST_CASE("ucx KV pools: AllocateKVPool names what is wrong") {
  auto unknown = pdlib::AllocateKVPool("no_such_backend", 4096);
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == StatusCode::kNotFound);
  const std::string message(unknown.status().message());
  CHECK(message.find("'no_such_backend'") != std::string::npos);
  CHECK(message.find("ucx") != std::string::npos);  // the known backends are listed
  CHECK(message.find("fake") != std::string::npos);

  CHECK(pdlib::AllocateKVPool("ucx", 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(pdlib::AllocateKVPool("fake", 0).status().code() == StatusCode::kInvalidArgument);
  auto bad_option =
      pdlib::AllocateKVPool("ucx", 4096, pdlib::MemoryKind::kHost, {{"ucx.bogus", "1"}});
  CHECK(bad_option.status().code() == StatusCode::kInvalidArgument);
  CHECK(pdlib::AllocateKVPool("fake", 4096, pdlib::MemoryKind::kCuda).status().code() ==
        StatusCode::kUnimplemented);
  auto cuda = pdlib::AllocateKVPool("ucx", 4096, pdlib::MemoryKind::kCuda, UcxOptions("shm"));
  if (!cuda.ok()) {
    INFO(cuda.status().ToString());
    CHECK(cuda.status().code() == StatusCode::kFailedPrecondition);
  } else {
    WARN("this UCX allocates CUDA memory: exercised only where a GPU is present");
  }
}

TEST_CASE("ucx KV pools: backends without an allocator get plain zeroed host memory") {
  constexpr uint64_t kBytes = (uint64_t{1} << 20) + 100;
  auto pool = pdlib::AllocateKVPool("fake", kBytes);
  REQUIRE(pool.ok());
  CHECK((*pool)->allocator() == "host");
  CHECK((*pool)->kind() == pdlib::MemoryKind::kHost);
  CHECK((*pool)->size() == kBytes);
  auto* bytes = static_cast<uint8_t*>((*pool)->data());
  CHECK(reinterpret_cast<uintptr_t>(bytes) % 4096 == 0);
  CHECK(std::all_of(bytes, bytes + kBytes, [](uint8_t b) { return b == 0; }));
  std::memset(bytes, 0x5a, kBytes);  // writable to the last byte
  CHECK(bytes[kBytes - 1] == 0x5a);

  auto ucx_pool = pdlib::AllocateKVPool("ucx", kBytes, pdlib::MemoryKind::kHost, UcxOptions("shm"));
  REQUIRE(ucx_pool.ok());
  CHECK((*ucx_pool)->allocator() == "ucx");
  CHECK((*ucx_pool)->size() >= kBytes);
  std::memset((*ucx_pool)->data(), 1, (*ucx_pool)->size());
}

// KV pages of several requests written by prefill into decode's pool-backed buffers. Every
// destination buffer is compared with an expected image, so stray writes are caught as well as
// missing ones; the pools then go before or after their managers.
TEST_CASE("ucx KV pools: pool-backed KV buffers receive exactly the bytes sent") {
  const std::string tls = GENERATE("shm", "tcp");
  const bool pools_first = GENERATE(false, true);
  INFO("tls " << tls << (pools_first ? ", pools destroyed first" : ", managers destroyed first"));
  static uint16_t next_bootstrap = 41000;  // in-process control plane: just a key
  const uint16_t bootstrap = next_bootstrap++;

  constexpr uint64_t kLayers = 3, kPages = 64, kItem = 8192 + 64;  // odd size: no alignment luck
  constexpr uint64_t kBufferBytes = kPages * kItem, kBuffers = 2 * kLayers;
  const auto options = UcxOptions(tls);
  Side prefill, decode;
  for (Side* side : {&prefill, &decode}) {
    auto pool =
        pdlib::AllocateKVPool("ucx", kBuffers * kBufferBytes, pdlib::MemoryKind::kHost, options);
    INFO(pool.status().ToString());
    REQUIRE(pool.ok());
    side->pool = std::move(*pool);
    side->aux = std::move(*pdlib::MetadataBuffers::Create(8, 0, 0));
  }
  std::mt19937_64 rng(7);
  auto* src = static_cast<uint8_t*>(prefill.pool->data());
  for (uint64_t i = 0; i < kBuffers * kBufferBytes; ++i) src[i] = static_cast<uint8_t>(rng());
  std::memset(decode.pool->data(), 0, kBuffers * kBufferBytes);

  for (Side* side : {&prefill, &decode}) {
    pdlib::KVManagerOptions o;
    o.mode = side == &prefill ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
    o.control_plane = pdlib::ControlPlane::kInProcess;
    o.bootstrap_port = bootstrap;
    o.backend = "ucx";
    o.backend_options = options;
    for (uint64_t b = 0; b < kBuffers; ++b) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(side->buffer(b, kBufferBytes)));
      o.args.kv.lens.push_back(kBufferBytes);
      o.args.kv.item_lens.push_back(kItem);
    }
    o.args.aux = side->aux->Describe();
    o.args.page_size = 16;
    o.args.fingerprint = {int32_t(kLayers), 8, 128, 2, 1, "kv-pool-test"};
    auto manager = pdlib::KVManager::Create(o);
    INFO(manager.status().ToString());
    REQUIRE(manager.ok());
    side->manager = std::move(*manager);
  }

  std::vector<uint8_t> expected(kBuffers * kBufferBytes, 0);
  for (uint64_t room = 1; room <= 4; ++room) {
    // Pages at random on each side, some runs consecutive so that coalesced writes happen too.
    std::vector<int32_t> all(kPages);
    for (int32_t p = 0; p < int32_t(kPages); ++p) all[p] = p;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> dst(all.begin(), all.begin() + 10);
    std::vector<int32_t> src_pages = {1, 2, 3, 40, 41, 7, 9, 60, 61, 62};
    const uint32_t slot = uint32_t(room % 8);
    prefill.aux->bootstrap_room(slot)[0] = room;

    auto sender = prefill.manager->CreateSender(room);
    REQUIRE(sender.ok());
    auto receiver = decode.manager->CreateReceiver({"127.0.0.1", bootstrap}, room);
    REQUIRE(receiver.ok());
    REQUIRE((*receiver)->Init(dst, slot).ok());
    REQUIRE(WaitFor([&] { return (*sender)->Poll() == KVPoll::kWaitingForInput; }));
    REQUIRE((*sender)->Init(src_pages.size(), slot).ok());
    REQUIRE((*sender)->Send(src_pages, true).ok());
    REQUIRE(WaitFor([&] { return pdlib::IsTerminal((*receiver)->Poll()); }));
    INFO((*receiver)->FailureReason().ToString());
    REQUIRE((*receiver)->Poll() == KVPoll::kSuccess);
    REQUIRE(WaitFor([&] { return pdlib::IsTerminal((*sender)->Poll()); }));
    CHECK((*sender)->Poll() == KVPoll::kSuccess);

    for (uint64_t b = 0; b < kBuffers; ++b) {
      for (size_t i = 0; i < dst.size(); ++i) {
        std::memcpy(expected.data() + b * kBufferBytes + dst[i] * kItem,
                    src + b * kBufferBytes + src_pages[i] * kItem, kItem);
      }
    }
    const auto* got = static_cast<const uint8_t*>(decode.pool->data());
    const auto [g, e] = std::mismatch(got, got + expected.size(), expected.begin());
    INFO("room " << room << ": first difference at byte " << (g - got) << " (buffer "
                 << (g - got) / kBufferBytes << ", page " << (g - got) % kBufferBytes / kItem
                 << ")");
    CHECK(g == got + expected.size());
  }

  if (pools_first) {
    prefill.pool.reset();
    decode.pool.reset();
  }
  prefill.manager.reset();
  decode.manager.reset();
}

// Issue #19: a GPU pool with a backend that cannot reach GPU memory is refused at Create, with a
// message naming the backend and the memory kind (not a failure deep in the first transfer).
TEST_CASE("ucx KV pools: a cuda pool with a backend that cannot reach GPU memory fails Create") {
  pdlib::spi::TransportOptions transport_options;
  transport_options.options = UcxOptions("shm");
  auto t = pdlib::spi::CreateTransport("ucx", transport_options);
  REQUIRE(t.ok());
  if ((*t)->capabilities().supports_cuda_memory) {
    WARN("skipped: this UCX reaches CUDA memory (refusal exercised with a UCX without CUDA)");
    return;
  }
  std::vector<uint8_t> buffer(4 * 4096);
  auto aux = pdlib::MetadataBuffers::Create(8, 0, 0);
  REQUIRE(aux.ok());
  for (pdlib::Mode mode : {pdlib::Mode::kPrefill, pdlib::Mode::kDecode}) {
    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.control_plane = pdlib::ControlPlane::kInProcess;
    o.bootstrap_port = 41900;
    o.backend = "ucx";
    o.backend_options = UcxOptions("shm");
    o.args.kv = {{reinterpret_cast<uint64_t>(buffer.data()),
                  reinterpret_cast<uint64_t>(buffer.data() + 8192)},
                 {8192, 8192},
                 {4096, 4096}};
    o.args.aux = (*aux)->Describe();
    o.args.memory_kind = pdlib::MemoryKind::kCuda;
    o.args.device_id = 3;
    o.args.page_size = 16;
    o.args.fingerprint = {1, 8, 128, 2, 1, "cuda-refusal-test"};
    auto manager = pdlib::KVManager::Create(o);
    REQUIRE_FALSE(manager.ok());
    const std::string message = manager.status().ToString();
    INFO(message);
    CHECK(manager.status().code() == StatusCode::kFailedPrecondition);
    CHECK(message.find("'ucx'") != std::string::npos);
    CHECK(message.find("cuda memory") != std::string::npos);
    CHECK(message.find("device 3") != std::string::npos);
    // The same pools in host memory are accepted: it is the memory kind that was refused.
    o.args.memory_kind = pdlib::MemoryKind::kHost;
    o.args.device_id = 0;
    auto host = pdlib::KVManager::Create(o);
    INFO(host.status().ToString());
    CHECK(host.ok());
  }
}

// The mechanism behind pools: one UCP context per UCX configuration, shared while anyone holds
// it, so that a transport created after a pool finds the pool's mapping.
TEST_CASE("ucx KV pools: contexts are shared by configuration and released with their users") {
  auto parse = [](std::map<std::string, std::string> options) {
    pdlib::spi::TransportOptions t;
    t.options = std::move(options);
    auto parsed =
        pdlib::ucx::ParseUcxOptions(t, [](const char* name) { return std::getenv(name); });
    REQUIRE(parsed.ok());
    return *parsed;
  };
  auto shm1 = pdlib::ucx::AcquireUcxContext(parse(UcxOptions("shm")));
  auto shm2 = pdlib::ucx::AcquireUcxContext(parse(UcxOptions("shm")));
  auto tcp = pdlib::ucx::AcquireUcxContext(parse(UcxOptions("tcp")));
  REQUIRE(shm1.ok());
  REQUIRE(shm2.ok());
  REQUIRE(tcp.ok());
  CHECK(shm1->get() == shm2->get());
  CHECK(shm1->get() != tcp->get());
  const std::weak_ptr<pdlib::ucx::UcxContext> weak = *shm1;
  shm1->reset();
  CHECK_FALSE(weak.expired());  // shm2 still holds it
  shm2->reset();
  CHECK(weak.expired());

  // A pool holds its context: a transport created afterwards with the same options shares it.
  auto pool = pdlib::ucx::AllocateUcxPoolFor(4096, pdlib::MemoryKind::kHost, UcxOptions("shm"),
                                             pdlib::Mode::kPrefill);
  REQUIRE(pool.ok());
  auto again = pdlib::ucx::AcquireUcxContext(parse(UcxOptions("shm")));
  REQUIRE(again.ok());
  const auto addr = reinterpret_cast<uintptr_t>((*pool)->data());
  CHECK((*again)->FindAllocation(addr + 100, 1000) != nullptr);
  CHECK((*again)->FindAllocation(addr, (*pool)->size() + 1) == nullptr);  // not inside
  CHECK((*tcp)->FindAllocation(addr, 4096) == nullptr);
  CHECK(pdlib::ucx::InForeignUcxPool(**tcp, addr, 4096));
  CHECK_FALSE(pdlib::ucx::InForeignUcxPool(**again, addr, 4096));
  pool->reset();
  CHECK((*again)->FindAllocation(addr, 4096) == nullptr);

  // Decode's transports configure UCX differently (no keepalive): a pool allocated for decode
  // lives in decode's context, where a decode manager finds it; one allocated for prefill is
  // foreign to decode (the per-pool warning and emulated shm puts the Python bench hit).
  auto parse_mode = [](std::map<std::string, std::string> options, pdlib::Mode mode) {
    pdlib::spi::TransportOptions t;
    t.options = std::move(options);
    t.mode = mode;
    auto parsed =
        pdlib::ucx::ParseUcxOptions(t, [](const char* name) { return std::getenv(name); });
    REQUIRE(parsed.ok());
    return *parsed;
  };
  auto decode_ctx =
      pdlib::ucx::AcquireUcxContext(parse_mode(UcxOptions("shm"), pdlib::Mode::kDecode));
  REQUIRE(decode_ctx.ok());
  auto decode_pool = pdlib::AllocateKVPool("ucx", 4096, pdlib::MemoryKind::kHost, UcxOptions("shm"),
                                           pdlib::Mode::kDecode);
  REQUIRE(decode_pool.ok());
  const auto daddr = reinterpret_cast<uintptr_t>((*decode_pool)->data());
  CHECK((*decode_ctx)->FindAllocation(daddr, 4096) != nullptr);
  CHECK_FALSE(pdlib::ucx::InForeignUcxPool(**decode_ctx, daddr, 4096));
  auto prefill_pool =
      pdlib::AllocateKVPool("ucx", 4096, pdlib::MemoryKind::kHost, UcxOptions("shm"));
  REQUIRE(prefill_pool.ok());
  const auto paddr = reinterpret_cast<uintptr_t>((*prefill_pool)->data());
  CHECK((*decode_ctx)->FindAllocation(paddr, 4096) == nullptr);
  CHECK(pdlib::ucx::InForeignUcxPool(**decode_ctx, paddr, 4096));
}
