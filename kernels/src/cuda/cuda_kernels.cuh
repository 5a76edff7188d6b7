// Launchers of the decoder's CUDA kernels. Every pointer is device memory, every launch is
// asynchronous on `stream`, and each kernel computes the same math as its namesake in
// cpu/ops.h (summation orders differ, hence the CPU-vs-CUDA tolerance). Included only by .cu
// files.
#ifndef PDLIB_KERNELS_SRC_CUDA_CUDA_KERNELS_CUH_
#define PDLIB_KERNELS_SRC_CUDA_CUDA_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace pdlib::kernels::internal {

// out[t][:] = table[ids[t]][:].
void LaunchEmbedding(const float* table, const int32_t* ids, int32_t n, int32_t hidden, float* out,
                     cudaStream_t stream);

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight.
void LaunchRmsNorm(const float* x, const float* weight, int32_t rows, int32_t hidden, float eps,
                   float* out, cudaStream_t stream);

// y[r][o] = sum_i x[r][i] * w[o][i] (x [rows][in], w [out][in], y [rows][out]).
void LaunchMatMul(const float* x, int32_t rows, int32_t in, const float* w, int32_t out, float* y,
                  cudaStream_t stream);

// Rotates `heads` heads starting at column `col` of each row of x (row stride `stride`), with
// the per-row cos/sin tables of cpu/ops.h RopeTable ([rows][head_dim / 2]).
void LaunchRope(float* x, int32_t rows, int32_t stride, int32_t col, int32_t heads,
                int32_t head_dim, const float* cos, const float* sin, cudaStream_t stream);

// The shape of one layer's K/V pools.
struct KVPoolShape {
  int32_t page_size;
  int32_t num_kv_heads;
  int32_t head_dim;
  bool hnd;   // [head][token][dim] pages; otherwise [token][head][dim]
  bool bf16;  // elements are bf16; otherwise fp32
};

// Stores each token's K (columns [k_col, k_col + kv_width) of src) and V (from v_col) at
// slots[t] = page * page_size + offset.
void LaunchWriteKV(const float* src, int32_t n, int32_t stride, int32_t k_col, int32_t v_col,
                   const int64_t* slots, const KVPoolShape& shape, void* k_pool, void* v_pool,
                   cudaStream_t stream);

struct PagedAttentionArgs {
  const float* q;  // token t, query head h at q[t * q_stride + h * head_dim]
  int32_t q_stride;
  float* out;  // token t, head h at out[t * out_stride + h * head_dim]
  int32_t out_stride;
  const void* k_pool;
  const void* v_pool;
  const int32_t* positions;         // per token
  const int32_t* token_seq;         // per token
  const int32_t* page_table_begin;  // per request
  const int32_t* page_tables;
  int32_t num_tokens;
  int32_t num_heads;
  int32_t max_position;  // largest entry of positions (sizes the key splits)
  KVPoolShape shape;
};

// Causal paged attention for prefill chunks and decode batches alike. Long contexts are split
// across blocks (flash-decoding) and merged by a second kernel that uses `workspace`.
// Requirements (checked by the model): head_dim <= 256, num_heads / num_kv_heads <= 8.
constexpr int32_t kMaxAttentionHeadDim = 256;
constexpr int32_t kMaxAttentionGroup = 8;
// Bytes of workspace LaunchPagedAttention needs for these arguments.
size_t PagedAttentionWorkspaceBytes(const PagedAttentionArgs& args);
void LaunchPagedAttention(const PagedAttentionArgs& args, void* workspace, cudaStream_t stream);

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i].
void LaunchSwiGLU(const float* gate_up, int32_t rows, int32_t inter, float* out,
                  cudaStream_t stream);

// x[i] += y[i].
void LaunchAdd(float* x, const float* y, int64_t n, cudaStream_t stream);

// out[i][:] = x[rows[i]][:].
void LaunchGatherRows(const float* x, const int32_t* rows, int32_t n, int32_t width, float* out,
                      cudaStream_t stream);

// The recurrent mixer over each request's tokens; fused rows are [u | decay | z], each `dim`
// wide. State slots start from zero where the request's start_pos is 0.
void LaunchRecurrentScan(const float* fused, int32_t dim, const int32_t* seq_token_begin,
                         const int32_t* seq_start_pos, const int32_t* seq_state_slot,
                         int32_t num_seqs, float* state_pool, float* y, cudaStream_t stream);

// Greedy sampling with log-softmax, per row of logits: token, its logprob, and the top_k
// (best first, lowest id on ties).
void LaunchSampleGreedy(const float* logits, int32_t rows, int32_t vocab, int32_t top_k,
                        int32_t* token, float* logprob, int32_t* top_ids, float* top_logprobs,
                        cudaStream_t stream);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CUDA_CUDA_KERNELS_CUH_
