// The CPU reference ops against naive double-precision formulas, plus the bit-exactness
// properties the model relies on (thread count and row blocking never change a result).
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cpu/thread_pool.h"
#include "half_float.h"
#include "kernel_op_util.h"
#include "kernel_test_util.h"
#include "pdlib_kernels/kv_cache.h"

namespace pdlib::kernels::internal {
namespace {

using testing::Noise;
using testing::SameBits;
using testing::TinyConfig;

TEST_CASE("Dot matches a double-precision sum for every length") {
  for (int64_t n : {0, 1, 7, 8, 9, 16, 31, 100}) {
    auto a = Noise(static_cast<size_t>(n), 1), b = Noise(static_cast<size_t>(n), 2);
    double ref = 0;
    for (int64_t i = 0; i < n; ++i) ref += static_cast<double>(a[i]) * b[i];
    CHECK(Dot(a.data(), b.data(), n) == Approx(ref).margin(1e-5));
  }
}

TEST_CASE("MatMul matches the naive formula and ignores threads and row blocking") {
  ThreadPool one(1), four(4);
  const std::vector<std::tuple<int, int, int>> shapes = {
      {1, 5, 3}, {5, 13, 7}, {70, 24, 33}, {9, 256, 300}};
  for (auto [rows, in, out] : shapes) {
    auto x = Noise(static_cast<size_t>(rows) * in, 3), w = Noise(static_cast<size_t>(out) * in, 4);
    std::vector<float> y1(static_cast<size_t>(rows) * out), y4(y1.size());
    MatMul(one, x.data(), rows, in, w.data(), out, y1.data());
    MatMul(four, x.data(), rows, in, w.data(), out, y4.data());
    REQUIRE(SameBits(y1, y4));
    for (int r = 0; r < rows; ++r) {
      // A row computed alone equals the same row computed inside a batch, bit for bit.
      std::vector<float> single(static_cast<size_t>(out));
      MatMul(four, x.data() + static_cast<size_t>(r) * in, 1, in, w.data(), out, single.data());
      REQUIRE(std::memcmp(single.data(), y4.data() + static_cast<size_t>(r) * out,
                          sizeof(float) * out) == 0);
      for (int o = 0; o < out; ++o) {
        double ref = 0;
        for (int i = 0; i < in; ++i) ref += static_cast<double>(x[r * in + i]) * w[o * in + i];
        REQUIRE(y4[static_cast<size_t>(r) * out + o] == Approx(ref).margin(1e-4));
      }
    }
  }
}

TEST_CASE("MatMul gives the same bits with and without AVX2") {
  if (!MatMulIsaAvailable(MatMulIsa::kAvx2)) {
    WARN("skipped: this CPU has no AVX2, only the generic path runs");
    return;
  }
  ThreadPool pool(2);
  const int rows = 11, in = 203, out = 37;
  auto x = Noise(static_cast<size_t>(rows) * in, 21), w = Noise(static_cast<size_t>(out) * in, 22);
  std::vector<float> generic(static_cast<size_t>(rows) * out), avx2(generic.size());
  ForceMatMulIsa(MatMulIsa::kGeneric);
  MatMul(pool, x.data(), rows, in, w.data(), out, generic.data());
  ForceMatMulIsa(MatMulIsa::kAvx2);
  MatMul(pool, x.data(), rows, in, w.data(), out, avx2.data());
  ForceMatMulIsa(MatMulIsa::kAuto);
  REQUIRE(SameBits(generic, avx2));
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      REQUIRE(Dot(x.data() + r * in, w.data() + o * in, in) == generic[r * out + o]);
    }
  }
}

TEST_CASE("RmsNorm matches the formula") {
  const int rows = 3, hidden = 19;
  auto x = Noise(rows * hidden, 5, 3.0f), w = Noise(hidden, 6);
  std::vector<float> y(x.size());
  RmsNorm(x.data(), w.data(), rows, hidden, 1e-5f, y.data());
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < hidden; ++i)
      ss += static_cast<double>(x[r * hidden + i]) * x[r * hidden + i];
    const double inv = 1.0 / std::sqrt(ss / hidden + 1e-5);
    for (int i = 0; i < hidden; ++i) {
      CHECK(y[r * hidden + i] == Approx(x[r * hidden + i] * inv * w[i]).margin(1e-5));
    }
  }
}

TEST_CASE("RoPE rotates pairs by position * theta^(-2i/d)") {
  const int heads = 2, hd = 8;
  std::vector<int32_t> positions = {0, 1, 17, 1000};
  std::vector<float> cos, sin;
  RopeTable(positions, hd, 10000.0f, &cos, &sin);
  auto x = Noise(positions.size() * heads * hd, 7);
  auto y = x;
  ApplyRope(y.data(), static_cast<int64_t>(positions.size()), heads, hd, cos.data(), sin.data());
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < hd / 2; ++i) {
        const double angle = positions[t] * std::pow(10000.0, -2.0 * i / hd);
        const size_t base = (t * heads + h) * hd;
        const double a = x[base + i], b = x[base + i + hd / 2];
        CHECK(y[base + i] == Approx(a * std::cos(angle) - b * std::sin(angle)).margin(1e-5));
        CHECK(y[base + i + hd / 2] ==
              Approx(b * std::cos(angle) + a * std::sin(angle)).margin(1e-5));
      }
    }
  }
  // Position 0 is the identity.
  for (int i = 0; i < heads * hd; ++i) CHECK(y[i] == x[i]);
}

TEST_CASE("WriteKV stores NHD and HND pages where KVOffsetInPage says, in fp32 and bf16") {
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (KVDtype dtype : {KVDtype::kFloat32, KVDtype::kBFloat16}) {
      ModelConfig c = TinyConfig();
      c.kv_layout = layout;
      c.kv_dtype = dtype;
      const int pages = 3, kw = c.kv_width();
      std::vector<uint8_t> k_pool(pages * c.kv_page_bytes()), v_pool(k_pool.size());
      std::vector<int64_t> slots = {5, 0, 11, 6};  // page 1 offset 1, page 0 offset 0, ...
      auto k = Noise(slots.size() * kw, 8), v = Noise(slots.size() * kw, 9);
      WriteKV(c, k.data(), v.data(), slots, k_pool.data(), v_pool.data());
      for (size_t t = 0; t < slots.size(); ++t) {
        const int32_t page = static_cast<int32_t>(slots[t] / c.page_size);
        const int32_t off = static_cast<int32_t>(slots[t] % c.page_size);
        for (int32_t h = 0; h < c.num_kv_heads; ++h) {
          std::vector<float> head(static_cast<size_t>(c.head_dim));
          ReadKVHead(c, k_pool.data(), slots[t], h, head.data());
          for (int32_t d = 0; d < c.head_dim; ++d) {
            const size_t at =
                page * (c.kv_page_bytes() / c.kv_elem_bytes()) + KVOffsetInPage(c, off, h, d);
            const float want = k[t * kw + h * c.head_dim + d];
            float raw;
            if (dtype == KVDtype::kFloat32) {
              std::memcpy(&raw, k_pool.data() + at * 4, 4);
              REQUIRE(raw == want);
            } else {
              uint16_t bits;
              std::memcpy(&bits, k_pool.data() + at * 2, 2);
              raw = Bf16ToFloat(bits);
              REQUIRE(bits == FloatToBf16(want));
              REQUIRE(std::fabs(raw - want) <= std::fabs(want) / 256.0f);
            }
            REQUIRE(head[d] == raw);
          }
        }
      }
    }
  }
}

TEST_CASE("PagedAttention matches naive causal GQA attention over scattered pages") {
  ThreadPool pool(3);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    ModelConfig c = TinyConfig();
    c.kv_layout = layout;
    const int32_t len = 10, qw = c.q_width(), kw = c.kv_width(), hd = c.head_dim;
    // Two requests: one of length 10 on pages {4, 1, 6}, one of length 3 on page {2}.
    std::vector<int32_t> page_tables = {4, 1, 6, 2};
    std::vector<int32_t> pt_begin = {0, 3};
    std::vector<int32_t> positions, token_seq;
    std::vector<int64_t> slots;
    for (int32_t p = 0; p < len; ++p) {
      positions.push_back(p);
      token_seq.push_back(0);
      slots.push_back(static_cast<int64_t>(page_tables[p / c.page_size]) * c.page_size +
                      p % c.page_size);
    }
    for (int32_t p = 0; p < 3; ++p) {
      positions.push_back(p);
      token_seq.push_back(1);
      slots.push_back(2 * c.page_size + p);
    }
    const size_t n = positions.size();
    auto q = Noise(n * qw, 10), k = Noise(n * kw, 11), v = Noise(n * kw, 12);
    std::vector<uint8_t> k_pool(8 * c.kv_page_bytes()), v_pool(k_pool.size());
    WriteKV(c, k.data(), v.data(), slots, k_pool.data(), v_pool.data());
    std::vector<float> out(n * qw);
    AttentionBatch batch{positions, token_seq, pt_begin, page_tables};
    PagedAttention(pool, c, q.data(), batch, k_pool.data(), v_pool.data(), out.data());
    const int group = c.num_heads / c.num_kv_heads;
    for (size_t t = 0; t < n; ++t) {
      const size_t first = token_seq[t] == 0 ? 0 : len;  // first token of the request
      for (int h = 0; h < c.num_heads; ++h) {
        const int kvh = h / group;
        std::vector<double> s;
        for (int32_t j = 0; j <= positions[t]; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) {
            dot += static_cast<double>(q[t * qw + h * hd + d]) * k[(first + j) * kw + kvh * hd + d];
          }
          s.push_back(dot / std::sqrt(static_cast<double>(hd)));
        }
        double mx = s[0], sum = 0;
        for (double x : s) mx = std::max(mx, x);
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int d = 0; d < hd; ++d) {
          double ref = 0;
          for (size_t j = 0; j < s.size(); ++j)
            ref += s[j] / sum * v[(first + j) * kw + kvh * hd + d];
          REQUIRE(out[t * qw + h * hd + d] == Approx(ref).margin(1e-5));
        }
      }
    }
  }
}

TEST_CASE("SwiGLU and the recurrent scan match their formulas") {
  auto g = Noise(10, 13, 4.0f), u = Noise(10, 14);
  std::vector<float> out(10);
  SwiGLU(g.data(), u.data(), 10, out.data());
  for (int i = 0; i < 10; ++i) {
    CHECK(out[i] == Approx(g[i] / (1.0 + std::exp(-g[i])) * u[i]).margin(1e-6));
  }

  // Two requests of 3 and 2 tokens, dim 4, slots 1 and 0; the second continues a state.
  const int dim = 4;
  std::vector<int32_t> begin = {0, 3, 5}, start = {0, 7}, slot = {1, 0};
  auto uu = Noise(5 * dim, 15), dec = Noise(5 * dim, 16, 3.0f), z = Noise(5 * dim, 17);
  std::vector<float> states = {0.5f, -0.25f, 1.0f, 2.0f, 9.0f, 9.0f, 9.0f, 9.0f};
  const std::vector<float> initial = states;
  std::vector<float> y(5 * dim);
  RecurrentScan(RecurrentBatch{begin, start, slot}, dim, uu.data(), dec.data(), z.data(),
                states.data(), y.data());
  for (int s = 0; s < 2; ++s) {
    for (int d = 0; d < dim; ++d) {
      // start_pos 0 ignores the stale 9.0s in slot 1.
      double h = start[s] == 0 ? 0.0 : initial[slot[s] * dim + d];
      for (int t = begin[s]; t < begin[s + 1]; ++t) {
        const double a = 1.0 / (1.0 + std::exp(-dec[t * dim + d]));
        h = a * h + (1 - a) * uu[t * dim + d];
        const double zz = z[t * dim + d];
        CHECK(y[t * dim + d] == Approx(h * zz / (1.0 + std::exp(-zz))).margin(1e-5));
      }
      CHECK(states[slot[s] * dim + d] == Approx(h).margin(1e-5));
    }
  }
}

TEST_CASE("SampleGreedy returns log-softmax, argmax with lowest-id ties, and ordered top-k") {
  std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 2.0f};
  ForwardResult r;
  SampleGreedy(logits.data(), 6, 4, &r);
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l));
  CHECK(r.token == 1);
  CHECK(r.logprob == Approx(3.0 - std::log(sum)).margin(1e-6));
  CHECK(r.top_ids == std::vector<int32_t>{1, 3, 5, 0});
  for (int k = 0; k < 4; ++k) {
    CHECK(r.top_logprobs[k] == Approx(logits[r.top_ids[k]] - std::log(sum)).margin(1e-6));
  }
  SampleGreedy(logits.data(), 6, 0, &r);
  CHECK(r.top_ids.empty());
}

TEST_CASE("ThreadPool hands out every index exactly once, repeatedly") {
  ThreadPool pool(4);
  for (int round = 0; round < 200; ++round) {
    const int64_t n = 1 + round * 7;
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.ParallelFor(n, 1 << 20, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
    });
    for (auto& h : hits) REQUIRE(h.load() == 1);
  }
}

TEST_CASE("bf16 rounds to nearest even and fp16 widens exactly") {
  CHECK(FloatToBf16(1.0f) == 0x3F80);
  CHECK(FloatToBf16(FloatFromBits(0x3F808000u)) == 0x3F80);  // tie, even stays
  CHECK(FloatToBf16(FloatFromBits(0x3F818000u)) == 0x3F82);  // tie, odd rounds up
  CHECK(FloatToBf16(FloatFromBits(0x3F808001u)) == 0x3F81);
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  CHECK(HalfToFloat(0x3C00) == 1.0f);
  CHECK(HalfToFloat(0xC000) == -2.0f);
  CHECK(HalfToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(HalfToFloat(0x7BFF) == 65504.0f);
  CHECK(std::isinf(HalfToFloat(0x7C00)));
}

}  // namespace
}  // namespace pdlib::kernels::internal
