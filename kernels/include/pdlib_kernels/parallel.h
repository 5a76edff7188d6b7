// Tensor and pipeline parallelism for the example model: which share of the model one rank
// holds (ShardLayout, a pure function of the config and the rank), and the small collective
// interface the ranks of one model replica talk through (ModelComm).
//
// The split, for tp_size x pp_size ranks:
//  - PP: stage s owns model layers [s * L / pp, (s + 1) * L / pp). Stage 0 embeds the tokens;
//    each stage hands the residual stream to the next; the last stage applies the final norm and
//    the LM head and hands every stage the sampled results.
//  - TP, attention: rank r holds query heads [r * H / tp, (r + 1) * H / tp) and their rows of
//    q_proj (MLA: of q_proj and kv_b_proj), computes attention for those heads only, and keeps
//    in its KV cache only the KV heads those query heads read: KV heads [r * K / tp, ...) when
//    tp <= K, else KV head r / (tp / K), replicated on tp / K ranks (as engines and pdlib's
//    planner do). MLA's latent row is replicated on every rank.
//  - TP, MLP: rank r holds intermediate units [r * I / tp, (r + 1) * I / tp) of gate_proj and
//    up_proj.
//  - TP, output projections (o_proj, down_proj): rank r holds output rows [r * D / tp, ...) (D =
//    hidden_size) and computes them from the whole input row, which the ranks first gather.
//  - Recurrent layers, embeddings, norms and the LM head are replicated.
//
// Why gather and not all-reduce: a real engine all-reduces o_proj's and down_proj's partial sums.
// Summing partials in a different order changes float bits, and the example model's promise is
// that every layout gives exactly the tokens of TP 1 (so a test can compare disaggregated runs
// token for token). Gathering the inputs of the output projections and splitting their output
// rows keeps every dot product whole, so each rank holds and computes 1/tp of every sharded
// weight and TP N is bit-identical to TP 1. The interface an engine backs with NCCL is the same
// (ncclAllGather, ncclSend/ncclRecv, ncclBroadcast).
#ifndef PDLIB_KERNELS_PARALLEL_H_
#define PDLIB_KERNELS_PARALLEL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"

namespace pdlib::kernels {

// Where one rank sits. The default is the whole model on one rank.
struct ModelShard {
  int32_t tp_size = 1;
  int32_t tp_rank = 0;
  int32_t pp_size = 1;
  int32_t pp_rank = 0;

  int32_t num_ranks() const { return tp_size * pp_size; }
  // The rank's index among all tp_size x pp_size ranks: pp_rank * tp_size + tp_rank.
  int32_t index() const { return pp_rank * tp_size + tp_rank; }
  std::string ToString() const;  // "tp 1/2 pp 0/1"
};

// What one rank holds. Ranges are [start, start + count) in the whole model's numbering.
struct ShardLayout {
  ModelShard shard;
  int32_t first_layer = 0;  // model layers [first_layer, end_layer) of the PP stage
  int32_t end_layer = 0;
  int32_t kv_start = 0;  // full-attention layers (KV pool indices) among them
  int32_t kv_count = 0;
  int32_t swa_start = 0;  // sliding-window layers (SWA pool indices)
  int32_t swa_count = 0;
  int32_t state_start = 0;  // recurrent layers (state pool indices)
  int32_t state_count = 0;
  int32_t q_head_start = 0;  // query heads
  int32_t q_head_count = 0;
  // KV heads in this rank's KV and SWA pages. MLA: 0 and 1 (the latent row, replicated).
  int32_t kv_head_start = 0;
  int32_t kv_head_count = 0;
  int32_t inter_start = 0;  // MLP intermediate units
  int32_t inter_count = 0;
  int32_t out_start = 0;  // output rows of o_proj and down_proj (hidden units)
  int32_t out_count = 0;

  bool first_stage() const { return shard.pp_rank == 0; }
  bool last_stage() const { return shard.pp_rank == shard.pp_size - 1; }
};

// The share of `shard`. kInvalidArgument, naming the numbers, when the rank is out of range, TP
// does not divide the query heads, hidden_size or intermediate_size, TP and the KV heads do not
// divide one another (GQA), PP exceeds the layers, or a PP stage would own no full-attention
// layer (pdlib needs KV in every stage).
StatusOr<ShardLayout> MakeShardLayout(const ModelConfig& config, const ModelShard& shard);

// The model config as one rank's KV cache sees it: the stage's layers only (layer_kinds sliced,
// num_layers = end_layer - first_layer), num_heads = q_head_count, num_kv_heads = kv_head_count
// (MLA: 1). kv_page_bytes() and KVOffsetInPage() of the result describe the rank's pages.
ModelConfig ShardCacheConfig(const ModelConfig& config, const ShardLayout& layout);

// The collective one rank of a sharded model uses. Every rank of the replica calls the same
// sequence of collectives with matching sizes (the model does, when every rank runs Forward on
// the same batch). Thread contract: one call at a time per member; members of one group are
// used from different threads (or processes).
class ModelComm {
 public:
  virtual ~ModelComm() = default;

  // Every rank of this rank's TP group (same PP stage) passes `mine` of the same length; `all`
  // (tp_size x that length) receives each rank's values in TP-rank order.
  [[nodiscard]] virtual Status AllGather(std::span<const float> mine, std::span<float> all) = 0;
  // Hands `data` to the same TP rank of the next PP stage, which receives it with
  // ReceiveFromPreviousStage into a span of the same length. May block until it is taken.
  [[nodiscard]] virtual Status SendToNextStage(std::span<const float> data) = 0;
  [[nodiscard]] virtual Status ReceiveFromPreviousStage(std::span<float> data) = 0;
  // Every stage of this rank's TP column calls it; on return each holds the last stage's
  // `bytes` (the last stage's are unchanged).
  [[nodiscard]] virtual Status BroadcastFromLastStage(std::vector<std::byte>* bytes) = 0;
  // Fails every pending and later call of every member with `why` (a rank that stops must not
  // leave the others blocked). Idempotent; the first reason wins.
  virtual void Abort(const Status& why) = 0;
};

// A group whose members are threads of one process: tp_size x pp_size members, member i for the
// rank with ModelShard::index() == i. Members must outlive every call on them.
std::vector<std::unique_ptr<ModelComm>> CreateInProcessModelComms(int32_t tp_size, int32_t pp_size);

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_PARALLEL_H_
