// The CPU dot product, axpy and matmul: where nearly all CPU time goes, and where bit-exactness is
// decided.
//
// Every dot product keeps eight partial sums (lane k sums elements i with i % 8 == k), adds the
// tail into lanes 0.. in order, then reduces the lanes with one fixed tree. The lanes are a GCC
// vector of eight floats: compiled for AVX2 it is one register, for baseline x86-64 two SSE
// halves, and in both cases each lane sees the same multiplies and adds in the same order, so
// both builds give the same bits. The file is compiled with -ffp-contract=off, so no build
// fuses a multiply-add that another does not. Dot, Axpy and MatMul pick the AVX2 build at run
// time when the CPU has it.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "cpu/ops.h"

namespace pdlib::kernels::internal {
namespace {

#if defined(__GNUC__)
typedef float Vec8 __attribute__((vector_size(32)));

// One weight row against kRows activation rows, sharing the weight loads. Row r's result is
// the same as DotRows<1> on that row alone.
template <int kRows>
[[gnu::always_inline]] inline void DotRows(const float* w, const float* const* x, int64_t n,
                                           float* out) {
  // Unrolled over rows so the accumulators live in registers (-O2 does not unroll by itself).
  Vec8 acc[kRows];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) acc[r] = Vec8{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Vec8 wv;
    std::memcpy(&wv, w + i, sizeof(wv));
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      Vec8 xv;
      std::memcpy(&xv, x[r] + i, sizeof(xv));
      acc[r] += wv * xv;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float lane[8];
    std::memcpy(lane, &acc[r], sizeof(lane));
    for (int64_t j = i; j < n; ++j) lane[j - i] += w[j] * x[r][j];
    out[r] =
        ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  }
}
#else
template <int kRows>
inline void DotRows(const float* w, const float* const* x, int64_t n, float* out) {
  for (int r = 0; r < kRows; ++r) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int k = 0; k < 8; ++k) lane[k] += w[i + k] * x[r][i + k];
    }
    for (int64_t j = i; j < n; ++j) lane[j - i] += w[j] * x[r][j];
    out[r] =
        ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  }
}
#endif

// y[i] += a * x[i]. Element-wise, so vector width cannot change a result.
[[gnu::always_inline]] inline void AxpyImpl(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__GNUC__)
  const Vec8 av = {a, a, a, a, a, a, a, a};
  for (; i + 8 <= n; i += 8) {
    Vec8 xv, yv;
    std::memcpy(&xv, x + i, sizeof(xv));
    std::memcpy(&yv, y + i, sizeof(yv));
    yv += av * xv;
    std::memcpy(y + i, &yv, sizeof(yv));
  }
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// Output features [o_begin, o_end) for every row. Rows go in blocks that stay in cache while
// the range's weight rows stream past.
[[gnu::always_inline]] inline void MatMulRangeImpl(const float* x, int64_t rows, int32_t in,
                                                   const float* w, int32_t out, float* y,
                                                   int64_t o_begin, int64_t o_end) {
  constexpr int64_t kRowBlock = 64;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t r1 = std::min(rows, r0 + kRowBlock);
    for (int64_t o = o_begin; o < o_end; ++o) {
      const float* wo = w + o * in;
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4) {
        const float* xs[4] = {x + r * in, x + (r + 1) * in, x + (r + 2) * in, x + (r + 3) * in};
        float res[4];
        DotRows<4>(wo, xs, in, res);
        for (int k = 0; k < 4; ++k) y[(r + k) * out + o] = res[k];
      }
      for (; r < r1; ++r) {
        const float* xs[1] = {x + r * in};
        DotRows<1>(wo, xs, in, &y[r * out + o]);
      }
    }
  }
}

float DotGeneric(const float* a, const float* b, int64_t n) {
  float out;
  const float* rows[1] = {b};
  DotRows<1>(a, rows, n, &out);
  return out;
}

void AxpyGeneric(float a, const float* x, float* y, int64_t n) { AxpyImpl(a, x, y, n); }

void MatMulRangeGeneric(const float* x, int64_t rows, int32_t in, const float* w, int32_t out,
                        float* y, int64_t o_begin, int64_t o_end) {
  MatMulRangeImpl(x, rows, in, w, out, y, o_begin, o_end);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define PDLIB_KERNELS_HAVE_AVX2_PATH 1
__attribute__((target("avx2"))) float DotAvx2(const float* a, const float* b, int64_t n) {
  float out;
  const float* rows[1] = {b};
  DotRows<1>(a, rows, n, &out);
  return out;
}

__attribute__((target("avx2"))) void AxpyAvx2(float a, const float* x, float* y, int64_t n) {
  AxpyImpl(a, x, y, n);
}

__attribute__((target("avx2"))) void MatMulRangeAvx2(const float* x, int64_t rows, int32_t in,
                                                     const float* w, int32_t out, float* y,
                                                     int64_t o_begin, int64_t o_end) {
  MatMulRangeImpl(x, rows, in, w, out, y, o_begin, o_end);
}
#endif

// Set once by tests; read on every Dot and MatMul. Relaxed: it only selects between two functions
// that compute identical results.
std::atomic<MatMulIsa> forced_isa{MatMulIsa::kAuto};

bool CpuHasAvx2() {
#if defined(PDLIB_KERNELS_HAVE_AVX2_PATH)
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

bool UseAvx2() {
  const MatMulIsa isa = forced_isa.load(std::memory_order_relaxed);
  return isa != MatMulIsa::kGeneric && CpuHasAvx2();
}

}  // namespace

bool MatMulIsaAvailable(MatMulIsa isa) { return isa != MatMulIsa::kAvx2 || CpuHasAvx2(); }

void ForceMatMulIsa(MatMulIsa isa) { forced_isa.store(isa, std::memory_order_relaxed); }

float Dot(const float* a, const float* b, int64_t n) {
#if defined(PDLIB_KERNELS_HAVE_AVX2_PATH)
  if (UseAvx2()) return DotAvx2(a, b, n);
#endif
  return DotGeneric(a, b, n);
}

void Axpy(float a, const float* x, float* y, int64_t n) {
#if defined(PDLIB_KERNELS_HAVE_AVX2_PATH)
  if (UseAvx2()) return AxpyAvx2(a, x, y, n);
#endif
  AxpyGeneric(a, x, y, n);
}

void MatMul(ThreadPool& pool, const float* x, int64_t rows, int32_t in, const float* w, int32_t out,
            float* y) {
  auto range = &MatMulRangeGeneric;
#if defined(PDLIB_KERNELS_HAVE_AVX2_PATH)
  if (UseAvx2()) range = &MatMulRangeAvx2;
#endif
  // Threads split the output features; each (row, feature) is one DotRows lane set, so the
  // split cannot change a result.
  pool.ParallelFor(out, rows * in, [&](int64_t o_begin, int64_t o_end) {
    range(x, rows, in, w, out, y, o_begin, o_end);
  });
}

}  // namespace pdlib::kernels::internal
