// The MLA and sliding-window variants of the example model (issue #16): their ops against naive
// double-precision formulas, their weights, and the model-level promises (chunked = one-shot,
// batched = alone, threads, layouts, TP/PP shards = TP 1, all bit for bit; a sliding-window
// layer never reads a page before its window). Also pins Random()'s weights for the existing
// configs, which the new tensors must not shift.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/ops.h"
#include "cpu/thread_pool.h"
#include "half_float.h"
#include "kernel_op_util.h"
#include "kernel_shard_harness.h"
#include "kernel_test_util.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/parallel.h"

namespace pdlib::kernels {
namespace {

using internal::AttentionBatch;
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

// TinyConfig with MLA: 4 query heads of 12, a latent of 20 and a rope part of 6 (tails past 8).
ModelConfig TinyMlaConfig() {
  ModelConfig c = testing::TinyConfig();
  c.attention = AttentionKind::kMla;
  c.num_kv_heads = 1;
  c.kv_lora_rank = 20;
  c.qk_rope_dim = 6;
  return c;
}

// Four layers, 1 and 3 sliding-window over 6 positions; pages of 4, so windows start inside
// pages. Each half (PP 2) has one full attention layer.
ModelConfig TinySwaConfig() {
  ModelConfig c = testing::TinyConfig();
  c.num_layers = 4;
  c.layer_kinds = {LayerKind::kAttention, LayerKind::kSlidingWindow, LayerKind::kAttention,
                   LayerKind::kSlidingWindow};
  c.sliding_window = 6;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Ops

TEST_CASE("variants: ApplyRopeStrided over whole heads equals ApplyRope bit for bit") {
  const ModelConfig c = testing::TinyConfig();
  const int32_t rows = 5, heads = 3, hd = c.head_dim;
  std::vector<int32_t> pos = {0, 3, 9, 17, 250};
  std::vector<float> cs, sn;
  internal::RopeTable(pos, hd, c.rope_theta, &cs, &sn);
  std::vector<float> a = Noise(static_cast<size_t>(rows * heads * hd), 1), b = a;
  internal::ApplyRope(a.data(), rows, heads, hd, cs.data(), sn.data());
  internal::ApplyRopeStrided(b.data(), rows, heads * hd, heads, hd, 0, hd, cs.data(), sn.data());
  REQUIRE(SameBits(a, b));
}

TEST_CASE("variants: windowed PagedAttention matches naive sliding-window attention") {
  ThreadPool one(1), three(3);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (int32_t window : {1, 3, 6, 100}) {
      ModelConfig c = testing::TinyConfig();
      c.kv_layout = layout;
      INFO("layout " << static_cast<int>(layout) << " window " << window);
      const OpBatch ob(c, 19, 7, {4, 1, 6, 3, 7});
      const int32_t qw = c.q_width(), kw = c.kv_width(), hd = c.head_dim;
      const size_t n = ob.size();
      auto q = Noise(n * qw, 10), k = Noise(n * kw, 11), v = Noise(n * kw, 12);
      std::vector<uint8_t> k_pool(8 * c.kv_page_bytes()), v_pool(k_pool.size());
      internal::WriteKV(c, k.data(), v.data(), ob.slots, k_pool.data(), v_pool.data());
      std::vector<float> out(n * qw), out1(n * qw);
      internal::PagedAttention(three, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                               out.data(), window);
      internal::PagedAttention(one, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                               out1.data(), window);
      REQUIRE(SameBits(out, out1));
      if (window >= 19) {
        // A window longer than every request is plain causal attention, bit for bit.
        std::vector<float> causal(n * qw);
        internal::PagedAttention(three, c, q.data(), ob.batch(), k_pool.data(), v_pool.data(),
                                 causal.data());
        REQUIRE(SameBits(out, causal));
      }
      const int group = c.num_heads / c.num_kv_heads;
      for (size_t t = 0; t < n; ++t) {
        const size_t base = static_cast<size_t>(ob.first_token[t]);
        const int32_t first = std::max(0, ob.positions[t] - window + 1);
        for (int h = 0; h < c.num_heads; ++h) {
          const int kvh = h / group;
          std::vector<double> s;
          for (int32_t j = first; j <= ob.positions[t]; ++j) {
            double dot = 0;
            for (int d = 0; d < hd; ++d) {
              dot += static_cast<double>(q[t * qw + static_cast<size_t>(h * hd + d)]) *
                     k[(base + static_cast<size_t>(j)) * kw + static_cast<size_t>(kvh * hd + d)];
            }
            s.push_back(dot / std::sqrt(static_cast<double>(hd)));
          }
          double mx = s[0], sum = 0;
          for (double x : s) mx = std::max(mx, x);
          for (double& x : s) sum += (x = std::exp(x - mx));
          for (int d = 0; d < hd; ++d) {
            double ref = 0;
            for (size_t j = 0; j < s.size(); ++j) {
              ref += s[j] / sum *
                     v[(base + static_cast<size_t>(first) + j) * kw +
                       static_cast<size_t>(kvh * hd + d)];
            }
            REQUIRE(out[t * qw + static_cast<size_t>(h * hd + d)] == Approx(ref).margin(1e-5));
          }
        }
      }
    }
  }
}

TEST_CASE("variants: windowed PagedAttention never reads a page wholly before the window") {
  ThreadPool pool(2);
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    ModelConfig c = testing::TinyConfig();
    c.kv_dtype = dtype;
    const int32_t window = 6;
    // Only the last token of each request is queried, so the window is [len - 6, len).
    const OpBatch ob(c, 19, 7, {4, 1, 6, 3, 7});
    const size_t n = ob.size();
    const int32_t qw = c.q_width(), kw = c.kv_width();
    auto q = Noise(n * qw, 20), k = Noise(n * kw, 21), v = Noise(n * kw, 22);
    std::vector<uint8_t> k_pool(8 * c.kv_page_bytes()), v_pool(k_pool.size());
    internal::WriteKV(c, k.data(), v.data(), ob.slots, k_pool.data(), v_pool.data());
    const std::vector<int32_t> last_pos = {18, 6}, last_seq = {0, 1};
    const AttentionBatch last{last_pos, last_seq, ob.pt_begin, ob.page_tables};
    std::vector<float> q_last(2 * static_cast<size_t>(qw));
    std::memcpy(q_last.data(), q.data() + 18 * qw, sizeof(float) * qw);
    std::memcpy(q_last.data() + qw, q.data() + (19 + 6) * qw, sizeof(float) * qw);
    std::vector<float> clean(2 * static_cast<size_t>(qw)), poisoned(clean.size());
    internal::PagedAttention(pool, c, q_last.data(), last, k_pool.data(), v_pool.data(),
                             clean.data(), window);
    // Request 0 reads positions [13, 18]: pages 0..2 of its table ({4, 1, 6}) hold [0, 12) and
    // are never read; request 1 reads [1, 6], so nothing of its is poisoned.
    ModelConfig with_window = c;  // SlidingWindowPages reads the config's window
    with_window.sliding_window = window;
    const ModelConfig::PageRange range = with_window.SlidingWindowPages(19);
    REQUIRE(range.first == 3);
    for (int32_t i = 0; i < range.first; ++i) {
      const size_t page = static_cast<size_t>(ob.page_tables[static_cast<size_t>(i)]);
      std::memset(k_pool.data() + page * c.kv_page_bytes(), 0xFF, c.kv_page_bytes());  // NaN
      std::memset(v_pool.data() + page * c.kv_page_bytes(), 0xFF, c.kv_page_bytes());
    }
    internal::PagedAttention(pool, c, q_last.data(), last, k_pool.data(), v_pool.data(),
                             poisoned.data(), window);
    REQUIRE(SameBits(clean, poisoned));
  }
}

// The naive (non-absorbed) MLA formula in double: per head, keys [W_uk c_j, k_rope_j] and values
// W_uv c_j, with c_j and k_rope_j as stored (widened from the pool's dtype).
double NaiveMla(const ModelConfig& c, const std::vector<float>& q, const std::vector<float>& kv_b,
                const std::vector<float>& rows, size_t q_row, size_t first_row, int32_t pos,
                int32_t h, int32_t d_out, int32_t num_heads) {
  const int32_t hd = c.head_dim, rd = c.qk_rope_dim, rank = c.kv_lora_rank, kw = c.kv_width();
  const float* qh = q.data() + (q_row * static_cast<size_t>(num_heads) + static_cast<size_t>(h)) *
                                   static_cast<size_t>(hd + rd);
  const float* w_uk = kv_b.data() + static_cast<size_t>(h) * 2 * hd * rank;
  const float* w_uv = w_uk + static_cast<size_t>(hd) * rank;
  std::vector<double> s;
  for (int32_t j = 0; j <= pos; ++j) {
    const float* row = rows.data() + (first_row + static_cast<size_t>(j)) * kw;
    double score = 0;
    for (int32_t d = 0; d < hd; ++d) {
      double k = 0;
      for (int32_t r = 0; r < rank; ++r) k += static_cast<double>(w_uk[d * rank + r]) * row[r];
      score += static_cast<double>(qh[d]) * k;
    }
    for (int32_t i = 0; i < rd; ++i) score += static_cast<double>(qh[hd + i]) * row[rank + i];
    s.push_back(score / std::sqrt(static_cast<double>(hd + rd)));
  }
  double mx = s[0], sum = 0;
  for (double x : s) mx = std::max(mx, x);
  for (double& x : s) sum += (x = std::exp(x - mx));
  double out = 0;
  for (int32_t j = 0; j <= pos; ++j) {
    const float* row = rows.data() + (first_row + static_cast<size_t>(j)) * kw;
    double v = 0;
    for (int32_t r = 0; r < rank; ++r) v += static_cast<double>(w_uv[d_out * rank + r]) * row[r];
    out += s[static_cast<size_t>(j)] / sum * v;
  }
  return out;
}

TEST_CASE("variants: MLA latent rows, pages and attention match the naive formulas") {
  ThreadPool one(1), three(3);
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    ModelConfig c = TinyMlaConfig();
    c.kv_dtype = dtype;
    INFO("dtype " << KVDtypeName(dtype));
    const OpBatch ob(c, 19, 7, {4, 1, 6, 3, 7});
    const size_t n = ob.size();
    const int32_t heads = c.num_heads, hd = c.head_dim, rd = c.qk_rope_dim;
    const int32_t rank = c.kv_lora_rank, kw = c.kv_width(), q_stride = hd + rd;

    // Latent rows: RMSNorm of the latent part, RoPE of the rest.
    auto kv_a = Noise(n * kw, 30, 2.0f), norm_w = Noise(static_cast<size_t>(rank), 31);
    for (float& w : norm_w) w = 1.0f + 0.1f * w;
    std::vector<float> cs, sn;
    internal::RopeTable(ob.positions, rd, c.rope_theta, &cs, &sn);
    std::vector<float> rows(n * kw), in_place = kv_a;
    internal::MlaLatentRows(c, kv_a.data(), static_cast<int64_t>(n), norm_w.data(), cs.data(),
                            sn.data(), rows.data());
    internal::MlaLatentRows(c, in_place.data(), static_cast<int64_t>(n), norm_w.data(), cs.data(),
                            sn.data(), in_place.data());
    REQUIRE(SameBits(rows, in_place));
    for (size_t t = 0; t < n; ++t) {
      const float* x = kv_a.data() + t * kw;
      double ms = 0;
      for (int32_t r = 0; r < rank; ++r) ms += static_cast<double>(x[r]) * x[r];
      const double inv = 1.0 / std::sqrt(ms / rank + c.rms_norm_eps);
      for (int32_t r = 0; r < rank; ++r) {
        REQUIRE(rows[t * kw + static_cast<size_t>(r)] ==
                Approx(x[r] * inv * norm_w[r]).margin(1e-5));
      }
      for (int32_t i = 0; i < rd / 2; ++i) {
        const double angle =
            ob.positions[t] * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / rd);
        const double a = x[rank + i], b = x[rank + i + rd / 2];
        REQUIRE(rows[t * kw + static_cast<size_t>(rank + i)] ==
                Approx(a * std::cos(angle) - b * std::sin(angle)).margin(1e-5));
        REQUIRE(rows[t * kw + static_cast<size_t>(rank + i + rd / 2)] ==
                Approx(b * std::cos(angle) + a * std::sin(angle)).margin(1e-5));
      }
    }

    // Pages: row t of a page at element t * kv_width, in the dtype.
    std::vector<uint8_t> latent_pool(8 * c.kv_page_bytes());
    internal::WriteLatent(c, rows.data(), ob.slots, latent_pool.data());
    std::vector<float> stored(n * kw), scratch(static_cast<size_t>(kw));
    for (size_t t = 0; t < n; ++t) {
      const float* got = internal::LatentRow(c, latent_pool.data(), ob.slots[t], scratch.data());
      for (int32_t i = 0; i < kw; ++i) {
        const float want = dtype == KVDtype::kFloat32 ? rows[t * kw + static_cast<size_t>(i)]
                                                      : internal::Bf16ToFloat(internal::FloatToBf16(
                                                            rows[t * kw + static_cast<size_t>(i)]));
        REQUIRE(std::memcmp(&got[i], &want, sizeof(float)) == 0);
        // The raw bytes sit at (page, t * kv_width + i).
        const int64_t page = ob.slots[t] / c.page_size, off = ob.slots[t] % c.page_size;
        const size_t at =
            static_cast<size_t>(page) * c.kv_page_bytes() +
            (static_cast<size_t>(off * kw) + static_cast<size_t>(i)) * c.kv_elem_bytes();
        if (dtype == KVDtype::kFloat32) {
          REQUIRE(std::memcmp(latent_pool.data() + at, &want, 4) == 0);
        } else {
          const uint16_t bits = internal::FloatToBf16(want);
          REQUIRE(std::memcmp(latent_pool.data() + at, &bits, 2) == 0);
        }
        stored[t * kw + static_cast<size_t>(i)] = want;
      }
    }

    // Attention: absorbed form vs the naive one; threads; a head range.
    auto q = Noise(n * heads * q_stride, 32),
         kv_b = Noise(static_cast<size_t>(heads) * 2 * hd * rank, 33, 0.4f);
    std::vector<float> out(n * heads * hd), out1(out.size());
    internal::MlaPagedAttention(three, c, heads, q.data(), kv_b.data(), ob.batch(),
                                latent_pool.data(), out.data());
    internal::MlaPagedAttention(one, c, heads, q.data(), kv_b.data(), ob.batch(),
                                latent_pool.data(), out1.data());
    REQUIRE(SameBits(out, out1));
    for (size_t t = 0; t < n; ++t) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t d = 0; d < hd; ++d) {
          const double ref = NaiveMla(c, q, kv_b, stored, t, static_cast<size_t>(ob.first_token[t]),
                                      ob.positions[t], h, d, heads);
          REQUIRE(out[(t * heads + static_cast<size_t>(h)) * hd + static_cast<size_t>(d)] ==
                  Approx(ref).margin(2e-5));
        }
      }
    }
    // Heads [2, 4) alone (a TP rank's share): the same bits as those heads of the whole.
    const int32_t h0 = 2, hc = 2;
    std::vector<float> q_part(n * hc * q_stride), part(n * hc * hd);
    for (size_t t = 0; t < n; ++t) {
      std::memcpy(q_part.data() + t * hc * q_stride, q.data() + (t * heads + h0) * q_stride,
                  sizeof(float) * hc * q_stride);
    }
    internal::MlaPagedAttention(three, c, hc, q_part.data(),
                                kv_b.data() + static_cast<size_t>(h0) * 2 * hd * rank, ob.batch(),
                                latent_pool.data(), part.data());
    for (size_t t = 0; t < n; ++t) {
      REQUIRE(std::memcmp(part.data() + t * hc * hd, out.data() + (t * heads + h0) * hd,
                          sizeof(float) * hc * hd) == 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weights

TEST_CASE("variants: Random() of the existing configs is unchanged") {
  // Recorded before MLA and sliding-window tensors were added to Tensors()/Random().
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
  };
  for (const Golden& g : goldens) {
    StatusOr<ModelWeights> w = ModelWeights::Random(g.config, g.seed);
    REQUIRE(w.ok());
    CHECK(HashWeights(*w) == g.hash);
  }
  StatusOr<ModelWeights> w = ModelWeights::Random(ModelConfig::Small(), 1);
  REQUIRE(w.ok());
  CHECK(w->layers[1].q_proj[5] == -0x1.b6ddbp-5f);
  CHECK(w->lm_head[100] == -0x1.98ee8ep-2f);
}

TEST_CASE("variants: MLA and SWA weights have their checkpoint names and shapes") {
  SECTION("MLA") {
    const ModelConfig c = ModelConfig::SmallMla();
    StatusOr<ModelWeights> w = ModelWeights::Random(c, 3);
    REQUIRE(w.ok());
    REQUIRE(w->Validate().ok());
    std::vector<std::pair<std::string, std::vector<int64_t>>> layer0;
    for (const NamedTensor& t : w->Tensors()) {
      if (t.name.rfind("model.layers.0.", 0) == 0) layer0.emplace_back(t.name, t.shape);
    }
    const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
        {"model.layers.0.input_layernorm.weight", {256}},
        {"model.layers.0.self_attn.q_proj.weight", {4 * (64 + 32), 256}},
        {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {64 + 32, 256}},
        {"model.layers.0.self_attn.kv_a_layernorm.weight", {64}},
        {"model.layers.0.self_attn.kv_b_proj.weight", {4 * 2 * 64, 64}},
        {"model.layers.0.self_attn.o_proj.weight", {256, 4 * 64}},
        {"model.layers.0.post_attention_layernorm.weight", {256}},
        {"model.layers.0.mlp.gate_proj.weight", {512, 256}},
        {"model.layers.0.mlp.up_proj.weight", {512, 256}},
        {"model.layers.0.mlp.down_proj.weight", {256, 512}},
    };
    REQUIRE(layer0 == want);
    REQUIRE(w->layers[0].k_proj.empty());
    // Norm weights near 1, linear weights with variance ~1/in.
    for (float x : w->layers[2].kv_a_layernorm) REQUIRE(std::abs(x - 1.0f) <= 0.1f);
    double ss = 0;
    for (float x : w->layers[2].kv_b_proj) ss += static_cast<double>(x) * x;
    REQUIRE(ss / static_cast<double>(w->layers[2].kv_b_proj.size()) ==
            Approx(1.0 / 64).epsilon(0.1));
    // A wrong-sized MLA tensor is named.
    w->layers[1].kv_b_proj.pop_back();
    const Status s = w->Validate();
    REQUIRE(!s.ok());
    REQUIRE(s.message().find("model.layers.1.self_attn.kv_b_proj.weight") != std::string::npos);
  }
  SECTION("SWA: the same tensors as attention, so the same random weights as Small()") {
    StatusOr<ModelWeights> swa = ModelWeights::Random(ModelConfig::SmallSwa(), 5);
    StatusOr<ModelWeights> small = ModelWeights::Random(ModelConfig::Small(), 5);
    REQUIRE(swa.ok());
    REQUIRE(small.ok());
    REQUIRE(swa->Validate().ok());
    std::vector<NamedTensor> a = swa->Tensors(), b = small->Tensors();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      REQUIRE(a[i].name == b[i].name);
      REQUIRE(a[i].shape == b[i].shape);
      REQUIRE(SameBits(*a[i].data, *b[i].data));
    }
  }
  SECTION("MLA safetensors round trip") {
    const ModelConfig c = TinyMlaConfig();
    StatusOr<ModelWeights> w = ModelWeights::Random(c, 4);
    REQUIRE(w.ok());
    StatusOr<SafetensorsFile> file =
        SafetensorsFile::Parse(testing::WriteSafetensors(testing::BlobsOf(*w)));
    REQUIRE(file.ok());
    StatusOr<ModelWeights> back = ModelWeights::FromSafetensors(*file, c);
    INFO(back.status().ToString());
    REQUIRE(back.ok());
    REQUIRE(HashWeights(*back) == HashWeights(*w));
  }
}

// ---------------------------------------------------------------------------------------------
// Model

using testing::MakeRequest;
using testing::RequireBatchedEqualsAlone;
using testing::RequireChunkedEqualsOneShot;
using testing::RequireShardsMatchWhole;

std::vector<ModelConfig> VariantConfigs() {
  std::vector<ModelConfig> out;
  for (ModelConfig base : {TinyMlaConfig(), TinySwaConfig()}) {
    for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
      for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
        ModelConfig c = base;
        c.kv_dtype = dtype;
        c.kv_layout = layout;
        out.push_back(c);
      }
    }
  }
  return out;
}

TEST_CASE("variants: chunked prefill and decode equal one-shot prefill, pages included") {
  for (const ModelConfig& c : VariantConfigs()) RequireChunkedEqualsOneShot(c);
}

TEST_CASE("variants: batched requests equal each request alone, for any thread count") {
  for (const ModelConfig& c : VariantConfigs()) RequireBatchedEqualsAlone(c, 17);
}

TEST_CASE("variants: NHD and HND give the same MLA bits (one latent head: the same pages)") {
  ModelConfig nhd = TinyMlaConfig(), hnd = TinyMlaConfig();
  hnd.kv_layout = KVLayout::kHND;
  int32_t next_page = 2;
  Request r = MakeRequest(nhd, 31, 13, &next_page);
  auto a = MakeWithThreads(nhd), b = MakeWithThreads(hnd);
  RequireSame(RunBatch(*a, {ChunkOf(r, 0, 13)})[0], RunBatch(*b, {ChunkOf(r, 0, 13)})[0]);
  REQUIRE(AllPages(a->kv_cache(), r) == AllPages(b->kv_cache(), r));
}

TEST_CASE("variants: an MLA model keeps one latent pool per layer, written for every token") {
  const ModelConfig c = TinyMlaConfig();
  auto m = MakeWithThreads(c);
  const KVCache& cache = m->kv_cache();
  REQUIRE(cache.num_kv_layers() == c.num_layers);
  REQUIRE(cache.pool(KVKind::kValue, 0).base == nullptr);
  REQUIRE(cache.pool(KVKind::kKey, 0).item_bytes ==
          static_cast<size_t>(c.page_size * (c.kv_lora_rank + c.qk_rope_dim)) * 4);
  int32_t next_page = 0;
  Request r = MakeRequest(c, 41, 6, &next_page);
  RunBatch(*m, {ChunkOf(r, 0, 6)});
  // Latent rows of tokens 0..5 are nonzero, the rest of page 1 is untouched.
  const std::vector<std::byte> page1 = testing::ReadPage(cache, KVKind::kKey, 1, r.pages[1]);
  const size_t row = static_cast<size_t>(c.kv_width()) * 4;
  auto zero = [&](size_t t) {
    return std::all_of(page1.begin() + static_cast<ptrdiff_t>(t * row),
                       page1.begin() + static_cast<ptrdiff_t>((t + 1) * row),
                       [](std::byte b) { return b == std::byte{0}; });
  };
  REQUIRE(!zero(0));
  REQUIRE(!zero(1));
  REQUIRE(zero(2));
  REQUIRE(zero(3));
}

TEST_CASE("variants: a window longer than the sequence gives the all-attention model's bits") {
  // SWA layers have the same tensors as attention layers, so Random() gives both models the
  // same weights; with a window covering every position the SWA layers are causal attention.
  ModelConfig swa = TinySwaConfig();
  swa.sliding_window = 1000;
  ModelConfig full = TinySwaConfig();
  full.layer_kinds.clear();
  full.sliding_window = 0;
  int32_t next_page = 0;
  Request r = MakeRequest(full, 51, 21, &next_page);
  auto a = MakeWithThreads(swa), b = MakeWithThreads(full);
  RequireSame(RunBatch(*a, {ChunkOf(r, 0, 21)})[0], RunBatch(*b, {ChunkOf(r, 0, 21)})[0]);
  // With the tiny window the results differ (the window is not a no-op).
  auto c = MakeWithThreads(TinySwaConfig());
  const ForwardResult windowed = RunBatch(*c, {ChunkOf(r, 0, 21)})[0];
  const ForwardResult causal = RunBatch(*MakeWithThreads(full), {ChunkOf(r, 0, 21)})[0];
  REQUIRE(windowed.logits != causal.logits);
}

TEST_CASE("variants: sliding-window layers never read SWA pages before the window") {
  for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      ModelConfig c = TinySwaConfig();
      c.kv_dtype = dtype;
      c.kv_layout = layout;
      INFO(c.ToString());
      int32_t next_page = 3;
      Request r = MakeRequest(c, 61, 30, &next_page);
      auto clean = MakeWithThreads(c), poisoned = MakeWithThreads(c);
      // Poisons, in every SWA pool, the pages wholly before the window of the next token.
      auto poison = [&](Model& m, int32_t num_tokens) {
        const ModelConfig::PageRange range = c.SlidingWindowPages(num_tokens);
        const std::vector<std::byte> nan(c.kv_page_bytes(), std::byte{0xFF});
        for (int32_t l = 0; l < m.kv_cache().num_swa_layers(); ++l) {
          for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
            for (int32_t i = 0; i < range.first; ++i) {
              REQUIRE(
                  m.kv_cache().WriteSwaPage(kind, l, r.pages[static_cast<size_t>(i)], nan).ok());
            }
          }
        }
        return range.first;
      };
      // Chunked prefill: [0, 13), then [13, 22) after poisoning what the chunk's first token
      // does not see, then decodes, poisoning again before each.
      RequireSame(RunBatch(*clean, {ChunkOf(r, 0, 13)})[0],
                  RunBatch(*poisoned, {ChunkOf(r, 0, 13)})[0]);
      REQUIRE(poison(*poisoned, 13) == 2);  // window of position 13: [8, 13], pages 2..3
      RequireSame(RunBatch(*clean, {ChunkOf(r, 13, 22)})[0],
                  RunBatch(*poisoned, {ChunkOf(r, 13, 22)})[0]);
      for (int32_t pos = 22; pos < 30; ++pos) {
        REQUIRE(poison(*poisoned, pos) >= 4);
        RequireSame(RunBatch(*clean, {ChunkOf(r, pos, pos + 1)})[0],
                    RunBatch(*poisoned, {ChunkOf(r, pos, pos + 1)})[0]);
      }
      // The full-attention layers' KV pools were not poisoned and read everything; the poison
      // really is in the SWA pools (and would have shown).
      std::vector<std::byte> page(c.kv_page_bytes());
      REQUIRE(poisoned->kv_cache().ReadSwaPage(KVKind::kKey, 0, r.pages[0], page).ok());
      REQUIRE(page[0] == std::byte{0xFF});
    }
  }
}

TEST_CASE("variants: SmallMla and SmallSwa run and generate varied tokens") {
  for (const ModelConfig& c : {ModelConfig::SmallMla(), ModelConfig::SmallSwa()}) {
    INFO(c.ToString());
    auto m = MakeWithThreads(c);
    int32_t next_page = 0;
    Request r = MakeRequest(c, 71, 40, &next_page);
    std::vector<int32_t> generated;
    ForwardResult res = RunBatch(*m, {ChunkOf(r, 0, 40)})[0];
    for (int32_t i = 0; i < 8; ++i) {
      generated.push_back(res.token);
      r.tokens.push_back(res.token);
      testing::EnsurePages(&r, static_cast<int32_t>(r.tokens.size()), c.page_size, &next_page);
      const int32_t n = static_cast<int32_t>(r.tokens.size());
      res = RunBatch(*m, {ChunkOf(r, n - 1, n)})[0];
      REQUIRE(std::isfinite(res.logprob));
    }
    std::sort(generated.begin(), generated.end());
    REQUIRE(std::unique(generated.begin(), generated.end()) - generated.begin() >= 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Sharded

TEST_CASE("variants: sharded MLA and SWA models give TP 1's bits") {
  SECTION("MLA TP 2") { RequireShardsMatchWhole(TinyMlaConfig(), 2, 1); }
  SECTION("MLA TP 4") { RequireShardsMatchWhole(TinyMlaConfig(), 4, 1); }
  SECTION("MLA bf16 TP 2 x PP 2") {
    ModelConfig c = TinyMlaConfig();
    c.kv_dtype = KVDtype::kBFloat16;
    RequireShardsMatchWhole(c, 2, 2);
  }
  SECTION("SWA TP 2") { RequireShardsMatchWhole(TinySwaConfig(), 2, 1); }
  SECTION("SWA TP 4: KV heads replicated") { RequireShardsMatchWhole(TinySwaConfig(), 4, 1); }
  SECTION("SWA bf16 HND TP 2 x PP 2") {
    ModelConfig c = TinySwaConfig();
    c.kv_dtype = KVDtype::kBFloat16;
    c.kv_layout = KVLayout::kHND;
    RequireShardsMatchWhole(c, 2, 2);
  }
}

}  // namespace
}  // namespace pdlib::kernels
