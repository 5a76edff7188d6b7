#include "pdlib_kernels/model.h"

#include <string>

#include "cpu/cpu_model.h"
#include "cuda/cuda_model.h"

namespace pdlib::kernels {

StatusOr<std::unique_ptr<Model>> Model::Create(const ModelWeights& weights,
                                               const RuntimeOptions& options) {
  Status s = weights.Validate();
  if (!s.ok()) return s;
  if (options.num_pages < 1) {
    return Status::InvalidArgument("model: num_pages " + std::to_string(options.num_pages) +
                                   " must be at least 1");
  }
  if (options.num_state_slots < 0 || (weights.config.is_hybrid() && options.num_state_slots < 1)) {
    return Status::InvalidArgument("model: num_state_slots " +
                                   std::to_string(options.num_state_slots) +
                                   " must be at least 1 for a hybrid model (0 or more otherwise)");
  }
  if (options.num_threads < 0) {
    return Status::InvalidArgument("model: num_threads " + std::to_string(options.num_threads) +
                                   " is negative");
  }
  const ModelConfig& config = weights.config;
  StatusOr<ShardLayout> layout = MakeShardLayout(config, options.shard);
  if (!layout.ok()) return layout.status().WithPrefix("model");
  if (options.shard.num_ranks() > 1 && options.comm == nullptr) {
    return Status::InvalidArgument("model: rank " + options.shard.ToString() +
                                   " of a sharded model needs RuntimeOptions::comm");
  }
  if (options.device == Device::kCuda &&
      (config.is_mla() || config.has_sliding_window() || config.has_indexer())) {
    // The CUDA kernels have dense GQA attention over whole pages only.
    const char* what = config.is_mla()               ? "MLA attention"
                       : config.has_sliding_window() ? "sliding-window attention"
                                                     : "lightning-indexer (sparse) attention";
    return Status::Unimplemented(std::string("model: the CUDA model has no ") + what +
                                 " kernels; use device cpu");
  }
  switch (options.device) {
    case Device::kCpu: return internal::CreateCpuModel(weights, options);
    case Device::kCuda: return internal::CreateCudaModel(weights, options);
  }
  return Status::InvalidArgument("model: unknown device " +
                                 std::to_string(static_cast<int>(options.device)));
}

Status Model::Prefill(const SequenceChunk& chunk, const ForwardOptions& options,
                      ForwardResult* result) {
  std::vector<ForwardResult> results;
  Status s = Forward(std::span<const SequenceChunk>(&chunk, 1), options, &results);
  if (!s.ok()) return s;
  *result = std::move(results[0]);
  return Status::OK();
}

Status Model::Decode(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                     std::vector<ForwardResult>* results) {
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].tokens.size() != 1) {
      return Status::InvalidArgument("decode: request " + std::to_string(i) + " of the batch has " +
                                     std::to_string(batch[i].tokens.size()) +
                                     " tokens; a decode step takes exactly one");
    }
  }
  return Forward(batch, options, results);
}

}  // namespace pdlib::kernels
