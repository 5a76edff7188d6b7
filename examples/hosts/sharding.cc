#include "examples/hosts/sharding.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace pdlib::hosts {

StatusOr<KVArgs> RankKVArgs(const kernels::ModelConfig& config, const kernels::ShardLayout& layout,
                            const kernels::KVCache& cache, const std::string& model_name) {
  if (config.is_hybrid() && config.has_sliding_window()) {
    return Status::InvalidArgument(
        "the model has both recurrent and sliding-window layers; a pdlib rank registers one kind "
        "of state");
  }
  KVArgs args;
  args.kv = cache.DescribeKV();
  if (config.is_hybrid()) {
    args.state = cache.DescribeState();
    args.state_type = StateType::kMamba;
    // Replicated on every TP rank: the primary TP rank sends it.
    args.state_dim_per_tensor.assign(args.state.size(), -1);
    args.state_start = layout.state_start;
  } else if (config.has_sliding_window()) {
    args.state = cache.DescribeSwa();
    args.state_type = StateType::kSwa;
    // A window page splits across TP like a KV page: NHD [token][head][dim] along dimension 1
    // (page_size rows before it), HND [head][token][dim] along dimension 0; the units are the
    // model's KV heads.
    const bool nhd = config.kv_layout == KVLayout::kNHD;
    args.state_dim_per_tensor.assign(args.state.size(), nhd ? 1 : 0);
    args.state_item_rows.assign(args.state.size(),
                                nhd ? static_cast<uint64_t>(config.page_size) : 1);
    args.state_split_units.assign(args.state.size(), static_cast<uint64_t>(config.num_kv_heads));
    args.state_start = 2 * layout.swa_start;  // K and V per sliding-window layer
  } else if (config.has_indexer()) {
    args.state = cache.DescribeIndex();
    args.state_type = StateType::kNsa;
    // The indexer's keys are replicated on every TP rank: the primary TP rank sends them.
    args.state_dim_per_tensor.assign(args.state.size(), -1);
    args.state_start = layout.kv_start;  // one index pool per full-attention layer
  }
  args.page_size = static_cast<uint32_t>(config.page_size);
  args.kv_head_num = config.is_mla() ? 1 : layout.kv_head_count;
  args.kv_layout = config.kv_layout;
  args.is_mla = config.is_mla();
  args.memory_kind = cache.memory_kind();
  args.parallel.tp_size = layout.shard.tp_size;
  args.parallel.tp_rank = layout.shard.tp_rank;
  args.parallel.pp_size = layout.shard.pp_size;
  args.parallel.pp_rank = layout.shard.pp_rank;
  args.prefill_start_layer = layout.kv_start;
  args.fingerprint = config.Fingerprint(model_name);
  return args;
}

void CorruptReceivedPage(const kernels::ModelConfig& cache_config, kernels::KVKind kind,
                         std::span<std::byte> page) {
  const size_t elem = cache_config.kv_elem_bytes();
  auto swap_runs = [&](size_t a, size_t b, size_t bytes) {
    std::swap_ranges(page.begin() + static_cast<std::ptrdiff_t>(a),
                     page.begin() + static_cast<std::ptrdiff_t>(a + bytes),
                     page.begin() + static_cast<std::ptrdiff_t>(b));
  };
  const int32_t rows = cache_config.page_size;
  if (cache_config.is_mla()) {
    // Latent rows of kv_width() values: [kv_lora_rank latent | qk_rope_dim rotated key].
    const size_t row = static_cast<size_t>(cache_config.kv_width()) * elem;
    const size_t rope = static_cast<size_t>(cache_config.qk_rope_dim) * elem;
    for (int32_t t = 0; t + 1 < rows; t += 2) {
      const size_t at = static_cast<size_t>(t) * row + row - rope;
      swap_runs(at, at + row, rope);
    }
    return;
  }
  const size_t head = static_cast<size_t>(cache_config.head_dim) * elem;
  if (cache_config.num_kv_heads >= 2) {
    for (int32_t t = 0; t < rows; ++t) {
      swap_runs(kernels::KVOffsetInPage(cache_config, t, 0, 0) * elem,
                kernels::KVOffsetInPage(cache_config, t, 1, 0) * elem, head);
    }
    return;
  }
  if (kind != kernels::KVKind::kKey) return;
  for (int32_t t = 0; t + 1 < rows; t += 2) {
    swap_runs(kernels::KVOffsetInPage(cache_config, t, 0, 0) * elem,
              kernels::KVOffsetInPage(cache_config, t + 1, 0, 0) * elem, head);
  }
}

void CorruptReceivedIndexPage(const kernels::ModelConfig& cache_config, std::span<std::byte> page) {
  const size_t row = static_cast<size_t>(cache_config.index_dim) * sizeof(float);
  for (int32_t t = 0; t + 1 < cache_config.page_size; ++t) {
    if (t % 2 != 0) continue;
    const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(t) * row);
    std::swap_ranges(page.begin() + at, page.begin() + at + static_cast<std::ptrdiff_t>(row),
                     page.begin() + at + static_cast<std::ptrdiff_t>(row));
  }
}

}  // namespace pdlib::hosts
