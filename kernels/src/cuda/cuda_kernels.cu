// The decoder's small CUDA kernels: embedding, RMSNorm, RoPE, KV writes, SwiGLU, residual add,
// row gather, the recurrent scan, and greedy sampling. Matmul and attention have their own
// files.
#include <cuda_bf16.h>

#include <cfloat>

#include "cuda/cuda_kernels.cuh"

namespace pdlib::kernels::internal {
namespace {

constexpr int kThreads = 256;

inline int Blocks(int64_t n, int threads = kThreads) {
  return static_cast<int>((n + threads - 1) / threads);
}

__device__ inline float SiluF(float x) { return x / (1.0f + expf(-x)); }

__device__ inline float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the result. blockDim.x is a multiple of 32, <= 1024.
__device__ float BlockSum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

__global__ void EmbeddingKernel(const float* table, const int32_t* ids, int32_t n, int32_t hidden,
                                float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(n) * hidden) return;
  const int64_t t = i / hidden, d = i % hidden;
  out[i] = table[static_cast<int64_t>(ids[t]) * hidden + d];
}

__global__ void RmsNormKernel(const float* x, const float* weight, int32_t hidden, float eps,
                              float* out) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * hidden;
  float* yr = out + static_cast<int64_t>(blockIdx.x) * hidden;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
  ss = BlockSum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) yr[i] = xr[i] * inv * weight[i];
}

__global__ void RopeKernel(float* x, int32_t rows, int32_t stride, int32_t col, int32_t heads,
                           int32_t head_dim, const float* cos, const float* sin) {
  const int32_t half = head_dim / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * heads * half) return;
  const int64_t r = i / (heads * half);
  const int32_t h = static_cast<int32_t>((i / half) % heads), k = static_cast<int32_t>(i % half);
  float* v = x + r * stride + col + static_cast<int64_t>(h) * head_dim;
  const float c = cos[r * half + k], s = sin[r * half + k];
  const float a = v[k], b = v[k + half];
  v[k] = a * c - b * s;
  v[k + half] = b * c + a * s;
}

__global__ void WriteKVKernel(const float* src, int32_t n, int32_t stride, int32_t k_col,
                              int32_t v_col, const int64_t* slots, KVPoolShape shape, void* k_pool,
                              void* v_pool) {
  const int32_t kw = shape.num_kv_heads * shape.head_dim;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(n) * kw) return;
  const int64_t t = i / kw;
  const int32_t h = static_cast<int32_t>((i % kw) / shape.head_dim);
  const int32_t d = static_cast<int32_t>(i % shape.head_dim);
  const int64_t page = slots[t] / shape.page_size;
  const int32_t off = static_cast<int32_t>(slots[t] % shape.page_size);
  const int64_t in_page =
      shape.hnd ? (static_cast<int64_t>(h) * shape.page_size + off) * shape.head_dim + d
                : (static_cast<int64_t>(off) * shape.num_kv_heads + h) * shape.head_dim + d;
  const int64_t dst = page * static_cast<int64_t>(shape.page_size) * kw + in_page;
  const float kv_k = src[t * stride + k_col + h * shape.head_dim + d];
  const float kv_v = src[t * stride + v_col + h * shape.head_dim + d];
  if (shape.bf16) {
    static_cast<__nv_bfloat16*>(k_pool)[dst] = __float2bfloat16_rn(kv_k);
    static_cast<__nv_bfloat16*>(v_pool)[dst] = __float2bfloat16_rn(kv_v);
  } else {
    static_cast<float*>(k_pool)[dst] = kv_k;
    static_cast<float*>(v_pool)[dst] = kv_v;
  }
}

__global__ void SwiGLUKernel(const float* gate_up, int32_t rows, int32_t inter, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * inter) return;
  const int64_t r = i / inter, k = i % inter;
  const float* row = gate_up + r * 2 * inter;
  out[i] = SiluF(row[k]) * row[inter + k];
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void GatherRowsKernel(const float* x, const int32_t* rows, int32_t n, int32_t width,
                                 float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(n) * width) return;
  const int64_t r = i / width, d = i % width;
  out[i] = x[static_cast<int64_t>(rows[r]) * width + d];
}

// One thread per (request, state dimension): the recurrence is sequential in time only.
__global__ void RecurrentScanKernel(const float* fused, int32_t dim, const int32_t* seq_token_begin,
                                    const int32_t* seq_start_pos, const int32_t* seq_state_slot,
                                    float* state_pool, float* y) {
  const int32_t s = blockIdx.y;
  const int32_t d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  float* state = state_pool + static_cast<int64_t>(seq_state_slot[s]) * dim + d;
  float h = seq_start_pos[s] == 0 ? 0.0f : *state;
  for (int32_t t = seq_token_begin[s]; t < seq_token_begin[s + 1]; ++t) {
    const float* row = fused + static_cast<int64_t>(t) * 3 * dim;
    const float a = 1.0f / (1.0f + expf(-row[dim + d]));
    h = a * h + (1.0f - a) * row[d];
    y[static_cast<int64_t>(t) * dim + d] = h * SiluF(row[2 * dim + d]);
  }
  *state = h;
}

// (value, index) ordered by value descending, then index ascending; NaN counts as -inf.
struct Candidate {
  float value;
  int32_t index;
};

__device__ inline bool Better(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ Candidate BlockBest(Candidate c) {
  __shared__ Candidate partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.value, offset),
                __shfl_xor_sync(0xffffffffu, c.index, offset)};
    if (Better(o, c)) c = o;
  }
  __syncthreads();
  if (lane == 0) partial[warp] = c;
  __syncthreads();
  Candidate best = partial[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
    if (Better(partial[w], best)) best = partial[w];
  }
  return best;
}

__device__ inline float Key(float v) { return isnan(v) ? -INFINITY : v; }

// One block per row. Top-k runs k selection rounds, each finding the best candidate strictly
// after the previous one in the ordering, so no scratch marks are needed.
__global__ void SampleGreedyKernel(const float* logits, int32_t vocab, int32_t top_k,
                                   int32_t* token, float* logprob, int32_t* top_ids,
                                   float* top_logprobs) {
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  Candidate best{-INFINITY, INT32_MAX};
  for (int32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    Candidate c{Key(row[i]), i};
    if (Better(c, best)) best = c;
  }
  const Candidate top = BlockBest(best);
  float sum = 0.0f;
  for (int32_t i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(row[i] - top.value);
  sum = BlockSum(sum);
  const float lse = top.value + logf(sum);
  if (threadIdx.x == 0) {
    token[blockIdx.x] = top.index;
    logprob[blockIdx.x] = top.value - lse;
  }
  Candidate prev{INFINITY, -1};
  for (int32_t k = 0; k < top_k; ++k) {
    Candidate mine{-INFINITY, INT32_MAX};
    for (int32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      Candidate c{Key(row[i]), i};
      if (Better(prev, c) && Better(c, mine)) mine = c;
    }
    prev = BlockBest(mine);
    if (threadIdx.x == 0) {
      top_ids[static_cast<int64_t>(blockIdx.x) * top_k + k] = prev.index;
      top_logprobs[static_cast<int64_t>(blockIdx.x) * top_k + k] = prev.value - lse;
    }
  }
}

}  // namespace

void LaunchEmbedding(const float* table, const int32_t* ids, int32_t n, int32_t hidden, float* out,
                     cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * hidden;
  EmbeddingKernel<<<Blocks(total), kThreads, 0, stream>>>(table, ids, n, hidden, out);
}

void LaunchRmsNorm(const float* x, const float* weight, int32_t rows, int32_t hidden, float eps,
                   float* out, cudaStream_t stream) {
  RmsNormKernel<<<rows, kThreads, 0, stream>>>(x, weight, hidden, eps, out);
}

void LaunchRope(float* x, int32_t rows, int32_t stride, int32_t col, int32_t heads,
                int32_t head_dim, const float* cos, const float* sin, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * heads * (head_dim / 2);
  RopeKernel<<<Blocks(total), kThreads, 0, stream>>>(x, rows, stride, col, heads, head_dim, cos,
                                                     sin);
}

void LaunchWriteKV(const float* src, int32_t n, int32_t stride, int32_t k_col, int32_t v_col,
                   const int64_t* slots, const KVPoolShape& shape, void* k_pool, void* v_pool,
                   cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * shape.num_kv_heads * shape.head_dim;
  WriteKVKernel<<<Blocks(total), kThreads, 0, stream>>>(src, n, stride, k_col, v_col, slots, shape,
                                                        k_pool, v_pool);
}

void LaunchSwiGLU(const float* gate_up, int32_t rows, int32_t inter, float* out,
                  cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * inter;
  SwiGLUKernel<<<Blocks(total), kThreads, 0, stream>>>(gate_up, rows, inter, out);
}

void LaunchAdd(float* x, const float* y, int64_t n, cudaStream_t stream) {
  AddKernel<<<Blocks(n), kThreads, 0, stream>>>(x, y, n);
}

void LaunchGatherRows(const float* x, const int32_t* rows, int32_t n, int32_t width, float* out,
                      cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * width;
  GatherRowsKernel<<<Blocks(total), kThreads, 0, stream>>>(x, rows, n, width, out);
}

void LaunchRecurrentScan(const float* fused, int32_t dim, const int32_t* seq_token_begin,
                         const int32_t* seq_start_pos, const int32_t* seq_state_slot,
                         int32_t num_seqs, float* state_pool, float* y, cudaStream_t stream) {
  constexpr int kScanThreads = 128;
  dim3 grid(Blocks(dim, kScanThreads), num_seqs);
  RecurrentScanKernel<<<grid, kScanThreads, 0, stream>>>(fused, dim, seq_token_begin, seq_start_pos,
                                                         seq_state_slot, state_pool, y);
}

void LaunchSampleGreedy(const float* logits, int32_t rows, int32_t vocab, int32_t top_k,
                        int32_t* token, float* logprob, int32_t* top_ids, float* top_logprobs,
                        cudaStream_t stream) {
  SampleGreedyKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, top_k, token, logprob, top_ids,
                                                    top_logprobs);
}

}  // namespace pdlib::kernels::internal
