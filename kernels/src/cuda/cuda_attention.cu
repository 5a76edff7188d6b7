// Causal paged attention on CUDA, one kernel for prefill chunks and decode batches.
//
// A block serves one (query token, KV head) pair and every query head of that KV head's GQA
// group, so each K/V row it reads is used `group` times. Its warps take keys round-robin; each
// lane holds head_dim / 32 dimensions and keeps an online softmax (running max, sum, weighted
// V) per query head. Warps merge through shared memory at the end. Long contexts are split over
// gridDim.z blocks (flash-decoding): each writes a partial (max, sum, accumulator) and a second
// kernel merges them.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/cuda_kernels.cuh"

namespace pdlib::kernels::internal {
namespace {

constexpr int kWarps = 4;
constexpr int kKeysPerSplit = 256;  // target keys per block before a context is split
constexpr int kMaxSplits = 64;

__device__ inline float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ inline float LoadKV(const void* pool, int64_t index);
template <>
__device__ inline float LoadKV<float>(const void* pool, int64_t index) {
  return static_cast<const float*>(pool)[index];
}
template <>
__device__ inline float LoadKV<__nv_bfloat16>(const void* pool, int64_t index) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(pool)[index]);
}

// Partial results of one split: per (token, query head, split), max, sum and head_dim values.
struct Partials {
  float* max;
  float* sum;
  float* acc;
};

Partials PartialsIn(void* workspace, const PagedAttentionArgs& a, int splits) {
  const int64_t rows = static_cast<int64_t>(a.num_tokens) * a.num_heads * splits;
  float* base = static_cast<float*>(workspace);
  return Partials{base, base + rows, base + 2 * rows};
}

// kDpl: head dimensions per lane (head_dim <= 32 * kDpl).
template <int kDpl, typename T>
__global__ void __launch_bounds__(kWarps * 32)
    PagedAttentionKernel(PagedAttentionArgs a, int keys_per_split, Partials partials) {
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const KVPoolShape& shape = a.shape;
  const int hd = shape.head_dim;
  const int group = a.num_heads / shape.num_kv_heads;
  const int pos = a.positions[t];
  const int32_t* pages = a.page_tables + a.page_table_begin[a.token_seq[t]];
  const int key_begin = split * keys_per_split;
  const int key_end = min(pos + 1, key_begin + keys_per_split);
  const float scale = rsqrtf(static_cast<float>(hd));

  float q[kMaxAttentionGroup][kDpl], acc[kMaxAttentionGroup][kDpl];
  float m[kMaxAttentionGroup], l[kMaxAttentionGroup];
#pragma unroll
  for (int g = 0; g < kMaxAttentionGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDpl; ++i) {
      const int d = lane + 32 * i;
      const bool live = g < group && d < hd;
      q[g][i] = live
                    ? a.q[static_cast<int64_t>(t) * a.q_stride + (kvh * group + g) * hd + d] * scale
                    : 0.0f;
      acc[g][i] = 0.0f;
    }
  }

  const int64_t page_elems = static_cast<int64_t>(shape.page_size) * shape.num_kv_heads * hd;
  for (int j = key_begin + warp; j < key_end; j += kWarps) {
    const int off = j % shape.page_size;
    const int64_t row = static_cast<int64_t>(pages[j / shape.page_size]) * page_elems +
                        (shape.hnd ? (static_cast<int64_t>(kvh) * shape.page_size + off) * hd
                                   : (static_cast<int64_t>(off) * shape.num_kv_heads + kvh) * hd);
    float k[kDpl], v[kDpl];
#pragma unroll
    for (int i = 0; i < kDpl; ++i) {
      const int d = lane + 32 * i;
      k[i] = d < hd ? LoadKV<T>(a.k_pool, row + d) : 0.0f;
      v[i] = d < hd ? LoadKV<T>(a.v_pool, row + d) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < kMaxAttentionGroup; ++g) {
      if (g >= group) break;
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kDpl; ++i) s += q[g][i] * k[i];
      s = WarpSum(s);
      const float m_new = fmaxf(m[g], s);
      const float correction = expf(m[g] - m_new);  // 0 on the first key (m = -inf)
      const float p = expf(s - m_new);
      l[g] = l[g] * correction + p;
#pragma unroll
      for (int i = 0; i < kDpl; ++i) acc[g][i] = acc[g][i] * correction + p * v[i];
      m[g] = m_new;
    }
  }

  __shared__ float sm_m[kWarps][kMaxAttentionGroup];
  __shared__ float sm_l[kWarps][kMaxAttentionGroup];
  __shared__ float sm_acc[kWarps][kMaxAttentionGroup][kDpl * 32];
#pragma unroll
  for (int g = 0; g < kMaxAttentionGroup; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kDpl; ++i) sm_acc[warp][g][lane + 32 * i] = acc[g][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * hd; idx += blockDim.x) {
    const int g = idx / hd, d = idx % hd;
    float block_max = -INFINITY;
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, sm_m[w][g]);
    float sum = 0.0f, value = 0.0f;
    if (block_max != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float f = expf(sm_m[w][g] - block_max);
        sum += sm_l[w][g] * f;
        value += sm_acc[w][g][d] * f;
      }
    }
    const int head = kvh * group + g;
    if (splits == 1) {
      a.out[static_cast<int64_t>(t) * a.out_stride + head * hd + d] = value / sum;
    } else {
      const int64_t prow = (static_cast<int64_t>(t) * a.num_heads + head) * splits + split;
      if (d == 0) {
        partials.max[prow] = block_max;
        partials.sum[prow] = sum;
      }
      partials.acc[prow * hd + d] = value;
    }
  }
}

// Merges the splits of one (token, head): blockDim.x covers head_dim.
__global__ void MergeSplitsKernel(PagedAttentionArgs a, int splits, Partials partials) {
  const int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  const int hd = a.shape.head_dim;
  if (d >= hd) return;
  const int64_t base = (static_cast<int64_t>(t) * a.num_heads + head) * splits;
  float global_max = -INFINITY;
  for (int s = 0; s < splits; ++s) global_max = fmaxf(global_max, partials.max[base + s]);
  float sum = 0.0f, value = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float mx = partials.max[base + s];
    if (mx == -INFINITY) continue;  // a split past this token's position saw no keys
    const float f = expf(mx - global_max);
    sum += partials.sum[base + s] * f;
    value += partials.acc[(base + s) * hd + d] * f;
  }
  a.out[static_cast<int64_t>(t) * a.out_stride + head * hd + d] = value / sum;
}

int SplitsFor(const PagedAttentionArgs& a) {
  const int keys = a.max_position + 1;
  return std::clamp((keys + kKeysPerSplit - 1) / kKeysPerSplit, 1, kMaxSplits);
}

template <int kDpl>
void LaunchWithDpl(const PagedAttentionArgs& a, void* workspace, cudaStream_t stream) {
  const int splits = SplitsFor(a);
  const int keys_per_split = (a.max_position + 1 + splits - 1) / splits;
  const Partials partials = splits > 1 ? PartialsIn(workspace, a, splits) : Partials{};
  dim3 grid(a.num_tokens, a.shape.num_kv_heads, splits);
  if (a.shape.bf16) {
    PagedAttentionKernel<kDpl, __nv_bfloat16>
        <<<grid, kWarps * 32, 0, stream>>>(a, keys_per_split, partials);
  } else {
    PagedAttentionKernel<kDpl, float>
        <<<grid, kWarps * 32, 0, stream>>>(a, keys_per_split, partials);
  }
  if (splits > 1) {
    const int threads = (a.shape.head_dim + 31) / 32 * 32;
    MergeSplitsKernel<<<dim3(a.num_tokens, a.num_heads), threads, 0, stream>>>(a, splits, partials);
  }
}

}  // namespace

size_t PagedAttentionWorkspaceBytes(const PagedAttentionArgs& a) {
  const int splits = SplitsFor(a);
  if (splits == 1) return 0;
  const size_t rows = static_cast<size_t>(a.num_tokens) * a.num_heads * splits;
  return rows * (2 + static_cast<size_t>(a.shape.head_dim)) * sizeof(float);
}

void LaunchPagedAttention(const PagedAttentionArgs& a, void* workspace, cudaStream_t stream) {
  if (a.num_tokens <= 0) return;
  const int hd = a.shape.head_dim;
  if (hd <= 32) {
    LaunchWithDpl<1>(a, workspace, stream);
  } else if (hd <= 64) {
    LaunchWithDpl<2>(a, workspace, stream);
  } else if (hd <= 128) {
    LaunchWithDpl<4>(a, workspace, stream);
  } else {
    LaunchWithDpl<8>(a, workspace, stream);
  }
}

}  // namespace pdlib::kernels::internal
