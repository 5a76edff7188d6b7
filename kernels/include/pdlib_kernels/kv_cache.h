// KVCache: the memory a Model keeps between forward passes, laid out exactly as a host
// registers it with pdlib.
//
//  - For every full attention layer, one K pool and one V pool. A pool is num_pages pages; a
//    page holds page_size tokens of num_kv_heads x head_dim elements (fp32 or bf16), as
//    [token][head][dim] (NHD) or [head][token][dim] (HND). MLA: one pool per layer (the K pool;
//    there is no V pool) whose page holds page_size latent rows of kv_width() elements.
//  - For every sliding-window layer, one K and one V "SWA pool" of num_pages pages laid out as
//    the KV pools. Page p of the SWA pools holds the same positions as page p of the KV pools
//    (one page table serves both); only the pages inside the window are ever read.
//  - For every full attention layer of a model with a lightning indexer (has_indexer()), one
//    "index pool" of num_pages pages of index_page_bytes(): page p holds the fp32 index keys
//    (index_dim values per token, row t at element t * index_dim) of the same positions as KV
//    page p (one page table serves both). Every TP rank holds the same index keys (they are not
//    split by heads). What pdlib moves as NSA state: the index pages of the whole sequence.
//  - For every recurrent layer (hybrid models), one state pool of num_state_slots slots of
//    state_dim fp32 values.
//
// A sharded model's cache (parallel.h) holds only its rank's share: config() is then
// ShardCacheConfig(model config, layout), so layer indices are the stage's own (0 = the stage's
// first full-attention layer) and pages hold the rank's KV heads only.
//
// A request owns a page table (the page indices holding its tokens 0, 1, 2, ... in order, page
// i covering positions [i * page_size, (i + 1) * page_size)) and, for hybrid models, one state
// slot. The host allocates both; the cache only stores bytes.
//
// Owned by the Model that created it; the memory lives on the model's device (host memory for
// the CPU model, device memory for CUDA). Not synchronised: the Read/Write helpers must not run
// concurrently with Model::Forward or a pdlib transfer into the same bytes.
#ifndef PDLIB_KERNELS_KV_CACHE_H_
#define PDLIB_KERNELS_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib/types.h"
#include "pdlib_kernels/config.h"

namespace pdlib::kernels {

// One registered buffer: base address, total bytes, and bytes per item (a page or a slot).
struct PoolRegion {
  void* base = nullptr;
  size_t bytes = 0;
  size_t item_bytes = 0;
};

enum class KVKind : int32_t { kKey = 0, kValue = 1 };

// Element offset of (token_in_page, head, dim) inside one page of a K or V pool.
inline size_t KVOffsetInPage(const ModelConfig& config, int32_t token_in_page, int32_t head,
                             int32_t dim) {
  const size_t t = static_cast<size_t>(token_in_page), h = static_cast<size_t>(head);
  const size_t d = static_cast<size_t>(dim), hd = static_cast<size_t>(config.head_dim);
  if (config.kv_layout == KVLayout::kNHD) {
    return (t * static_cast<size_t>(config.num_kv_heads) + h) * hd + d;
  }
  return (h * static_cast<size_t>(config.page_size) + t) * hd + d;
}

// Pages needed to hold `num_tokens` tokens.
inline int32_t PagesForTokens(int64_t num_tokens, int32_t page_size) {
  return static_cast<int32_t>((num_tokens + page_size - 1) / page_size);
}

class KVCache {
 public:
  virtual ~KVCache() = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  const ModelConfig& config() const { return config_; }
  int32_t num_pages() const { return num_pages_; }
  int32_t num_state_slots() const { return num_state_slots_; }
  MemoryKind memory_kind() const { return memory_kind_; }

  // kv_layer is the attention-layer index (ModelConfig::kv_layer_index), in [0, num_kv_layers).
  // MLA has K pools only (pool(kValue, ...) is empty).
  int32_t num_kv_layers() const { return static_cast<int32_t>(k_pools_.size()); }
  PoolRegion pool(KVKind kind, int32_t kv_layer) const;
  // swa_layer is the sliding-window-layer index (ModelConfig::swa_layer_index).
  int32_t num_swa_layers() const { return static_cast<int32_t>(swa_k_pools_.size()); }
  PoolRegion swa_pool(KVKind kind, int32_t swa_layer) const;
  // Index pools (models with a lightning indexer), one per full attention layer, numbered like
  // the KV pools (kv_layer); 0 layers and empty regions otherwise.
  int32_t num_index_layers() const { return static_cast<int32_t>(index_pools_.size()); }
  PoolRegion index_pool(int32_t kv_layer) const;
  // state_layer is the recurrent-layer index (ModelConfig::state_layer_index).
  int32_t num_state_layers() const { return static_cast<int32_t>(state_pools_.size()); }
  PoolRegion state_pool(int32_t state_layer) const;

  // The KV pools in pdlib's registration order: every layer's K pool, then every layer's V pool
  // (KVArgs::kv); MLA: one pool per layer. item_lens are page bytes.
  BufferFamily DescribeKV() const;
  // The state pools, one per recurrent layer (KVArgs::state with StateType::kMamba).
  BufferFamily DescribeState() const;
  // The SWA pools per sliding-window layer, K then V (KVArgs::state with StateType::kSwa:
  // interleaved per layer so that a PP stage's buffers are a contiguous run of the model's).
  BufferFamily DescribeSwa() const;
  // The index pools, one buffer per full attention layer, item = one index page (KVArgs::state
  // with StateType::kNsa; the engine passes one state index per KV page of the request, the
  // same page indices as the page table).
  BufferFamily DescribeIndex() const;

  // Copies one page between the pool and host memory (`bytes` must be exactly one page).
  // Used by tests and by hosts that move KV without pdlib.
  [[nodiscard]] Status ReadPage(KVKind kind, int32_t kv_layer, int32_t page,
                                std::span<std::byte> out) const;
  [[nodiscard]] Status WritePage(KVKind kind, int32_t kv_layer, int32_t page,
                                 std::span<const std::byte> bytes);
  // The same for one page of a sliding-window layer's SWA pool.
  [[nodiscard]] Status ReadSwaPage(KVKind kind, int32_t swa_layer, int32_t page,
                                   std::span<std::byte> out) const;
  [[nodiscard]] Status WriteSwaPage(KVKind kind, int32_t swa_layer, int32_t page,
                                    std::span<const std::byte> bytes);
  // The same for one page of a full attention layer's index pool (index_page_bytes()).
  [[nodiscard]] Status ReadIndexPage(int32_t kv_layer, int32_t page,
                                     std::span<std::byte> out) const;
  [[nodiscard]] Status WriteIndexPage(int32_t kv_layer, int32_t page,
                                      std::span<const std::byte> bytes);
  // Copies one request's recurrent state (state_dim floats) of one recurrent layer.
  [[nodiscard]] Status ReadState(int32_t state_layer, int32_t slot, std::span<float> out) const;
  [[nodiscard]] Status WriteState(int32_t state_layer, int32_t slot, std::span<const float> in);

 protected:
  KVCache(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots,
          MemoryKind memory_kind);

  // Copies between the cache's memory and host memory.
  virtual Status CopyToHost(const void* src, void* dst, size_t bytes) const = 0;
  virtual Status CopyFromHost(const void* src, void* dst, size_t bytes) = 0;

  ModelConfig config_;
  int32_t num_pages_;
  int32_t num_state_slots_;
  MemoryKind memory_kind_;
  // Filled by the derived class's factory.
  std::vector<PoolRegion> k_pools_;
  std::vector<PoolRegion> v_pools_;
  std::vector<PoolRegion> swa_k_pools_;
  std::vector<PoolRegion> swa_v_pools_;
  std::vector<PoolRegion> index_pools_;
  std::vector<PoolRegion> state_pools_;

 private:
  enum class PageFamily { kKv, kSwa, kIndex };
  Status CheckPage(PageFamily family, KVKind kind, int32_t layer, int32_t page, size_t bytes,
                   const void** where) const;
  Status CheckState(int32_t state_layer, int32_t slot, size_t bytes, const void** where) const;
};

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_KV_CACHE_H_
