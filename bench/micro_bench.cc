// pdlib microbenchmarks: the cost of the hot paths an engine touches every scheduler step.
//   make bench   (or build/release/bench/pdlib_micro_bench --benchmark_format=json)
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "lib/base/crc32c.h"
#include "lib/core/kv_digest.h"
#include "lib/core/room_table.h"
#include "pdlib/kv_manager.h"
#include "pdlib/log.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/page_index.h"

namespace {

// Poll() on a live room: one acquire load (SPEC R2.3). Target: <= 10 ns.
void BM_Poll(benchmark::State& state) {
  pdlib::RoomState room(1);
  room.Advance(pdlib::KVPoll::kTransferring);
  for (auto _ : state) benchmark::DoNotOptimize(room.Poll());
}
BENCHMARK(BM_Poll);

// One forward transition by compare-and-swap, including the timestamp it records. Rooms are
// made in blocks outside the timed region so the figure is the transition alone.
void BM_StateTransition(benchmark::State& state) {
  constexpr size_t kBlock = 4096;
  std::vector<std::unique_ptr<pdlib::RoomState>> rooms;
  size_t next = kBlock;
  for (auto _ : state) {
    if (next == kBlock) {
      state.PauseTiming();
      rooms.clear();
      for (size_t i = 0; i < kBlock; ++i) rooms.push_back(std::make_unique<pdlib::RoomState>(i));
      next = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(rooms[next++]->Advance(pdlib::KVPoll::kWaitingForInput));
  }
}
BENCHMARK(BM_StateTransition);

// Poll() as an engine calls it: through the public KVSender handle (a virtual call and the
// room's atomic), on a live request of a real manager over the fake backend.
void BM_PollHandle(benchmark::State& state) {
  pdlib::SetLogLevel(pdlib::LogLevel::kError);  // the abort on teardown is expected
  std::vector<uint8_t> kv(1 << 16);
  pdlib::KVManagerOptions o;
  o.mode = pdlib::Mode::kPrefill;
  o.control_plane = pdlib::ControlPlane::kInProcess;
  o.bootstrap_port = 1;  // in-process only
  o.args.kv = {{reinterpret_cast<uint64_t>(kv.data())}, {kv.size()}, {4096}};
  auto manager = pdlib::KVManager::Create(o);
  auto sender = (*manager)->CreateSender(7);
  const pdlib::KVSender& handle = **sender;
  for (auto _ : state) benchmark::DoNotOptimize(handle.Poll());
}
BENCHMARK(BM_PollHandle);

// A full room lifecycle without pausing the timer: insert, three transitions, erase.
void BM_RoomLifecycle(benchmark::State& state) {
  pdlib::RoomTable table;
  uint64_t id = 0;
  for (auto _ : state) {
    auto r = table.Insert(++id);
    (*r)->Advance(pdlib::KVPoll::kWaitingForInput);
    (*r)->Advance(pdlib::KVPoll::kTransferring);
    (*r)->Advance(pdlib::KVPoll::kSuccess);
    table.Erase(id, r->get());
  }
}
BENCHMARK(BM_RoomLifecycle);

// Coalescing (SPEC R5.3). Arg 0: fraction of page pairs that break a run, in percent
// (0: fully contiguous; 100: fully scattered). Target: >= 100 M pages/s.
void BM_CoalescePages(benchmark::State& state) {
  const size_t n = 1 << 16;
  const int break_pct = static_cast<int>(state.range(0));
  std::mt19937 rng(1);
  std::vector<int32_t> src(n), dst(n);
  int32_t s = 0, d = 0;
  for (size_t i = 0; i < n; ++i) {
    bool brk = static_cast<int>(rng() % 100) < break_pct;
    s = brk ? static_cast<int32_t>(rng() % (1 << 20)) : s + 1;
    d = brk ? static_cast<int32_t>(rng() % (1 << 20)) : d + 1;
    src[i] = s;
    dst[i] = d;
  }
  std::vector<pdlib::PageRun> runs;
  runs.reserve(n);
  for (auto _ : state) {
    pdlib::CoalescePageRuns(src, dst, &runs).IgnoreError();
    benchmark::DoNotOptimize(runs.data());
  }
  state.counters["pages_per_s"] =
      benchmark::Counter(static_cast<double>(n) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["runs"] = static_cast<double>(runs.size());
}
BENCHMARK(BM_CoalescePages)->Arg(0)->Arg(10)->Arg(100);

// KVSender::SendLayers as a forward loop calls it after each layer (issue #17: <= 2 us, never
// blocking on the network): one announcement of one more layer of a 16-page chunk, on a room
// of a prefill manager whose decode peer is ready, over the fake backend (the writes it queues
// are planned and posted on pdlib's workers, not in this call). 64 layers per room; setting up
// the next room is outside the timing.
void BM_SendLayers(benchmark::State& state) {
  pdlib::SetLogLevel(pdlib::LogLevel::kError);
  constexpr int32_t kLayers = 64, kPages = 16, kPoolPages = 64;
  constexpr uint64_t kItem = 1024;
  std::vector<std::vector<uint8_t>> pools(2 * 2 * kLayers,
                                          std::vector<uint8_t>(kPoolPages * kItem));
  auto options = [&](pdlib::Mode mode, size_t first) {
    pdlib::KVManagerOptions o;
    o.mode = mode;
    o.control_plane = pdlib::ControlPlane::kInProcess;
    o.bootstrap_port = 2;  // in-process only
    for (size_t b = first; b < first + 2 * kLayers; ++b) {
      o.args.kv.ptrs.push_back(reinterpret_cast<uint64_t>(pools[b].data()));
      o.args.kv.lens.push_back(pools[b].size());
      o.args.kv.item_lens.push_back(kItem);
    }
    o.args.page_size = 16;
    o.args.fingerprint = {kLayers, 1, 512, 2, 1, "micro-bench"};
    return o;
  };
  auto prefill = pdlib::KVManager::Create(options(pdlib::Mode::kPrefill, 0));
  auto decode = pdlib::KVManager::Create(options(pdlib::Mode::kDecode, 2 * kLayers));
  if (!prefill.ok() || !decode.ok()) {
    state.SkipWithError("KVManager::Create failed");
    return;
  }
  std::vector<int32_t> pages(kPages);
  for (int32_t i = 0; i < kPages; ++i) pages[size_t(i)] = i * 3 % kPoolPages;
  uint64_t room = 0;
  std::unique_ptr<pdlib::KVSender> sender;
  std::unique_ptr<pdlib::KVReceiver> receiver;
  int32_t done = kLayers;
  for (auto _ : state) {
    if (done == kLayers) {  // the next room, ready for its first announcement
      state.PauseTiming();
      sender.reset();
      receiver.reset();
      sender = std::move(*(*prefill)->CreateSender(++room));
      receiver = std::move(*(*decode)->CreateReceiver({"127.0.0.1", 2}, room));
      receiver->Init(pages, std::nullopt).IgnoreError();
      while (sender->Poll() != pdlib::KVPoll::kWaitingForInput) {
        if (pdlib::IsTerminal(sender->Poll())) {
          state.SkipWithError("room failed before its first announcement");
          return;
        }
      }
      sender->Init(kPages, std::nullopt).IgnoreError();
      done = 0;
      state.ResumeTiming();
    }
    ++done;
    benchmark::DoNotOptimize(sender->SendLayers(pages, done, true));
  }
  state.counters["layers_per_room"] = kLayers;
}
BENCHMARK(BM_SendLayers);

// Metadata slot alloc + free, as the schedulers do per request.
void BM_MetadataSlotAllocFree(benchmark::State& state) {
  pdlib::MetadataSlotAllocator alloc(1024);
  for (auto _ : state) {
    auto slot = alloc.Alloc();
    alloc.Free(*slot).IgnoreError();
  }
}
BENCHMARK(BM_MetadataSlotAllocFree);

// KV integrity (issue #42): the raw CRC32C rate of one core over a page-sized buffer, by each path
// this CPU runs (range 1 indexes pdlib::Crc32cPaths(), fastest first: e.g. AVX-512 folding, the
// SSE4.2 three streams, the portable table); bytes/s is the digest rate.
void BM_Crc32c(benchmark::State& state) {
  std::vector<uint8_t> buf(static_cast<size_t>(state.range(0)));
  std::mt19937 rng(1);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const auto paths = pdlib::Crc32cPaths();
  if (static_cast<size_t>(state.range(1)) >= paths.size()) {
    state.SkipWithError("this CPU has fewer CRC32C paths");
    return;
  }
  const std::string_view path = paths[static_cast<size_t>(state.range(1))];
  for (auto _ : state) {
    benchmark::DoNotOptimize(pdlib::Crc32cRawBy(path, 0, buf.data(), buf.size()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(buf.size()));
  state.SetLabel(std::string(path));
}
BENCHMARK(BM_Crc32c)->ArgsProduct({{4096, 32768, 1 << 20}, {0, 1}})->Args({32768, 2});

// A sender's digest of one request as pdlib computes it (AddWritesToDigest): 2 layers x K,V x
// 16 pages of 32 KiB, whole pages (TP 1:1) or two heads' halves of each token (TP 2 -> 1, NHD,
// 16 tokens): the CRC plus the cell keys, and the zero shifts of sliced pages.
void BM_DigestRequest(benchmark::State& state) {
  const bool sliced = state.range(0) != 0;
  constexpr uint64_t kPage = 32768, kPages = 16, kBuffers = 4, kTokens = 16;
  std::vector<std::vector<uint8_t>> src(kBuffers, std::vector<uint8_t>(kPage * kPages, 7));
  pdlib::DigestMemory mem, items;
  for (auto& s : src) {
    mem.kv.push_back(reinterpret_cast<uint64_t>(s.data()));
    items.kv_item.push_back(kPage);
  }
  std::vector<int32_t> dst;
  for (int32_t p = 0; p < static_cast<int32_t>(kPages); ++p) dst.push_back(p * 3 + 1);
  std::vector<pdlib::planner::PlannedWrite> writes;
  for (uint32_t b = 0; b < kBuffers; ++b) {
    for (uint64_t p = 0; p < kPages; ++p) {
      if (!sliced) {
        writes.push_back({pdlib::planner::RegionKind::kKv, b, p * kPage, b,
                          static_cast<uint64_t>(dst[p]) * kPage, kPage});
        continue;
      }
      const uint64_t row = kPage / kTokens, half = row / 2;
      for (uint64_t t = 0; t < kTokens; ++t) {
        writes.push_back({pdlib::planner::RegionKind::kKv, b, p * kPage / 2 + t * half, b,
                          static_cast<uint64_t>(dst[p]) * kPage + t * row, half});
      }
    }
  }
  const pdlib::PagePositions positions(dst);
  uint64_t bytes = 0;
  for (const auto& w : writes) bytes += w.length;
  for (auto _ : state) {
    pdlib::KvDigest d = pdlib::KvDigest::Empty(kBuffers, kPages, 0, 0, 0);
    benchmark::DoNotOptimize(pdlib::AddWritesToDigest(writes, mem, items, positions, &d).ok());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.SetLabel(sliced ? "TP 2 -> 1 head halves" : "whole pages");
}
BENCHMARK(BM_DigestRequest)->Arg(0)->Arg(1);

}  // namespace

BENCHMARK_MAIN();
