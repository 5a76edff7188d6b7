#include "pdlib_kernels/config.h"

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
      if (layer_kinds[i] != LayerKind::kAttention && layer_kinds[i] != LayerKind::kRecurrent) {
        return Bad("layer_kinds[" + std::to_string(i) + "] is not attention or recurrent");
      }
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
  return s;
}

LayerKind ModelConfig::layer_kind(int32_t layer) const {
  if (layer_kinds.empty() || layer < 0 || static_cast<size_t>(layer) >= layer_kinds.size()) {
    return LayerKind::kAttention;
  }
  return layer_kinds[static_cast<size_t>(layer)];
}

int32_t ModelConfig::num_attention_layers() const { return num_layers - num_recurrent_layers(); }

int32_t ModelConfig::num_recurrent_layers() const {
  int32_t n = 0;
  for (LayerKind kind : layer_kinds) n += kind == LayerKind::kRecurrent ? 1 : 0;
  return n;
}

int32_t ModelConfig::kv_layer_index(int32_t layer) const {
  if (layer < 0 || layer >= num_layers || layer_kind(layer) != LayerKind::kAttention) return -1;
  int32_t index = 0;
  for (int32_t l = 0; l < layer; ++l) index += layer_kind(l) == LayerKind::kAttention ? 1 : 0;
  return index;
}

int32_t ModelConfig::state_layer_index(int32_t layer) const {
  if (layer < 0 || layer >= num_layers || layer_kind(layer) != LayerKind::kRecurrent) return -1;
  int32_t index = 0;
  for (int32_t l = 0; l < layer; ++l) index += layer_kind(l) == LayerKind::kRecurrent ? 1 : 0;
  return index;
}

ModelFingerprint ModelConfig::Fingerprint(std::string model_name) const {
  ModelFingerprint fp;
  fp.num_layers = num_attention_layers();
  fp.num_kv_heads = num_kv_heads;
  fp.head_dim = head_dim;
  fp.dtype_bytes = static_cast<int32_t>(kv_elem_bytes());
  fp.model_name = std::move(model_name);
  return fp;
}

}  // namespace pdlib::kernels
