// Helpers of the kernel op tests (ops.h, internal): deterministic noise, bit equality, a weights
// hash, and a two-request attention batch over scattered pages.
#ifndef PDLIB_TEST_KERNELS_KERNEL_OP_UTIL_H_
#define PDLIB_TEST_KERNELS_KERNEL_OP_UTIL_H_

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/ops.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::kernels::testing {

// Uniform in [-scale, scale), the same for a seed on every machine.
inline std::vector<float> Noise(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 12345;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = scale * (static_cast<float>(x >> 40) / 16777216.0f * 2.0f - 1.0f);
  }
  return v;
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// FNV-1a over every tensor's name and bits: a weights golden.
inline uint64_t HashWeights(ModelWeights w) {
  uint64_t h = 1469598103934665603ull;
  for (const NamedTensor& t : w.Tensors()) {
    for (char ch : t.name) {
      h ^= static_cast<unsigned char>(ch);
      h *= 1099511628211ull;
    }
    for (float f : *t.data) {
      uint32_t b = 0;
      std::memcpy(&b, &f, 4);
      h ^= b;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// Two requests over scattered pages: request 0 has `len0` tokens on `pages0` ({4, 1, 6, 3, 7, 5}
// by default), request 1 has `len1` tokens on pages {2, 0}. `slots` are where each token's row
// goes (page * page_size + offset).
struct OpBatch {
  std::vector<int32_t> page_tables, pt_begin, positions, token_seq, first_token;
  std::vector<int64_t> slots;

  OpBatch(const ModelConfig& c, int32_t len0, int32_t len1,
          const std::vector<int32_t>& pages0 = {4, 1, 6, 3, 7, 5}) {
    const std::vector<int32_t> pages1 = {2, 0};
    REQUIRE(len0 <= static_cast<int32_t>(pages0.size()) * c.page_size);
    REQUIRE(len1 <= 2 * c.page_size);
    page_tables = pages0;
    page_tables.insert(page_tables.end(), pages1.begin(), pages1.end());
    pt_begin = {0, static_cast<int32_t>(pages0.size())};
    for (int32_t s = 0; s < 2; ++s) {
      const int32_t len = s == 0 ? len0 : len1;
      const std::vector<int32_t>& pages = s == 0 ? pages0 : pages1;
      for (int32_t p = 0; p < len; ++p) {
        positions.push_back(p);
        token_seq.push_back(s);
        first_token.push_back(s == 0 ? 0 : len0);
        slots.push_back(static_cast<int64_t>(pages[static_cast<size_t>(p / c.page_size)]) *
                            c.page_size +
                        p % c.page_size);
      }
    }
  }
  internal::AttentionBatch batch() const { return {positions, token_seq, pt_begin, page_tables}; }
  size_t size() const { return positions.size(); }
};

}  // namespace pdlib::kernels::testing

#endif  // PDLIB_TEST_KERNELS_KERNEL_OP_UTIL_H_
