#include "examples/hosts/sharding.h"

#include <cstring>
#include <string>

#include "pdlib_kernels/kv_cache.h"

namespace pdlib::hosts {

StatusOr<StageLayout> MakeStageLayout(const kernels::ModelConfig& config, int32_t tp_size,
                                      int32_t tp_rank, int32_t pp_size, int32_t pp_rank) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || pp_size < 1 || pp_rank < 0 ||
      pp_rank >= pp_size) {
    return Status::InvalidArgument("rank tp " + std::to_string(tp_rank) + "/" +
                                   std::to_string(tp_size) + " pp " + std::to_string(pp_rank) +
                                   "/" + std::to_string(pp_size) + " is out of range");
  }
  if (config.num_kv_heads % tp_size != 0) {
    return Status::InvalidArgument("TP " + std::to_string(tp_size) + " does not divide the " +
                                   std::to_string(config.num_kv_heads) +
                                   " KV heads of the model: every rank must hold whole heads");
  }
  if (pp_size > config.num_layers) {
    return Status::InvalidArgument("PP " + std::to_string(pp_size) + " exceeds the model's " +
                                   std::to_string(config.num_layers) + " layers");
  }
  StageLayout s;
  s.first_layer = pp_rank * config.num_layers / pp_size;
  s.end_layer = (pp_rank + 1) * config.num_layers / pp_size;
  for (int32_t layer = 0; layer < s.end_layer; ++layer) {
    const bool attention = config.layer_kind(layer) == kernels::LayerKind::kAttention;
    int32_t& before = attention ? s.kv_start : s.state_start;
    int32_t& inside = attention ? s.kv_count : s.state_count;
    (layer < s.first_layer ? before : inside) += 1;
  }
  if (s.kv_count == 0) {
    return Status::InvalidArgument(
        "PP stage " + std::to_string(pp_rank) + " of " + std::to_string(pp_size) +
        " owns layers [" + std::to_string(s.first_layer) + ", " + std::to_string(s.end_layer) +
        ") and none of them is an attention layer; pdlib needs KV in every stage (use a smaller "
        "PP)");
  }
  s.head_count = config.num_kv_heads / tp_size;
  s.head_start = tp_rank * s.head_count;
  return s;
}

size_t ShardPageBytes(const kernels::ModelConfig& config, int32_t head_count) {
  return static_cast<size_t>(config.page_size) * static_cast<size_t>(head_count) *
         static_cast<size_t>(config.head_dim) * config.kv_elem_bytes();
}

void CopyHeadShard(const kernels::ModelConfig& config, int32_t head_start, int32_t head_count,
                   std::span<const std::byte> full, std::span<std::byte> shard) {
  kernels::ModelConfig shard_config = config;
  shard_config.num_kv_heads = head_count;
  const size_t elem = config.kv_elem_bytes();
  const size_t run = static_cast<size_t>(config.head_dim) * elem;  // one head of one token
  for (int32_t t = 0; t < config.page_size; ++t) {
    for (int32_t h = 0; h < head_count; ++h) {
      const size_t from = kernels::KVOffsetInPage(config, t, head_start + h, 0) * elem;
      const size_t to = kernels::KVOffsetInPage(shard_config, t, h, 0) * elem;
      std::memcpy(shard.data() + to, full.data() + from, run);
    }
  }
}

PageSpan PagesWritten(int32_t start_pos, int32_t num_tokens, int32_t page_size) {
  return {start_pos / page_size, (start_pos + num_tokens - 1) / page_size};
}

}  // namespace pdlib::hosts
