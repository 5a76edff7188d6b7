#include "shard_util.h"

#include <cstring>
#include <string>

namespace pdlib::kernels::internal {
namespace {

// ForwardResults as bytes, for the last PP stage to hand to the others.
template <typename T>
void Put(std::vector<std::byte>* out, const T* p, size_t n) {
  if (n == 0) return;  // an empty vector's data() may be null
  const auto* b = reinterpret_cast<const std::byte*>(p);
  out->insert(out->end(), b, b + n * sizeof(T));
}

template <typename T>
void PutVector(std::vector<std::byte>* out, const std::vector<T>& v) {
  const uint64_t n = v.size();
  Put(out, &n, 1);
  Put(out, v.data(), v.size());
}

class ByteReader {
 public:
  explicit ByteReader(const std::vector<std::byte>& bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* p, size_t n) {
    if (bytes_.size() - at_ < n * sizeof(T)) return false;
    if (n == 0) return true;  // an empty vector's data() may be null
    std::memcpy(p, bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return true;
  }
  template <typename T>
  bool GetVector(std::vector<T>* v) {
    uint64_t n = 0;
    if (!Get(&n, 1) || n > (bytes_.size() - at_) / sizeof(T)) return false;
    v->resize(n);
    return Get(v->data(), n);
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  const std::vector<std::byte>& bytes_;
  size_t at_ = 0;
};

}  // namespace

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const std::vector<float>* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

std::vector<float> Rows(const std::vector<float>& m, int32_t width, int32_t begin, int32_t count) {
  const auto from = static_cast<ptrdiff_t>(begin) * width;
  return std::vector<float>(m.begin() + from,
                            m.begin() + from + static_cast<ptrdiff_t>(count) * width);
}

RankLayer SliceLayer(const ModelWeights& w, const ShardLayout& s, int32_t l) {
  const ModelConfig& c = w.config;
  const int32_t hidden = c.hidden_size, hd = c.head_dim;
  const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
  RankLayer layer;
  layer.kind = c.layer_kind(l);
  layer.input_norm = lw.input_layernorm;
  layer.post_norm = lw.post_attention_layernorm;
  if (layer.kind == LayerKind::kRecurrent) {
    // Replicated: every TP rank runs the whole recurrence on its own copy of the state.
    layer.pool_index = c.state_layer_index(l) - s.state_start;
    layer.mix_in = Stack({&lw.rec_in_proj, &lw.rec_decay_proj, &lw.rec_gate_proj});
    layer.mix_out = lw.rec_out_proj;
  } else if (c.is_mla()) {
    layer.pool_index = c.kv_layer_index(l) - s.kv_start;
    const int32_t q_rows = hd + c.qk_rope_dim;  // per head: nope then rope
    const std::vector<float> q =
        Rows(lw.q_proj, hidden, s.q_head_start * q_rows, s.q_head_count * q_rows);
    layer.mix_in = Stack({&q, &lw.kv_a_proj});
    layer.kv_a_norm = lw.kv_a_layernorm;
    layer.kv_b =
        Rows(lw.kv_b_proj, c.kv_lora_rank, s.q_head_start * 2 * hd, s.q_head_count * 2 * hd);
    layer.mix_out = Rows(lw.o_proj, c.q_width(), s.out_start, s.out_count);
  } else {
    layer.pool_index = layer.kind == LayerKind::kAttention ? c.kv_layer_index(l) - s.kv_start
                                                           : c.swa_layer_index(l) - s.swa_start;
    // This rank's query heads and the KV heads they read, stacked q | k | v.
    const std::vector<float> q = Rows(lw.q_proj, hidden, s.q_head_start * hd, s.q_head_count * hd);
    const std::vector<float> k =
        Rows(lw.k_proj, hidden, s.kv_head_start * hd, s.kv_head_count * hd);
    const std::vector<float> v =
        Rows(lw.v_proj, hidden, s.kv_head_start * hd, s.kv_head_count * hd);
    layer.mix_in = Stack({&q, &k, &v});
    layer.mix_out = Rows(lw.o_proj, c.q_width(), s.out_start, s.out_count);
    if (layer.kind == LayerKind::kAttention && c.has_indexer()) {
      // The indexer sees every position for every head: the same keys and choice on every rank.
      layer.index_proj = Stack({&lw.index_q_proj, &lw.index_k_proj});
    }
  }
  const std::vector<float> gate = Rows(lw.gate_proj, hidden, s.inter_start, s.inter_count);
  const std::vector<float> up = Rows(lw.up_proj, hidden, s.inter_start, s.inter_count);
  layer.gate_up = Stack({&gate, &up});
  layer.down = Rows(lw.down_proj, c.intermediate_size, s.out_start, s.out_count);
  return layer;
}

// gathered is [parts][rows][width] (what AllGather of a [rows][width] slice returns); out is
// [rows][parts * width] with part p's columns at [p * width, (p + 1) * width).
void Interleave(const std::vector<float>& gathered, int32_t parts, int64_t rows, int32_t width,
                std::vector<float>* out) {
  out->resize(static_cast<size_t>(rows) * static_cast<size_t>(parts) * width);
  for (int32_t p = 0; p < parts; ++p) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out->data() + (r * parts + p) * width,
                  gathered.data() + (static_cast<int64_t>(p) * rows + r) * width,
                  sizeof(float) * static_cast<size_t>(width));
    }
  }
}

void SerializeResults(const std::vector<ForwardResult>& results, std::vector<std::byte>* out) {
  out->clear();
  const uint64_t n = results.size();
  Put(out, &n, 1);
  for (const ForwardResult& r : results) {
    Put(out, &r.token, 1);
    Put(out, &r.logprob, 1);
    PutVector(out, r.top_ids);
    PutVector(out, r.top_logprobs);
    PutVector(out, r.logits);
    PutVector(out, r.hidden);
  }
}

Status DeserializeResults(const std::vector<std::byte>& bytes, std::vector<ForwardResult>* out) {
  ByteReader in(bytes);
  uint64_t n = 0;
  bool ok = in.Get(&n, 1) && n <= bytes.size();
  out->assign(ok ? n : 0, ForwardResult{});
  for (ForwardResult& r : *out) {
    ok = ok && in.Get(&r.token, 1) && in.Get(&r.logprob, 1) && in.GetVector(&r.top_ids) &&
         in.GetVector(&r.top_logprobs) && in.GetVector(&r.logits) && in.GetVector(&r.hidden);
  }
  if (!ok || !in.done()) {
    return Status::Internal("model: the last PP stage's results are malformed (" +
                            std::to_string(bytes.size()) + " bytes)");
  }
  return Status::OK();
}

}  // namespace pdlib::kernels::internal
