// Helpers shared by the pdlib_kernels tests: small configs, a sequential page allocator, greedy
// generation, exact comparisons, and a tiny safetensors writer.
#ifndef PDLIB_TEST_KERNELS_KERNEL_TEST_UTIL_H_
#define PDLIB_TEST_KERNELS_KERNEL_TEST_UTIL_H_

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "pdlib_kernels/config.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/model.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::kernels::testing {

// Small enough that a forward pass takes microseconds even under sanitizers, but with GQA, a
// page size that makes requests span several pages, and a head_dim with a tail past 8.
inline ModelConfig TinyConfig() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 48;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 12;
  c.intermediate_size = 80;
  c.vocab_size = 97;
  c.page_size = 4;
  return c;
}

inline ModelConfig TinyHybridConfig() {
  ModelConfig c = TinyConfig();
  c.num_layers = 3;
  c.layer_kinds = {LayerKind::kAttention, LayerKind::kRecurrent, LayerKind::kAttention};
  return c;
}

inline std::vector<int32_t> PromptTokens(uint64_t seed, int32_t n, int32_t vocab) {
  std::vector<int32_t> out;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int32_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out.push_back(static_cast<int32_t>(x % static_cast<uint64_t>(vocab)));
  }
  return out;
}

// 64 pages and two threads: plenty for the tests' requests, cheap to allocate.
inline RuntimeOptions TestOptions() {
  RuntimeOptions o;
  o.num_pages = 64;
  o.num_threads = 2;
  return o;
}

inline std::unique_ptr<Model> MakeModel(const ModelConfig& config, uint64_t seed = 7,
                                        const RuntimeOptions& options = TestOptions()) {
  StatusOr<ModelWeights> weights = ModelWeights::Random(config, seed);
  REQUIRE(weights.ok());
  StatusOr<std::unique_ptr<Model>> model = Model::Create(*weights, options);
  INFO(model.status().ToString());
  REQUIRE(model.ok());
  return std::move(model).value();
}

// One request: its tokens so far, its pages, its state slot.
struct Request {
  std::vector<int32_t> tokens = {};
  std::vector<int32_t> pages = {};
  int32_t state_slot = 0;
  int32_t cached = 0;  // tokens already in the cache
};

// Gives out pages `first, first + 1, ...` as a request grows.
inline void EnsurePages(Request* r, int32_t num_tokens, int32_t page_size, int32_t* next_page) {
  while (static_cast<int32_t>(r->pages.size()) * page_size < num_tokens) {
    r->pages.push_back((*next_page)++);
  }
}

inline SequenceChunk ChunkOf(const Request& r, int32_t begin, int32_t end) {
  SequenceChunk c;
  c.tokens = std::span<const int32_t>(r.tokens.data() + begin, static_cast<size_t>(end - begin));
  c.start_pos = begin;
  c.page_table = r.pages;
  c.state_slot = r.state_slot;
  return c;
}

inline ForwardOptions FullOptions() {
  ForwardOptions o;
  o.top_k = 5;
  o.return_logits = true;
  o.return_hidden = true;
  return o;
}

// The same floats bit for bit (NaNs included); empty vectors are equal.
inline bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

inline void RequireSame(const ForwardResult& a, const ForwardResult& b) {
  REQUIRE(a.token == b.token);
  REQUIRE(std::memcmp(&a.logprob, &b.logprob, sizeof(float)) == 0);
  REQUIRE(a.top_ids == b.top_ids);
  REQUIRE(SameFloats(a.top_logprobs, b.top_logprobs));
  REQUIRE(SameFloats(a.logits, b.logits));
  REQUIRE(SameFloats(a.hidden, b.hidden));
}

inline std::vector<std::byte> ReadPage(const KVCache& cache, KVKind kind, int32_t layer,
                                       int32_t page) {
  std::vector<std::byte> bytes(cache.config().kv_page_bytes());
  Status s = cache.ReadPage(kind, layer, page, bytes);
  REQUIRE(s.ok());
  return bytes;
}

// Little-endian helpers for the safetensors writer.
inline void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

struct TensorBlob {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline TensorBlob F32Blob(std::string name, std::vector<int64_t> shape,
                          const std::vector<float>& data) {
  TensorBlob b{std::move(name), "F32", std::move(shape), {}};
  b.bytes.resize(data.size() * 4);
  std::memcpy(b.bytes.data(), data.data(), b.bytes.size());  // the test hosts are little-endian
  return b;
}

// A safetensors file: u64 header length, JSON header, then the tensors' bytes back to back.
inline std::vector<uint8_t> WriteSafetensors(const std::vector<TensorBlob>& tensors,
                                             const std::string& metadata_json = "") {
  std::string header = "{";
  if (!metadata_json.empty()) header += "\"__metadata__\":" + metadata_json + ",";
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorBlob& t = tensors[i];
    header += (i ? "," : "") + std::string("\"") + t.name + "\":{\"dtype\":\"" + t.dtype +
              "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      header += (d ? "," : "") + std::to_string(t.shape[d]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.bytes.size()) + "]}";
    offset += t.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // the format aligns the data section
  std::vector<uint8_t> out;
  PutU64(&out, header.size());
  out.insert(out.end(), header.begin(), header.end());
  for (const TensorBlob& t : tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

// Every tensor of `weights` as F32 blobs with its checkpoint name.
inline std::vector<TensorBlob> BlobsOf(ModelWeights weights) {
  std::vector<TensorBlob> blobs;
  for (const NamedTensor& t : weights.Tensors()) blobs.push_back(F32Blob(t.name, t.shape, *t.data));
  return blobs;
}

}  // namespace pdlib::kernels::testing

#endif  // PDLIB_TEST_KERNELS_KERNEL_TEST_UTIL_H_
