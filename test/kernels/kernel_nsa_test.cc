// The lightning-indexer (NSA) variant of the example model (issue #16): the indexer's choice and
// the sparse attention op against naive double-precision formulas, its weights and index pools,
// and the model-level promises (a choice of every position is dense attention bit for bit;
// chunked = one-shot, batched = alone, threads, TP/PP shards = TP 1, all bit for bit; the index
// pages are read, so a wrong transfer of that state changes tokens).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/ops.h"
#include "cpu/thread_pool.h"
#include "kernel_op_util.h"
#include "kernel_shard_harness.h"
#include "kernel_test_util.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/parallel.h"

namespace pdlib::kernels {
namespace {

using internal::AttentionBatch;
using internal::KeySelection;
using internal::ThreadPool;
using testing::AllPages;
using testing::ChunkOf;
using testing::FullOptions;
using testing::HashWeights;
using testing::MakeWithThreads;
using testing::Noise;
using testing::OpBatch;
using testing::PromptTokens;
using testing::Request;
using testing::RequireSame;
using testing::RunBatch;
using testing::SameBits;

// TinyConfig (2 layers, 4 query heads and 2 KV heads of 12, pages of 4) with an indexer of 10
// (a tail past 8) choosing 6 positions, so prompts of 20+ tokens attend sparsely.
ModelConfig TinyNsaConfig() {
  ModelConfig c = testing::TinyConfig();
  c.index_dim = 10;
  c.index_topk = 6;
  return c;
}

// The naive choice in double: the topk best of [0, pos] (ties: lower j), ascending.
std::vector<int32_t> NaiveSelect(const std::vector<float>& q_idx, const std::vector<float>& k_idx,
                                 int32_t dim, size_t t, size_t first_row, int32_t pos, int32_t topk,
                                 double* gap) {
  std::vector<double> s;
  for (int32_t j = 0; j <= pos; ++j) {
    double dot = 0;
    for (int32_t d = 0; d < dim; ++d) {
      dot += static_cast<double>(q_idx[t * static_cast<size_t>(dim) + static_cast<size_t>(d)]) *
             k_idx[(first_row + static_cast<size_t>(j)) * static_cast<size_t>(dim) +
                   static_cast<size_t>(d)];
    }
    s.push_back(dot);
  }
  std::vector<int32_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return s[static_cast<size_t>(a)] > s[static_cast<size_t>(b)];
  });
  const size_t count = std::min(s.size(), static_cast<size_t>(topk));
  *gap = count < s.size()
             ? s[static_cast<size_t>(order[count - 1])] - s[static_cast<size_t>(order[count])]
             : INFINITY;
  std::vector<int32_t> chosen(order.begin(), order.begin() + static_cast<ptrdiff_t>(count));
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// ---------------------------------------------------------------------------------------------
// Ops

TEST_CASE("nsa: the indexer's choice and sparse attention match naive double formulas") {
  ThreadPool one(1), three(3);
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    for (int32_t topk : {1, 5, 9, 100}) {
      ModelConfig c = TinyNsaConfig();
      c.kv_dtype = dtype;
      c.index_topk = topk;
      INFO("dtype " << KVDtypeName(dtype) << " topk " << topk);
      const OpBatch ob(c, 22, 7);
      const size_t n = ob.size();
      const int32_t qw = c.q_width(), kw = c.kv_width(), hd = c.head_dim, dim = c.index_dim;
      auto q = Noise(n * qw, 10), k = Noise(n * kw, 11), v = Noise(n * kw, 12);
      auto q_idx = Noise(n * dim, 13), k_idx = Noise(n * dim, 14);
      std::vector<uint8_t> k_pool(8 * c.kv_page_bytes()), v_pool(k_pool.size());
      std::vector<uint8_t> index_pool(8 * c.index_page_bytes());
      internal::WriteKV(c, k.data(), v.data(), ob.slots, k_pool.data(), v_pool.data());
      internal::WriteIndexKeys(c, k_idx.data(), ob.slots, index_pool.data());
      // Index pages: row t of a page at element t * index_dim, fp32 whatever the KV dtype.
      for (size_t t = 0; t < n; ++t) {
        REQUIRE(std::memcmp(index_pool.data() + static_cast<size_t>(ob.slots[t]) * dim * 4,
                            k_idx.data() + t * dim, static_cast<size_t>(dim) * 4) == 0);
      }
      KeySelection sel, sel1;
      internal::IndexerSelect(three, c, q_idx.data(), ob.batch(), index_pool.data(), topk, &sel);
      internal::IndexerSelect(one, c, q_idx.data(), ob.batch(), index_pool.data(), topk, &sel1);
      REQUIRE(sel.begin == sel1.begin);
      REQUIRE(sel.positions == sel1.positions);
      REQUIRE(sel.begin.size() == n + 1);
      std::vector<float> out(n * qw), out1(n * qw);
      internal::PagedAttention(three, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                               out.data(), 0, &sel);
      internal::PagedAttention(one, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                               out1.data(), 0, &sel);
      REQUIRE(SameBits(out, out1));
      const int group = c.num_heads / c.num_kv_heads;
      for (size_t t = 0; t < n; ++t) {
        const size_t base = static_cast<size_t>(ob.first_token[t]);
        double gap = 0;
        const std::vector<int32_t> want =
            NaiveSelect(q_idx, k_idx, dim, t, base, ob.positions[t], topk, &gap);
        REQUIRE(gap > 1e-5);  // the data has no near ties, so float and double agree
        const std::vector<int32_t> got(sel.positions.begin() + sel.begin[t],
                                       sel.positions.begin() + sel.begin[t + 1]);
        REQUIRE(got == want);
        for (int h = 0; h < c.num_heads; ++h) {
          const int kvh = h / group;
          // K and V as stored (bf16 rounds them).
          auto stored = [&](const std::vector<uint8_t>& pool, int32_t j, int d) {
            float tmp[64];
            internal::ReadKVHead(c, pool.data(), ob.slots[base + static_cast<size_t>(j)], kvh, tmp);
            return static_cast<double>(tmp[d]);
          };
          std::vector<double> s;
          for (int32_t j : want) {
            double dot = 0;
            for (int d = 0; d < hd; ++d) {
              dot += static_cast<double>(q[t * qw + static_cast<size_t>(h * hd + d)]) *
                     stored(k_pool, j, d);
            }
            s.push_back(dot / std::sqrt(static_cast<double>(hd)));
          }
          double mx = s[0], sum = 0;
          for (double x : s) mx = std::max(mx, x);
          for (double& x : s) sum += (x = std::exp(x - mx));
          for (int d = 0; d < hd; ++d) {
            double ref = 0;
            for (size_t i = 0; i < s.size(); ++i) ref += s[i] / sum * stored(v_pool, want[i], d);
            REQUIRE(out[t * qw + static_cast<size_t>(h * hd + d)] == Approx(ref).margin(1e-5));
          }
        }
      }
      if (topk >= 22) {
        // A choice of every position is causal attention, bit for bit.
        std::vector<float> causal(n * qw);
        internal::PagedAttention(three, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                                 causal.data());
        REQUIRE(SameBits(out, causal));
      }
    }
  }
}

TEST_CASE("nsa: equal scores choose the lower positions, NaN scores count as -inf") {
  ThreadPool pool(2);
  const ModelConfig c = TinyNsaConfig();
  const OpBatch ob(c, 15, 3);
  const size_t n = ob.size();
  auto q_idx = Noise(n * c.index_dim, 3);
  std::vector<float> k_idx(n * c.index_dim, 0.0f);  // every score 0
  std::vector<uint8_t> index_pool(8 * c.index_page_bytes());
  internal::WriteIndexKeys(c, k_idx.data(), ob.slots, index_pool.data());
  KeySelection sel;
  internal::IndexerSelect(pool, c, q_idx.data(), ob.batch(), index_pool.data(), 4, &sel);
  for (size_t t = 0; t < n; ++t) {
    std::vector<int32_t> want(static_cast<size_t>(std::min(ob.positions[t] + 1, 4)));
    std::iota(want.begin(), want.end(), 0);
    REQUIRE(std::vector<int32_t>(sel.positions.begin() + sel.begin[t],
                                 sel.positions.begin() + sel.begin[t + 1]) == want);
  }
  // NaN keys at positions 0 and 1 of request 0: they drop behind every real score.
  std::memset(index_pool.data() + static_cast<size_t>(ob.slots[0]) * c.index_dim * 4, 0xFF,
              2 * static_cast<size_t>(c.index_dim) * 4);
  internal::IndexerSelect(pool, c, q_idx.data(), ob.batch(), index_pool.data(), 4, &sel);
  REQUIRE(std::vector<int32_t>(sel.positions.begin() + sel.begin[14],
                               sel.positions.begin() + sel.begin[15]) ==
          std::vector<int32_t>{2, 3, 4, 5});
}

// ---------------------------------------------------------------------------------------------
// Config, weights and cache

TEST_CASE("nsa: config validation, SmallNsa and ToString") {
  const ModelConfig small = ModelConfig::SmallNsa();
  REQUIRE(small.Validate().ok());
  REQUIRE(small.has_indexer());
  REQUIRE(small.index_dim == 32);
  REQUIRE(small.index_topk == 24);
  REQUIRE(small.index_page_bytes() == 16u * 32 * 4);
  REQUIRE_FALSE(ModelConfig::Small().has_indexer());
  REQUIRE(ModelConfig::Small().index_page_bytes() == 0);
  CHECK_THAT(small.ToString(), Catch::Contains("index_dim=32 index_topk=24"));
  auto error = [](ModelConfig c) {
    const Status s = c.Validate();
    REQUIRE_FALSE(s.ok());
    return s.ToString();
  };
  ModelConfig c = small;
  c.index_topk = 0;
  CHECK_THAT(error(c), Catch::Contains("index_topk in [1, 1048576] (got 0)"));
  c = small;
  c.index_dim = 5000;
  CHECK_THAT(error(c), Catch::Contains("index_dim in [1, 4096] (got 5000)"));
  c = ModelConfig::SmallMla();
  c.index_dim = 8;
  c.index_topk = 8;
  CHECK_THAT(error(c), Catch::Contains("MLA is not supported"));
  for (ModelConfig other : {ModelConfig::SmallSwa(), ModelConfig::SmallHybrid()}) {
    other.index_dim = 8;
    other.index_topk = 8;
    CHECK_THAT(error(other), Catch::Contains("may not have sliding-window or recurrent layers"));
  }
  // The CUDA model refuses it with the reason.
  StatusOr<ModelWeights> w = ModelWeights::Random(TinyNsaConfig(), 1);
  REQUIRE(w.ok());
  RuntimeOptions o = testing::TestOptions();
  o.device = Device::kCuda;
  StatusOr<std::unique_ptr<Model>> m = Model::Create(*w, o);
  REQUIRE(m.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(m.status().ToString(), Catch::Contains("lightning-indexer"));
  CHECK_THAT(m.status().ToString(), Catch::Contains("use device cpu"));
}

TEST_CASE("nsa: Random() of the existing configs is unchanged") {
  // Recorded from the code before the indexer (Small and SmallHybrid as in
  // kernel_variants_test; SmallSwa has Small's tensors).
  struct Golden {
    ModelConfig config;
    uint64_t seed;
    uint64_t hash;
  };
  const Golden goldens[] = {
      {ModelConfig::Small(), 1, 0xd5d5c2c1ed8aa4ddull},
      {ModelConfig::Small(), 7, 0x2882122913c53663ull},
      {ModelConfig::SmallHybrid(), 1, 0x9d6007b6bd830be9ull},
      {ModelConfig::SmallHybrid(), 7, 0x0754e704a7779e40ull},
      {ModelConfig::SmallMla(), 1, 0xb01ddbe95348f882ull},
      {ModelConfig::SmallMla(), 7, 0xc28f8f2c2567977cull},
      {ModelConfig::SmallSwa(), 1, 0xd5d5c2c1ed8aa4ddull},
      {ModelConfig::SmallSwa(), 7, 0x2882122913c53663ull},
  };
  for (const Golden& g : goldens) {
    INFO(g.config.ToString() << " seed " << g.seed);
    StatusOr<ModelWeights> w = ModelWeights::Random(g.config, g.seed);
    REQUIRE(w.ok());
    CHECK(HashWeights(*w) == g.hash);
  }
}

TEST_CASE("nsa: indexer weights have their names and shapes, the rest are Small()'s") {
  StatusOr<ModelWeights> w = ModelWeights::Random(ModelConfig::SmallNsa(), 5);
  StatusOr<ModelWeights> small = ModelWeights::Random(ModelConfig::Small(), 5);
  REQUIRE(w.ok());
  REQUIRE(small.ok());
  REQUIRE(w->Validate().ok());
  std::vector<std::pair<std::string, std::vector<int64_t>>> layer0;
  for (const NamedTensor& t : w->Tensors()) {
    if (t.name.rfind("model.layers.0.", 0) == 0) layer0.emplace_back(t.name, t.shape);
  }
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"model.layers.0.input_layernorm.weight", {256}},
      {"model.layers.0.self_attn.q_proj.weight", {256, 256}},
      {"model.layers.0.self_attn.k_proj.weight", {128, 256}},
      {"model.layers.0.self_attn.v_proj.weight", {128, 256}},
      {"model.layers.0.self_attn.o_proj.weight", {256, 256}},
      {"model.layers.0.self_attn.indexer.wq.weight", {32, 256}},
      {"model.layers.0.self_attn.indexer.wk.weight", {32, 256}},
      {"model.layers.0.post_attention_layernorm.weight", {256}},
      {"model.layers.0.mlp.gate_proj.weight", {512, 256}},
      {"model.layers.0.mlp.up_proj.weight", {512, 256}},
      {"model.layers.0.mlp.down_proj.weight", {256, 512}},
  };
  REQUIRE(layer0 == want);
  // Every other tensor is bit for bit Small()'s.
  std::vector<NamedTensor> a = w->Tensors(), b = small->Tensors();
  size_t matched = 0;
  for (const NamedTensor& t : a) {
    if (t.name.find(".indexer.") != std::string::npos) continue;
    REQUIRE(t.name == b[matched].name);
    REQUIRE(SameBits(*t.data, *b[matched].data));
    ++matched;
  }
  REQUIRE(matched == b.size());
  // Linear scale: variance ~1/hidden; the two indexer tensors differ.
  double ss = 0;
  for (float x : w->layers[2].index_k_proj) ss += static_cast<double>(x) * x;
  REQUIRE(ss / static_cast<double>(w->layers[2].index_k_proj.size()) ==
          Approx(1.0 / 256).epsilon(0.1));
  REQUIRE(w->layers[2].index_k_proj != w->layers[2].index_q_proj);
  REQUIRE(w->layers[2].index_k_proj != w->layers[3].index_k_proj);
  // A wrong-sized indexer tensor is named.
  w->layers[1].index_q_proj.pop_back();
  const Status s = w->Validate();
  REQUIRE(!s.ok());
  REQUIRE(s.message().find("model.layers.1.self_attn.indexer.wq.weight") != std::string::npos);

  SECTION("safetensors round trip") {
    const ModelConfig c = TinyNsaConfig();
    StatusOr<ModelWeights> tiny = ModelWeights::Random(c, 4);
    REQUIRE(tiny.ok());
    StatusOr<SafetensorsFile> file =
        SafetensorsFile::Parse(testing::WriteSafetensors(testing::BlobsOf(*tiny)));
    REQUIRE(file.ok());
    StatusOr<ModelWeights> back = ModelWeights::FromSafetensors(*file, c);
    INFO(back.status().ToString());
    REQUIRE(back.ok());
    REQUIRE(HashWeights(*back) == HashWeights(*tiny));
    // Without the indexer tensors the checkpoint is refused, naming one.
    std::vector<testing::TensorBlob> blobs = testing::BlobsOf(*tiny);
    blobs.erase(std::remove_if(blobs.begin(), blobs.end(),
                               [](const testing::TensorBlob& t) {
                                 return t.name.find(".indexer.wk.") != std::string::npos;
                               }),
                blobs.end());
    StatusOr<SafetensorsFile> partial = SafetensorsFile::Parse(testing::WriteSafetensors(blobs));
    REQUIRE(partial.ok());
    StatusOr<ModelWeights> refused = ModelWeights::FromSafetensors(*partial, c);
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(refused.status().ToString(),
               Catch::Contains("model.layers.0.self_attn.indexer.wk.weight"));
  }
}

// ---------------------------------------------------------------------------------------------
// Model

std::vector<std::byte> IndexPage(const KVCache& cache, int32_t layer, int32_t page) {
  std::vector<std::byte> bytes(cache.config().index_page_bytes());
  const Status s = cache.ReadIndexPage(layer, page, bytes);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return bytes;
}

using testing::MakeRequest;
using testing::RequireBatchedEqualsAlone;
using testing::RequireChunkedEqualsOneShot;
using testing::RequireShardsMatchWhole;

std::vector<ModelConfig> NsaConfigs() {
  std::vector<ModelConfig> out;
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      ModelConfig c = TinyNsaConfig();
      c.kv_dtype = dtype;
      c.kv_layout = layout;
      out.push_back(c);
    }
  }
  return out;
}

TEST_CASE("nsa: the cache has one index pool per full attention layer") {
  const ModelConfig c = TinyNsaConfig();
  auto m = MakeWithThreads(c);
  const KVCache& cache = m->kv_cache();
  REQUIRE(cache.num_index_layers() == c.num_attention_layers());
  const BufferFamily family = cache.DescribeIndex();
  REQUIRE(family.ptrs.size() == static_cast<size_t>(c.num_attention_layers()));
  for (int32_t l = 0; l < cache.num_index_layers(); ++l) {
    const PoolRegion r = cache.index_pool(l);
    REQUIRE(r.base != nullptr);
    REQUIRE(family.ptrs[static_cast<size_t>(l)] == reinterpret_cast<uint64_t>(r.base));
    REQUIRE(family.item_lens[static_cast<size_t>(l)] == c.index_page_bytes());
    REQUIRE(family.lens[static_cast<size_t>(l)] ==
            c.index_page_bytes() * static_cast<size_t>(cache.num_pages()));
  }
  REQUIRE(cache.index_pool(c.num_attention_layers()).base == nullptr);
  // Index keys of tokens 0..5 are written (pages 0 and 1), the rest of page 1 is untouched.
  int32_t next_page = 0;
  Request r = MakeRequest(c, 41, 6, &next_page);
  RunBatch(*m, {ChunkOf(r, 0, 6)});
  const std::vector<std::byte> page1 = IndexPage(cache, 1, r.pages[1]);
  const size_t row = static_cast<size_t>(c.index_dim) * 4;
  auto zero = [&](size_t t) {
    return std::all_of(page1.begin() + static_cast<ptrdiff_t>(t * row),
                       page1.begin() + static_cast<ptrdiff_t>((t + 1) * row),
                       [](std::byte b) { return b == std::byte{0}; });
  };
  REQUIRE(!zero(0));
  REQUIRE(!zero(1));
  REQUIRE(zero(2));
  REQUIRE(zero(3));
  // The page copies check like ReadPage.
  std::vector<std::byte> small(c.index_page_bytes() - 4);
  CHECK(cache.ReadIndexPage(0, 0, small).code() == StatusCode::kInvalidArgument);
  std::vector<std::byte> page(c.index_page_bytes());
  CHECK(cache.ReadIndexPage(2, 0, page).code() == StatusCode::kOutOfRange);
  CHECK(cache.ReadIndexPage(0, cache.num_pages(), page).code() == StatusCode::kOutOfRange);
  // A model without an indexer has none.
  auto plain = MakeWithThreads(testing::TinyConfig());
  REQUIRE(plain->kv_cache().num_index_layers() == 0);
  REQUIRE(plain->kv_cache().DescribeIndex().ptrs.empty());
  const Status none = plain->kv_cache().ReadIndexPage(0, 0, page);
  CHECK(none.code() == StatusCode::kOutOfRange);
  CHECK_THAT(none.ToString(), Catch::Contains("no lightning indexer"));
}

TEST_CASE("nsa: choosing every position gives the dense GQA model's bits") {
  // Random() gives both models the same non-indexer weights; with index_topk beyond the
  // sequence every token attends to [0, p] in ascending order, the dense sums exactly.
  ModelConfig all = TinyNsaConfig();
  all.index_topk = 1000;
  const ModelConfig dense = testing::TinyConfig();
  int32_t next_page = 0;
  Request r = MakeRequest(dense, 51, 26, &next_page);
  auto a = MakeWithThreads(all), b = MakeWithThreads(dense);
  RequireSame(RunBatch(*a, {ChunkOf(r, 0, 15)})[0], RunBatch(*b, {ChunkOf(r, 0, 15)})[0]);
  RequireSame(RunBatch(*a, {ChunkOf(r, 15, 25)})[0], RunBatch(*b, {ChunkOf(r, 15, 25)})[0]);
  RequireSame(RunBatch(*a, {ChunkOf(r, 25, 26)})[0], RunBatch(*b, {ChunkOf(r, 25, 26)})[0]);
  for (int32_t l = 0; l < dense.num_layers; ++l) {
    for (int32_t page : r.pages) {
      for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
        REQUIRE(testing::ReadPage(a->kv_cache(), kind, l, page) ==
                testing::ReadPage(b->kv_cache(), kind, l, page));
      }
    }
  }
  // With 6 of 26 positions the results differ (the selection is not a no-op).
  auto sparse = MakeWithThreads(TinyNsaConfig());
  const ForwardResult chosen = RunBatch(*sparse, {ChunkOf(r, 0, 26)})[0];
  const ForwardResult full = RunBatch(*MakeWithThreads(dense), {ChunkOf(r, 0, 26)})[0];
  REQUIRE(chosen.logits != full.logits);
}

TEST_CASE("nsa: chunked prefill and decode equal one-shot prefill, index pages included") {
  for (const ModelConfig& c : NsaConfigs()) RequireChunkedEqualsOneShot(c);
}

TEST_CASE("nsa: batched requests equal each request alone, for any thread count") {
  for (const ModelConfig& c : NsaConfigs()) RequireBatchedEqualsAlone(c, 19);
}

TEST_CASE("nsa: one thread and two threads give the same bits") {
  const ModelConfig c = TinyNsaConfig();
  int32_t next_page = 0;
  Request r = MakeRequest(c, 23, 30, &next_page);
  auto one = MakeWithThreads(c, 1), two = MakeWithThreads(c, 2);
  RequireSame(RunBatch(*one, {ChunkOf(r, 0, 29)})[0], RunBatch(*two, {ChunkOf(r, 0, 29)})[0]);
  RequireSame(RunBatch(*one, {ChunkOf(r, 29, 30)})[0], RunBatch(*two, {ChunkOf(r, 29, 30)})[0]);
  REQUIRE(AllPages(one->kv_cache(), r) == AllPages(two->kv_cache(), r));
}

// Greedy generation of `steps` tokens after the request's prompt, from the prefilled cache.
std::vector<int32_t> Generate(Model& m, Request r, int32_t steps, int32_t* next_page,
                              std::vector<std::vector<float>>* logits = nullptr) {
  std::vector<int32_t> out;
  const int32_t page_size = m.config().page_size;
  for (int32_t i = 0; i < steps; ++i) {
    const int32_t n = static_cast<int32_t>(r.tokens.size());
    const ForwardResult res = RunBatch(m, {ChunkOf(r, n - 1, n)})[0];
    if (logits != nullptr) logits->push_back(res.logits);
    out.push_back(res.token);
    r.tokens.push_back(res.token);
    testing::EnsurePages(&r, n + 1, page_size, next_page);
  }
  return out;
}

TEST_CASE("nsa: decode reads the moved index pages, wrong ones change the tokens") {
  // A decode host that receives the prompt's KV and index pages (into other page numbers, as a
  // transfer does) decodes exactly like the prefill host; one that gets the KV but wrong index
  // pages chooses other positions and decodes other tokens.
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    ModelConfig c = TinyNsaConfig();
    c.kv_dtype = dtype;
    INFO(c.ToString());
    int32_t prefill_next = 0;
    Request prompt = MakeRequest(c, 61, 31, &prefill_next);  // 31 tokens: 8 pages
    auto prefill = MakeWithThreads(c);
    RunBatch(*prefill, {ChunkOf(prompt, 0, 30)});  // the last prompt token is decoded below
    Request moved = prompt;
    moved.pages.clear();
    int32_t decode_next = 20;
    testing::EnsurePages(&moved, 31, c.page_size, &decode_next);
    auto good = MakeWithThreads(c), poisoned = MakeWithThreads(c), missing = MakeWithThreads(c);
    for (int32_t l = 0; l < c.num_attention_layers(); ++l) {
      for (size_t i = 0; i < prompt.pages.size(); ++i) {
        const int32_t src = prompt.pages[i], dst = moved.pages[i];
        for (Model* m : {good.get(), poisoned.get(), missing.get()}) {
          for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
            REQUIRE(
                m->kv_cache()
                    .WritePage(kind, l, dst, testing::ReadPage(prefill->kv_cache(), kind, l, src))
                    .ok());
          }
        }
        const std::vector<std::byte> index = IndexPage(prefill->kv_cache(), l, src);
        REQUIRE(good->kv_cache().WriteIndexPage(l, dst, index).ok());
        // Wrong index keys: another request's (noise of the same scale).
        std::vector<float> wrong = Noise(static_cast<size_t>(c.page_size * c.index_dim),
                                         100 + i + 10 * static_cast<size_t>(l), 2.0f);
        REQUIRE(poisoned->kv_cache()
                    .WriteIndexPage(l, dst, std::as_bytes(std::span<const float>(wrong)))
                    .ok());
      }
    }
    int32_t n0 = prefill_next, n1 = decode_next, n2 = decode_next, n3 = decode_next;
    std::vector<std::vector<float>> want_logits, good_logits, bad_logits, missing_logits;
    const std::vector<int32_t> want = Generate(*prefill, prompt, 8, &n0, &want_logits);
    REQUIRE(Generate(*good, moved, 8, &n1, &good_logits) == want);
    REQUIRE(good_logits == want_logits);
    REQUIRE(AllPages(good->kv_cache(), moved) == AllPages(prefill->kv_cache(), prompt));
    const std::vector<int32_t> bad = Generate(*poisoned, moved, 8, &n2, &bad_logits);
    const std::vector<int32_t> none = Generate(*missing, moved, 8, &n3, &missing_logits);
    CHECK(bad_logits[0] != want_logits[0]);
    CHECK(missing_logits[0] != want_logits[0]);
    CHECK(bad != want);
    CHECK(none != want);
  }
}

TEST_CASE("nsa: the prompt's index pages change the selection (poisoning one position)") {
  // Negating the index keys of the first page (positions 0..3) after prefill changes what the
  // next token chooses: the choice is made from the keys in the pages, not recomputed.
  const ModelConfig c = TinyNsaConfig();
  int32_t next_page = 0;
  Request r = MakeRequest(c, 71, 25, &next_page);
  auto clean = MakeWithThreads(c), poisoned = MakeWithThreads(c);
  RunBatch(*clean, {ChunkOf(r, 0, 24)});
  RunBatch(*poisoned, {ChunkOf(r, 0, 24)});
  REQUIRE(AllPages(clean->kv_cache(), r) == AllPages(poisoned->kv_cache(), r));
  for (int32_t l = 0; l < c.num_attention_layers(); ++l) {
    std::vector<std::byte> page = IndexPage(poisoned->kv_cache(), l, r.pages[0]);
    std::vector<float> keys(page.size() / 4);
    std::memcpy(keys.data(), page.data(), page.size());
    for (float& k : keys) k *= -1.0f;  // every score of positions 0..3 negated
    REQUIRE(poisoned->kv_cache()
                .WriteIndexPage(l, r.pages[0], std::as_bytes(std::span<const float>(keys)))
                .ok());
  }
  const ForwardResult a = RunBatch(*clean, {ChunkOf(r, 24, 25)})[0];
  const ForwardResult b = RunBatch(*poisoned, {ChunkOf(r, 24, 25)})[0];
  REQUIRE(a.logits != b.logits);
  // Only the decoded token's own rows differ from here on: the KV pages match.
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (int32_t page : r.pages) {
      if (page == r.pages.back()) continue;  // holds position 24, computed after the poison
      REQUIRE(testing::ReadPage(clean->kv_cache(), KVKind::kKey, l, page) ==
              testing::ReadPage(poisoned->kv_cache(), KVKind::kKey, l, page));
    }
  }
}

TEST_CASE("nsa: SmallNsa runs and generates varied tokens") {
  const ModelConfig c = ModelConfig::SmallNsa();
  auto m = MakeWithThreads(c);
  int32_t next_page = 0;
  Request r = MakeRequest(c, 71, 40, &next_page);
  RunBatch(*m, {ChunkOf(r, 0, 39)});
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> generated = Generate(*m, r, 8, &next_page, &logits);
  for (const std::vector<float>& l : logits) {
    for (float x : l) REQUIRE(std::isfinite(x));
  }
  std::sort(generated.begin(), generated.end());
  REQUIRE(std::unique(generated.begin(), generated.end()) - generated.begin() >= 2);
  // 40 positions, 24 chosen: sparse, and not the dense model's logits.
  auto dense = MakeWithThreads(ModelConfig::Small());
  REQUIRE(RunBatch(*dense, {ChunkOf(r, 0, 40)})[0].logits !=
          RunBatch(*MakeWithThreads(c), {ChunkOf(r, 0, 40)})[0].logits);
}

// ---------------------------------------------------------------------------------------------
// Sharded

TEST_CASE("nsa: sharded indexer models give TP 1's bits, index pools replicated") {
  SECTION("TP 2") { RequireShardsMatchWhole(TinyNsaConfig(), 2, 1); }
  SECTION("TP 4: KV heads replicated") { RequireShardsMatchWhole(TinyNsaConfig(), 4, 1); }
  SECTION("PP 2") { RequireShardsMatchWhole(TinyNsaConfig(), 1, 2); }
  SECTION("bf16 HND TP 2 x PP 2") {
    ModelConfig c = TinyNsaConfig();
    c.kv_dtype = KVDtype::kBFloat16;
    c.kv_layout = KVLayout::kHND;
    RequireShardsMatchWhole(c, 2, 2);
  }
}

}  // namespace
}  // namespace pdlib::kernels
