// KV transfer round trips through the public API: a prefill and a decode KVManager in one
// process (in-process control plane), their KV buffers carved out of pools from
// pdlib::AllocateKVPool, one request at a time. Timed per request from the receiver's Init() to
// Success at decode (manual time), so the figure is the transfer itself: TransferInfo to
// prefill, the writes of every K and V buffer, the aux slot, the status back. Bytes/s counts the
// KV payload (pages x 2 x layers x item bytes).
//
//   pdlib_micro_bench --benchmark_filter=RoundTrip
//
// BM_SendCall times only the KVSender::Send() call of one chunk of N pages (fake backend): the
// C++ baseline for bench/python/pdlib_py_bench.py's send() figure, measured the same way.
//
// Args: {pages per request, item bytes}. Pages are distinct and at random in each side's pool,
// so almost no write coalesces. The ucx variants run only when the ucx backend is built.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/pdlib.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kLayers = 8;
constexpr uint64_t kPoolPages = 256;  // per buffer, unless Setup() is given more
constexpr int kPageSets = 64;         // page lists cycled through

// A prefill and a decode manager connected through the in-process control plane.
class RoundTrip {
 public:
  // Returns "" or why the pair could not be set up.
  std::string Setup(const std::string& backend, const std::map<std::string, std::string>& options,
                    uint64_t pages, uint64_t item, uint64_t pool_pages = kPoolPages,
                    pdlib::ControlPlane plane = pdlib::ControlPlane::kInProcess) {
    static uint16_t next_bootstrap = 1000;  // in-process control plane: only a key
    bootstrap_ = plane == pdlib::ControlPlane::kInProcess ? next_bootstrap++ : 0;
    pages_ = pages;
    const uint64_t buffer_bytes = pool_pages * item;
    for (int side = 0; side < 2; ++side) {
      auto pool = pdlib::AllocateKVPool(backend, 2 * kLayers * buffer_bytes,
                                        pdlib::MemoryKind::kHost, options);
      if (!pool.ok()) return pool.status().ToString();
      std::memset((*pool)->data(), side == 0 ? 0x5a : 0, 2 * kLayers * buffer_bytes);
      auto aux = pdlib::MetadataBuffers::Create(8, 0, 0);
      if (!aux.ok()) return aux.status().ToString();
      pdlib::KVManagerOptions o;
      o.mode = side == 0 ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
      o.control_plane = plane;
      o.bootstrap_port = bootstrap_;  // gRPC: prefill's bootstrap server takes a free port
      o.start_bootstrap_server = side == 0;
      o.backend = backend;
      o.backend_options = options;
      auto* base = static_cast<uint8_t*>((*pool)->data());
      for (uint64_t b = 0; b < 2 * kLayers; ++b) {
        o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(base + b * buffer_bytes));
        o.args.kv.lens.push_back(buffer_bytes);
        o.args.kv.item_lens.push_back(item);
      }
      o.args.aux = (*aux)->Describe();
      o.args.page_size = 16;
      o.args.fingerprint = {int32_t(kLayers), 8, 128, 2, 1, "round-trip-bench"};
      auto manager = pdlib::KVManager::Create(o);
      if (!manager.ok()) return manager.status().ToString();
      if (side == 0 && plane == pdlib::ControlPlane::kGrpc) {
        const std::string where = (*manager)->bootstrap_endpoint();
        bootstrap_ = uint16_t(std::stoi(where.substr(where.rfind(':') + 1)));
      }
      pools_[side] = std::move(*pool);
      aux_[side] = std::move(*aux);
      managers_[side] = std::move(*manager);
    }
    std::mt19937_64 rng(42);
    std::vector<int32_t> all(pool_pages);
    for (size_t p = 0; p < all.size(); ++p) all[p] = int32_t(p);
    for (auto* sets : {&src_, &dst_}) {
      for (int s = 0; s < kPageSets; ++s) {
        std::shuffle(all.begin(), all.end(), rng);
        sets->insert(sets->end(), all.begin(), all.begin() + std::ptrdiff_t(pages));
      }
    }
    return "";
  }

  // Decode's warm-up (KVManager::Connect) to the prefill deployment.
  std::string Connect() {
    pdlib::Status s = managers_[1]->Connect({"127.0.0.1", bootstrap_}, std::chrono::seconds(10));
    return s.ok() ? "" : s.ToString();
  }

  // What Run() times.
  enum class Timed { kTransfer, kSendCall, kFromCreate };

  // One request; returns the time from the receiver's Init() to Success (or of the Send() call
  // alone), or an error.
  std::string Run(uint64_t i, std::chrono::duration<double>* elapsed,
                  Timed timed = Timed::kTransfer) {
    const uint64_t room = ++room_;
    const uint32_t slot = uint32_t(room % 8);
    aux_[0]->bootstrap_room(slot)[0] = room;  // decode checks it (SPEC R4.4)
    const auto set = (i % kPageSets) * pages_;
    const std::span<const int32_t> src(src_.data() + set, pages_);
    const std::span<const int32_t> dst(dst_.data() + set, pages_);
    const auto created = Clock::now();
    auto sender = managers_[0]->CreateSender(room);
    if (!sender.ok()) return sender.status().ToString();
    auto receiver = managers_[1]->CreateReceiver({"127.0.0.1", bootstrap_}, room);
    if (!receiver.ok()) return receiver.status().ToString();
    if (!WaitFor(**receiver, pdlib::KVPoll::kWaitingForInput)) return Why(**receiver);

    const auto start = Clock::now();
    if (auto s = (*receiver)->Init(dst, slot); !s.ok()) return s.ToString();
    if (!WaitFor(**sender, pdlib::KVPoll::kWaitingForInput)) return Why(**sender);
    if (auto s = (*sender)->Init(src.size(), slot); !s.ok()) return s.ToString();
    const auto send_start = Clock::now();
    if (auto s = (*sender)->Send(src, true); !s.ok()) return s.ToString();
    if (timed == Timed::kSendCall) *elapsed = Clock::now() - send_start;
    if (!WaitFor(**receiver, pdlib::KVPoll::kSuccess)) return Why(**receiver);
    if (timed == Timed::kTransfer) *elapsed = Clock::now() - start;
    if (timed == Timed::kFromCreate) *elapsed = Clock::now() - created;

    if (!WaitFor(**sender, pdlib::KVPoll::kSuccess)) return Why(**sender);
    return "";
  }

 private:
  // Spins (yielding) until `h` reaches `state` or fails; false on failure or after 10 s.
  static bool WaitFor(const pdlib::KVPollable& h, pdlib::KVPoll state) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (h.Poll() < state) {
      if (h.Poll() == pdlib::KVPoll::kFailed || Clock::now() > deadline) return false;
      std::this_thread::yield();
    }
    return true;
  }
  static std::string Why(const pdlib::KVPollable& h) {
    return "room " + std::to_string(h.room()) + " in state " +
           std::string(pdlib::KVPollName(h.Poll())) + ": " + h.FailureReason().ToString();
  }

  uint16_t bootstrap_ = 0;
  uint64_t pages_ = 0;
  uint64_t room_ = 0;
  // Destroyed managers first (members go in reverse order), then the pools.
  std::unique_ptr<pdlib::KVPool> pools_[2];
  std::unique_ptr<pdlib::MetadataBuffers> aux_[2];
  std::unique_ptr<pdlib::KVManager> managers_[2];
  std::vector<int32_t> src_, dst_;
};

void BM_KVRoundTrip(benchmark::State& state, const char* backend,
                    std::map<std::string, std::string> options) {
  pdlib::SetLogLevel(pdlib::LogLevel::kError);
  const auto builtin = pdlib::BuiltinBackends();
  if (std::find(builtin.begin(), builtin.end(), backend) == builtin.end()) {
    state.SkipWithError((std::string(backend) + " backend not built").c_str());
    return;
  }
  const uint64_t pages = uint64_t(state.range(0)), item = uint64_t(state.range(1));
  RoundTrip trip;
  if (std::string e = trip.Setup(backend, options, pages, item); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  uint64_t i = 0;
  for (auto _ : state) {
    std::chrono::duration<double> elapsed{};
    if (std::string e = trip.Run(i++, &elapsed); !e.empty()) {
      state.SkipWithError(e.c_str());
      break;
    }
    state.SetIterationTime(elapsed.count());
  }
  state.SetBytesProcessed(int64_t(state.iterations() * pages * 2 * kLayers * item));
}

// The Send() call of one 1,000-page chunk (the whole request), fake backend, 4 KiB items.
void BM_SendCall(benchmark::State& state) {
  pdlib::SetLogLevel(pdlib::LogLevel::kError);
  const uint64_t pages = uint64_t(state.range(0));
  RoundTrip trip;
  if (std::string e = trip.Setup("fake", {}, pages, 4096, pages + 8); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  uint64_t i = 0;
  std::vector<double> us;
  for (auto _ : state) {
    std::chrono::duration<double> elapsed{};
    if (std::string e = trip.Run(i++, &elapsed, RoundTrip::Timed::kSendCall); !e.empty()) {
      state.SkipWithError(e.c_str());
      return;
    }
    state.SetIterationTime(elapsed.count());
    us.push_back(elapsed.count() * 1e6);
  }
  if (us.empty()) return;
  std::sort(us.begin(), us.end());  // the Python bench reports medians: so does this
  state.counters["median_us"] = us[us.size() / 2];
  state.counters["p90_us"] = us[us.size() * 9 / 10];
}
BENCHMARK(BM_SendCall)->ArgName("pages")->Arg(1000)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The first request of a fresh decode manager to a fresh prefill deployment (gRPC control plane,
// fake backend), from CreateSender/CreateReceiver to Success: with connect:1 decode called
// KVManager::Connect() first (its warm-up, issue #20), with connect:0 the request pays the
// bootstrap lookup and the connection set-up.
void BM_FirstRequest(benchmark::State& state) {
  pdlib::SetLogLevel(pdlib::LogLevel::kError);
  const bool connect = state.range(0) != 0;
  for (auto _ : state) {
    RoundTrip trip;
    if (std::string e = trip.Setup("fake", {}, 16, 4096, kPoolPages, pdlib::ControlPlane::kGrpc);
        !e.empty()) {
      state.SkipWithError(e.c_str());
      return;
    }
    if (connect) {
      if (std::string e = trip.Connect(); !e.empty()) {
        state.SkipWithError(e.c_str());
        return;
      }
    }
    std::chrono::duration<double> elapsed{};
    if (std::string e = trip.Run(0, &elapsed, RoundTrip::Timed::kFromCreate); !e.empty()) {
      state.SkipWithError(e.c_str());
      return;
    }
    state.SetIterationTime(elapsed.count());
  }
}
BENCHMARK(BM_FirstRequest)
    ->ArgName("connect")
    ->Arg(0)
    ->Arg(1)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void RoundTripArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"pages", "item_bytes"});
  for (int64_t pages : {1, 16, 64}) {
    for (int64_t item : {4096, 32768}) b->Args({pages, item});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(BM_KVRoundTrip, fake, "fake", {})->Apply(RoundTripArgs);
BENCHMARK_CAPTURE(BM_KVRoundTrip, ucx_shm, "ucx", {{"ucx.tls", "shm"}})->Apply(RoundTripArgs);
BENCHMARK_CAPTURE(BM_KVRoundTrip, ucx_tcp, "ucx", {{"ucx.tls", "tcp"}, {"ucx.net_devices", "lo"}})
    ->Apply(RoundTripArgs);

}  // namespace
