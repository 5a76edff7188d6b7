// PlanBatch: checks a Forward batch against the model and its cache and flattens it into the
// per-token and per-request index arrays that both the CPU and the CUDA model consume. Pure
// logic: no memory of the cache is touched, so a rejected batch changes nothing.
#ifndef PDLIB_KERNELS_SRC_BATCH_PLAN_H_
#define PDLIB_KERNELS_SRC_BATCH_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/model.h"

namespace pdlib::kernels::internal {

struct BatchPlan {
  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  // Per token, in batch order (all of chunk 0's tokens, then chunk 1's, ...).
  std::vector<int32_t> token_ids;
  std::vector<int32_t> positions;
  std::vector<int32_t> token_seq;    // index of the chunk the token belongs to
  std::vector<int64_t> write_slots;  // page * page_size + position % page_size
  // Per chunk.
  std::vector<int32_t> seq_token_begin;  // num_seqs + 1 entries
  std::vector<int32_t> seq_start_pos;
  std::vector<int32_t> seq_state_slot;    // -1 for models without recurrent layers
  std::vector<int32_t> page_table_begin;  // num_seqs + 1 entries into page_tables
  std::vector<int32_t> page_tables;       // the pages covering each chunk's positions, flattened

  int32_t last_token(int32_t seq) const { return seq_token_begin[seq + 1] - 1; }
};

// Every config ModelConfig::Validate accepts is planned the same way: a request's one page table
// covers all its positions and indexes the KV pools (MLA: the latent pool) and the SWA pools
// alike, so write_slots and page_tables serve every attention kind. The table must cover
// positions before a sliding window too: every model has a full attention layer, which reads
// them. The plan carries no window; the model applies it (ops.h, PagedAttention).
StatusOr<BatchPlan> PlanBatch(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots,
                              std::span<const SequenceChunk> batch, const ForwardOptions& options);

}  // namespace pdlib::kernels::internal

#endif  // PDLIB_KERNELS_SRC_BATCH_PLAN_H_
