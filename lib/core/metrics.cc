// Prometheus text rendering of KVManagerMetrics (SPEC R10.1).
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pdlib/kv_manager.h"

namespace pdlib {
inline namespace v1 {
namespace {

// Label values escape backslash, double quote and newline (exposition format).
std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string Labels(const std::map<std::string, std::string>& labels,
                   const std::pair<std::string, std::string>* extra = nullptr) {
  std::string out;
  auto add = [&](const std::string& k, const std::string& v) {
    absl::StrAppend(&out, out.empty() ? "{" : ",", k, "=\"", Escape(v), "\"");
  };
  for (const auto& [k, v] : labels) add(k, v);
  if (extra) add(extra->first, extra->second);
  if (!out.empty()) out += "}";
  return out;
}

}  // namespace

std::string RenderPrometheus(const KVManagerMetrics& m,
                             const std::map<std::string, std::string>& labels) {
  std::string out;
  const std::string l = Labels(labels);
  auto metric = [&](const char* name, const char* type, const char* help, uint64_t value) {
    absl::StrAppendFormat(&out, "# HELP pdlib_%s %s\n# TYPE pdlib_%s %s\npdlib_%s%s %d\n", name,
                          help, name, type, name, l, value);
  };
  metric("live_rooms", "gauge", "Requests with a live handle.", m.live_rooms);
  metric("bootstrap_queue_size", "gauge", "Requests in Bootstrapping.", m.bootstrap_queue_size);
  metric("transfer_queue_size", "gauge", "Requests in WaitingForInput or Transferring.",
         m.transfer_queue_size);
  metric("connections", "gauge", "Live peer connections.", m.connections);
  metric("requests_total", "counter", "Requests created.", m.requests_total);
  metric("succeeded_reqs_total", "counter", "Requests that reached Success.", m.rooms_succeeded);
  metric("failed_reqs_total", "counter", "Requests that reached Failed.", m.rooms_failed);
  metric("bootstrap_failed_reqs_total", "counter", "Requests failed during Bootstrapping.",
         m.bootstrap_failed_reqs);
  metric("transfer_failed_reqs_total", "counter", "Requests failed after Bootstrapping.",
         m.transfer_failed_reqs);
  metric("transferred_bytes_total", "counter", "KV bytes written to peers.", m.bytes_transferred);
  metric("transferred_pages_total", "counter", "KV pages written to peers.", m.pages_transferred);
  metric("write_batches_total", "counter", "Write batches completed.", m.write_batches);
  metric("quarantined_rooms", "gauge",
         "Failed requests whose pages are held until no late write can land.", m.quarantined_rooms);
  metric("quarantined_pages", "gauge", "Pages (KV, metadata, state) held by quarantine.",
         m.quarantined_pages);
  metric("quarantine_oldest_ms", "gauge", "Age of the oldest current quarantine.",
         m.quarantine_oldest_ms);
  metric("quarantine_max_hold_ms", "gauge", "Longest quarantine so far.", m.quarantine_max_hold_ms);
  metric("quarantine_released_drained_total", "counter",
         "Quarantines ended by the prefill rank reporting the room drained.",
         m.quarantine_released_drained);
  metric("quarantine_released_fenced_total", "counter",
         "Quarantines ended by fencing the connection.", m.quarantine_released_fenced);
  metric("quarantine_released_gone_total", "counter",
         "Quarantines ended because the prefill manager is gone.", m.quarantine_released_gone);
  metric("fenced_connections_total", "counter", "Connections cut off with a transport fence.",
         m.fenced_connections);
  metric("rooms_checksummed_total", "counter", "Rooms whose KV was digested end to end.",
         m.rooms_checksummed);
  metric("rooms_checksummed_in_flight_total", "counter",
         "Digested rooms whose KV the transport digested as it moved it (decode: copied in; "
         "prefill: sent).",
         m.rooms_checksummed_in_flight);
  metric("checksum_mismatches_total", "counter",
         "Rooms whose KV did not match its digest (failed DATA_LOSS).", m.checksum_mismatches);
  absl::StrAppend(&out,
                  "# HELP pdlib_failed_reqs_by_cause_total Failed requests by status code.\n"
                  "# TYPE pdlib_failed_reqs_by_cause_total counter\n");
  for (const auto& [cause, n] : m.failed_by_cause) {
    std::pair<std::string, std::string> extra{"cause", cause};
    absl::StrAppendFormat(&out, "pdlib_failed_reqs_by_cause_total%s %d\n", Labels(labels, &extra),
                          n);
  }
  if (!m.checksum_mismatches_by_peer.empty()) {
    absl::StrAppend(&out,
                    "# HELP pdlib_checksum_mismatches_by_peer_total KV digest mismatches of rooms "
                    "a prefill rank wrote to.\n"
                    "# TYPE pdlib_checksum_mismatches_by_peer_total counter\n");
    for (const auto& [peer, n] : m.checksum_mismatches_by_peer) {
      std::pair<std::string, std::string> extra{"peer", peer};
      absl::StrAppendFormat(&out, "pdlib_checksum_mismatches_by_peer_total%s %d\n",
                            Labels(labels, &extra), n);
    }
  }
  absl::StrAppendFormat(&out,
                        "# HELP pdlib_transfer_latency_seconds Creation to Success.\n"
                        "# TYPE pdlib_transfer_latency_seconds summary\n"
                        "pdlib_transfer_latency_seconds_sum%s %.6f\n"
                        "pdlib_transfer_latency_seconds_count%s %d\n",
                        l, m.transfer_latency_us_sum / 1e6, l, m.transfer_latency_count);
  return out;
}

}  // namespace v1
}  // namespace pdlib
