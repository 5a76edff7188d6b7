// KernelsModelRunner: the scheduler's ModelRunner over a pdlib::kernels::Model (kernels/), so a
// host that serves the example model only wires the two together.
//
// OffloadKV copies the request's pages of every pool the model's KV cache holds (per full-attention
// layer K then V, MLA: the latent pool only; then per sliding-window layer K then V, then each
// indexer's key pool, the same page-table entries) and its recurrent state of every recurrent layer
// to host memory; RestoreKV writes them into new pages and a new state slot. A sharded model's
// cache holds only its rank's layers and heads, and so does the copy. Not thread-safe, like the
// Model it wraps (which must outlive it).
#ifndef PDLIB_EXAMPLES_SCHEDULER_KERNELS_RUNNER_H_
#define PDLIB_EXAMPLES_SCHEDULER_KERNELS_RUNNER_H_

#include "examples/scheduler/engine.h"
#include "pdlib_kernels/model.h"

namespace pdlib::sched {

class KernelsModelRunner final : public ModelRunner {
 public:
  explicit KernelsModelRunner(kernels::Model* model, int32_t top_k = 5)
      : model_(model), top_k_(top_k) {}

  Status Forward(std::span<const ForwardChunk> batch, std::vector<ForwardOutput>* results) override;
  // The model's ForwardOptions::on_kv_layers_done (after each full-attention or MLA layer).
  Status ForwardStreaming(std::span<const ForwardChunk> batch,
                          const std::function<void(int32_t)>& kv_layers_done,
                          std::vector<ForwardOutput>* results) override;
  StatusOr<HostKV> OffloadKV(std::span<const int32_t> page_table, int64_t num_tokens,
                             int32_t state_slot) override;
  Status RestoreKV(const HostKV& kv, std::span<const int32_t> page_table,
                   int32_t state_slot) override;

  // Bytes of one page over every K and V pool of this rank's cache (the schedulers'
  // kv_bytes_per_page; MLA: the latent pools).
  uint64_t kv_bytes_per_page() const;
  // Bytes of one page over every sliding-window and index pool of this rank's cache (the
  // schedulers' page_state_bytes_per_page).
  uint64_t page_state_bytes_per_page() const;

 private:
  kernels::Model* model_;
  int32_t top_k_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_KERNELS_RUNNER_H_
