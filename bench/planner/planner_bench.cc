// Planning cost of the transfer planner (lib/planner): one chunk of 16 pages of a 32-layer model
// (8 kv heads of 128 bf16 elements, 16-token pages: 32 KiB pages at TP 1), for one
// (prefill rank, decode rank) pair. Reported per page of the chunk (counter "per_page").
//   build/<dir>/bench/planner/pdlib_planner_bench [--benchmark_format=json]
// Arguments: layout (0 NHD, 1 HND), prefill TP, decode TP, pages (0 scattered, 1 contiguous).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "lib/planner/planner.h"

namespace {

using namespace pdlib::planner;  // NOLINT(build/namespaces): a benchmark file
using pdlib::KVLayout;

constexpr int32_t kLayers = 32;
constexpr int32_t kHeads = 8;
constexpr uint64_t kHeadBytes = 128 * 2;
constexpr uint32_t kPageSize = 16;
constexpr int32_t kPages = 16;
constexpr int32_t kPool = 1024;

SideLayout Side(KVLayout layout, int32_t tp, int32_t rank) {
  SideLayout l;
  l.tp_size = tp;
  l.tp_rank = rank;
  l.total_layers = kLayers;
  l.total_kv_heads = kHeads;
  l.kv_heads = kHeads / tp;
  l.page_size = kPageSize;
  l.layout = layout;
  const uint64_t item = kPageSize * static_cast<uint64_t>(l.kv_heads) * kHeadBytes;
  l.kv.assign(2 * kLayers, {item, item * kPool});
  return l;
}

void BM_PlanChunk(benchmark::State& state) {
  const KVLayout layout = state.range(0) == 0 ? KVLayout::kNHD : KVLayout::kHND;
  const auto prefill_tp = static_cast<int32_t>(state.range(1));
  const auto decode_tp = static_cast<int32_t>(state.range(2));
  const bool contiguous = state.range(3) != 0;
  auto plan = MakePairPlan(Side(layout, prefill_tp, 0), Side(layout, decode_tp, 0));
  if (!plan.ok()) {
    state.SkipWithError(plan.status().ToString().c_str());
    return;
  }
  std::vector<int32_t> src(kPool), dst(kPool);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  if (!contiguous) {
    std::mt19937 rng(1);
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
  }
  src.resize(kPages);
  dst.resize(kPages);
  ChunkInput in;
  in.pages = {src, dst, false, kPages * kPageSize};
  PlanOutput out;
  for (auto _ : state) {
    pdlib::Status s = PlanChunkWrites(*plan, in, &out);
    benchmark::DoNotOptimize(s);
    benchmark::DoNotOptimize(out.writes.data());
  }
  state.counters["writes"] = static_cast<double>(out.writes.size());
  state.counters["per_page"] = benchmark::Counter(
      static_cast<double>(kPages),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(pdlib::KVLayoutName(layout)) + " TP " + std::to_string(prefill_tp) +
                 "->" + std::to_string(decode_tp) + (contiguous ? " contiguous" : " scattered"));
}
BENCHMARK(BM_PlanChunk)
    ->ArgNames({"hnd", "ptp", "dtp", "contig"})
    ->ArgsProduct({{0, 1}, {1, 2}, {1, 2}, {0, 1}});

// The per-connection plan, computed once at Register.
void BM_MakePairPlan(benchmark::State& state) {
  const SideLayout p = Side(KVLayout::kHND, 2, 1);
  const SideLayout d = Side(KVLayout::kHND, 1, 0);
  for (auto _ : state) {
    auto plan = MakePairPlan(p, d);
    benchmark::DoNotOptimize(plan);
  }
}
BENCHMARK(BM_MakePairPlan);

}  // namespace

BENCHMARK_MAIN();
