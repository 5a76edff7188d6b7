#include "lib/control/bootstrap_types.h"

#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pdlib {
inline namespace v1 {
namespace control {

std::string RankIdString(const RankId& id) {
  return absl::StrFormat("(dp %d, tp %d, pp %d)", id.dp_rank, id.tp_rank, id.pp_rank);
}

bool FingerprintsMatch(const ModelFingerprint& a, const ModelFingerprint& b) {
  return FingerprintDifference(a, b).empty();
}

std::string FingerprintDifference(const ModelFingerprint& a, const ModelFingerprint& b) {
  std::vector<std::string> diffs;
  auto check = [&diffs](const char* name, int32_t x, int32_t y) {
    if (x != y) diffs.push_back(absl::StrFormat("%s %d vs %d", name, x, y));
  };
  check("num_layers", a.num_layers, b.num_layers);
  check("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  check("head_dim", a.head_dim, b.head_dim);
  check("dtype_bytes", a.dtype_bytes, b.dtype_bytes);
  check("layout_version", a.layout_version, b.layout_version);
  if (!a.model_name.empty() && !b.model_name.empty() && a.model_name != b.model_name) {
    diffs.push_back(absl::StrFormat("model_name '%s' vs '%s'", a.model_name, b.model_name));
  }
  return absl::StrJoin(diffs, ", ");
}

std::string FingerprintString(const ModelFingerprint& fp) {
  return absl::StrFormat(
      "{num_layers %d, num_kv_heads %d, head_dim %d, dtype_bytes %d, layout_version %d, "
      "model_name '%s'}",
      fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype_bytes, fp.layout_version,
      fp.model_name);
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
