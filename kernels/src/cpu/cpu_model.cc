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
#include "shard_util.h"

namespace pdlib::kernels::internal {
namespace {

// Copies columns [begin, begin + width) of every row of a [rows][stride] matrix.
void SliceColumns(const std::vector<float>& in, int64_t rows, int32_t stride, int32_t begin,
                  int32_t width, std::vector<float>* out) {
  out->resize(static_cast<size_t>(rows) * static_cast<size_t>(width));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out->data() + r * width, in.data() + r * stride + begin, sizeof(float) * width);
  }
}

// One rank's share of the model (parallel.h). With one rank it is the whole model and every
// computation is exactly the unsharded one: the gathers are skipped and the weight slices are
// the whole matrices.
class CpuModel final : public Model {
 public:
  CpuModel(const ModelWeights& w, const ShardLayout& layout, ModelComm* comm,
           std::unique_ptr<HostKVCache> cache, int32_t threads)
      : config_(w.config), layout_(layout), comm_(comm), cache_(std::move(cache)), pool_(threads) {
    const ModelConfig& c = config_;
    const ShardLayout& s = layout_;
    if (s.first_stage()) embed_ = w.embed_tokens;
    if (s.last_stage()) {
      final_norm_ = w.final_norm;
      lm_head_ = c.tie_word_embeddings ? w.embed_tokens : w.lm_head;
    }
    for (int32_t l = s.first_layer; l < s.end_layer; ++l) layers_.push_back(SliceLayer(w, s, l));
  }

  const ModelConfig& config() const override { return config_; }
  const ShardLayout& shard_layout() const override { return layout_; }
  Device device() const override { return Device::kCpu; }
  KVCache& kv_cache() override { return *cache_; }
  const KVCache& kv_cache() const override { return *cache_; }

  Status Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                 std::vector<ForwardResult>* results) override;

 private:
  Status AttentionMixer(const RankLayer& layer, const BatchPlan& plan);
  Status MlaMixer(const RankLayer& layer, const BatchPlan& plan);
  void RecurrentMixer(const RankLayer& layer, const BatchPlan& plan);
  Status Mlp(const RankLayer& layer, int64_t tokens);
  // `local` is [rows][width] of this rank's columns; returns every TP rank's columns in rank
  // order ([rows][tp * width]), gathered into `full`, or `local` itself with one TP rank.
  StatusOr<const std::vector<float>*> GatherColumns(const std::vector<float>& local, int64_t rows,
                                                    int32_t width, std::vector<float>* full);
  // y = x W^T for this rank's output rows of the projection, gathered, added to the residual.
  Status OutputProjection(const std::vector<float>& in, int64_t rows, int32_t in_width,
                          const std::vector<float>& w_rows);
  Status Head(const BatchPlan& plan, const ForwardOptions& options,
              std::vector<ForwardResult>* results);
  bool tp() const { return layout_.shard.tp_size > 1; }

  ModelConfig config_;
  ShardLayout layout_;
  ModelComm* comm_;  // null for one rank
  std::unique_ptr<HostKVCache> cache_;
  ThreadPool pool_;
  std::vector<float> embed_, final_norm_, lm_head_;  // first stage; last stage
  std::vector<RankLayer> layers_;                    // the stage's layers
  // Activations, reused between calls: x is the residual stream [tokens][hidden].
  std::vector<float> x_, xn_, fused_, a_, b_, c_, mixed_, delta_, rope_cos_, rope_sin_;
  std::vector<float> gathered_, full_, local_out_;  // TP gathers
  std::vector<float> index_q_, index_k_;            // lightning indexer: [tokens][index_dim] each
  KeySelection selection_;                          // the indexer's choice per token
};

StatusOr<const std::vector<float>*> CpuModel::GatherColumns(const std::vector<float>& local,
                                                            int64_t rows, int32_t width,
                                                            std::vector<float>* full) {
  const int32_t parts = layout_.shard.tp_size;
  if (parts == 1) return &local;
  gathered_.resize(local.size() * static_cast<size_t>(parts));
  if (Status s = comm_->AllGather(local, gathered_); !s.ok()) {
    return s.WithPrefix("model rank " + layout_.shard.ToString() + ": TP all-gather");
  }
  Interleave(gathered_, parts, rows, width, full);
  return full;
}

Status CpuModel::OutputProjection(const std::vector<float>& in, int64_t rows, int32_t in_width,
                                  const std::vector<float>& w_rows) {
  const int32_t h = config_.hidden_size, oc = layout_.out_count;
  // One rank computes every output row straight into delta_; under TP each rank its rows.
  std::vector<float>& out = tp() ? local_out_ : delta_;
  out.resize(static_cast<size_t>(rows * oc));
  MatMul(pool_, in.data(), rows, in_width, w_rows.data(), oc, out.data());
  if (tp()) {
    StatusOr<const std::vector<float>*> whole = GatherColumns(local_out_, rows, oc, &delta_);
    if (!whole.ok()) return whole.status();
  }
  AddInPlace(x_.data(), delta_.data(), rows * h);
  return Status::OK();
}

Status CpuModel::AttentionMixer(const RankLayer& layer, const BatchPlan& plan) {
  const ModelConfig& c = cache_->config();  // this rank's heads
  const int64_t n = plan.num_tokens;
  const int32_t qw = c.q_width(), kw = c.kv_width(), fused_w = qw + 2 * kw;
  fused_.resize(static_cast<size_t>(n * fused_w));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.mix_in.data(), fused_w, fused_.data());
  SliceColumns(fused_, n, fused_w, 0, qw, &a_);        // q
  SliceColumns(fused_, n, fused_w, qw, kw, &b_);       // k
  SliceColumns(fused_, n, fused_w, qw + kw, kw, &c_);  // v
  ApplyRope(a_.data(), n, c.num_heads, c.head_dim, rope_cos_.data(), rope_sin_.data());
  ApplyRope(b_.data(), n, c.num_kv_heads, c.head_dim, rope_cos_.data(), rope_sin_.data());
  const bool swa = layer.kind == LayerKind::kSlidingWindow;
  void* k_pool = (swa ? cache_->swa_pool(KVKind::kKey, layer.pool_index)
                      : cache_->pool(KVKind::kKey, layer.pool_index))
                     .base;
  void* v_pool = (swa ? cache_->swa_pool(KVKind::kValue, layer.pool_index)
                      : cache_->pool(KVKind::kValue, layer.pool_index))
                     .base;
  WriteKV(c, b_.data(), c_.data(), plan.write_slots, k_pool, v_pool);
  AttentionBatch batch{plan.positions, plan.token_seq, plan.page_table_begin, plan.page_tables};
  const KeySelection* selection = nullptr;
  if (!layer.index_proj.empty()) {
    // Lightning indexer: index query and key from the same normalised input (whole, on every
    // rank), the keys into the layer's index pool first, then each token's choice of positions.
    const int32_t id = c.index_dim;
    fused_.resize(static_cast<size_t>(n * 2 * id));
    MatMul(pool_, xn_.data(), n, c.hidden_size, layer.index_proj.data(), 2 * id, fused_.data());
    SliceColumns(fused_, n, 2 * id, 0, id, &index_q_);
    SliceColumns(fused_, n, 2 * id, id, id, &index_k_);
    void* index_pool = cache_->index_pool(layer.pool_index).base;
    WriteIndexKeys(c, index_k_.data(), plan.write_slots, index_pool);
    IndexerSelect(pool_, c, index_q_.data(), batch, index_pool, c.index_topk, &selection_);
    selection = &selection_;
  }
  mixed_.resize(static_cast<size_t>(n * qw));
  // Sliding-window layers attend to the last sliding_window positions only, so they never read
  // a page wholly before the window (pdlib moves only the window's pages as SWA state).
  PagedAttention(pool_, c, a_.data(), batch, k_pool, v_pool, mixed_.data(),
                 swa ? config_.sliding_window : 0, selection);
  StatusOr<const std::vector<float>*> whole = GatherColumns(mixed_, n, qw, &full_);
  if (!whole.ok()) return whole.status();
  return OutputProjection(**whole, n, config_.q_width(), layer.mix_out);
}

// MLA (ops.h, MlaPagedAttention): the rank's query heads and the whole latent row in one matmul;
// the latent row (normalised c, rotated k_rope) goes into the layer's one pool, the same bytes on
// every TP rank; attention for the rank's heads in the absorbed form; then the gather and the
// o_proj row split of the GQA path.
Status CpuModel::MlaMixer(const RankLayer& layer, const BatchPlan& plan) {
  const ModelConfig& c = cache_->config();  // this rank's heads
  const int64_t n = plan.num_tokens;
  const int32_t heads = c.num_heads, hd = c.head_dim, rd = c.qk_rope_dim;
  const int32_t q_stride = hd + rd, qw = heads * q_stride, kw = c.kv_width(), fused_w = qw + kw;
  fused_.resize(static_cast<size_t>(n * fused_w));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.mix_in.data(), fused_w, fused_.data());
  SliceColumns(fused_, n, fused_w, 0, qw, &a_);   // q, per head [nope, rope]
  SliceColumns(fused_, n, fused_w, qw, kw, &b_);  // kv_a: [latent, k_rope], raw
  ApplyRopeStrided(a_.data(), n, qw, heads, q_stride, hd, rd, rope_cos_.data(), rope_sin_.data());
  MlaLatentRows(c, b_.data(), n, layer.kv_a_norm.data(), rope_cos_.data(), rope_sin_.data(),
                b_.data());
  void* latent_pool = cache_->pool(KVKind::kKey, layer.pool_index).base;
  WriteLatent(c, b_.data(), plan.write_slots, latent_pool);
  AttentionBatch batch{plan.positions, plan.token_seq, plan.page_table_begin, plan.page_tables};
  mixed_.resize(static_cast<size_t>(n * c.q_width()));
  MlaPagedAttention(pool_, c, heads, a_.data(), layer.kv_b.data(), batch, latent_pool,
                    mixed_.data());
  StatusOr<const std::vector<float>*> whole = GatherColumns(mixed_, n, c.q_width(), &full_);
  if (!whole.ok()) return whole.status();
  return OutputProjection(**whole, n, config_.q_width(), layer.mix_out);
}

void CpuModel::RecurrentMixer(const RankLayer& layer, const BatchPlan& plan) {
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

Status CpuModel::Mlp(const RankLayer& layer, int64_t n) {
  const ModelConfig& c = config_;
  const int32_t inter = layout_.inter_count;
  fused_.resize(static_cast<size_t>(n * 2 * inter));
  MatMul(pool_, xn_.data(), n, c.hidden_size, layer.gate_up.data(), 2 * inter, fused_.data());
  mixed_.resize(static_cast<size_t>(n * inter));
  for (int64_t t = 0; t < n; ++t) {
    const float* row = fused_.data() + t * 2 * inter;
    SwiGLU(row, row + inter, inter, mixed_.data() + t * inter);
  }
  StatusOr<const std::vector<float>*> whole = GatherColumns(mixed_, n, inter, &full_);
  if (!whole.ok()) return whole.status();
  return OutputProjection(**whole, n, c.intermediate_size, layer.down);
}

Status CpuModel::Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                         std::vector<ForwardResult>* results) {
  // Every rank plans the same batch against the same page and slot counts, so all ranks accept
  // or refuse it together and none is left waiting in a collective.
  StatusOr<BatchPlan> planned =
      PlanBatch(config_, cache_->num_pages(), cache_->num_state_slots(), batch, options);
  if (!planned.ok()) return planned.status();
  const BatchPlan& plan = *planned;
  const ModelConfig& c = config_;
  const int64_t n = plan.num_tokens;
  const int32_t h = c.hidden_size;

  x_.resize(static_cast<size_t>(n * h));
  xn_.resize(static_cast<size_t>(n * h));
  if (layout_.first_stage()) {
    Embedding(embed_.data(), h, plan.token_ids, x_.data());
  } else if (Status s = comm_->ReceiveFromPreviousStage(x_); !s.ok()) {
    return s.WithPrefix("model rank " + layout_.shard.ToString() + ": activations from stage " +
                        std::to_string(layout_.shard.pp_rank - 1));
  }
  // MLA rotates only the qk_rope_dim part of its keys and queries.
  RopeTable(plan.positions, c.is_mla() ? c.qk_rope_dim : c.head_dim, c.rope_theta, &rope_cos_,
            &rope_sin_);
  for (const RankLayer& layer : layers_) {
    RmsNorm(x_.data(), layer.input_norm.data(), n, h, c.rms_norm_eps, xn_.data());
    if (layer.kind == LayerKind::kRecurrent) {
      RecurrentMixer(layer, plan);
    } else if (Status s = c.is_mla() ? MlaMixer(layer, plan) : AttentionMixer(layer, plan);
               !s.ok()) {
      return s;
    }
    RmsNorm(x_.data(), layer.post_norm.data(), n, h, c.rms_norm_eps, xn_.data());
    if (Status s = Mlp(layer, n); !s.ok()) return s;
    if (options.on_kv_layers_done && layer.kind == LayerKind::kAttention) {
      options.on_kv_layers_done(layer.pool_index + 1);
    }
  }
  if (!layout_.last_stage()) {
    if (Status s = comm_->SendToNextStage(x_); !s.ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": activations to stage " +
                          std::to_string(layout_.shard.pp_rank + 1));
    }
  }
  return Head(plan, options, results);
}

Status CpuModel::Head(const BatchPlan& plan, const ForwardOptions& options,
                      std::vector<ForwardResult>* results) {
  const ModelConfig& c = config_;
  const int32_t h = c.hidden_size;
  std::vector<std::byte> bytes;
  if (!layout_.last_stage()) {
    if (Status s = comm_->BroadcastFromLastStage(&bytes); !s.ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": results");
    }
    return DeserializeResults(bytes, results);
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
  if (layout_.shard.pp_size > 1) {
    SerializeResults(*results, &bytes);
    if (Status s = comm_->BroadcastFromLastStage(&bytes); !s.ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": results");
    }
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<Model>> CreateCpuModel(const ModelWeights& weights,
                                                const RuntimeOptions& options) {
  StatusOr<ShardLayout> layout = MakeShardLayout(weights.config, options.shard);
  if (!layout.ok()) return layout.status();
  StatusOr<std::unique_ptr<HostKVCache>> cache = HostKVCache::Create(
      ShardCacheConfig(weights.config, *layout), options.num_pages, options.num_state_slots);
  if (!cache.ok()) return cache.status();
  int32_t threads = options.num_threads;
  if (threads == 0) {
    threads =
        static_cast<int32_t>(std::max(1u, std::min(64u, std::thread::hardware_concurrency())));
  }
  return std::unique_ptr<Model>(
      new CpuModel(weights, *layout, options.comm, std::move(cache).value(), threads));
}

}  // namespace pdlib::kernels::internal
