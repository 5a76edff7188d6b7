// The CUDA model against the CPU reference. Without a GPU (or without CUDA in the build) each
// comparison prints why it is skipped and checks only that the CUDA entry points say so.
//
// Tolerance: with the same inputs, a logit (and a hidden value) may differ between CUDA and CPU
// by at most 2e-3 * max(1, |cpu value|) with fp32 KV, and 3e-2 * max(1, |cpu value|) with bf16
// KV (a K or V element may round to a neighbouring bf16 value when the fp32 inputs differ in
// the last bits). KV cache elements obey the same bounds. Greedy tokens must agree wherever the
// CPU's best logit leads the runner-up by more than twice the tolerance. Decoding is
// teacher-forced with the CPU's tokens so that one near-tie cannot derail the comparison.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernel_test_util.h"
#include "pdlib_kernels/cuda_info.h"
#include "pdlib_kernels/model.h"

namespace pdlib::kernels {
namespace {

using testing::ChunkOf;
using testing::EnsurePages;
using testing::FullOptions;
using testing::PromptTokens;
using testing::Request;

// True when a CUDA device can run the comparison; otherwise prints why the test is skipped.
bool GpuPresent() {
  const CudaInfo info = ProbeCuda();
  if (info.device_count > 0) return true;
  WARN("skipped: no CUDA device (" << info.reason << ")");
  return false;
}

float Tolerance(const ModelConfig& c) { return c.kv_dtype == KVDtype::kFloat32 ? 2e-3f : 3e-2f; }

void RequireClose(const std::vector<float>& cpu, const std::vector<float>& gpu, float tol,
                  const std::string& what) {
  REQUIRE(cpu.size() == gpu.size());
  float worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const float err = std::fabs(cpu[i] - gpu[i]) / std::max(1.0f, std::fabs(cpu[i]));
    if (!(err <= worst)) {
      worst = err;
      worst_at = i;
    }
  }
  INFO(what << ": worst relative error " << worst << " at " << worst_at << " (cpu " << cpu[worst_at]
            << ", cuda " << gpu[worst_at] << "), tolerance " << tol);
  REQUIRE(worst <= tol);
}

void CompareResults(const ForwardResult& cpu, const ForwardResult& gpu, float tol,
                    const std::string& what) {
  RequireClose(cpu.logits, gpu.logits, tol, what + " logits");
  RequireClose(cpu.hidden, gpu.hidden, tol, what + " hidden");
  std::vector<float> sorted = cpu.logits;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  if (sorted[0] - sorted[1] > 2 * tol * std::max(1.0f, std::fabs(sorted[0]))) {
    REQUIRE(cpu.token == gpu.token);
    REQUIRE(std::fabs(cpu.logprob - gpu.logprob) <=
            2 * tol * std::max(1.0f, std::fabs(cpu.logprob)));
  }
  REQUIRE(gpu.top_ids.size() == cpu.top_ids.size());
  REQUIRE(gpu.top_ids[0] == gpu.token);
}

std::vector<float> PageAsFloats(const KVCache& cache, KVKind kind, int32_t layer, int32_t page) {
  const ModelConfig& c = cache.config();
  std::vector<std::byte> bytes(c.kv_page_bytes());
  REQUIRE(cache.ReadPage(kind, layer, page, bytes).ok());
  std::vector<float> out(bytes.size() / c.kv_elem_bytes());
  for (size_t i = 0; i < out.size(); ++i) {
    if (c.kv_dtype == KVDtype::kFloat32) {
      std::memcpy(&out[i], &bytes[4 * i], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[2 * i], 2);
      const uint32_t u = static_cast<uint32_t>(h) << 16;
      std::memcpy(&out[i], &u, 4);
    }
  }
  return out;
}

// Runs the same workload on both devices: three requests prefilled in chunks (one of them in a
// batch with another's first chunk), then batched decode steps with the CPU's tokens.
void CompareDevices(const ModelConfig& c) {
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 11);
  REQUIRE(w.ok());
  RuntimeOptions cpu_opts, gpu_opts;
  cpu_opts.num_pages = gpu_opts.num_pages = 64;
  cpu_opts.num_threads = 2;
  gpu_opts.device = Device::kCuda;
  auto cpu = Model::Create(*w, cpu_opts);
  auto gpu = Model::Create(*w, gpu_opts);
  REQUIRE(cpu.ok());
  INFO(gpu.status().ToString());
  REQUIRE(gpu.ok());
  CHECK((*gpu)->kv_cache().memory_kind() == MemoryKind::kCuda);
  const float tol = Tolerance(c);

  std::vector<Request> reqs;
  int32_t next = 0;
  for (int i = 0; i < 3; ++i) {
    reqs.push_back(Request{PromptTokens(60 + i, 5 + 9 * i, c.vocab_size)});
    reqs.back().state_slot = i;
    EnsurePages(&reqs.back(), static_cast<int32_t>(reqs.back().tokens.size()) + 6, c.page_size,
                &next);
  }
  auto both = [&](const std::vector<SequenceChunk>& batch, const std::string& what) {
    std::vector<ForwardResult> a, b;
    REQUIRE((*cpu)->Forward(batch, FullOptions(), &a).ok());
    Status s = (*gpu)->Forward(batch, FullOptions(), &b);
    INFO(s.ToString());
    REQUIRE(s.ok());
    for (size_t i = 0; i < a.size(); ++i) CompareResults(a[i], b[i], tol, what);
    return a;
  };
  // Prefill: request 0 whole together with request 1's first 7 tokens, then the rest of 1, then
  // request 2 (23 tokens) in one chunk.
  both({ChunkOf(reqs[0], 0, 5), ChunkOf(reqs[1], 0, 7)}, "prefill batch");
  both({ChunkOf(reqs[1], 7, 14)}, "prefill chunk");
  both({ChunkOf(reqs[2], 0, 23)}, "prefill long");
  for (int step = 0; step < 5; ++step) {
    std::vector<SequenceChunk> batch;
    for (Request& r : reqs) {
      r.tokens.push_back(PromptTokens(70 + step, 1, c.vocab_size)[0]);
      const int32_t len = static_cast<int32_t>(r.tokens.size());
      batch.push_back(ChunkOf(r, len - 1, len));
    }
    both(batch, "decode step " + std::to_string(step));
  }
  for (int32_t layer = 0; layer < c.num_attention_layers(); ++layer) {
    for (int32_t p = 0; p < next; ++p) {
      for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
        RequireClose(PageAsFloats((*cpu)->kv_cache(), kind, layer, p),
                     PageAsFloats((*gpu)->kv_cache(), kind, layer, p), tol,
                     "KV layer " + std::to_string(layer) + " page " + std::to_string(p));
      }
    }
  }
  for (int32_t layer = 0; layer < c.num_recurrent_layers(); ++layer) {
    for (const Request& r : reqs) {
      std::vector<float> a(static_cast<size_t>(c.state_dim())), b(a.size());
      REQUIRE((*cpu)->kv_cache().ReadState(layer, r.state_slot, a).ok());
      REQUIRE((*gpu)->kv_cache().ReadState(layer, r.state_slot, b).ok());
      RequireClose(a, b, tol, "state");
    }
  }
}

TEST_CASE("CUDA entry points explain themselves without a GPU") {
  const CudaInfo info = ProbeCuda();
  if (info.device_count > 0) {
    CHECK(info.compiled);
    CHECK(info.reason.empty());
    return;
  }
  WARN("no CUDA device: " << info.reason);
  CHECK(!info.reason.empty());
  StatusOr<ModelWeights> w = ModelWeights::Random(testing::TinyConfig(), 1);
  REQUIRE(w.ok());
  RuntimeOptions o;
  o.device = Device::kCuda;
  CHECK(Model::Create(*w, o).status().code() == StatusCode::kUnavailable);
  CHECK(MeasureCudaDecodeAttention(ModelConfig::Small(), 1, 16, 1).status().code() ==
        StatusCode::kUnavailable);
}

TEST_CASE("CUDA refuses the model variants it has no kernels for, GPU or not") {
  for (const ModelConfig& c :
       {ModelConfig::SmallMla(), ModelConfig::SmallSwa(), ModelConfig::SmallNsa()}) {
    StatusOr<ModelWeights> w = ModelWeights::Random(c, 1);
    REQUIRE(w.ok());
    RuntimeOptions o;
    o.device = Device::kCuda;
    StatusOr<std::unique_ptr<Model>> model = Model::Create(*w, o);
    REQUIRE(model.status().code() == StatusCode::kUnimplemented);
    CHECK_THAT(model.status().ToString(), Catch::Contains("use device cpu"));
  }
}

// TP 2 x PP 2 on one GPU (four ranks, four threads) against the whole model on the same GPU:
// the same kernels on the same data, the rank's slices gathered through host memory.
TEST_CASE("CUDA sharded model matches the whole CUDA model") {
  if (!GpuPresent()) return;
  const ModelConfig c = testing::TinyHybridConfig();
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 13);
  REQUIRE(w.ok());
  std::vector<Request> reqs;
  int32_t next = 0;
  for (int i = 0; i < 2; ++i) {
    reqs.push_back(Request{PromptTokens(90 + i, 9 + 7 * i, c.vocab_size)});
    reqs.back().state_slot = i;
    EnsurePages(&reqs.back(), static_cast<int32_t>(reqs.back().tokens.size()), c.page_size, &next);
  }
  const std::vector<SequenceChunk> batch = {ChunkOf(reqs[0], 0, 9), ChunkOf(reqs[1], 0, 16)};
  RuntimeOptions whole_opts;
  whole_opts.device = Device::kCuda;
  whole_opts.num_pages = 64;
  auto whole = Model::Create(*w, whole_opts);
  REQUIRE(whole.ok());
  std::vector<ForwardResult> expected;
  REQUIRE((*whole)->Forward(batch, FullOptions(), &expected).ok());

  std::vector<std::unique_ptr<ModelComm>> comms = CreateInProcessModelComms(2, 2);
  std::vector<std::unique_ptr<Model>> ranks;
  for (int32_t i = 0; i < 4; ++i) {
    RuntimeOptions o = whole_opts;
    o.shard = {2, i % 2, 2, i / 2};
    o.comm = comms[static_cast<size_t>(i)].get();
    auto m = Model::Create(*w, o);
    INFO(m.status().ToString());
    REQUIRE(m.ok());
    ranks.push_back(std::move(m).value());
  }
  std::vector<std::vector<ForwardResult>> got(4);
  std::vector<Status> status(4);
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] { status[i] = ranks[i]->Forward(batch, FullOptions(), &got[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (int32_t i = 0; i < 4; ++i) {
    INFO("rank " << i << ": " << status[i].ToString());
    REQUIRE(status[i].ok());
    REQUIRE(got[i].size() == expected.size());
    for (size_t r = 0; r < expected.size(); ++r) {
      CompareResults(expected[r], got[i][r], Tolerance(c), "sharded rank " + std::to_string(i));
    }
  }
}

TEST_CASE("CUDA matches CPU: fp32 KV, NHD") {
  if (!GpuPresent()) return;
  CompareDevices(testing::TinyConfig());
}

TEST_CASE("CUDA matches CPU: bf16 KV, HND, default config") {
  if (!GpuPresent()) return;
  ModelConfig c = ModelConfig::Small();
  c.kv_dtype = KVDtype::kBFloat16;
  c.kv_layout = KVLayout::kHND;
  CompareDevices(c);
}

TEST_CASE("CUDA matches CPU: hybrid model with recurrent state") {
  if (!GpuPresent()) return;
  CompareDevices(testing::TinyHybridConfig());
}

TEST_CASE("CUDA matches CPU: long context uses split attention") {
  if (!GpuPresent()) return;
  ModelConfig c = testing::TinyConfig();
  c.head_dim = 64;  // another kernel instantiation
  c.num_heads = 8;
  c.num_kv_heads = 1;
  StatusOr<ModelWeights> w = ModelWeights::Random(c, 12);
  REQUIRE(w.ok());
  RuntimeOptions o;
  o.num_pages = 300;
  auto cpu = Model::Create(*w, o);
  o.device = Device::kCuda;
  auto gpu = Model::Create(*w, o);
  REQUIRE(cpu.ok());
  REQUIRE(gpu.ok());
  Request r{PromptTokens(80, 1100, c.vocab_size)};  // > 256 keys: several splits
  int32_t next = 0;
  EnsurePages(&r, 1101, c.page_size, &next);
  ForwardResult a, b;
  REQUIRE((*cpu)->Prefill(ChunkOf(r, 0, 1100), FullOptions(), &a).ok());
  REQUIRE((*gpu)->Prefill(ChunkOf(r, 0, 1100), FullOptions(), &b).ok());
  CompareResults(a, b, Tolerance(c), "long prefill");
  r.tokens.push_back(a.token);
  std::vector<ForwardResult> da, db;
  SequenceChunk step = ChunkOf(r, 1100, 1101);
  REQUIRE((*cpu)->Decode(std::span<const SequenceChunk>(&step, 1), FullOptions(), &da).ok());
  REQUIRE((*gpu)->Decode(std::span<const SequenceChunk>(&step, 1), FullOptions(), &db).ok());
  CompareResults(da[0], db[0], Tolerance(c), "long decode");
}

TEST_CASE("CUDA decode attention bandwidth probe runs") {
  if (!GpuPresent()) return;
  StatusOr<DecodeAttentionBandwidth> bw =
      MeasureCudaDecodeAttention(ModelConfig::Small(), 8, 1024, 5);
  INFO(bw.status().ToString());
  REQUIRE(bw.ok());
  CHECK(bw->achieved_gbps > 0);
  WARN("decode attention: " << bw->achieved_gbps << " GB/s of " << bw->peak_gbps << " GB/s peak");
}

}  // namespace
}  // namespace pdlib::kernels
