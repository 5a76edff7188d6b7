#include "cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "half_float.h"
#include "pdlib_kernels/kv_cache.h"

namespace pdlib::kernels::internal {
namespace {

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

size_t PageElems(const ModelConfig& config) {
  return static_cast<size_t>(config.page_size) * static_cast<size_t>(config.kv_width());
}

}  // namespace

void Embedding(const float* table, int32_t hidden, std::span<const int32_t> ids, float* out) {
  for (size_t t = 0; t < ids.size(); ++t) {
    std::memcpy(out + t * static_cast<size_t>(hidden),
                table + static_cast<size_t>(ids[t]) * static_cast<size_t>(hidden),
                sizeof(float) * static_cast<size_t>(hidden));
  }
}

void RmsNorm(const float* x, const float* weight, int64_t rows, int32_t hidden, float eps,
             float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* yr = out + r * hidden;
    const float mean_sq = Dot(xr, xr, hidden) / static_cast<float>(hidden);
    const float inv = 1.0f / std::sqrt(mean_sq + eps);
    for (int32_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv * weight[i];
  }
}

void RopeTable(std::span<const int32_t> positions, int32_t head_dim, float theta,
               std::vector<float>* cos, std::vector<float>* sin) {
  const int32_t half = head_dim / 2;
  cos->resize(positions.size() * static_cast<size_t>(half));
  sin->resize(positions.size() * static_cast<size_t>(half));
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int32_t i = 0; i < half; ++i) {
      const double inv_freq =
          std::pow(static_cast<double>(theta), -2.0 * i / static_cast<double>(head_dim));
      const double angle = static_cast<double>(positions[t]) * inv_freq;
      (*cos)[t * static_cast<size_t>(half) + static_cast<size_t>(i)] =
          static_cast<float>(std::cos(angle));
      (*sin)[t * static_cast<size_t>(half) + static_cast<size_t>(i)] =
          static_cast<float>(std::sin(angle));
    }
  }
}

void ApplyRope(float* x, int64_t rows, int32_t heads, int32_t head_dim, const float* cos,
               const float* sin) {
  const int32_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int32_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

void ApplyRopeStrided(float* x, int64_t rows, int64_t row_stride, int32_t heads,
                      int32_t head_stride, int32_t offset, int32_t rope_dim, const float* cos,
                      const float* sin) {
  const int32_t half = rope_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int32_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + static_cast<int64_t>(h) * head_stride + offset;
      for (int32_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

void WriteKV(const ModelConfig& config, const float* k, const float* v,
             std::span<const int64_t> write_slots, void* k_pool, void* v_pool) {
  const int32_t hd = config.head_dim;
  const size_t page_elems = PageElems(config);
  for (size_t t = 0; t < write_slots.size(); ++t) {
    const int64_t page = write_slots[t] / config.page_size;
    const int32_t off = static_cast<int32_t>(write_slots[t] % config.page_size);
    for (int32_t h = 0; h < config.num_kv_heads; ++h) {
      const size_t dst = static_cast<size_t>(page) * page_elems + KVOffsetInPage(config, off, h, 0);
      const float* ks = k + (t * static_cast<size_t>(config.num_kv_heads) + h) * hd;
      const float* vs = v + (t * static_cast<size_t>(config.num_kv_heads) + h) * hd;
      if (config.kv_dtype == KVDtype::kFloat32) {
        std::memcpy(static_cast<float*>(k_pool) + dst, ks, sizeof(float) * hd);
        std::memcpy(static_cast<float*>(v_pool) + dst, vs, sizeof(float) * hd);
      } else {
        uint16_t* kd = static_cast<uint16_t*>(k_pool) + dst;
        uint16_t* vd = static_cast<uint16_t*>(v_pool) + dst;
        for (int32_t d = 0; d < hd; ++d) {
          kd[d] = FloatToBf16(ks[d]);
          vd[d] = FloatToBf16(vs[d]);
        }
      }
    }
  }
}

void ReadKVHead(const ModelConfig& config, const void* pool, int64_t slot, int32_t head,
                float* out) {
  const int64_t page = slot / config.page_size;
  const int32_t off = static_cast<int32_t>(slot % config.page_size);
  const size_t at =
      static_cast<size_t>(page) * PageElems(config) + KVOffsetInPage(config, off, head, 0);
  if (config.kv_dtype == KVDtype::kFloat32) {
    std::memcpy(out, static_cast<const float*>(pool) + at, sizeof(float) * config.head_dim);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(pool) + at;
    for (int32_t d = 0; d < config.head_dim; ++d) out[d] = Bf16ToFloat(src[d]);
  }
}

const float* KVHead(const ModelConfig& config, const void* pool, int64_t slot, int32_t head,
                    float* scratch) {
  if (config.kv_dtype != KVDtype::kFloat32) {
    ReadKVHead(config, pool, slot, head, scratch);
    return scratch;
  }
  const int64_t page = slot / config.page_size;
  const int32_t off = static_cast<int32_t>(slot % config.page_size);
  return static_cast<const float*>(pool) + static_cast<size_t>(page) * PageElems(config) +
         KVOffsetInPage(config, off, head, 0);
}

void PagedAttention(ThreadPool& pool, const ModelConfig& config, const float* q,
                    const AttentionBatch& batch, const void* k_pool, const void* v_pool, float* out,
                    int32_t window, const KeySelection* selection) {
  const int32_t hd = config.head_dim;
  const int32_t heads = config.num_heads;
  const int32_t group = config.num_heads / config.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t tasks = static_cast<int64_t>(batch.positions.size()) * heads;
  int64_t mean_keys = batch.positions.empty() ? 1 : batch.positions.back() + 1;
  if (window > 0) mean_keys = std::min<int64_t>(mean_keys, window);
  if (selection != nullptr && !batch.positions.empty()) {
    mean_keys = std::max<int64_t>(
        1, static_cast<int64_t>(selection->positions.size() / batch.positions.size()));
  }
  pool.ParallelFor(tasks, mean_keys * hd * 2, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kv(static_cast<size_t>(hd)), acc(static_cast<size_t>(hd));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads;
      const int32_t h = static_cast<int32_t>(task % heads);
      const int32_t kvh = h / group;
      const int32_t pos = batch.positions[static_cast<size_t>(t)];
      const int32_t seq = batch.token_seq[static_cast<size_t>(t)];
      const int32_t* pages = batch.page_tables.data() + batch.page_table_begin[seq];
      const float* qh = q + (t * heads + h) * hd;
      // The keys, in the order every sum runs: key(i) for i in [0, count).
      int32_t first = 0, count = 0;
      const int32_t* chosen = nullptr;
      if (selection != nullptr) {
        const int32_t b = selection->begin[static_cast<size_t>(t)];
        chosen = selection->positions.data() + b;
        count = selection->begin[static_cast<size_t>(t) + 1] - b;
      } else {
        first = window > 0 ? std::max(0, pos - window + 1) : 0;
        count = pos - first + 1;
      }
      auto slot_of = [&](int32_t i) {
        const int32_t j = chosen != nullptr ? chosen[i] : first + i;
        return static_cast<int64_t>(pages[j / config.page_size]) * config.page_size +
               j % config.page_size;
      };
      scores.resize(static_cast<size_t>(count));
      float max_score = -INFINITY;
      for (int32_t i = 0; i < count; ++i) {
        const float sc = Dot(qh, KVHead(config, k_pool, slot_of(i), kvh, kv.data()), hd) * scale;
        scores[static_cast<size_t>(i)] = sc;
        max_score = std::max(max_score, sc);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int32_t i = 0; i < count; ++i) {
        const float p = std::exp(scores[static_cast<size_t>(i)] - max_score);
        sum += p;
        const float* v = KVHead(config, v_pool, slot_of(i), kvh, kv.data());
        Axpy(p, v, acc.data(), hd);
      }
      float* oh = out + (t * heads + h) * hd;
      for (int32_t d = 0; d < hd; ++d) oh[d] = acc[d] / sum;
    }
  });
}

void WriteIndexKeys(const ModelConfig& config, const float* k_idx,
                    std::span<const int64_t> write_slots, void* index_pool) {
  const size_t dim = static_cast<size_t>(config.index_dim);
  for (size_t t = 0; t < write_slots.size(); ++t) {
    std::memcpy(static_cast<float*>(index_pool) + static_cast<size_t>(write_slots[t]) * dim,
                k_idx + t * dim, sizeof(float) * dim);
  }
}

void IndexerSelect(ThreadPool& pool, const ModelConfig& config, const float* q_idx,
                   const AttentionBatch& batch, const void* index_pool, int32_t topk,
                   KeySelection* selection) {
  const int32_t dim = config.index_dim;
  const size_t tokens = batch.positions.size();
  selection->begin.resize(tokens + 1);
  selection->begin[0] = 0;
  for (size_t t = 0; t < tokens; ++t) {
    selection->begin[t + 1] = selection->begin[t] + std::min(batch.positions[t] + 1, topk);
  }
  selection->positions.resize(static_cast<size_t>(selection->begin[tokens]));
  const int64_t mean_keys = batch.positions.empty() ? 1 : batch.positions.back() + 1;
  const float* keys = static_cast<const float*>(index_pool);
  pool.ParallelFor(static_cast<int64_t>(tokens), mean_keys * dim, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int32_t> order;
    for (int64_t t = begin; t < end; ++t) {
      const int32_t pos = batch.positions[static_cast<size_t>(t)];
      int32_t* out = selection->positions.data() + selection->begin[static_cast<size_t>(t)];
      const int32_t count = std::min(pos + 1, topk);
      if (count == pos + 1) {  // every position: no scores needed
        for (int32_t j = 0; j <= pos; ++j) out[j] = j;
        continue;
      }
      const int32_t seq = batch.token_seq[static_cast<size_t>(t)];
      const int32_t* pages = batch.page_tables.data() + batch.page_table_begin[seq];
      const float* qt = q_idx + t * dim;
      scores.resize(static_cast<size_t>(pos) + 1);
      for (int32_t j = 0; j <= pos; ++j) {
        const int64_t slot = static_cast<int64_t>(pages[j / config.page_size]) * config.page_size +
                             j % config.page_size;
        const float s = Dot(qt, keys + static_cast<size_t>(slot) * static_cast<size_t>(dim), dim);
        scores[static_cast<size_t>(j)] = std::isnan(s) ? -INFINITY : s;
      }
      order.resize(static_cast<size_t>(pos) + 1);
      std::iota(order.begin(), order.end(), 0);
      // A strict total order (score descending, then position ascending): the chosen set is
      // unique, whatever the algorithm.
      std::nth_element(order.begin(), order.begin() + (count - 1), order.end(),
                       [&](int32_t a, int32_t b) {
                         const float sa = scores[static_cast<size_t>(a)];
                         const float sb = scores[static_cast<size_t>(b)];
                         return sa != sb ? sa > sb : a < b;
                       });
      std::sort(order.begin(), order.begin() + count);
      std::copy(order.begin(), order.begin() + count, out);
    }
  });
}

void MlaLatentRows(const ModelConfig& config, const float* kv_a, int64_t rows,
                   const float* norm_weight, const float* cos, const float* sin, float* latent) {
  const int32_t rank = config.kv_lora_rank, rd = config.qk_rope_dim, kw = config.kv_width();
  const int32_t half = rd / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = kv_a + r * kw;
    float* row = latent + r * kw;
    // RmsNorm reads its row whole before writing, so latent may alias kv_a.
    RmsNorm(in, norm_weight, 1, rank, config.rms_norm_eps, row);
    if (row != in) std::memcpy(row + rank, in + rank, sizeof(float) * static_cast<size_t>(rd));
    ApplyRopeStrided(row, 1, kw, 1, 0, rank, rd, cos + r * half, sin + r * half);
  }
}

void WriteLatent(const ModelConfig& config, const float* latent,
                 std::span<const int64_t> write_slots, void* pool) {
  const size_t kw = static_cast<size_t>(config.kv_width());
  const size_t page_elems = PageElems(config);
  for (size_t t = 0; t < write_slots.size(); ++t) {
    const int64_t page = write_slots[t] / config.page_size;
    const size_t off = static_cast<size_t>(write_slots[t] % config.page_size);
    const size_t dst = static_cast<size_t>(page) * page_elems + off * kw;
    const float* src = latent + t * kw;
    if (config.kv_dtype == KVDtype::kFloat32) {
      std::memcpy(static_cast<float*>(pool) + dst, src, sizeof(float) * kw);
    } else {
      uint16_t* d = static_cast<uint16_t*>(pool) + dst;
      for (size_t i = 0; i < kw; ++i) d[i] = FloatToBf16(src[i]);
    }
  }
}

const float* LatentRow(const ModelConfig& config, const void* pool, int64_t slot, float* scratch) {
  const size_t kw = static_cast<size_t>(config.kv_width());
  const int64_t page = slot / config.page_size;
  const size_t off = static_cast<size_t>(slot % config.page_size);
  const size_t at = static_cast<size_t>(page) * PageElems(config) + off * kw;
  if (config.kv_dtype == KVDtype::kFloat32) return static_cast<const float*>(pool) + at;
  const uint16_t* src = static_cast<const uint16_t*>(pool) + at;
  for (size_t i = 0; i < kw; ++i) scratch[i] = Bf16ToFloat(src[i]);
  return scratch;
}

void MlaPagedAttention(ThreadPool& pool, const ModelConfig& config, int32_t num_heads,
                       const float* q, const float* kv_b, const AttentionBatch& batch,
                       const void* latent_pool, float* out) {
  const int32_t hd = config.head_dim, rd = config.qk_rope_dim, rank = config.kv_lora_rank;
  const int32_t q_stride = hd + rd;
  const size_t head_w = static_cast<size_t>(2) * hd * rank;  // kv_b elements per head
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd + rd));
  const int64_t tasks = static_cast<int64_t>(batch.positions.size()) * num_heads;
  const int64_t mean_keys = batch.positions.empty() ? 1 : batch.positions.back() + 1;
  const int64_t cost = mean_keys * (2 * rank + rd) + 2 * static_cast<int64_t>(hd) * rank;
  pool.ParallelFor(tasks, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(static_cast<size_t>(config.kv_width()));
    std::vector<float> q_abs(static_cast<size_t>(rank)), o_lat(static_cast<size_t>(rank));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_heads;
      const int32_t h = static_cast<int32_t>(task % num_heads);
      const int32_t pos = batch.positions[static_cast<size_t>(t)];
      const int32_t seq = batch.token_seq[static_cast<size_t>(t)];
      const int32_t* pages = batch.page_tables.data() + batch.page_table_begin[seq];
      const float* q_nope = q + (t * num_heads + h) * q_stride;
      const float* q_rope = q_nope + hd;
      const float* w_uk = kv_b + static_cast<size_t>(h) * head_w;  // [head_dim][rank]
      const float* w_uv = w_uk + static_cast<size_t>(hd) * rank;   // [head_dim][rank]
      auto slot_of = [&](int32_t j) {
        return static_cast<int64_t>(pages[j / config.page_size]) * config.page_size +
               j % config.page_size;
      };
      // Absorb W_uk into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c.
      std::fill(q_abs.begin(), q_abs.end(), 0.0f);
      for (int32_t d = 0; d < hd; ++d)
        Axpy(q_nope[d], w_uk + static_cast<size_t>(d) * rank, q_abs.data(), rank);
      scores.resize(static_cast<size_t>(pos) + 1);
      float max_score = -INFINITY;
      for (int32_t j = 0; j <= pos; ++j) {
        const float* c = LatentRow(config, latent_pool, slot_of(j), row.data());
        const float nope = Dot(q_abs.data(), c, rank);
        const float rope = Dot(q_rope, c + rank, rd);
        scores[static_cast<size_t>(j)] = (nope + rope) * scale;
        max_score = std::max(max_score, scores[static_cast<size_t>(j)]);
      }
      float sum = 0.0f;
      std::fill(o_lat.begin(), o_lat.end(), 0.0f);
      for (int32_t j = 0; j <= pos; ++j) {
        const float p = std::exp(scores[static_cast<size_t>(j)] - max_score);
        sum += p;
        Axpy(p, LatentRow(config, latent_pool, slot_of(j), row.data()), o_lat.data(), rank);
      }
      for (int32_t r = 0; r < rank; ++r) o_lat[static_cast<size_t>(r)] /= sum;
      // Up-project the attended latent with W_uv: out = W_uv (sum_j p_j c_j) / sum.
      float* oh = out + (t * num_heads + h) * hd;
      for (int32_t d = 0; d < hd; ++d) {
        oh[d] = Dot(w_uv + static_cast<size_t>(d) * rank, o_lat.data(), rank);
      }
    }
  });
}

void SwiGLU(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Silu(gate[i]) * up[i];
}

void AddInPlace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void RecurrentScan(const RecurrentBatch& batch, int32_t dim, const float* u, const float* decay,
                   const float* z, float* state_pool, float* y) {
  for (size_t s = 0; s + 1 < batch.seq_token_begin.size(); ++s) {
    float* state = state_pool + static_cast<size_t>(batch.seq_state_slot[s]) * dim;
    if (batch.seq_start_pos[s] == 0) std::fill(state, state + dim, 0.0f);
    for (int32_t t = batch.seq_token_begin[s]; t < batch.seq_token_begin[s + 1]; ++t) {
      const size_t row = static_cast<size_t>(t) * static_cast<size_t>(dim);
      for (int32_t d = 0; d < dim; ++d) {
        const float a = Sigmoid(decay[row + d]);
        state[d] = a * state[d] + (1.0f - a) * u[row + d];
        y[row + d] = state[d] * Silu(z[row + d]);
      }
    }
  }
}

void SampleGreedy(const float* logits, int32_t vocab, int32_t top_k, ForwardResult* result) {
  // NaN sorts below every number, so the ordering stays strict and weak.
  auto key = [&](int32_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; ++i) {
    if (key(i) > key(best)) best = i;
  }
  const float max_logit = logits[best];
  double sum = 0.0;
  for (int32_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max_logit));
  const double lse = static_cast<double>(max_logit) + std::log(sum);
  auto logprob = [&](int32_t i) { return static_cast<float>(logits[i] - lse); };
  result->token = best;
  result->logprob = logprob(best);
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + top_k, ids.end(), [&](int32_t a, int32_t b) {
    return key(a) != key(b) ? key(a) > key(b) : a < b;
  });
  result->top_ids.assign(ids.begin(), ids.begin() + top_k);
  result->top_logprobs.resize(static_cast<size_t>(top_k));
  for (int32_t k = 0; k < top_k; ++k) result->top_logprobs[k] = logprob(ids[k]);
}

}  // namespace pdlib::kernels::internal
