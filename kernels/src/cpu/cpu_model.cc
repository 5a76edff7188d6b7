#include "cpu/cpu_model.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "batch_plan.h"
#include "cpu/host_kv_cache.h"
#include "cpu/ops.h"
#include "cpu/thread_pool.h"

namespace pdlib::kernels::internal {
namespace {

// Weights regrouped for the forward pass: the projections that read the same input are stacked
// into one matrix (q|k|v, in|decay|gate, gate|up) so one parallel matmul computes them all.
// Stacking rows does not change any dot product, so results equal the separate matmuls.
struct CpuLayer {
  LayerKind kind = LayerKind::kAttention;
  int32_t pool_index = -1;  // KV layer (attention) or state layer (recurrent)
  std::vector<float> input_norm;
  std::vector<float> mix_in;   // [q; k; v] or [in; decay; gate], each [width][hidden]
  std::vector<float> mix_out;  // o_proj or rec_out_proj
  std::vector<float> post_norm;
  std::vector<float> gate_up;  // [gate; up], [2 * intermediate][hidden]
  std::vector<float> down;
};

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const std::vector<float>* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// Copies columns [begin, begin + width) of every row of a [rows][stride] matrix.
void SliceColumns(const std::vector<float>& in, int64_t rows, int32_t stride, int32_t begin,
                  int32_t width, std::vector<float>* out) {
  out->resize(static_cast<size_t>(rows) * static_cast<size_t>(width));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out->data() + r * width, in.data() + r * stride + begin, sizeof(float) * width);
  }
}

class CpuModel final : public Model {
 public:
  CpuModel(const ModelWeights& w, std::unique_ptr<HostKVCache> cache, int32_t threads)
      : config_(w.config), cache_(std::move(cache)), pool_(threads) {
    embed_ = w.embed_tokens;
    final_norm_ = w.final_norm;
    lm_head_ = config_.tie_word_embeddings ? w.embed_tokens : w.lm_head;
    for (int32_t l = 0; l < config_.num_layers; ++l) {
      const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
      CpuLayer layer;
      layer.kind = config_.layer_kind(l);
      layer.input_norm = lw.input_layernorm;
      layer.post_norm = lw.post_attention_layernorm;
      if (layer.kind == LayerKind::kAttention) {
        layer.pool_index = config_.kv_layer_index(l);
        layer.mix_in = Stack({&lw.q_proj, &lw.k_proj, &lw.v_proj});
        layer.mix_out = lw.o_proj;
      } else {
        layer.pool_index = config_.state_layer_index(l);
        layer.mix_in = Stack({&lw.rec_in_proj, &lw.rec_decay_proj, &lw.rec_gate_proj});
        layer.mix_out = lw.rec_out_proj;
      }
      layer.gate_up = Stack({&lw.gate_proj, &lw.up_proj});
      layer.down = lw.down_proj;
      layers_.push_back(std::move(layer));
    }
  }

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return Device::kCpu; }
  KVCache& kv_cache() override { return *cache_; }
  const KVCache& kv_cache() const override { return *cache_; }

  Status Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                 std::vector<ForwardResult>* results) override;

 private:
  void AttentionMixer(const CpuLayer& layer, const BatchPlan& plan);
  void RecurrentMixer(const CpuLayer& layer, const BatchPlan& plan);
  void Mlp(const CpuLayer& layer, int64_t tokens);

  ModelConfig config_;
  std::unique_ptr<HostKVCache> cache_;
  ThreadPool pool_;
  std::vector<float> embed_, final_norm_, lm_head_;
  std::vector<CpuLayer> layers_;
  // Activations, reused between calls: x is the residual stream [tokens][hidden].
  std::vector<float> x_, xn_, fused_, a_, b_, c_, mixed_, delta_, rope_cos_, rope_sin_;
};

void CpuModel::AttentionMixer(const CpuLayer& layer, const BatchPlan& plan) {
  const ModelConfig& c = config_;
  const int64_t n = plan.num_tokens;
  const int32_t qw = c.q_width(), kw = c.kv_width(), fused_w = qw + 2 * kw;
  fused_.resize(static_cast<size_t>(n * fused_w));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.mix_in.data(), fused_w, fused_.data());
  SliceColumns(fused_, n, fused_w, 0, qw, &a_);        // q
  SliceColumns(fused_, n, fused_w, qw, kw, &b_);       // k
  SliceColumns(fused_, n, fused_w, qw + kw, kw, &c_);  // v
  ApplyRope(a_.data(), n, c.num_heads, c.head_dim, rope_cos_.data(), rope_sin_.data());
  ApplyRope(b_.data(), n, c.num_kv_heads, c.head_dim, rope_cos_.data(), rope_sin_.data());
  void* k_pool = cache_->pool(KVKind::kKey, layer.pool_index).base;
  void* v_pool = cache_->pool(KVKind::kValue, layer.pool_index).base;
  WriteKV(c, b_.data(), c_.data(), plan.write_slots, k_pool, v_pool);
  AttentionBatch batch{plan.positions, plan.token_seq, plan.page_table_begin, plan.page_tables};
  mixed_.resize(static_cast<size_t>(n * qw));
  PagedAttention(pool_, c, a_.data(), batch, k_pool, v_pool, mixed_.data());
  delta_.resize(static_cast<size_t>(n * c.hidden_size));
  MatMul(pool_, mixed_.data(), n, qw, layer.mix_out.data(), c.hidden_size, delta_.data());
  AddInPlace(x_.data(), delta_.data(), n * c.hidden_size);
}

void CpuModel::RecurrentMixer(const CpuLayer& layer, const BatchPlan& plan) {
  const ModelConfig& c = config_;
  const int64_t n = plan.num_tokens;
  const int32_t sd = c.state_dim(), fused_w = 3 * sd;
  fused_.resize(static_cast<size_t>(n * fused_w));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.mix_in.data(), fused_w, fused_.data());
  SliceColumns(fused_, n, fused_w, 0, sd, &a_);       // u
  SliceColumns(fused_, n, fused_w, sd, sd, &b_);      // decay logits
  SliceColumns(fused_, n, fused_w, 2 * sd, sd, &c_);  // gate
  mixed_.resize(static_cast<size_t>(n * sd));
  RecurrentBatch batch{plan.seq_token_begin, plan.seq_start_pos, plan.seq_state_slot};
  float* states = static_cast<float*>(cache_->state_pool(layer.pool_index).base);
  RecurrentScan(batch, sd, a_.data(), b_.data(), c_.data(), states, mixed_.data());
  delta_.resize(static_cast<size_t>(n * c.hidden_size));
  MatMul(pool_, mixed_.data(), n, sd, layer.mix_out.data(), c.hidden_size, delta_.data());
  AddInPlace(x_.data(), delta_.data(), n * c.hidden_size);
}

void CpuModel::Mlp(const CpuLayer& layer, int64_t n) {
  const ModelConfig& c = config_;
  const int32_t inter = c.intermediate_size;
  fused_.resize(static_cast<size_t>(n * 2 * inter));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.gate_up.data(), 2 * inter, fused_.data());
  mixed_.resize(static_cast<size_t>(n * inter));
  for (int64_t t = 0; t < n; ++t) {
    const float* row = fused_.data() + t * 2 * inter;
    SwiGLU(row, row + inter, inter, mixed_.data() + t * inter);
  }
  delta_.resize(static_cast<size_t>(n * c.hidden_size));
  MatMul(pool_, mixed_.data(), n, inter, layer.down.data(), c.hidden_size, delta_.data());
  AddInPlace(x_.data(), delta_.data(), n * c.hidden_size);
}

Status CpuModel::Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                         std::vector<ForwardResult>* results) {
  StatusOr<BatchPlan> planned =
      PlanBatch(config_, cache_->num_pages(), cache_->num_state_slots(), batch, options);
  if (!planned.ok()) return planned.status();
  const BatchPlan& plan = *planned;
  const ModelConfig& c = config_;
  const int64_t n = plan.num_tokens;
  const int32_t h = c.hidden_size;

  x_.resize(static_cast<size_t>(n * h));
  xn_.resize(static_cast<size_t>(n * h));
  Embedding(embed_.data(), h, plan.token_ids, x_.data());
  RopeTable(plan.positions, c.head_dim, c.rope_theta, &rope_cos_, &rope_sin_);
  for (const CpuLayer& layer : layers_) {
    RmsNorm(x_.data(), layer.input_norm.data(), n, h, c.rms_norm_eps, xn_.data());
    if (layer.kind == LayerKind::kAttention) {
      AttentionMixer(layer, plan);
    } else {
      RecurrentMixer(layer, plan);
    }
    RmsNorm(x_.data(), layer.post_norm.data(), n, h, c.rms_norm_eps, xn_.data());
    Mlp(layer, n);
  }

  // Only each request's last token feeds the LM head.
  const int32_t seqs = plan.num_seqs;
  std::vector<float> last(static_cast<size_t>(seqs) * h), normed(last.size());
  for (int32_t s = 0; s < seqs; ++s) {
    std::memcpy(last.data() + static_cast<size_t>(s) * h,
                x_.data() + static_cast<size_t>(plan.last_token(s)) * h, sizeof(float) * h);
  }
  RmsNorm(last.data(), final_norm_.data(), seqs, h, c.rms_norm_eps, normed.data());
  std::vector<float> logits(static_cast<size_t>(seqs) * c.vocab_size);
  MatMul(pool_, normed.data(), seqs, h, lm_head_.data(), c.vocab_size, logits.data());

  results->assign(static_cast<size_t>(seqs), ForwardResult{});
  for (int32_t s = 0; s < seqs; ++s) {
    ForwardResult& r = (*results)[static_cast<size_t>(s)];
    const float* row = logits.data() + static_cast<size_t>(s) * c.vocab_size;
    SampleGreedy(row, c.vocab_size, options.top_k, &r);
    if (options.return_logits) r.logits.assign(row, row + c.vocab_size);
    if (options.return_hidden) {
      r.hidden.assign(normed.begin() + static_cast<ptrdiff_t>(s) * h,
                      normed.begin() + static_cast<ptrdiff_t>(s + 1) * h);
    }
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<Model>> CreateCpuModel(const ModelWeights& weights,
                                                const RuntimeOptions& options) {
  StatusOr<std::unique_ptr<HostKVCache>> cache =
      HostKVCache::Create(weights.config, options.num_pages, options.num_state_slots);
  if (!cache.ok()) return cache.status();
  int32_t threads = options.num_threads;
  if (threads == 0) {
    threads =
        static_cast<int32_t>(std::max(1u, std::min(64u, std::thread::hardware_concurrency())));
  }
  return std::unique_ptr<Model>(new CpuModel(weights, std::move(cache).value(), threads));
}

}  // namespace pdlib::kernels::internal
