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

namespace {

// A peer's strings go into error messages: at most 64 characters of each.
std::string Shown(std::string_view s) {
  constexpr size_t kMax = 64;
  return s.size() <= kMax ? std::string(s) : std::string(s.substr(0, kMax)) + "...";
}

}  // namespace

std::string FingerprintDifference(const ModelFingerprint& a, const ModelFingerprint& b) {
  std::vector<std::string> diffs;
  auto check = [&diffs](const char* name, int32_t x, int32_t y) {
    if (x != y) diffs.push_back(absl::StrFormat("%s %d vs %d", name, x, y));
  };
  auto check_text = [&diffs](const char* name, const std::string& x, const std::string& y) {
    if (x != y) diffs.push_back(absl::StrFormat("%s '%s' vs '%s'", name, Shown(x), Shown(y)));
  };
  check("wire_version", a.wire_version, b.wire_version);
  check("num_layers", a.num_layers, b.num_layers);
  check("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  check("head_dim", a.head_dim, b.head_dim);
  check("dtype_bytes", a.dtype_bytes, b.dtype_bytes);
  check_text("kv_dtype", a.kv_dtype, b.kv_dtype);
  check_text("state_dtype", a.state_dtype, b.state_dtype);
  check_text("page_layout", a.page_layout, b.page_layout);
  check("layout_version", a.layout_version, b.layout_version);
  check_text("engine_tag", a.engine_tag, b.engine_tag);
  // A pdlib without the field sends none: it checks nothing.
  check_text("checksum", a.checksum.empty() ? "off" : a.checksum,
             b.checksum.empty() ? "off" : b.checksum);
  if (!a.model_name.empty() && !b.model_name.empty()) {
    check_text("model_name", a.model_name, b.model_name);
  }
  return absl::StrJoin(diffs, ", ");
}

std::string FingerprintString(const ModelFingerprint& fp) {
  return absl::StrFormat(
      "{wire_version %d, num_layers %d, num_kv_heads %d, head_dim %d, dtype_bytes %d, "
      "kv_dtype '%s', state_dtype '%s', page_layout '%s', layout_version %d, engine_tag '%s', "
      "model_name '%s', checksum '%s'}",
      fp.wire_version, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype_bytes,
      Shown(fp.kv_dtype), Shown(fp.state_dtype), Shown(fp.page_layout), fp.layout_version,
      Shown(fp.engine_tag), Shown(fp.model_name), Shown(fp.checksum));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
