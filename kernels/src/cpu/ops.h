// The CPU reference ops of the decoder, on plain row-major fp32 arrays.
//
// Every op computes each output element in one fixed order, whatever the batch or the number
// of threads, so the CPU model is bit-for-bit reproducible. Ops that take a ThreadPool split
// only across output elements, never inside a sum.
#ifndef PDLIB_KERNELS_SRC_CPU_OPS_H_
#define PDLIB_KERNELS_SRC_CPU_OPS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cpu/thread_pool.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/model.h"

namespace pdlib::kernels::internal {

// Sum of a[i] * b[i] in a fixed order (eight interleaved partial sums, then a fixed tree).
float Dot(const float* a, const float* b, int64_t n);

// out[t][:] = table[ids[t]][:].
void Embedding(const float* table, int32_t hidden, std::span<const int32_t> ids, float* out);

// out[r][i] = x[r][i] / sqrt(mean(x[r]^2) + eps) * weight[i].
void RmsNorm(const float* x, const float* weight, int64_t rows, int32_t hidden, float eps,
             float* out);

// y[i] += a * x[i] (element-wise, so exact whatever the vector width).
void Axpy(float a, const float* x, float* y, int64_t n);

// y[r][o] = sum_i x[r][i] * w[o][i]: x is [rows][in], w is [out][in], y is [rows][out].
// Each y element equals Dot(x[r], w[o], in) bit for bit.
void MatMul(ThreadPool& pool, const float* x, int64_t rows, int32_t in, const float* w, int32_t out,
            float* y);

// Which instruction set Dot's, Axpy's and MatMul's inner loops are compiled for. Both give
// identical bits; tests force each in turn to prove it.
enum class MatMulIsa { kAuto, kGeneric, kAvx2 };
bool MatMulIsaAvailable(MatMulIsa isa);
void ForceMatMulIsa(MatMulIsa isa);

// cos and sin of position * theta^(-2i / head_dim) for i < head_dim / 2, per position:
// [positions.size()][head_dim / 2] each. Computed in double, then rounded, so every backend can
// use the same table.
void RopeTable(std::span<const int32_t> positions, int32_t head_dim, float theta,
               std::vector<float>* cos, std::vector<float>* sin);

// Rotates each head of x ([rows][heads * head_dim]) in place, Llama "rotate half" style:
// the pair (x[i], x[i + head_dim/2]) is rotated by row r's angle i.
void ApplyRope(float* x, int64_t rows, int32_t heads, int32_t head_dim, const float* cos,
               const float* sin);

// Stores k and v ([tokens][kv_heads * head_dim]) into one layer's pools at write_slots
// (page * page_size + offset), in the config's layout and dtype.
void WriteKV(const ModelConfig& config, const float* k, const float* v,
             std::span<const int64_t> write_slots, void* k_pool, void* v_pool);

// Reads one head of one token back from a pool as fp32 (head_dim values).
void ReadKVHead(const ModelConfig& config, const void* pool, int64_t slot, int32_t head,
                float* out);
// The same head as a pointer: straight into an fp32 pool, or into `scratch` (head_dim floats)
// after widening bf16.
const float* KVHead(const ModelConfig& config, const void* pool, int64_t slot, int32_t head,
                    float* scratch);

// Rotates, in every row r and head h, the rope_dim values at
// x + r * row_stride + h * head_stride + offset, rotate-half style with row r's angles (cos and
// sin are [rows][rope_dim / 2], RopeTable(positions, rope_dim, ...)). The same arithmetic as
// ApplyRope, which is ApplyRopeStrided(x, rows, heads * head_dim, heads, head_dim, 0, head_dim).
// MLA uses it for the rope part of each query head and for the shared k_rope.
void ApplyRopeStrided(float* x, int64_t rows, int64_t row_stride, int32_t heads,
                      int32_t head_stride, int32_t offset, int32_t rope_dim, const float* cos,
                      const float* sin);

// Paged attention. For each token t of the batch (request token_seq[t], position positions[t])
// and query head h: softmax over keys j in [first, positions[t]] of q.k_j / sqrt(head_dim),
// times v_j, with K and V read from the request's pages; first = 0 (causal, window 0) or
// max(0, positions[t] - window + 1) (a sliding window of `window` positions, the token itself
// included): pages wholly before the window are never read. GQA: query head h reads KV head
// h / (num_heads / num_kv_heads). q and out are [tokens][num_heads * head_dim]. The pools must
// already hold the tokens' own K and V.
//
// With a `selection` (sparse attention, the lightning indexer), token t attends only over the
// positions selection->positions[begin[t] .. begin[t + 1]) (ascending, each in [0, positions[t]])
// instead: the same scores, running max, exp, sum and value accumulation in that order, so a
// selection of every position [0, positions[t]] gives exactly the causal result's bits. The
// window must then be 0.
struct AttentionBatch {
  std::span<const int32_t> positions;
  std::span<const int32_t> token_seq;
  std::span<const int32_t> page_table_begin;  // per request, into page_tables
  std::span<const int32_t> page_tables;
};
struct KeySelection {
  std::vector<int32_t> begin;      // tokens + 1 entries into positions
  std::vector<int32_t> positions;  // per token, ascending
};
void PagedAttention(ThreadPool& pool, const ModelConfig& config, const float* q,
                    const AttentionBatch& batch, const void* k_pool, const void* v_pool, float* out,
                    int32_t window = 0, const KeySelection* selection = nullptr);

// --- Lightning indexer (config.has_indexer()) ---
//
// An index pool page holds page_size rows of index_dim fp32 index keys, row t at element
// t * index_dim, so the row of slot s (page * page_size + offset) starts at element
// s * index_dim.

// Stores index keys ([tokens][index_dim]) into an index pool at write_slots.
void WriteIndexKeys(const ModelConfig& config, const float* k_idx,
                    std::span<const int64_t> write_slots, void* index_pool);

// The indexer's choice of keys for every token of the batch. Token t at position p scores every
// position j in [0, p]: s_j = Dot(q_idx[t], k_idx_j, index_dim), k_idx_j read from the request's
// pages of the index pool (the tokens' own keys must already be there). It selects the
// min(p + 1, topk) positions with the highest scores (ties: the lower j; a NaN score counts as
// -inf), listed in ascending order; with p + 1 <= topk every position. One task per token, so
// the choice does not depend on threads or batching. q_idx is [tokens][index_dim].
void IndexerSelect(ThreadPool& pool, const ModelConfig& config, const float* q_idx,
                   const AttentionBatch& batch, const void* index_pool, int32_t topk,
                   KeySelection* selection);

// --- Multi-head latent attention (config.is_mla()) ---
//
// A page of the latent pool holds page_size rows of kv_width() = kv_lora_rank + qk_rope_dim
// elements in the config's dtype, row t at element t * kv_width() (NHD and HND coincide: one
// "head"). A row is [c (kv_lora_rank, RMS-normalised), k_rope (qk_rope_dim, rotated)].

// The latent rows of `rows` tokens from kv_a_proj's output kv_a ([rows][kv_width()], raw): c =
// RmsNorm(kv_a[:rank]) * norm_weight, k_rope = rotate-half RoPE of kv_a[rank:] with row r's
// angles (cos, sin: [rows][qk_rope_dim / 2]). latent is [rows][kv_width()]; it may equal kv_a.
void MlaLatentRows(const ModelConfig& config, const float* kv_a, int64_t rows,
                   const float* norm_weight, const float* cos, const float* sin, float* latent);

// Stores latent rows ([tokens][kv_width()]) into a latent pool at write_slots, in the config's
// dtype (bf16 rounds to nearest even, as WriteKV).
void WriteLatent(const ModelConfig& config, const float* latent,
                 std::span<const int64_t> write_slots, void* pool);

// One latent row (kv_width() values) as a pointer: straight into an fp32 pool, or into
// `scratch` (kv_width() floats) after widening bf16.
const float* LatentRow(const ModelConfig& config, const void* pool, int64_t slot, float* scratch);

// Causal MLA attention over the latent pool for `num_heads` query heads (a rank's range of the
// model's heads; the caller passes their q and kv_b rows). For token t and head h, in the
// absorbed form:
//   q_abs = sum_d q_nope[d] * W_uk[d][:]            (kv_lora_rank values; d ascending)
//   s_j   = (Dot(q_abs, c_j) + Dot(q_rope, k_rope_j)) * (1 / sqrt(head_dim + qk_rope_dim))
//   o_lat = sum_j exp(s_j - max s) * c_j / sum_j exp(s_j - max s)   (j ascending)
//   out[d] = Dot(W_uv[d], o_lat)
// for keys j in [0, positions[t]]. Mathematically the naive form
// softmax_j((q_nope . W_uk c_j + q_rope . k_rope_j) * scale) W_uv c_j.
// q: [tokens][num_heads][head_dim + qk_rope_dim], per head nope then rope (already rotated).
// kv_b: [num_heads][2 * head_dim][kv_lora_rank], per head W_uk rows then W_uv rows (kv_b_proj's
// rows of those heads). out: [tokens][num_heads * head_dim]. Each (token, head) is one task
// computed in a fixed order, so results do not depend on threads or batching.
void MlaPagedAttention(ThreadPool& pool, const ModelConfig& config, int32_t num_heads,
                       const float* q, const float* kv_b, const AttentionBatch& batch,
                       const void* latent_pool, float* out);

// out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
void SwiGLU(const float* gate, const float* up, int64_t n, float* out);

// x[i] += y[i].
void AddInPlace(float* x, const float* y, int64_t n);

// The recurrent mixer, per request and state dimension, over that request's tokens in order:
//   a = sigmoid(decay[t]), h = a * h + (1 - a) * u[t], y[t] = h * silu(z[t]).
// u, decay, z and y are [tokens][dim]; `state` is the request's slot (dim floats), read as the
// initial h (zeros when seq_start_pos is 0) and overwritten with the final h.
struct RecurrentBatch {
  std::span<const int32_t> seq_token_begin;  // num_seqs + 1 entries
  std::span<const int32_t> seq_start_pos;
  std::span<const int32_t> seq_state_slot;
};
void RecurrentScan(const RecurrentBatch& batch, int32_t dim, const float* u, const float* decay,
                   const float* z, float* state_pool, float* y);

// Log-softmax of `logits` and the greedy choice: token = argmax (lowest id on ties), its
// logprob, and the top_k tokens by logprob (best first, lowest id on ties).
void SampleGreedy(const float* logits, int32_t vocab, int32_t top_k, ForwardResult* result);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_CPU_OPS_H_
