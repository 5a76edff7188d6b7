#include "tools/chaos/chaos_accounting.h"

#include <algorithm>
#include <charconv>
#include <sstream>

namespace pdlib_chaos {

std::string FailureCategory(const Outcome& prefill, const Outcome& decode, bool settled) {
  if (!settled) return "NOT_TERMINAL";
  if (decode.kind == Outcome::kBadBytes || prefill.kind == Outcome::kBadBytes) return "BAD_BYTES";
  if (decode.kind == Outcome::kFailed) return StatusCodeOf(decode.detail);
  if (prefill.kind == Outcome::kFailed) {
    return decode.kind == Outcome::kSuccess ? "PREFILL_FAILED_DECODE_SUCCEEDED"
                                            : StatusCodeOf(prefill.detail);
  }
  if (decode.kind == Outcome::kLost) {
    if (prefill.kind == Outcome::kLost) return "BOTH_LOST";
    return decode.detail.ends_with("killed") ? "DECODE_KILLED" : "DECODE_CRASHED";
  }
  return decode.kind == Outcome::kSuccess ? "" : "NOT_TERMINAL";
}

std::string StatusCodeOf(std::string_view reason) {
  const size_t colon = reason.find(':');
  const std::string_view code = reason.substr(0, colon);
  const bool ok = colon != std::string_view::npos && !code.empty() &&
                  std::all_of(code.begin(), code.end(),
                              [](char c) { return (c >= 'A' && c <= 'Z') || c == '_'; });
  return ok ? std::string(code) : "OTHER";
}

std::map<std::string, uint64_t> ParseCounters(std::string_view line) {
  std::map<std::string, uint64_t> out;
  std::istringstream in{std::string(line)};
  for (std::string token; in >> token;) {
    const size_t eq = token.find('=');
    if (eq == std::string::npos) continue;
    uint64_t v = 0;
    const char* b = token.data() + eq + 1;
    const char* e = token.data() + token.size();
    const auto [end, ec] = std::from_chars(b, e, v);
    if (ec == std::errc() && end == e) out[token.substr(0, eq)] = v;
  }
  return out;
}

std::map<std::string, uint64_t> Leftovers(const std::map<std::string, uint64_t>& m,
                                          uint64_t expected_connections) {
  auto get = [&](const char* k) { return m.contains(k) ? m.at(k) : uint64_t{0}; };
  auto held = [&](const char* capacity, const char* free) {
    return get(capacity) - std::min(get(free), get(capacity));
  };
  std::map<std::string, uint64_t> l;
  l["rooms"] = get("live_rooms") + get("bootstrap_queue") + get("transfer_queue");
  l["handles"] = get("handles");
  l["aux_slots"] = held("aux_capacity", "aux_free");
  l["pages"] = held("pages_capacity", "pages_free");
  l["state_items"] = held("state_capacity", "state_free");
  const uint64_t connections = get("connections");
  l["connections"] = connections > expected_connections ? connections - expected_connections : 0;
  return l;
}

}  // namespace pdlib_chaos
