// The CUDA model: the CPU model's forward pass (cpu/cpu_model.cc) with every op on the device.
// Batch validation, page-table flattening and RoPE angles come from the same host code as the
// CPU path (batch_plan.h, cpu/ops.h RopeTable), so only the kernels' arithmetic differs.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "batch_plan.h"
#include "cpu/ops.h"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_kernels.cuh"
#include "cuda/cuda_kv_cache.cuh"
#include "cuda/cuda_model.h"

namespace pdlib::kernels::internal {
namespace {

template <typename T>
Status Upload(DeviceBuffer* buffer, const std::vector<T>& host, cudaStream_t stream) {
  return buffer->Upload(host.data(), host.size() * sizeof(T), stream);
}

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const std::vector<float>* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// Same grouping as the CPU model: projections that read the same input are stacked.
struct GpuLayer {
  LayerKind kind = LayerKind::kAttention;
  int32_t pool_index = -1;
  DeviceBuffer input_norm, mix_in, mix_out, post_norm, gate_up, down;
};

class CudaModel final : public Model {
 public:
  CudaModel(const ModelConfig& config, int device)
      : config_(config), layout_(MakeShardLayout(config, ModelShard{}).value()), device_(device) {}

  Status Init(const ModelWeights& w, const RuntimeOptions& options);

  const ModelConfig& config() const override { return config_; }
  const ShardLayout& shard_layout() const override { return layout_; }
  Device device() const override { return Device::kCuda; }
  KVCache& kv_cache() override { return *cache_; }
  const KVCache& kv_cache() const override { return *cache_; }

  Status Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                 std::vector<ForwardResult>* results) override;

 private:
  Status UploadPlan(const BatchPlan& plan);
  Status RunLayers(const BatchPlan& plan);

  ModelConfig config_;
  ShardLayout layout_;  // always the whole model (model.cc refuses sharded CUDA models)
  int device_;
  CudaStream stream_;
  std::unique_ptr<DeviceKVCache> cache_;
  DeviceBuffer embed_, final_norm_, lm_head_;
  std::vector<GpuLayer> layers_;
  // The current batch's plan on the device.
  DeviceBuffer token_ids_, positions_, token_seq_, write_slots_, seq_token_begin_, seq_start_pos_,
      seq_state_slot_, page_table_begin_, page_tables_, last_rows_, rope_cos_, rope_sin_;
  // Activations.
  DeviceBuffer x_, xn_, fused_, mixed_, delta_, last_, normed_, logits_, workspace_;
  DeviceBuffer out_token_, out_logprob_, out_top_ids_, out_top_logprobs_;
  int32_t max_position_ = 0;
};

Status CudaModel::Init(const ModelWeights& w, const RuntimeOptions& options) {
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Status s = stream_.Create();
  if (!s.ok()) return s;
  StatusOr<std::unique_ptr<DeviceKVCache>> cache =
      DeviceKVCache::Create(config_, options.num_pages, options.num_state_slots, device_);
  if (!cache.ok()) return cache.status();
  cache_ = std::move(cache).value();
  cudaStream_t st = stream_.get();
  if (!(s = Upload(&embed_, w.embed_tokens, st)).ok()) return s;
  if (!(s = Upload(&final_norm_, w.final_norm, st)).ok()) return s;
  if (!(s = Upload(&lm_head_, config_.tie_word_embeddings ? w.embed_tokens : w.lm_head, st)).ok()) {
    return s;
  }
  layers_.resize(static_cast<size_t>(config_.num_layers));
  for (int32_t l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    GpuLayer& layer = layers_[static_cast<size_t>(l)];
    layer.kind = config_.layer_kind(l);
    const bool attention = layer.kind == LayerKind::kAttention;
    layer.pool_index = attention ? config_.kv_layer_index(l) : config_.state_layer_index(l);
    const std::vector<float> mix_in =
        attention ? Stack({&lw.q_proj, &lw.k_proj, &lw.v_proj})
                  : Stack({&lw.rec_in_proj, &lw.rec_decay_proj, &lw.rec_gate_proj});
    const std::vector<float> gate_up = Stack({&lw.gate_proj, &lw.up_proj});
    if (!(s = Upload(&layer.input_norm, lw.input_layernorm, st)).ok()) return s;
    if (!(s = Upload(&layer.mix_in, mix_in, st)).ok()) return s;
    if (!(s = Upload(&layer.mix_out, attention ? lw.o_proj : lw.rec_out_proj, st)).ok()) return s;
    if (!(s = Upload(&layer.post_norm, lw.post_attention_layernorm, st)).ok()) return s;
    if (!(s = Upload(&layer.gate_up, gate_up, st)).ok()) return s;
    if (!(s = Upload(&layer.down, lw.down_proj, st)).ok()) return s;
  }
  PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  return Status::OK();
}

Status CudaModel::UploadPlan(const BatchPlan& plan) {
  cudaStream_t st = stream_.get();
  std::vector<int32_t> last_rows(static_cast<size_t>(plan.num_seqs));
  for (int32_t s = 0; s < plan.num_seqs; ++s)
    last_rows[static_cast<size_t>(s)] = plan.last_token(s);
  std::vector<float> cos, sin;
  RopeTable(plan.positions, config_.head_dim, config_.rope_theta, &cos, &sin);
  max_position_ = 0;
  for (int32_t p : plan.positions) max_position_ = std::max(max_position_, p);
  Status s;
  if (!(s = Upload(&token_ids_, plan.token_ids, st)).ok()) return s;
  if (!(s = Upload(&positions_, plan.positions, st)).ok()) return s;
  if (!(s = Upload(&token_seq_, plan.token_seq, st)).ok()) return s;
  if (!(s = Upload(&write_slots_, plan.write_slots, st)).ok()) return s;
  if (!(s = Upload(&seq_token_begin_, plan.seq_token_begin, st)).ok()) return s;
  if (!(s = Upload(&seq_start_pos_, plan.seq_start_pos, st)).ok()) return s;
  if (!(s = Upload(&seq_state_slot_, plan.seq_state_slot, st)).ok()) return s;
  if (!(s = Upload(&page_table_begin_, plan.page_table_begin, st)).ok()) return s;
  if (!(s = Upload(&page_tables_, plan.page_tables, st)).ok()) return s;
  if (!(s = Upload(&last_rows_, last_rows, st)).ok()) return s;
  if (!(s = Upload(&rope_cos_, cos, st)).ok()) return s;
  return Upload(&rope_sin_, sin, st);
}

Status CudaModel::RunLayers(const BatchPlan& plan) {
  const ModelConfig& c = config_;
  cudaStream_t st = stream_.get();
  const int32_t n = plan.num_tokens, h = c.hidden_size, inter = c.intermediate_size;
  const int32_t qw = c.q_width(), kw = c.kv_width(), sd = c.state_dim();
  const int32_t fused_w = std::max({qw + 2 * kw, 3 * sd, 2 * inter});
  const size_t f = sizeof(float);
  Status s;
  for (DeviceBuffer* b : {&x_, &xn_, &delta_}) {
    if (!(s = b->Grow(static_cast<size_t>(n) * h * f)).ok()) return s;
  }
  if (!(s = fused_.Grow(static_cast<size_t>(n) * fused_w * f)).ok()) return s;
  if (!(s = mixed_.Grow(static_cast<size_t>(n) * std::max({qw, sd, inter}) * f)).ok()) return s;

  const KVPoolShape shape{c.page_size, c.num_kv_heads, c.head_dim, c.kv_layout == KVLayout::kHND,
                          c.kv_dtype == KVDtype::kBFloat16};
  PagedAttentionArgs attn{};
  attn.q = fused_.as<float>();
  attn.q_stride = qw + 2 * kw;
  attn.out = mixed_.as<float>();
  attn.out_stride = qw;
  attn.positions = positions_.as<int32_t>();
  attn.token_seq = token_seq_.as<int32_t>();
  attn.page_table_begin = page_table_begin_.as<int32_t>();
  attn.page_tables = page_tables_.as<int32_t>();
  attn.num_tokens = n;
  attn.num_heads = c.num_heads;
  attn.max_position = max_position_;
  attn.shape = shape;
  if (!(s = workspace_.Grow(PagedAttentionWorkspaceBytes(attn))).ok()) return s;

  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* fused = fused_.as<float>();
  float* mixed = mixed_.as<float>();
  float* delta = delta_.as<float>();
  LaunchEmbedding(embed_.as<float>(), token_ids_.as<int32_t>(), n, h, x, st);
  for (const GpuLayer& layer : layers_) {
    LaunchRmsNorm(x, layer.input_norm.as<float>(), n, h, c.rms_norm_eps, xn, st);
    if (layer.kind == LayerKind::kAttention) {
      const int32_t stride = qw + 2 * kw;
      LaunchMatMul(xn, n, h, layer.mix_in.as<float>(), stride, fused, st);
      LaunchRope(fused, n, stride, 0, c.num_heads, c.head_dim, rope_cos_.as<float>(),
                 rope_sin_.as<float>(), st);
      LaunchRope(fused, n, stride, qw, c.num_kv_heads, c.head_dim, rope_cos_.as<float>(),
                 rope_sin_.as<float>(), st);
      void* k_pool = cache_->pool(KVKind::kKey, layer.pool_index).base;
      void* v_pool = cache_->pool(KVKind::kValue, layer.pool_index).base;
      LaunchWriteKV(fused, n, stride, qw, qw + kw, write_slots_.as<int64_t>(), shape, k_pool,
                    v_pool, st);
      attn.k_pool = k_pool;
      attn.v_pool = v_pool;
      LaunchPagedAttention(attn, workspace_.get(), st);
      LaunchMatMul(mixed, n, qw, layer.mix_out.as<float>(), h, delta, st);
    } else {
      LaunchMatMul(xn, n, h, layer.mix_in.as<float>(), 3 * sd, fused, st);
      float* states = static_cast<float*>(cache_->state_pool(layer.pool_index).base);
      LaunchRecurrentScan(fused, sd, seq_token_begin_.as<int32_t>(), seq_start_pos_.as<int32_t>(),
                          seq_state_slot_.as<int32_t>(), plan.num_seqs, states, mixed, st);
      LaunchMatMul(mixed, n, sd, layer.mix_out.as<float>(), h, delta, st);
    }
    LaunchAdd(x, delta, static_cast<int64_t>(n) * h, st);
    LaunchRmsNorm(x, layer.post_norm.as<float>(), n, h, c.rms_norm_eps, xn, st);
    LaunchMatMul(xn, n, h, layer.gate_up.as<float>(), 2 * inter, fused, st);
    LaunchSwiGLU(fused, n, inter, mixed, st);
    LaunchMatMul(mixed, n, inter, layer.down.as<float>(), h, delta, st);
    LaunchAdd(x, delta, static_cast<int64_t>(n) * h, st);
  }
  PDLIB_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status CudaModel::Forward(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                          std::vector<ForwardResult>* results) {
  StatusOr<BatchPlan> planned =
      PlanBatch(config_, cache_->num_pages(), cache_->num_state_slots(), batch, options);
  if (!planned.ok()) return planned.status();
  const BatchPlan& plan = *planned;
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Status s = UploadPlan(plan);
  if (!s.ok()) return s;
  if (!(s = RunLayers(plan)).ok()) return s;

  const ModelConfig& c = config_;
  cudaStream_t st = stream_.get();
  const int32_t seqs = plan.num_seqs, h = c.hidden_size, vocab = c.vocab_size;
  const int32_t k = options.top_k;
  const size_t f = sizeof(float);
  for (DeviceBuffer* b : {&last_, &normed_}) {
    if (!(s = b->Grow(static_cast<size_t>(seqs) * h * f)).ok()) return s;
  }
  if (!(s = logits_.Grow(static_cast<size_t>(seqs) * vocab * f)).ok()) return s;
  if (!(s = out_token_.Grow(static_cast<size_t>(seqs) * 4)).ok()) return s;
  if (!(s = out_logprob_.Grow(static_cast<size_t>(seqs) * 4)).ok()) return s;
  if (!(s = out_top_ids_.Grow(static_cast<size_t>(seqs) * k * 4)).ok()) return s;
  if (!(s = out_top_logprobs_.Grow(static_cast<size_t>(seqs) * k * 4)).ok()) return s;
  LaunchGatherRows(x_.as<float>(), last_rows_.as<int32_t>(), seqs, h, last_.as<float>(), st);
  LaunchRmsNorm(last_.as<float>(), final_norm_.as<float>(), seqs, h, c.rms_norm_eps,
                normed_.as<float>(), st);
  LaunchMatMul(normed_.as<float>(), seqs, h, lm_head_.as<float>(), vocab, logits_.as<float>(), st);
  LaunchSampleGreedy(logits_.as<float>(), seqs, vocab, k, out_token_.as<int32_t>(),
                     out_logprob_.as<float>(), out_top_ids_.as<int32_t>(),
                     out_top_logprobs_.as<float>(), st);
  PDLIB_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  std::vector<int32_t> tokens(static_cast<size_t>(seqs)), top_ids(static_cast<size_t>(seqs) * k);
  std::vector<float> logprobs(static_cast<size_t>(seqs)), top_lp(static_cast<size_t>(seqs) * k);
  std::vector<float> logits, hidden;
  auto d2h = [&](void* dst, const DeviceBuffer& src, size_t bytes) {
    return bytes == 0 ? cudaSuccess
                      : cudaMemcpyAsync(dst, src.get(), bytes, cudaMemcpyDeviceToHost, st);
  };
  PDLIB_CUDA_RETURN_IF_ERROR(d2h(tokens.data(), out_token_, tokens.size() * 4));
  PDLIB_CUDA_RETURN_IF_ERROR(d2h(logprobs.data(), out_logprob_, logprobs.size() * 4));
  PDLIB_CUDA_RETURN_IF_ERROR(d2h(top_ids.data(), out_top_ids_, top_ids.size() * 4));
  PDLIB_CUDA_RETURN_IF_ERROR(d2h(top_lp.data(), out_top_logprobs_, top_lp.size() * 4));
  if (options.return_logits) {
    logits.resize(static_cast<size_t>(seqs) * vocab);
    PDLIB_CUDA_RETURN_IF_ERROR(d2h(logits.data(), logits_, logits.size() * f));
  }
  if (options.return_hidden) {
    hidden.resize(static_cast<size_t>(seqs) * h);
    PDLIB_CUDA_RETURN_IF_ERROR(d2h(hidden.data(), normed_, hidden.size() * f));
  }
  PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));

  results->assign(static_cast<size_t>(seqs), ForwardResult{});
  for (int32_t i = 0; i < seqs; ++i) {
    ForwardResult& r = (*results)[static_cast<size_t>(i)];
    const size_t si = static_cast<size_t>(i);
    r.token = tokens[si];
    r.logprob = logprobs[si];
    r.top_ids.assign(top_ids.begin() + si * k, top_ids.begin() + (si + 1) * k);
    r.top_logprobs.assign(top_lp.begin() + si * k, top_lp.begin() + (si + 1) * k);
    if (options.return_logits) {
      r.logits.assign(logits.begin() + si * vocab, logits.begin() + (si + 1) * vocab);
    }
    if (options.return_hidden) {
      r.hidden.assign(hidden.begin() + si * h, hidden.begin() + (si + 1) * h);
    }
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<Model>> CreateCudaModel(const ModelWeights& weights,
                                                 const RuntimeOptions& options) {
  const ModelConfig& c = weights.config;
  if (c.head_dim > kMaxAttentionHeadDim || c.num_heads / c.num_kv_heads > kMaxAttentionGroup) {
    return Status::Unimplemented(
        "CUDA model: attention supports head_dim <= " + std::to_string(kMaxAttentionHeadDim) +
        " and at most " + std::to_string(kMaxAttentionGroup) + " query heads per KV head; got " +
        std::to_string(c.head_dim) + " and " + std::to_string(c.num_heads / c.num_kv_heads));
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return Status::Unavailable(std::string("CUDA model: no usable CUDA device (") +
                               (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")");
  }
  if (options.cuda_device < 0 || options.cuda_device >= count) {
    return Status::InvalidArgument("CUDA model: cuda_device " +
                                   std::to_string(options.cuda_device) + " out of range [0, " +
                                   std::to_string(count) + ")");
  }
  auto model = std::make_unique<CudaModel>(c, options.cuda_device);
  Status s = model->Init(weights, options);
  if (!s.ok()) return s;
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace pdlib::kernels::internal
