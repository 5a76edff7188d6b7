// Model: a small Llama-style decoder that runs forward passes over a paged KV cache, on the CPU
// (the reference, always built) or on a CUDA GPU (built when nvcc is found).
//
// One call, Forward(), serves prefill and decode: each entry of the batch is one request's
// next chunk of tokens at positions [start_pos, start_pos + tokens.size()), attending to the
// request's first start_pos tokens already in the cache (chunked prefill, or decode with one
// token) and to the chunk itself, causally. Forward writes the chunk's K and V into the pages
// of the request's page table (and, with a lightning indexer, its index keys into the same pages
// of the index pools), advances the request's recurrent state (hybrid models), and greedily
// samples the next token after the chunk's last token.
//
// Determinism: on the CPU every output element is computed by one thread in a fixed order, so
// a request's results (tokens, logprobs, KV bytes, state) are bit-identical however requests
// are batched and however many threads run. The CUDA model is deterministic for a fixed batch
// and matches the CPU within the tolerance stated in kernels/README.md.
//
// Sharded (parallel.h): a model created for one rank of tp_size x pp_size holds and computes
// only that rank's share, and its KVCache only that share's pools and heads. Every rank of the
// replica must call Forward with the same batch (the ranks meet in the collectives); each rank
// then gets the same results, bit-identical to the whole model on one rank.
//
// Owns its KVCache. Not thread-safe: one thread at a time calls Forward or touches the cache.
#ifndef PDLIB_KERNELS_MODEL_H_
#define PDLIB_KERNELS_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/parallel.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::kernels {

enum class Device : int32_t { kCpu = 0, kCuda = 1 };

struct RuntimeOptions {
  Device device = Device::kCpu;
  int32_t num_pages = 256;       // pages in every K and V pool
  int32_t num_state_slots = 16;  // recurrent-state slots per recurrent layer (hybrid models)
  // CPU: worker threads for matmuls and attention, the caller included; 0 = hardware threads.
  int32_t num_threads = 0;
  int32_t cuda_device = 0;  // CUDA: which device
  // The rank this model is (parallel.h); the default is the whole model.
  ModelShard shard;
  // Required when shard has more than one rank: this rank's member of the replica's group.
  // Must outlive the model. Not owned.
  ModelComm* comm = nullptr;
};

// One request's share of a forward pass. The spans must stay valid during Forward.
struct SequenceChunk {
  std::span<const int32_t> tokens;      // new tokens (at least one)
  int32_t start_pos = 0;                // tokens of this request already in the cache
  std::span<const int32_t> page_table;  // the request's pages; covers start_pos + tokens.size()
  // Hybrid models: the request's state slot. start_pos == 0 starts from a zero state.
  int32_t state_slot = -1;
};

struct ForwardOptions {
  int32_t top_k = 5;           // top logprobs to return, in [0, vocab_size]
  bool return_logits = false;  // fill ForwardResult::logits
  bool return_hidden = false;  // fill ForwardResult::hidden
  // Layer-wise streaming: called once per layer whose K/V go into the KV pools (full-attention
  // and MLA layers; not sliding-window, recurrent or index pools), in order, with the count of
  // this rank's KV pools (kv_cache().DescribeKV() layers) that now hold every chunk's K/V, so the
  // caller can hand them to pdlib (KVSender::SendLayers) while the rest of the forward runs.
  // CPU: on the Forward thread, after the layer. CUDA: on CUDA's host-callback thread
  // (cudaLaunchHostFunc, enqueued after the layer's KV write, so the bytes are in memory when it
  // runs); every call has returned before Forward does. It must not call CUDA. Not called when
  // Forward fails validation.
  std::function<void(int32_t kv_layers_done)> on_kv_layers_done;
};

// What Forward produces for each chunk: the greedy choice after the chunk's last token.
struct ForwardResult {
  int32_t token = -1;  // argmax of the logits (lowest id on ties)
  float logprob = 0;   // log-softmax of `token`
  // The top_k tokens by logprob, best first (lowest id first on ties); top_ids[0] == token.
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  std::vector<float> logits;  // vocab_size values when ForwardOptions::return_logits
  std::vector<float> hidden;  // last token's hidden state after the final RMSNorm, when asked
};

class Model {
 public:
  // Builds a model on options.device from `weights` (copied). kUnavailable when CUDA was asked
  // for but is not built or no device is present; kInvalidArgument for bad weights or options.
  static StatusOr<std::unique_ptr<Model>> Create(const ModelWeights& weights,
                                                 const RuntimeOptions& options);

  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // The whole model's config (kv_cache().config() is this rank's share of it).
  virtual const ModelConfig& config() const = 0;
  virtual const ShardLayout& shard_layout() const = 0;
  virtual Device device() const = 0;
  virtual KVCache& kv_cache() = 0;
  virtual const KVCache& kv_cache() const = 0;

  // Runs one forward pass over `batch` (see the file comment) and fills one result per chunk.
  // Validates the whole batch first (token ids, page tables against the pool, distinct pages
  // and state slots between requests); on error nothing is written.
  [[nodiscard]] virtual Status Forward(std::span<const SequenceChunk> batch,
                                       const ForwardOptions& options,
                                       std::vector<ForwardResult>* results) = 0;

  // Forward over one request's prompt chunk.
  [[nodiscard]] Status Prefill(const SequenceChunk& chunk, const ForwardOptions& options,
                               ForwardResult* result);
  // Forward over a batch in which every chunk is exactly one token.
  [[nodiscard]] Status Decode(std::span<const SequenceChunk> batch, const ForwardOptions& options,
                              std::vector<ForwardResult>* results);

 protected:
  Model() = default;
};

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_MODEL_H_
