// How a prefill host splits the example model across its ranks for pdlib, as pure functions
// (no threads, no I/O) so that tests check them exhaustively.
//
// The example model (kernels/) is not sharded: every rank runs a full replica and computes every
// layer and every KV head. What is split is what each rank *registers* with pdlib, which is what
// a real TP/PP engine would hold:
//
//  - PP: stage s owns model layers [s * L / pp, (s + 1) * L / pp). It registers the K and V pools
//    of the attention layers among them (all K, then all V), with prefill_start_layer = the
//    first one's index among attention layers (ModelFingerprint counts attention layers), and
//    the state pools of the recurrent layers among them, with state_start likewise.
//  - TP: rank r holds KV heads [r * H / tp, (r + 1) * H / tp). Its registered K/V pools are
//    *shard* pools of pages with only those heads, same layout; after every forward the host
//    copies the head slice of each page the forward wrote from the replica's full pool into the
//    shard pool (CopyHeadShard). Recurrent state is replicated (state_dim_per_tensor = -1).
#ifndef PDLIB_EXAMPLES_HOSTS_SHARDING_H_
#define PDLIB_EXAMPLES_HOSTS_SHARDING_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"

namespace pdlib::hosts {

// What one PP stage of one TP rank owns.
struct StageLayout {
  int32_t first_layer = 0;  // model layers [first_layer, end_layer)
  int32_t end_layer = 0;
  int32_t kv_start = 0;  // attention-layer (KV pool) indices [kv_start, kv_start + kv_count)
  int32_t kv_count = 0;
  int32_t state_start = 0;  // recurrent-layer (state pool) indices
  int32_t state_count = 0;
  int32_t head_start = 0;  // KV heads [head_start, head_start + head_count) of every page
  int32_t head_count = 0;
};

// The share of rank (tp_rank, pp_rank). kInvalidArgument, naming the numbers, when TP does not
// divide the KV heads, PP exceeds the layers, or a stage would own no attention layer (pdlib
// needs KV in every stage).
StatusOr<StageLayout> MakeStageLayout(const kernels::ModelConfig& config, int32_t tp_size,
                                      int32_t tp_rank, int32_t pp_size, int32_t pp_rank);

// Bytes of one shard page: page_size x head_count x head_dim elements.
size_t ShardPageBytes(const kernels::ModelConfig& config, int32_t head_count);

// Copies heads [head_start, head_start + head_count) of every token of one full page (the
// model's layout, config.num_kv_heads heads) into one shard page (same layout, head_count heads).
// `full` must be config.kv_page_bytes() long and `shard` ShardPageBytes(config, head_count).
void CopyHeadShard(const kernels::ModelConfig& config, int32_t head_start, int32_t head_count,
                   std::span<const std::byte> full, std::span<std::byte> shard);

// Indices into a request's page table of the pages holding positions [start_pos, start_pos + n)
// (n >= 1): [first, last].
struct PageSpan {
  int32_t first = 0;
  int32_t last = 0;
};
PageSpan PagesWritten(int32_t start_pos, int32_t num_tokens, int32_t page_size);

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_SHARDING_H_
