// y = x W^T for the decoder's linear layers, in two shapes:
//  - few rows (decode, short chunks): one warp per output feature streams its weight row once
//    and dots it with up to kSkinnyRows activation rows at a time. Memory-bound on W, which is
//    the point of decode.
//  - many rows (prefill): a classic shared-memory tiled SGEMM, 64x64 tiles, 4x4 per thread.
// Both are deterministic: a given launch always sums in the same order.
#include "cuda/cuda_kernels.cuh"

namespace pdlib::kernels::internal {
namespace {

constexpr int kSkinnyRows = 8;
constexpr int kSkinnyMaxRows = 32;  // above this the tiled kernel wins

__device__ inline float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <bool kVec4>
__global__ void SkinnyMatMulKernel(const float* x, int32_t rows, int32_t in, const float* w,
                                   int32_t out, float* y) {
  const int64_t o = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (o >= out) return;
  const float* wo = w + o * in;
  for (int32_t r0 = 0; r0 < rows; r0 += kSkinnyRows) {
    float acc[kSkinnyRows];
#pragma unroll
    for (int r = 0; r < kSkinnyRows; ++r) acc[r] = 0.0f;
    if constexpr (kVec4) {
      const float4* w4 = reinterpret_cast<const float4*>(wo);
      for (int32_t i = lane; i < in / 4; i += 32) {
        const float4 wv = w4[i];
#pragma unroll
        for (int r = 0; r < kSkinnyRows; ++r) {
          if (r0 + r < rows) {
            const float4 xv =
                reinterpret_cast<const float4*>(x + static_cast<int64_t>(r0 + r) * in)[i];
            acc[r] += wv.x * xv.x + wv.y * xv.y + wv.z * xv.z + wv.w * xv.w;
          }
        }
      }
    } else {
      for (int32_t i = lane; i < in; i += 32) {
        const float wv = wo[i];
#pragma unroll
        for (int r = 0; r < kSkinnyRows; ++r) {
          if (r0 + r < rows) acc[r] += wv * x[static_cast<int64_t>(r0 + r) * in + i];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kSkinnyRows; ++r) {
      const float sum = WarpSum(acc[r]);
      if (lane == 0 && r0 + r < rows) y[static_cast<int64_t>(r0 + r) * out + o] = sum;
    }
  }
}

constexpr int kTile = 64;
constexpr int kTileK = 16;
constexpr int kTileThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each

__global__ void TiledMatMulKernel(const float* x, int32_t rows, int32_t in, const float* w,
                                  int32_t out, float* y) {
  // Stored k-major so the inner product reads rows of both tiles; +4 padding spreads banks.
  __shared__ float xs[kTileK][kTile + 4];
  __shared__ float ws[kTileK][kTile + 4];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int32_t k0 = 0; k0 < in; k0 += kTileK) {
#pragma unroll
    for (int q = 0; q < (kTile * kTileK) / kTileThreads; ++q) {
      const int e = threadIdx.x + q * kTileThreads;
      const int r = e / kTileK, kk = e % kTileK;
      const int64_t gk = k0 + kk;
      xs[kk][r] = (row0 + r < rows && gk < in) ? x[(row0 + r) * in + gk] : 0.0f;
      ws[kk][r] = (col0 + r < out && gk < in) ? w[(col0 + r) * in + gk] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[kk][ty * 4 + i];
        b[i] = ws[kk][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty * 4 + i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col0 + tx * 4 + j;
      if (c < out) y[r * out + c] = acc[i][j];
    }
  }
}

}  // namespace

void LaunchMatMul(const float* x, int32_t rows, int32_t in, const float* w, int32_t out, float* y,
                  cudaStream_t stream) {
  if (rows <= 0 || out <= 0) return;
  if (rows <= kSkinnyMaxRows) {
    constexpr int kThreads = 256;  // 8 warps = 8 output features per block
    const int blocks = static_cast<int>((static_cast<int64_t>(out) * 32 + kThreads - 1) / kThreads);
    // float4 loads need 16-byte aligned rows: cudaMalloc bases are, and in % 4 == 0 keeps
    // every row aligned.
    if (in % 4 == 0) {
      SkinnyMatMulKernel<true><<<blocks, kThreads, 0, stream>>>(x, rows, in, w, out, y);
    } else {
      SkinnyMatMulKernel<false><<<blocks, kThreads, 0, stream>>>(x, rows, in, w, out, y);
    }
    return;
  }
  dim3 grid((out + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  TiledMatMulKernel<<<grid, kTileThreads, 0, stream>>>(x, rows, in, w, out, y);
}

}  // namespace pdlib::kernels::internal
