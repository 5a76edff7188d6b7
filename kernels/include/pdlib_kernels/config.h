// ModelConfig: the shape of the small Llama-style decoder that pdlib's example hosts run, and of
// its paged KV cache.
//
// A plain value type; fill it, call Validate(), and hand it to ModelWeights. The default is a
// model small enough to run quickly on two CPU cores. Thread-safe as any const value.
#ifndef PDLIB_KERNELS_CONFIG_H_
#define PDLIB_KERNELS_CONFIG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib::kernels {

// Element type of the KV cache. Weights and activations are always fp32.
enum class KVDtype : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,  // rounded to nearest even on write, widened to fp32 on read
};
std::string_view KVDtypeName(KVDtype dtype);

// What the mixing half of a decoder layer is. Every layer also has a SwiGLU MLP.
enum class LayerKind : int32_t {
  kAttention = 0,  // attention over the paged KV cache (GQA or MLA, ModelConfig::attention)
  kRecurrent = 1,  // gated linear recurrence over a per-request state slot (mamba-like)
  // GQA attention over the last ModelConfig::sliding_window positions (the token itself
  // included), its K and V in the SWA pools (kv_cache.h), not in the KV pools.
  kSlidingWindow = 2,
};

// How the attention layers keep K and V.
enum class AttentionKind : int32_t {
  // Grouped-query attention: num_kv_heads heads of head_dim for K and for V.
  kGqa = 0,
  // Multi-head latent attention (DeepSeek-V2 style): per token one row of kv_lora_rank latent
  // values (RMS-normalised) followed by qk_rope_dim rotated key values, shared by every head.
  // Head h's key is [W_uk_h c, k_rope] and its value W_uv_h c (head_dim each, c the latent);
  // its query is [q_nope_h (head_dim), q_rope_h (qk_rope_dim)]. num_kv_heads must be 1.
  kMla = 1,
};

struct ModelConfig {
  int32_t num_layers = 4;
  int32_t hidden_size = 256;
  int32_t num_heads = 4;     // query heads
  int32_t num_kv_heads = 2;  // key/value heads (GQA); divides num_heads
  int32_t head_dim = 64;
  int32_t intermediate_size = 512;  // SwiGLU width
  int32_t vocab_size = 512;
  float rope_theta = 10000.0f;
  float rms_norm_eps = 1e-5f;
  int32_t page_size = 16;  // tokens per KV page
  KVDtype kv_dtype = KVDtype::kFloat32;
  KVLayout kv_layout = KVLayout::kNHD;
  // Empty: every layer is attention. Otherwise exactly num_layers entries.
  std::vector<LayerKind> layer_kinds;
  // When true, the LM head reuses the embedding table (no lm_head.weight tensor).
  bool tie_word_embeddings = false;
  AttentionKind attention = AttentionKind::kGqa;
  int32_t kv_lora_rank = 0;  // MLA: latent values per token (0 for GQA)
  int32_t qk_rope_dim = 0;   // MLA: rotated key/query values per token and head (0 for GQA)
  // kSlidingWindow layers: positions a token attends to, itself included (>= 1 when the model
  // has such a layer, 0 otherwise).
  int32_t sliding_window = 0;
  // Lightning indexer (DeepSeek-V3.2-style sparse attention; both > 0 or both 0): every full
  // attention layer (GQA only) scores the earlier positions with index_dim-wide fp32 index keys
  // kept in the cache's index pools and attends to the index_topk best only. What pdlib moves as
  // NSA state (StateType::kNsa): the index pages of the whole sequence.
  int32_t index_dim = 0;
  int32_t index_topk = 0;

  // The default: 4 attention layers, hidden 256, 4 query heads and 2 KV heads of 64, vocab 512.
  static ModelConfig Small() { return ModelConfig(); }
  // Small() with layers 1 and 3 recurrent, so hosts exercise state transfer.
  static ModelConfig SmallHybrid();
  // Small() with MLA attention: one KV "head" of kv_lora_rank 64 + qk_rope_dim 32 per token.
  static ModelConfig SmallMla();
  // Small() with layers 1 and 3 sliding-window attention over 24 positions (so windows start
  // inside pages).
  static ModelConfig SmallSwa();
  // Small() with a lightning indexer on every layer: index keys of 32 fp32 values, attention over
  // the best 24 positions (fewer than a 40-token prompt, so selection matters).
  static ModelConfig SmallNsa();

  [[nodiscard]] Status Validate() const;
  std::string ToString() const;

  LayerKind layer_kind(int32_t layer) const;
  bool is_mla() const { return attention == AttentionKind::kMla; }
  // Has recurrent layers (mamba-like state slots).
  bool is_hybrid() const { return num_recurrent_layers() > 0; }
  bool has_sliding_window() const { return num_swa_layers() > 0; }
  // Every full attention layer has a lightning indexer (index_dim and index_topk set).
  bool has_indexer() const { return index_dim > 0 && index_topk > 0; }
  // Full attention layers (kAttention): the layers whose KV pdlib moves as KV.
  int32_t num_attention_layers() const;
  int32_t num_recurrent_layers() const;
  int32_t num_swa_layers() const;
  // Position of `layer` among the attention layers (its KV pool index), or -1.
  int32_t kv_layer_index(int32_t layer) const;
  // Position of `layer` among the recurrent layers (its state pool index), or -1.
  int32_t state_layer_index(int32_t layer) const;
  // Position of `layer` among the sliding-window layers (its SWA pool index), or -1.
  int32_t swa_layer_index(int32_t layer) const;

  // Width of the attention output (and of the o_proj input): num_heads x head_dim.
  int32_t q_width() const { return num_heads * head_dim; }
  // GQA: num_kv_heads x head_dim values per token in each of K and V. MLA: the latent row,
  // kv_lora_rank + qk_rope_dim.
  int32_t kv_width() const {
    return is_mla() ? kv_lora_rank + qk_rope_dim : num_kv_heads * head_dim;
  }
  // Width of a recurrent layer's state: one fp32 per hidden unit.
  int32_t state_dim() const { return hidden_size; }

  size_t kv_elem_bytes() const { return kv_dtype == KVDtype::kFloat32 ? 4 : 2; }
  // Bytes of one page of one K (or V, or MLA latent, or SWA) pool: page_size x kv_width()
  // elements.
  size_t kv_page_bytes() const {
    return static_cast<size_t>(page_size) * static_cast<size_t>(kv_width()) * kv_elem_bytes();
  }
  // The pages of a request's page table (indices into it, [first, end)) that hold the positions
  // a sliding-window layer still reads when the request's next token is at position
  // `num_tokens`: [max(0, num_tokens - sliding_window + 1), num_tokens). Empty without a window
  // or tokens. What pdlib moves as SWA state (StateType::kSwa), on both sides.
  struct PageRange {
    int32_t first = 0;
    int32_t end = 0;
  };
  PageRange SlidingWindowPages(int64_t num_tokens) const;
  // Bytes of one page of one index pool: page_size x index_dim fp32 index keys (always fp32,
  // whatever kv_dtype). 0 without an indexer.
  size_t index_page_bytes() const {
    return has_indexer() ? static_cast<size_t>(page_size) * static_cast<size_t>(index_dim) * 4 : 0;
  }
  // Bytes of one request's state in one recurrent layer's pool.
  size_t state_slot_bytes() const { return static_cast<size_t>(state_dim()) * sizeof(float); }

  // What a pdlib KVManager compares between the two sides (SPEC R6.4). num_layers counts the
  // layers that own KV pools (the full attention layers); MLA counts one KV head of kv_width().
  ModelFingerprint Fingerprint(std::string model_name = "pdlib-kernels-llama") const;
};

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_CONFIG_H_
