#include "pdlib_kernels/config.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace pdlib::kernels {
namespace {

Status Bad(const std::string& what) { return Status::InvalidArgument("model config: " + what); }

}  // namespace

std::string_view KVDtypeName(KVDtype dtype) {
  switch (dtype) {
    case KVDtype::kFloat32: return "fp32";
    case KVDtype::kBFloat16: return "bf16";
  }
  return "unknown";
}

ModelConfig ModelConfig::SmallHybrid() {
  ModelConfig config;
  config.layer_kinds = {LayerKind::kAttention, LayerKind::kRecurrent, LayerKind::kAttention,
                        LayerKind::kRecurrent};
  return config;
}

ModelConfig ModelConfig::SmallMla() {
  ModelConfig config;
  config.attention = AttentionKind::kMla;
  config.num_kv_heads = 1;
  config.kv_lora_rank = 64;
  config.qk_rope_dim = 32;
  return config;
}

ModelConfig ModelConfig::SmallSwa() {
  ModelConfig config;
  config.layer_kinds = {LayerKind::kAttention, LayerKind::kSlidingWindow, LayerKind::kAttention,
                        LayerKind::kSlidingWindow};
  config.sliding_window = 24;
  return config;
}

ModelConfig ModelConfig::SmallNsa() {
  ModelConfig config;
  config.index_dim = 32;
  config.index_topk = 24;
  return config;
}

Status ModelConfig::Validate() const {
  // Upper bounds keep every derived size far from integer overflow and catch unit mistakes.
  auto in_range = [](int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  if (!in_range(num_layers, 1, 1024)) {
    return Bad("num_layers " + std::to_string(num_layers) + " not in [1, 1024]");
  }
  if (!in_range(hidden_size, 1, 65536)) {
    return Bad("hidden_size " + std::to_string(hidden_size) + " not in [1, 65536]");
  }
  if (!in_range(num_heads, 1, 1024) || !in_range(num_kv_heads, 1, 1024)) {
    return Bad("num_heads " + std::to_string(num_heads) + " and num_kv_heads " +
               std::to_string(num_kv_heads) + " must be in [1, 1024]");
  }
  if (num_heads % num_kv_heads != 0) {
    return Bad("num_heads " + std::to_string(num_heads) + " is not a multiple of num_kv_heads " +
               std::to_string(num_kv_heads));
  }
  if (!in_range(head_dim, 2, 1024) || head_dim % 2 != 0) {
    return Bad("head_dim " + std::to_string(head_dim) + " must be even and in [2, 1024]");
  }
  if (!in_range(intermediate_size, 1, 262144)) {
    return Bad("intermediate_size " + std::to_string(intermediate_size) + " not in [1, 262144]");
  }
  if (!in_range(vocab_size, 1, 1 << 20)) {
    return Bad("vocab_size " + std::to_string(vocab_size) + " not in [1, 1048576]");
  }
  if (!in_range(page_size, 1, 4096)) {
    return Bad("page_size " + std::to_string(page_size) + " not in [1, 4096]");
  }
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) {
    return Bad("rope_theta must be a positive finite number");
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps)) {
    return Bad("rms_norm_eps must be a positive finite number");
  }
  if (kv_dtype != KVDtype::kFloat32 && kv_dtype != KVDtype::kBFloat16) {
    return Bad("kv_dtype " + std::to_string(static_cast<int>(kv_dtype)) + " is not fp32 or bf16");
  }
  if (kv_layout != KVLayout::kNHD && kv_layout != KVLayout::kHND) {
    return Bad("kv_layout " + std::to_string(static_cast<int>(kv_layout)) + " is not NHD or HND");
  }
  if (!layer_kinds.empty()) {
    if (layer_kinds.size() != static_cast<size_t>(num_layers)) {
      return Bad("layer_kinds has " + std::to_string(layer_kinds.size()) +
                 " entries; expected num_layers = " + std::to_string(num_layers) + " (or none)");
    }
    for (size_t i = 0; i < layer_kinds.size(); ++i) {
      if (layer_kinds[i] != LayerKind::kAttention && layer_kinds[i] != LayerKind::kRecurrent &&
          layer_kinds[i] != LayerKind::kSlidingWindow) {
        return Bad("layer_kinds[" + std::to_string(i) +
                   "] is not attention, recurrent or sliding-window");
      }
    }
  }
  if (attention != AttentionKind::kGqa && attention != AttentionKind::kMla) {
    return Bad("attention " + std::to_string(static_cast<int>(attention)) + " is not GQA or MLA");
  }
  if (is_mla()) {
    if (num_kv_heads != 1) {
      return Bad("MLA keeps one latent row per token: num_kv_heads must be 1, not " +
                 std::to_string(num_kv_heads));
    }
    if (!in_range(kv_lora_rank, 1, 4096) || !in_range(qk_rope_dim, 2, 1024) ||
        qk_rope_dim % 2 != 0) {
      return Bad("MLA needs kv_lora_rank in [1, 4096] (got " + std::to_string(kv_lora_rank) +
                 ") and an even qk_rope_dim in [2, 1024] (got " + std::to_string(qk_rope_dim) +
                 ")");
    }
    if (num_swa_layers() > 0) return Bad("MLA with sliding-window layers is not supported");
  } else if (kv_lora_rank != 0 || qk_rope_dim != 0) {
    return Bad("kv_lora_rank and qk_rope_dim are MLA settings; GQA needs 0 for both");
  }
  if (num_swa_layers() > 0) {
    if (!in_range(sliding_window, 1, 1 << 20)) {
      return Bad("sliding_window " + std::to_string(sliding_window) +
                 " not in [1, 1048576] for a model with sliding-window layers");
    }
    if (num_recurrent_layers() > 0) {
      // pdlib carries one state type per model (KVArgs::state_type).
      return Bad("a model may have recurrent or sliding-window layers, not both");
    }
  } else if (sliding_window != 0) {
    return Bad("sliding_window " + std::to_string(sliding_window) +
               " set but no layer is a sliding-window layer");
  }
  if (num_attention_layers() < 1) return Bad("the model needs at least one full attention layer");
  if (index_dim != 0 || index_topk != 0) {
    if (!in_range(index_dim, 1, 4096) || !in_range(index_topk, 1, 1 << 20)) {
      return Bad("the lightning indexer needs index_dim in [1, 4096] (got " +
                 std::to_string(index_dim) + ") and index_topk in [1, 1048576] (got " +
                 std::to_string(index_topk) + "); set both to 0 for dense attention");
    }
    if (is_mla()) return Bad("the lightning indexer is for GQA attention; MLA is not supported");
    if (num_swa_layers() > 0 || num_recurrent_layers() > 0) {
      // pdlib carries one state type per model (KVArgs::state_type): NSA here.
      return Bad(
          "a model with a lightning indexer may not have sliding-window or recurrent "
          "layers (pdlib moves one state type per model)");
    }
  }
  return Status::OK();
}

std::string ModelConfig::ToString() const {
  std::string s =
      "layers=" + std::to_string(num_layers) + " (" + std::to_string(num_attention_layers()) +
      " attention, " + std::to_string(num_recurrent_layers()) + " recurrent)" +
      " hidden=" + std::to_string(hidden_size) + " heads=" + std::to_string(num_heads) +
      " kv_heads=" + std::to_string(num_kv_heads) + " head_dim=" + std::to_string(head_dim) +
      " intermediate=" + std::to_string(intermediate_size) +
      " vocab=" + std::to_string(vocab_size) + " page_size=" + std::to_string(page_size) +
      " kv_dtype=" + std::string(KVDtypeName(kv_dtype)) +
      " kv_layout=" + (kv_layout == KVLayout::kNHD ? "NHD" : "HND");
  if (is_mla()) {
    s += " attention=MLA kv_lora_rank=" + std::to_string(kv_lora_rank) +
         " qk_rope_dim=" + std::to_string(qk_rope_dim);
  }
  if (has_indexer()) {
    s += " indexer: index_dim=" + std::to_string(index_dim) +
         " index_topk=" + std::to_string(index_topk);
  }
  if (num_swa_layers() > 0) {
    s += " sliding_window=" + std::to_string(sliding_window) + " (" +
         std::to_string(num_swa_layers()) + " layers)";
  }
  return s;
}

LayerKind ModelConfig::layer_kind(int32_t layer) const {
  if (layer_kinds.empty() || layer < 0 || static_cast<size_t>(layer) >= layer_kinds.size()) {
    return LayerKind::kAttention;
  }
  return layer_kinds[static_cast<size_t>(layer)];
}

namespace {

int32_t CountKind(const ModelConfig& c, LayerKind kind, int32_t end_layer) {
  int32_t n = 0;
  for (int32_t l = 0; l < end_layer; ++l) n += c.layer_kind(l) == kind ? 1 : 0;
  return n;
}

int32_t IndexAmong(const ModelConfig& c, LayerKind kind, int32_t layer) {
  if (layer < 0 || layer >= c.num_layers || c.layer_kind(layer) != kind) return -1;
  return CountKind(c, kind, layer);
}

}  // namespace

int32_t ModelConfig::num_attention_layers() const {
  return CountKind(*this, LayerKind::kAttention, num_layers);
}

int32_t ModelConfig::num_recurrent_layers() const {
  return CountKind(*this, LayerKind::kRecurrent, num_layers);
}

int32_t ModelConfig::num_swa_layers() const {
  return CountKind(*this, LayerKind::kSlidingWindow, num_layers);
}

int32_t ModelConfig::kv_layer_index(int32_t layer) const {
  return IndexAmong(*this, LayerKind::kAttention, layer);
}

int32_t ModelConfig::state_layer_index(int32_t layer) const {
  return IndexAmong(*this, LayerKind::kRecurrent, layer);
}

int32_t ModelConfig::swa_layer_index(int32_t layer) const {
  return IndexAmong(*this, LayerKind::kSlidingWindow, layer);
}

ModelConfig::PageRange ModelConfig::SlidingWindowPages(int64_t num_tokens) const {
  if (sliding_window < 1 || num_tokens < 1 || page_size < 1) return {};
  const int64_t first_pos = std::max<int64_t>(0, num_tokens - sliding_window + 1);
  if (first_pos >= num_tokens) return {};  // a window of 1: the next token reads only itself
  return {static_cast<int32_t>(first_pos / page_size),
          static_cast<int32_t>((num_tokens - 1) / page_size + 1)};
}

ModelFingerprint ModelConfig::Fingerprint(std::string model_name) const {
  ModelFingerprint fp;
  fp.num_layers = num_attention_layers();
  fp.num_kv_heads = num_kv_heads;
  fp.head_dim = is_mla() ? kv_width() : head_dim;
  fp.dtype_bytes = static_cast<int32_t>(kv_elem_bytes());
  fp.model_name = std::move(model_name);
  return fp;
}

}  // namespace pdlib::kernels
