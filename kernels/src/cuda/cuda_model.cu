// The CUDA model: the CPU model's forward pass (cpu/cpu_model.cc) with every op on the device.
// Batch validation, page-table flattening and RoPE angles come from the same host code as the
// CPU path (batch_plan.h, cpu/ops.h RopeTable), so only the kernels' arithmetic differs.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "batch_plan.h"
#include "cpu/ops.h"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_kernels.cuh"
#include "cuda/cuda_kv_cache.cuh"
#include "cuda/cuda_model.h"
#include "shard_util.h"

namespace pdlib::kernels::internal {
namespace {

template <typename T>
Status Upload(DeviceBuffer* buffer, const std::vector<T>& host, cudaStream_t stream) {
  return buffer->Upload(host.data(), host.size() * sizeof(T), stream);
}

// Same grouping and sharding as the CPU model (shard_util.h), on the device.
struct GpuLayer {
  LayerKind kind = LayerKind::kAttention;
  int32_t pool_index = -1;
  DeviceBuffer input_norm, mix_in, mix_out, post_norm, gate_up, down;
};

class CudaModel final : public Model {
 public:
  // One rank of a sharded model (parallel.h) like the CPU model: the rank's heads, MLP units and
  // output rows, gathered through `comm` (host memory: each gather copies the slice down and the
  // whole back up), PP stages handing the residual stream on through the host.
  CudaModel(const ModelConfig& config, const ShardLayout& layout, ModelComm* comm, int device)
      : config_(config), layout_(layout), comm_(comm), device_(device) {}

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
  // `on_kv_layers_done` (ForwardOptions) is enqueued as a host callback after each attention
  // layer's KV write.
  Status RunLayers(const BatchPlan& plan, const std::function<void(int32_t)>* on_kv_layers_done);
  // `local` holds [rows][width] of this rank's columns; `full` gets every TP rank's columns in
  // rank order. Synchronises the stream.
  Status GatherColumns(const DeviceBuffer& local, int32_t rows, int32_t width, DeviceBuffer* full);
  Status Head(const BatchPlan& plan, const ForwardOptions& options,
              std::vector<ForwardResult>* results);
  bool tp() const { return layout_.shard.tp_size > 1; }

  ModelConfig config_;
  ShardLayout layout_;
  ModelComm* comm_;  // null for one rank
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
  DeviceBuffer full_, local_out_;  // TP: gathered inputs, this rank's output rows
  std::vector<float> host_local_, host_all_, host_full_;  // TP gathers and PP hand-offs
  DeviceBuffer out_token_, out_logprob_, out_top_ids_, out_top_logprobs_;
  int32_t max_position_ = 0;
  // Layer-wise streaming: what each host callback of the running Forward reports.
  struct LayerCallback {
    const std::function<void(int32_t)>* hook = nullptr;
    int32_t kv_layers_done = 0;
  };
  std::vector<LayerCallback> layer_callbacks_;
};

Status CudaModel::Init(const ModelWeights& w, const RuntimeOptions& options) {
  PDLIB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Status s = stream_.Create();
  if (!s.ok()) return s;
  StatusOr<std::unique_ptr<DeviceKVCache>> cache = DeviceKVCache::Create(
      ShardCacheConfig(config_, layout_), options.num_pages, options.num_state_slots, device_);
  if (!cache.ok()) return cache.status();
  cache_ = std::move(cache).value();
  cudaStream_t st = stream_.get();
  if (layout_.first_stage() && !(s = Upload(&embed_, w.embed_tokens, st)).ok()) return s;
  if (layout_.last_stage()) {
    if (!(s = Upload(&final_norm_, w.final_norm, st)).ok()) return s;
    if (!(s = Upload(&lm_head_, config_.tie_word_embeddings ? w.embed_tokens : w.lm_head, st))
             .ok()) {
      return s;
    }
  }
  for (int32_t l = layout_.first_layer; l < layout_.end_layer; ++l) {
    const RankLayer rank = SliceLayer(w, layout_, l);
    GpuLayer& layer = layers_.emplace_back();
    layer.kind = rank.kind;
    layer.pool_index = rank.pool_index;
    if (!(s = Upload(&layer.input_norm, rank.input_norm, st)).ok()) return s;
    if (!(s = Upload(&layer.mix_in, rank.mix_in, st)).ok()) return s;
    if (!(s = Upload(&layer.mix_out, rank.mix_out, st)).ok()) return s;
    if (!(s = Upload(&layer.post_norm, rank.post_norm, st)).ok()) return s;
    if (!(s = Upload(&layer.gate_up, rank.gate_up, st)).ok()) return s;
    if (!(s = Upload(&layer.down, rank.down, st)).ok()) return s;
    // The host copies go before the next layer's are made: Upload is asynchronous.
    PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
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

Status CudaModel::GatherColumns(const DeviceBuffer& local, int32_t rows, int32_t width,
                                DeviceBuffer* full) {
  cudaStream_t st = stream_.get();
  const int32_t parts = layout_.shard.tp_size;
  const size_t count = static_cast<size_t>(rows) * static_cast<size_t>(width);
  host_local_.resize(count);
  host_all_.resize(count * static_cast<size_t>(parts));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_local_.data(), local.get(), count * sizeof(float),
                                             cudaMemcpyDeviceToHost, st));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  if (Status s = comm_->AllGather(host_local_, host_all_); !s.ok()) {
    return s.WithPrefix("model rank " + layout_.shard.ToString() + ": TP all-gather");
  }
  Interleave(host_all_, parts, rows, width, &host_full_);
  if (Status s = full->Grow(host_full_.size() * sizeof(float)); !s.ok()) return s;
  PDLIB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(full->get(), host_full_.data(),
                                             host_full_.size() * sizeof(float),
                                             cudaMemcpyHostToDevice, st));
  PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  return Status::OK();
}

Status CudaModel::RunLayers(const BatchPlan& plan,
                            const std::function<void(int32_t)>* on_kv_layers_done) {
  const ModelConfig& c = config_;
  const ModelConfig& local = cache_->config();  // this rank's heads
  cudaStream_t st = stream_.get();
  const int32_t n = plan.num_tokens, h = c.hidden_size, sd = c.state_dim();
  const int32_t qw = local.q_width(), kw = local.kv_width();  // the rank's heads
  const int32_t inter = layout_.inter_count, oc = layout_.out_count;
  const int32_t fused_w = std::max({qw + 2 * kw, 3 * sd, 2 * inter});
  const size_t f = sizeof(float);
  Status s;
  for (DeviceBuffer* b : {&x_, &xn_, &delta_}) {
    if (!(s = b->Grow(static_cast<size_t>(n) * h * f)).ok()) return s;
  }
  if (!(s = fused_.Grow(static_cast<size_t>(n) * fused_w * f)).ok()) return s;
  if (!(s = mixed_.Grow(static_cast<size_t>(n) * std::max({qw, sd, inter}) * f)).ok()) return s;
  if (!(s = local_out_.Grow(static_cast<size_t>(n) * oc * f)).ok()) return s;

  const KVPoolShape shape{local.page_size, local.num_kv_heads, local.head_dim,
                          local.kv_layout == KVLayout::kHND, local.kv_dtype == KVDtype::kBFloat16};
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
  attn.num_heads = local.num_heads;
  attn.max_position = max_position_;
  attn.shape = shape;
  if (!(s = workspace_.Grow(PagedAttentionWorkspaceBytes(attn))).ok()) return s;

  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* fused = fused_.as<float>();
  float* mixed = mixed_.as<float>();
  float* delta = delta_.as<float>();
  // The rank's output rows of a projection of `in` ([n][in_width], whole), gathered into delta.
  auto project = [&](const DeviceBuffer& in, int32_t in_width, const DeviceBuffer& w) -> Status {
    if (!tp()) {
      LaunchMatMul(in.as<float>(), n, in_width, w.as<float>(), h, delta, st);
      return Status::OK();
    }
    LaunchMatMul(in.as<float>(), n, in_width, w.as<float>(), oc, local_out_.as<float>(), st);
    if (Status g = GatherColumns(local_out_, n, oc, &delta_); !g.ok()) return g;
    delta = delta_.as<float>();  // Grow may not move it (already n x h), but stay exact
    return Status::OK();
  };
  // The whole input row of an output projection: this rank's columns, gathered under TP.
  auto whole = [&](int32_t width) -> StatusOr<const DeviceBuffer*> {
    if (!tp()) return &mixed_;
    if (Status g = GatherColumns(mixed_, n, width, &full_); !g.ok()) return g;
    return &full_;
  };
  if (layout_.first_stage()) {
    LaunchEmbedding(embed_.as<float>(), token_ids_.as<int32_t>(), n, h, x, st);
  } else {
    host_full_.resize(static_cast<size_t>(n) * h);
    if (!(s = comm_->ReceiveFromPreviousStage(host_full_)).ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": activations from stage " +
                          std::to_string(layout_.shard.pp_rank - 1));
    }
    PDLIB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(x, host_full_.data(), host_full_.size() * f, cudaMemcpyHostToDevice, st));
    PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  }
  for (const GpuLayer& layer : layers_) {
    LaunchRmsNorm(x, layer.input_norm.as<float>(), n, h, c.rms_norm_eps, xn, st);
    if (layer.kind == LayerKind::kAttention) {
      const int32_t stride = qw + 2 * kw;
      LaunchMatMul(xn, n, h, layer.mix_in.as<float>(), stride, fused, st);
      LaunchRope(fused, n, stride, 0, local.num_heads, c.head_dim, rope_cos_.as<float>(),
                 rope_sin_.as<float>(), st);
      LaunchRope(fused, n, stride, qw, local.num_kv_heads, c.head_dim, rope_cos_.as<float>(),
                 rope_sin_.as<float>(), st);
      void* k_pool = cache_->pool(KVKind::kKey, layer.pool_index).base;
      void* v_pool = cache_->pool(KVKind::kValue, layer.pool_index).base;
      LaunchWriteKV(fused, n, stride, qw, qw + kw, write_slots_.as<int64_t>(), shape, k_pool,
                    v_pool, st);
      attn.k_pool = k_pool;
      attn.v_pool = v_pool;
      if (on_kv_layers_done != nullptr) {
        // The KV of this layer is in the pools once the stream gets here: tell the caller from
        // CUDA's host-callback thread (the entries outlive the Forward that synchronises).
        LayerCallback& cb = layer_callbacks_[static_cast<size_t>(layer.pool_index)];
        cb = {on_kv_layers_done, layer.pool_index + 1};
        PDLIB_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
            st,
            [](void* arg) {
              auto* c = static_cast<LayerCallback*>(arg);
              (*c->hook)(c->kv_layers_done);
            },
            &cb));
      }
      LaunchPagedAttention(attn, workspace_.get(), st);
      StatusOr<const DeviceBuffer*> in = whole(qw);
      if (!in.ok()) return in.status();
      if (!(s = project(**in, c.q_width(), layer.mix_out)).ok()) return s;
    } else {
      LaunchMatMul(xn, n, h, layer.mix_in.as<float>(), 3 * sd, fused, st);
      float* states = static_cast<float*>(cache_->state_pool(layer.pool_index).base);
      LaunchRecurrentScan(fused, sd, seq_token_begin_.as<int32_t>(), seq_start_pos_.as<int32_t>(),
                          seq_state_slot_.as<int32_t>(), plan.num_seqs, states, mixed, st);
      LaunchMatMul(mixed, n, sd, layer.mix_out.as<float>(), h, delta, st);  // replicated
    }
    LaunchAdd(x, delta, static_cast<int64_t>(n) * h, st);
    LaunchRmsNorm(x, layer.post_norm.as<float>(), n, h, c.rms_norm_eps, xn, st);
    LaunchMatMul(xn, n, h, layer.gate_up.as<float>(), 2 * inter, fused, st);
    LaunchSwiGLU(fused, n, inter, mixed, st);
    StatusOr<const DeviceBuffer*> in = whole(inter);
    if (!in.ok()) return in.status();
    if (!(s = project(**in, c.intermediate_size, layer.down)).ok()) return s;
    LaunchAdd(x, delta, static_cast<int64_t>(n) * h, st);
  }
  PDLIB_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (!layout_.last_stage()) {
    host_full_.resize(static_cast<size_t>(n) * h);
    PDLIB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host_full_.data(), x, host_full_.size() * f, cudaMemcpyDeviceToHost, st));
    PDLIB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    if (!(s = comm_->SendToNextStage(host_full_)).ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": activations to stage " +
                          std::to_string(layout_.shard.pp_rank + 1));
    }
  }
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
  const std::function<void(int32_t)>* hook =
      options.on_kv_layers_done ? &options.on_kv_layers_done : nullptr;
  if (hook != nullptr) layer_callbacks_.resize(layers_.size());
  if (!(s = RunLayers(plan, hook)).ok()) {
    // Callbacks already enqueued refer to `options`: let them run before returning.
    if (hook != nullptr) cudaStreamSynchronize(stream_.get());
    return s;
  }
  s = Head(plan, options, results);
  if (!s.ok() && hook != nullptr) cudaStreamSynchronize(stream_.get());
  return s;
}

Status CudaModel::Head(const BatchPlan& plan, const ForwardOptions& options,
                       std::vector<ForwardResult>* results) {
  std::vector<std::byte> bytes;
  if (!layout_.last_stage()) {
    if (Status s = comm_->BroadcastFromLastStage(&bytes); !s.ok()) {
      return s.WithPrefix("model rank " + layout_.shard.ToString() + ": results");
    }
    return DeserializeResults(bytes, results);
  }
  Status s;
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
  if (layout_.shard.pp_size > 1) {
    SerializeResults(*results, &bytes);
    if (Status b = comm_->BroadcastFromLastStage(&bytes); !b.ok()) {
      return b.WithPrefix("model rank " + layout_.shard.ToString() + ": results");
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
  StatusOr<ShardLayout> layout = MakeShardLayout(c, options.shard);
  if (!layout.ok()) return layout.status();
  auto model = std::make_unique<CudaModel>(c, *layout, options.comm, options.cuda_device);
  Status s = model->Init(weights, options);
  if (!s.ok()) return s;
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace pdlib::kernels::internal
