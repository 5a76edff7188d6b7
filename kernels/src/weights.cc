#include "pdlib_kernels/weights.h"

#include <cmath>
#include <string>
#include <utility>

namespace pdlib::kernels {
namespace {

// splitmix64: tiny, well mixed, and identical everywhere, so a seed names the same weights on
// every host (prefill and decode build their models independently).
uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1), exactly representable.
float UniformSym(uint64_t* state) {
  return static_cast<float>(SplitMix64(state) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::vector<NamedTensor> ModelWeights::Tensors() {
  const ModelConfig& c = config;
  const int64_t h = c.hidden_size;
  std::vector<NamedTensor> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, &embed_tokens});
  for (int32_t l = 0; l < c.num_layers && static_cast<size_t>(l) < layers.size(); ++l) {
    LayerWeights& w = layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {h}, &w.input_layernorm});
    const LayerKind kind = c.layer_kind(l);
    if (kind == LayerKind::kAttention && c.is_mla()) {
      // DeepSeek-V2 names. q_proj rows per head: head_dim nope rows, then qk_rope_dim rope rows.
      const int64_t rank = c.kv_lora_rank;
      out.push_back({p + "self_attn.q_proj.weight",
                     {static_cast<int64_t>(c.num_heads) * (c.head_dim + c.qk_rope_dim), h},
                     &w.q_proj});
      out.push_back(
          {p + "self_attn.kv_a_proj_with_mqa.weight", {rank + c.qk_rope_dim, h}, &w.kv_a_proj});
      out.push_back({p + "self_attn.kv_a_layernorm.weight", {rank}, &w.kv_a_layernorm});
      out.push_back({p + "self_attn.kv_b_proj.weight",
                     {static_cast<int64_t>(c.num_heads) * 2 * c.head_dim, rank},
                     &w.kv_b_proj});
      out.push_back({p + "self_attn.o_proj.weight", {h, c.q_width()}, &w.o_proj});
    } else if (kind == LayerKind::kAttention || kind == LayerKind::kSlidingWindow) {
      // Sliding-window layers are GQA attention layers with the same tensors and names.
      out.push_back({p + "self_attn.q_proj.weight", {c.q_width(), h}, &w.q_proj});
      out.push_back({p + "self_attn.k_proj.weight", {c.kv_width(), h}, &w.k_proj});
      out.push_back({p + "self_attn.v_proj.weight", {c.kv_width(), h}, &w.v_proj});
      out.push_back({p + "self_attn.o_proj.weight", {h, c.q_width()}, &w.o_proj});
      if (kind == LayerKind::kAttention && c.has_indexer()) {
        out.push_back({p + "self_attn.indexer.wq.weight", {c.index_dim, h}, &w.index_q_proj});
        out.push_back({p + "self_attn.indexer.wk.weight", {c.index_dim, h}, &w.index_k_proj});
      }
    } else {
      out.push_back({p + "recurrent.in_proj.weight", {c.state_dim(), h}, &w.rec_in_proj});
      out.push_back({p + "recurrent.decay_proj.weight", {c.state_dim(), h}, &w.rec_decay_proj});
      out.push_back({p + "recurrent.gate_proj.weight", {c.state_dim(), h}, &w.rec_gate_proj});
      out.push_back({p + "recurrent.out_proj.weight", {h, c.state_dim()}, &w.rec_out_proj});
    }
    out.push_back({p + "post_attention_layernorm.weight", {h}, &w.post_attention_layernorm});
    out.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, h}, &w.gate_proj});
    out.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, h}, &w.up_proj});
    out.push_back({p + "mlp.down_proj.weight", {h, c.intermediate_size}, &w.down_proj});
  }
  out.push_back({"model.norm.weight", {h}, &final_norm});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, h}, &lm_head});
  return out;
}

Status ModelWeights::Validate() const {
  Status s = config.Validate();
  if (!s.ok()) return s;
  if (layers.size() != static_cast<size_t>(config.num_layers)) {
    return Status::InvalidArgument("weights: " + std::to_string(layers.size()) +
                                   " layers but the config has " +
                                   std::to_string(config.num_layers));
  }
  // Tensors() only hands out pointers; nothing is modified here.
  for (const NamedTensor& t : const_cast<ModelWeights*>(this)->Tensors()) {
    if (t.data->size() != static_cast<size_t>(Numel(t.shape))) {
      return Status::InvalidArgument("weights: tensor " + t.name + " has " +
                                     std::to_string(t.data->size()) + " elements; shape " +
                                     Shape(t.shape) + " needs " + std::to_string(Numel(t.shape)));
    }
  }
  if (config.tie_word_embeddings && !lm_head.empty()) {
    return Status::InvalidArgument("weights: lm_head must be empty when tie_word_embeddings");
  }
  return Status::OK();
}

StatusOr<ModelWeights> ModelWeights::Random(const ModelConfig& config, uint64_t seed) {
  Status s = config.Validate();
  if (!s.ok()) return s;
  ModelWeights w;
  w.config = config;
  w.layers.resize(static_cast<size_t>(config.num_layers));
  uint64_t index = 0, indexer_index = 0;
  for (NamedTensor& t : w.Tensors()) {
    // Each tensor gets its own stream, seeded by its position in Tensors(): a model's streams
    // depend only on its own tensor list, so MLA and sliding-window layers (which change that
    // list only for models that have them) leave every other model's weights unchanged. The
    // indexer's tensors are numbered apart (and their streams offset), so adding an indexer
    // leaves the model's other tensors as they were without it.
    const bool is_indexer = t.name.find(".self_attn.indexer.") != std::string::npos;
    uint64_t state = is_indexer
                         ? seed ^ (0xA0761D6478BD642Full * ++indexer_index) ^ 0xE7037ED1A0B428DBull
                         : seed ^ (0xD1B54A32D192ED03ull * ++index);
    const size_t n = static_cast<size_t>(Numel(t.shape));
    t.data->resize(n);
    const bool is_norm = t.shape.size() == 1;
    const bool is_embedding = t.name == "model.embed_tokens.weight";
    const bool is_lm_head = t.name == "lm_head.weight";
    // Linear layers: variance 1/in keeps activations O(1). The LM head is scaled up so that the
    // next-token distribution is peaked and greedy choices are robust to rounding.
    float scale = 1.0f;
    if (!is_norm && !is_embedding) scale = std::sqrt(3.0f / static_cast<float>(t.shape[1]));
    if (is_lm_head) scale *= 4.0f;
    for (size_t i = 0; i < n; ++i) {
      float u = UniformSym(&state);
      (*t.data)[i] = is_norm ? 1.0f + 0.1f * u : scale * u;
    }
  }
  return w;
}

StatusOr<ModelWeights> ModelWeights::FromSafetensors(const SafetensorsFile& file,
                                                     const ModelConfig& config) {
  Status s = config.Validate();
  if (!s.ok()) return s;
  ModelWeights w;
  w.config = config;
  w.layers.resize(static_cast<size_t>(config.num_layers));
  for (NamedTensor& t : w.Tensors()) {
    const SafetensorsTensor* found = file.Find(t.name);
    if (found == nullptr) {
      return Status::NotFound("weights: checkpoint has no tensor '" + t.name + "' (shape " +
                              Shape(t.shape) + ")");
    }
    if (found->shape != t.shape) {
      return Status::InvalidArgument("weights: tensor '" + t.name + "' has shape " +
                                     Shape(found->shape) + " but the config needs " +
                                     Shape(t.shape));
    }
    StatusOr<std::vector<float>> data = file.ReadFloat32(t.name);
    if (!data.ok()) return data.status();
    *t.data = std::move(data).value();
  }
  return w;
}

StatusOr<ModelWeights> ModelWeights::LoadSafetensors(const std::string& path,
                                                     const ModelConfig& config) {
  StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  return FromSafetensors(*file, config);
}

}  // namespace pdlib::kernels
