// Throughput of the small decoder (ModelConfig::Small()): CPU prefill and decode tokens/s, the
// same on CUDA, and the CUDA decode-attention kernel's achieved memory bandwidth against the
// GPU's peak. CUDA cases report "no GPU" and skip where none is present.
//
//   pdlib_kernel_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pdlib_kernels/cuda_info.h"
#include "pdlib_kernels/model.h"

namespace pdlib::kernels {
namespace {

constexpr int32_t kPromptTokens = 128;
constexpr int32_t kDecodeContext = 128;  // tokens already cached when a decode step runs

std::vector<int32_t> Tokens(int32_t n, int32_t vocab, uint64_t seed) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    out.push_back(static_cast<int32_t>((seed >> 33) % static_cast<uint64_t>(vocab)));
  }
  return out;
}

std::unique_ptr<Model> MakeModel(benchmark::State& state, Device device, int32_t num_pages,
                                 int32_t threads) {
  if (device == Device::kCuda) {
    const CudaInfo info = ProbeCuda();
    if (info.device_count == 0) {
      state.SkipWithError(("no GPU: " + info.reason).c_str());
      return nullptr;
    }
  }
  StatusOr<ModelWeights> weights = ModelWeights::Random(ModelConfig::Small(), 1);
  RuntimeOptions options;
  options.device = device;
  options.num_pages = num_pages;
  options.num_threads = threads;
  StatusOr<std::unique_ptr<Model>> model = weights.ok()
                                               ? Model::Create(*weights, options)
                                               : StatusOr<std::unique_ptr<Model>>(weights.status());
  if (!model.ok()) {
    state.SkipWithError(model.status().ToString().c_str());
    return nullptr;
  }
  return std::move(model).value();
}

// One request's prompt of kPromptTokens tokens per iteration (the same pages are reused).
// Arg: CPU threads (0 = one per hardware thread).
void BM_Prefill(benchmark::State& state, Device device) {
  const ModelConfig config = ModelConfig::Small();
  const int32_t pages = PagesForTokens(kPromptTokens, config.page_size);
  const int32_t threads = static_cast<int32_t>(state.range(0));
  std::unique_ptr<Model> model = MakeModel(state, device, pages, threads);
  if (!model) return;
  const std::vector<int32_t> prompt = Tokens(kPromptTokens, config.vocab_size, 1);
  std::vector<int32_t> page_table(static_cast<size_t>(pages));
  for (int32_t i = 0; i < pages; ++i) page_table[static_cast<size_t>(i)] = i;
  ForwardResult result;
  for (auto _ : state) {
    Status s = model->Prefill({prompt, 0, page_table}, {}, &result);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(result.token);
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kPromptTokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  if (device == Device::kCpu) {
    state.counters["threads"] = threads > 0 ? threads : std::thread::hardware_concurrency();
  }
}

// A decode step for `batch` requests, each with kDecodeContext tokens cached. Every iteration
// decodes at the same position (rewriting that KV slot), so the context length stays fixed.
// Args: batch, CPU threads (0 = one per hardware thread).
void BM_Decode(benchmark::State& state, Device device) {
  const ModelConfig config = ModelConfig::Small();
  const int32_t batch = static_cast<int32_t>(state.range(0));
  const int32_t threads = static_cast<int32_t>(state.range(1));
  const int32_t pages_per_req = PagesForTokens(kDecodeContext + 1, config.page_size);
  std::unique_ptr<Model> model = MakeModel(state, device, batch * pages_per_req, threads);
  if (!model) return;
  std::vector<std::vector<int32_t>> tokens, tables;
  for (int32_t b = 0; b < batch; ++b) {
    tokens.push_back(Tokens(kDecodeContext + 1, config.vocab_size, 100 + b));
    tables.emplace_back();
    for (int32_t p = 0; p < pages_per_req; ++p) tables.back().push_back(b * pages_per_req + p);
    ForwardResult r;
    SequenceChunk prompt{std::span<const int32_t>(tokens.back().data(), kDecodeContext), 0,
                         tables.back()};
    if (!model->Prefill(prompt, {}, &r).ok()) {
      state.SkipWithError("prefill failed");
      return;
    }
  }
  std::vector<SequenceChunk> step;
  for (int32_t b = 0; b < batch; ++b) {
    step.push_back({std::span<const int32_t>(tokens[b].data() + kDecodeContext, 1), kDecodeContext,
                    tables[b]});
  }
  std::vector<ForwardResult> results;
  for (auto _ : state) {
    Status s = model->Decode(step, {}, &results);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(results.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_CpuPrefill(benchmark::State& state) { BM_Prefill(state, Device::kCpu); }
void BM_CpuDecode(benchmark::State& state) { BM_Decode(state, Device::kCpu); }
void BM_CudaPrefill(benchmark::State& state) { BM_Prefill(state, Device::kCuda); }
void BM_CudaDecode(benchmark::State& state) { BM_Decode(state, Device::kCuda); }

// Wall-clock rates: the CPU model's worker threads do most of the work, so the main thread's
// CPU time (Google Benchmark's default for rates) would overstate throughput.
BENCHMARK(BM_CpuPrefill)
    ->ArgName("threads")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CpuDecode)
    ->ArgNames({"batch", "threads"})
    ->Args({1, 0})
    ->Args({16, 0})
    ->Args({1, 1})
    ->Args({16, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaPrefill)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaDecode)->Args({1, 0})->Args({16, 0})->UseRealTime()->Unit(benchmark::kMillisecond);

// The decode attention kernel alone on a Llama-8B-like attention shape (32 query heads, 8 KV
// heads of 128, bf16 KV, page size 16): args are batch and context length.
void BM_CudaDecodeAttention(benchmark::State& state) {
  const CudaInfo info = ProbeCuda();
  if (info.device_count == 0) {
    state.SkipWithError(("no GPU: " + info.reason).c_str());
    return;
  }
  ModelConfig config = ModelConfig::Small();
  config.num_heads = 32;
  config.num_kv_heads = 8;
  config.head_dim = 128;
  config.hidden_size = 4096;
  config.kv_dtype = KVDtype::kBFloat16;
  config.kv_layout = KVLayout::kHND;
  const int32_t batch = static_cast<int32_t>(state.range(0));
  const int32_t context = static_cast<int32_t>(state.range(1));
  DecodeAttentionBandwidth last;
  for (auto _ : state) {
    StatusOr<DecodeAttentionBandwidth> bw = MeasureCudaDecodeAttention(config, batch, context, 20);
    if (!bw.ok()) {
      state.SkipWithError(bw.status().ToString().c_str());
      return;
    }
    last = *bw;
    state.SetIterationTime(bw->seconds_per_call);
  }
  state.counters["GB/s"] = last.achieved_gbps;
  state.counters["peak_GB/s"] = last.peak_gbps;
  state.counters["of_peak"] = last.peak_gbps > 0 ? last.achieved_gbps / last.peak_gbps : 0;
  state.SetLabel(info.device_name);
}
BENCHMARK(BM_CudaDecodeAttention)
    ->Args({1, 4096})
    ->Args({32, 4096})
    ->Args({64, 8192})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace pdlib::kernels
