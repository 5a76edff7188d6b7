// What one rank of a host registers with pdlib, and the test-only fault, as functions of the
// rank's share of the example model (kernels/parallel.h), so that tests check them directly.
//
// Every rank of a host (prefill, decode, colocated) runs a kernels::Model built for its share
// (RuntimeOptions::shard): PP stage s holds layers [s * L / pp, (s + 1) * L / pp), TP rank r the
// query heads [r * H / tp, ...) and the KV heads they read (GQA heads replicated when TP exceeds
// them; MLA's latent on every rank). Its KVCache holds exactly that share, so the rank registers
// its own cache pools, nothing copied:
//
//  - KV: the stage's full-attention pools (GQA: all K then all V; MLA: one latent pool per layer,
//    is_mla), kv_head_num = the rank's KV heads (MLA 1), prefill_start_layer = the stage's first
//    full-attention layer among the model's (ModelFingerprint counts those).
//  - Recurrent state (small-hybrid, StateType::kMamba): the stage's state pools, replicated
//    (state_dim_per_tensor -1: one TP rank sends it), state_start = the stage's first one.
//  - Sliding-window layers (small-swa, StateType::kSwa): the stage's SWA pools, K and V per layer
//    (KVCache::DescribeSwa), state_start = 2 x the stage's first one. A page is split across TP
//    like a KV page: NHD [token][head][dim] along dimension 1 (rows = page_size), HND
//    [head][token][dim] along dimension 0, in units of the model's KV heads. The state indices
//    are the window pages of the request's page table (examples/scheduler, SlidingWindowPages).
//  - NSA-style indexer (small-nsa, StateType::kNsa): the stage's index pools, one per
//    full-attention layer (KVCache::DescribeIndex), replicated on every TP rank
//    (state_dim_per_tensor -1), state_start = the stage's first full-attention layer. The state
//    indices are the request's page-table entries of the whole prompt.
#ifndef PDLIB_EXAMPLES_HOSTS_SHARDING_H_
#define PDLIB_EXAMPLES_HOSTS_SHARDING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/kv_cache.h"
#include "pdlib_kernels/parallel.h"

namespace pdlib::hosts {

// The KVArgs of the rank `layout` describes, whose model (the whole model's `config`) keeps
// `cache`: kv, state (type, splits, state_start), page_size, kv_head_num, kv_layout, is_mla,
// parallel (TP/PP sizes and ranks), prefill_start_layer, memory_kind, and the fingerprint with
// `model_name`. aux and everything else are the caller's. kInvalidArgument for a model with both
// recurrent and sliding-window layers (a rank registers one kind of state; an indexer model has
// neither, ModelConfig::Validate).
StatusOr<KVArgs> RankKVArgs(const kernels::ModelConfig& config, const kernels::ShardLayout& layout,
                            const kernels::KVCache& cache, const std::string& model_name);

// The test-only fault "swap-heads" (HostOptions::test_fault): corrupts one received page of one
// pool of a rank's cache in place, in a way that must change the tokens decoded from it.
// `cache_config` is the rank's cache config (KVCache::config(): its KV heads), `kind` the pool's.
//  - GQA, the page holds >= 2 KV heads: heads 0 and 1 of every token swap (K and V pools).
//  - GQA, one KV head: token rows 2i and 2i+1 swap in K pages only (V untouched), so no key
//    meets its own value. Swapping whole K/V rows would only permute positions, which attention
//    over keys that carry their rotation cannot see.
//  - MLA: the rotated-key parts (the last qk_rope_dim values) of latent rows 2i and 2i+1 swap,
//    for the same reason (a latent row holds both the key's and the value's source).
// `page` must be one page of that pool (cache_config.kv_page_bytes()).
void CorruptReceivedPage(const kernels::ModelConfig& cache_config, kernels::KVKind kind,
                         std::span<std::byte> page);

// The test-only fault "swap-index": corrupts one received page of an indexer's key pool in place
// (the index keys of tokens 2i and 2i+1 swap), so that the top-k selection, and the tokens, of a
// decode that reads them change while its KV is intact. `page` is index_page_bytes() long.
void CorruptReceivedIndexPage(const kernels::ModelConfig& cache_config, std::span<std::byte> page);

// HostOptions::test_fault's values.
inline constexpr char kTestFaultSwapHeads[] = "swap-heads";
inline constexpr char kTestFaultSwapIndex[] = "swap-index";

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_SHARDING_H_
