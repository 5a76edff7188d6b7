// The C API's cost against the C++ API's (issue #44): Poll() of a live sender (ns), and a whole
// request's round trip (fake backend, in-process control plane: create both handles, Init, Send
// 16 pages, poll both to Success, destroy) through each API. Built twice: pdlib_c_api_bench
// (PDLIB_BENCH_C_API=1: through libpdlib_c.so) and pdlib_cxx_api_bench (the static C++ library).
// One process cannot hold both: libpdlib_c.so carries its own copy of pdlib, whose protobuf
// descriptors would be registered twice in the one libprotobuf. bench/c_api_bench.sh runs the
// two alternately and prints their figures side by side.
//
//   bench/c_api_bench.sh build/release
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#if PDLIB_BENCH_C_API
#include "pdlib/c/pdlib.h"
#else
#include "pdlib/pdlib.h"
#endif

namespace {

constexpr int kBuffers = 8, kPages = 64, kPage = 4096, kSent = 16;

struct Memory {
  std::vector<std::vector<uint8_t>> kv{kBuffers, std::vector<uint8_t>(kPages* kPage)};
  std::vector<uint8_t> aux = std::vector<uint8_t>(8 * 64);
  std::vector<uint64_t> ptrs, lens, items;
  uint64_t aux_desc[3] = {};
  Memory() {
    for (auto& b : kv) {
      ptrs.push_back(reinterpret_cast<uint64_t>(b.data()));
      lens.push_back(b.size());
      items.push_back(kPage);
    }
    aux_desc[0] = reinterpret_cast<uint64_t>(aux.data());
    aux_desc[1] = aux.size();
    aux_desc[2] = 64;
  }
};

uint16_t NextPort() {
  static uint16_t port = 30000;
  return port++;
}

#if !PDLIB_BENCH_C_API
// A C++ prefill + decode pair.
struct CxxPair {
  Memory mem[2];
  std::unique_ptr<pdlib::KVManager> side[2];
  uint16_t port = NextPort();
  CxxPair() {
    for (int s = 0; s < 2; ++s) {
      pdlib::KVManagerOptions o;
      o.mode = s == 0 ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
      o.control_plane = pdlib::ControlPlane::kInProcess;
      o.bootstrap_port = port;
      o.args.kv = {mem[s].ptrs, mem[s].lens, mem[s].items};
      o.args.aux = {{mem[s].aux_desc[0]}, {mem[s].aux_desc[1]}, {mem[s].aux_desc[2]}};
      o.args.page_size = 16;
      o.args.fingerprint = {kBuffers / 2, 8, 128, 2, 1, "c-api-bench"};
      side[s] = std::move(*pdlib::KVManager::Create(o));
    }
  }
};

#endif

#if PDLIB_BENCH_C_API
// The same through the C API.
struct CPair {
  Memory mem[2];
  pdlib_manager* side[2] = {nullptr, nullptr};
  uint16_t port = NextPort();
  CPair() {
    for (int s = 0; s < 2; ++s) {
      pdlib_manager_options o;
      pdlib_manager_options_init(&o);
      o.mode = s == 0 ? PDLIB_MODE_PREFILL : PDLIB_MODE_DECODE;
      o.control_plane = PDLIB_CONTROL_IN_PROCESS;
      o.bootstrap_port = port;
      o.kv = {mem[s].ptrs.data(), mem[s].lens.data(), mem[s].items.data(), kBuffers};
      o.aux = {&mem[s].aux_desc[0], &mem[s].aux_desc[1], &mem[s].aux_desc[2], 1};
      o.page_size = 16;
      o.num_layers = kBuffers / 2;
      o.num_kv_heads = 8;
      o.head_dim = 128;
      o.dtype_bytes = 2;
      o.model_name = "c-api-bench";
      if (pdlib_manager_create(&o, &side[s]) != PDLIB_OK) side[s] = nullptr;
    }
  }
  ~CPair() {
    pdlib_manager_destroy(side[1]);
    pdlib_manager_destroy(side[0]);
  }
};

#endif

std::vector<int32_t> Pages(int offset) {
  std::vector<int32_t> p;
  for (int i = 0; i < kSent; ++i) p.push_back((offset + i * 3) % kPages);
  return p;
}

#if !PDLIB_BENCH_C_API
void BM_PollCxx(benchmark::State& state) {
  CxxPair pair;
  auto sender = pair.side[0]->CreateSender(1);
  if (!sender.ok()) return state.SkipWithError(sender.status().ToString().c_str());
  for (auto _ : state) benchmark::DoNotOptimize((*sender)->Poll());
  state.SetLabel("C++ KVSender::Poll");
}
BENCHMARK(BM_PollCxx);
#else
void BM_PollC(benchmark::State& state) {
  CPair pair;
  pdlib_sender* sender = nullptr;
  if (pair.side[0] == nullptr || pdlib_sender_create(pair.side[0], 1, &sender) != PDLIB_OK) {
    return state.SkipWithError(pdlib_last_error());
  }
  for (auto _ : state) benchmark::DoNotOptimize(pdlib_sender_poll(sender));
  state.SetLabel("C pdlib_sender_poll");
  pdlib_sender_destroy(sender);
}
BENCHMARK(BM_PollC);
#endif

#if !PDLIB_BENCH_C_API
void BM_RoundTripCxx(benchmark::State& state) {
  CxxPair pair;
  uint64_t room = 100;
  int k = 0;
  for (auto _ : state) {
    const std::vector<int32_t> src = Pages(k), dst = Pages(k + 1);
    ++k;
    auto s = pair.side[0]->CreateSender(room);
    auto r = pair.side[1]->CreateReceiver({"127.0.0.1", pair.port}, room++);
    if (!s.ok() || !r.ok()) return state.SkipWithError("handles");
    if (!(*r)->Init(dst, 1u).ok()) return state.SkipWithError("receiver Init");
    while ((*s)->Poll() < pdlib::KVPoll::kWaitingForInput) {
    }
    if (!(*s)->Init(src.size(), 0u).ok() || !(*s)->Send(src, true).ok()) {
      return state.SkipWithError("Send");
    }
    while (!pdlib::IsTerminal((*r)->Poll()) || !pdlib::IsTerminal((*s)->Poll())) {
    }
    if ((*r)->Poll() != pdlib::KVPoll::kSuccess) return state.SkipWithError("not Success");
  }
  state.SetLabel("C++ API, fake, 16 pages");
}
BENCHMARK(BM_RoundTripCxx)->UseRealTime();
#else
void BM_RoundTripC(benchmark::State& state) {
  CPair pair;
  if (pair.side[0] == nullptr || pair.side[1] == nullptr) {
    return state.SkipWithError(pdlib_last_error());
  }
  uint64_t room = 100;
  int k = 0;
  for (auto _ : state) {
    const std::vector<int32_t> src = Pages(k), dst = Pages(k + 1);
    ++k;
    pdlib_sender* s = nullptr;
    pdlib_receiver* r = nullptr;
    if (pdlib_sender_create(pair.side[0], room, &s) != PDLIB_OK ||
        pdlib_receiver_create(pair.side[1], "127.0.0.1", pair.port, room++, -1, &r) != PDLIB_OK) {
      return state.SkipWithError(pdlib_last_error());
    }
    pdlib_receive_params rp;
    pdlib_receive_params_init(&rp);
    rp.pages = dst.data();
    rp.page_count = dst.size();
    rp.aux_index = 1;
    if (pdlib_receiver_init(r, &rp) != PDLIB_OK) return state.SkipWithError(pdlib_last_error());
    while (pdlib_sender_poll(s) < PDLIB_POLL_WAITING_FOR_INPUT) {
    }
    pdlib_send_params sp;
    pdlib_send_params_init(&sp);
    sp.pages = src.data();
    sp.page_count = src.size();
    sp.is_last_chunk = 1;
    if (pdlib_sender_init(s, src.size(), 0) != PDLIB_OK || pdlib_sender_send(s, &sp) != PDLIB_OK) {
      return state.SkipWithError(pdlib_last_error());
    }
    auto terminal = [](pdlib_poll p) { return p == PDLIB_POLL_SUCCESS || p == PDLIB_POLL_FAILED; };
    while (!terminal(pdlib_receiver_poll(r)) || !terminal(pdlib_sender_poll(s))) {
    }
    if (pdlib_receiver_poll(r) != PDLIB_POLL_SUCCESS) return state.SkipWithError("not Success");
    pdlib_sender_destroy(s);
    pdlib_receiver_destroy(r);
  }
  state.SetLabel("C API, fake, 16 pages");
}
BENCHMARK(BM_RoundTripC)->UseRealTime();
#endif

}  // namespace

BENCHMARK_MAIN();
