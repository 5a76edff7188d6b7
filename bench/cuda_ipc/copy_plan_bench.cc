// pdlib_copy_plan_bench (issue #19): the CPU cost cuda_ipc adds to every batch before its one
// kernel launch: CoalesceCopies (resolved writes -> strided descriptors) and PlanTiles (the
// kernel's tiles), for the transfer bench's request shape (32 layers x K,V, 8 KV heads x 128 dims
// x bf16 x 16 tokens = 32 KiB items, 16 scattered pages): 1:1, and prefill TP 2 -> decode TP 1 in
// NHD (16 rows per page and head slice) and HND. The writes are the real planner's, resolved
// onto made-up addresses (nothing is copied), so it runs on any machine. Counters: writes in,
// descriptors and tiles out, per batch.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "backends/cuda_ipc/copy_plan.h"
#include "lib/planner/kv_layout_testing.h"
#include "lib/planner/planner.h"

namespace pdlib::cuda_ipc {
namespace {

namespace planner = pdlib::planner;

constexpr int32_t kLayers = 32;
constexpr int32_t kHeads = 8;
constexpr uint32_t kPageSize = 16;
constexpr uint64_t kHeadBytes = 256;
constexpr int32_t kPoolPages = 1024;
constexpr size_t kRequestPages = 16;
constexpr uint32_t kTileUnits = 1024;  // the gather kernel's (GatherCopier::kTileUnits)

planner::SideLayout Layout(int32_t tp_size, int32_t tp_rank, KVLayout layout) {
  return planner::KvOnlySideLayout({kLayers, kHeads, kPageSize, kHeadBytes, kPoolPages}, tp_size,
                                   tp_rank, layout);
}

// Prefill rank 0's batch for one request (what its transport coalesces), resolved onto buffers
// 1 GiB apart.
std::vector<ResolvedCopy> RankBatch(int32_t prefill_tp, KVLayout layout) {
  std::mt19937_64 rng(7);
  std::vector<int32_t> pages(kPoolPages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<int32_t> src(pages.begin(), pages.begin() + kRequestPages);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<int32_t> dst(pages.begin(), pages.begin() + kRequestPages);
  auto plan = planner::MakePairPlan(Layout(prefill_tp, 0, layout), Layout(1, 0, layout));
  if (!plan.ok()) {
    std::fprintf(stderr, "MakePairPlan: %s\n", plan.status().ToString().c_str());
    std::exit(1);
  }
  planner::PlanOutput out;
  planner::ChunkPages chunk;
  chunk.src_pages = src;
  chunk.dst_pages = dst;
  chunk.is_last = true;
  if (Status s = planner::PlanKvWrites(*plan, chunk, &out); !s.ok()) {
    std::fprintf(stderr, "PlanKvWrites: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  constexpr uint64_t kSrcBase = uint64_t{1} << 44, kDstBase = uint64_t{1} << 45;
  constexpr uint64_t kSpacing = uint64_t{1} << 30;
  std::vector<ResolvedCopy> copies;
  for (const planner::PlannedWrite& w : out.writes) {
    copies.push_back({kSrcBase + w.local_buffer * kSpacing + w.local_offset,
                      kDstBase + w.remote_buffer * kSpacing + w.remote_offset, w.length});
  }
  return copies;
}

void BM_CoalesceAndTile(benchmark::State& state) {
  const auto prefill_tp = static_cast<int32_t>(state.range(0));
  const auto layout = state.range(1) == 0 ? KVLayout::kNHD : KVLayout::kHND;
  const std::vector<ResolvedCopy> copies = RankBatch(prefill_tp, layout);
  std::vector<CopyDesc> descs;
  TilePlan tiles;
  for (auto _ : state) {
    CoalesceCopies(copies, &descs);
    if (Status s = PlanTiles(descs, kTileUnits, &tiles); !s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(tiles.tile_start.data());
  }
  state.SetLabel(std::string(prefill_tp == 1 ? "1:1" : "TP 2->1") +
                 (layout == KVLayout::kNHD ? " NHD" : " HND"));
  state.counters["writes"] = static_cast<double>(copies.size());
  state.counters["descs"] = static_cast<double>(descs.size());
  state.counters["tiles"] = static_cast<double>(tiles.tiles());
  state.counters["writes/s"] = benchmark::Counter(
      static_cast<double>(copies.size()) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CoalesceAndTile)->Args({1, 0})->Args({2, 0})->Args({2, 1});

}  // namespace
}  // namespace pdlib::cuda_ipc

BENCHMARK_MAIN();
