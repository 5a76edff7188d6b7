// ModelWeights: every parameter of the decoder as host fp32 arrays, row-major with the shapes
// (and Llama tensor names) of a Hugging Face checkpoint. A linear layer's weight is
// [out_features][in_features], and y = W x.
//
// A plain value: make one with Random() or LoadSafetensors(), then hand it to Model::Create,
// which copies what it needs. Not synchronised; share it read-only.
#ifndef PDLIB_KERNELS_WEIGHTS_H_
#define PDLIB_KERNELS_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pdlib/status.h"
#include "pdlib_kernels/config.h"
#include "pdlib_kernels/safetensors.h"

namespace pdlib::kernels {

struct LayerWeights {
  std::vector<float> input_layernorm;  // [hidden]
  // Attention layers (full and sliding-window). GQA:
  std::vector<float> q_proj;  // [num_heads * head_dim][hidden]; MLA: [num_heads *
                              // (head_dim + qk_rope_dim)][hidden], per head nope then rope
  std::vector<float> k_proj;  // [num_kv_heads * head_dim][hidden]
  std::vector<float> v_proj;  // [num_kv_heads * head_dim][hidden]
  std::vector<float> o_proj;  // [hidden][num_heads * head_dim]
  // MLA only (k_proj and v_proj empty): the latent and the shared rotated key from x, the
  // latent's RMSNorm, and per head the key (nope) and value up-projections from the latent.
  std::vector<float> kv_a_proj;       // [kv_lora_rank + qk_rope_dim][hidden]
  std::vector<float> kv_a_layernorm;  // [kv_lora_rank]
  std::vector<float> kv_b_proj;       // [num_heads * 2 * head_dim][kv_lora_rank], per head
                                      // k_nope rows then v rows
  // Full attention layers of a model with a lightning indexer (config.has_indexer()): the index
  // query and the index key of a token, q_idx = W_iq x and k_idx = W_ik x.
  std::vector<float> index_q_proj;  // [index_dim][hidden] ("self_attn.indexer.wq.weight")
  std::vector<float> index_k_proj;  // [index_dim][hidden] ("self_attn.indexer.wk.weight")
  // Recurrent layers: h_t = a * h_{t-1} + (1 - a) * (W_in x), a = sigmoid(W_decay x),
  // y = W_out (h_t * silu(W_gate x)).
  std::vector<float> rec_in_proj;     // [hidden][hidden]
  std::vector<float> rec_decay_proj;  // [hidden][hidden]
  std::vector<float> rec_gate_proj;   // [hidden][hidden]
  std::vector<float> rec_out_proj;    // [hidden][hidden]
  // MLP (every layer): down(silu(gate x) * up x).
  std::vector<float> post_attention_layernorm;  // [hidden]
  std::vector<float> gate_proj;                 // [intermediate][hidden]
  std::vector<float> up_proj;                   // [intermediate][hidden]
  std::vector<float> down_proj;                 // [hidden][intermediate]
};

// One tensor as a checkpoint names it. `data` points into the ModelWeights it came from.
struct NamedTensor {
  std::string name;  // "model.layers.3.self_attn.q_proj.weight", ...; MLA:
                     // "...self_attn.kv_a_proj_with_mqa.weight", "...kv_a_layernorm.weight",
                     // "...kv_b_proj.weight"
  std::vector<int64_t> shape;  // what the config requires
  std::vector<float>* data;
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> embed_tokens;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab][hidden]; empty when config.tie_word_embeddings

  // Deterministic weights from `seed` (same seed, same bits on every machine), scaled so that
  // activations stay O(1) and the next-token distribution is far from uniform. The indexer
  // tensors draw from streams of their own, so a model with an indexer has exactly the other
  // weights of the same model without one.
  static StatusOr<ModelWeights> Random(const ModelConfig& config, uint64_t seed);
  // Loads every tensor that `config` needs from a safetensors file with Llama names; shapes must
  // match exactly. F32, F16 and BF16 tensors are accepted; extra tensors are ignored.
  static StatusOr<ModelWeights> LoadSafetensors(const std::string& path, const ModelConfig& config);
  static StatusOr<ModelWeights> FromSafetensors(const SafetensorsFile& file,
                                                const ModelConfig& config);

  // Every tensor of this model with its checkpoint name and shape, in a fixed order:
  // embedding, layers 0..n-1, final norm, LM head.
  std::vector<NamedTensor> Tensors();
  // kInvalidArgument naming the first tensor whose size does not match the config.
  [[nodiscard]] Status Validate() const;
};

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_WEIGHTS_H_
