#include "examples/scheduler/metrics.h"

#include <cstdio>

namespace pdlib::sched {
namespace {

// Label values escape backslash, double quote and newline (exposition format).
std::string Labels(const std::map<std::string, std::string>& labels) {
  std::string out;
  for (const auto& [k, v] : labels) {
    out += out.empty() ? "{" : ",";
    out += k + "=\"";
    for (char c : v) {
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      if (c == '\\' || c == '"') out += '\\';
      out += c;
    }
    out += "\"";
  }
  return out.empty() ? out : out + "}";
}

}  // namespace

std::string RenderPrometheus(const SchedulerMetrics& m,
                             const std::map<std::string, std::string>& labels) {
  const std::string l = Labels(labels);
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, uint64_t value) {
    const std::string full = std::string("pdlib_scheduler_") + name;
    out += "# HELP " + full + " " + help + "\n# TYPE " + full + " " + type + "\n" + full + l + " " +
           std::to_string(value) + "\n";
  };
  metric("bootstrap_queue_size", "gauge", "Prefill requests waiting for decode's TransferInfo.",
         m.bootstrap_queue_size);
  metric("waiting_queue_size", "gauge", "Requests waiting for a forward pass or a batch slot.",
         m.waiting_queue_size);
  metric("inflight_queue_size", "gauge", "Prefill requests whose KV is being transferred.",
         m.inflight_queue_size);
  metric("prealloc_queue_size", "gauge", "Decode requests waiting for pre-allocated pages.",
         m.prealloc_queue_size);
  metric("transfer_queue_size", "gauge", "Decode requests whose KV is being received.",
         m.transfer_queue_size);
  metric("running_requests", "gauge", "Requests in the decode running batch.", m.running_requests);
  metric("retracted_queue_size", "gauge", "Requests retracted to host memory.",
         m.retracted_queue_size);
  metric("prealloc_tokens", "gauge", "Tokens pre-allocated to requests in the transfer queue.",
         m.prealloc_tokens);
  metric("total_tokens", "gauge", "KV cache capacity in tokens.", m.total_tokens);
  metric("free_tokens", "gauge", "Free KV cache tokens.", m.free_tokens);
  metric("quarantined_requests", "gauge",
         "Failed requests whose pages wait for pdlib to release them (PagesReusable).",
         m.quarantined_requests);
  metric("quarantined_pages", "gauge", "KV pages held by quarantined requests.",
         m.quarantined_pages);
  metric("requests_total", "counter", "Requests accepted.", m.requests_total);
  metric("rejected_reqs_total", "counter", "Requests refused on arrival.", m.rejected_reqs);
  metric("finished_reqs_total", "counter", "Requests finished successfully.", m.finished_reqs);
  metric("bootstrap_failed_reqs_total", "counter", "Requests failed before their transfer.",
         m.bootstrap_failed_reqs);
  metric("transfer_failed_reqs_total", "counter", "Requests failed during or after transfer.",
         m.transfer_failed_reqs);
  metric("retracted_reqs_total", "counter", "Retractions to host memory.", m.retracted_reqs);
  metric("resumed_reqs_total", "counter", "Retracted requests resumed.", m.resumed_reqs);
  metric("transferred_pages_total", "counter", "KV pages sent or received.", m.transferred_pages);
  metric("transferred_bytes_total", "counter", "KV bytes sent or received.", m.transferred_bytes);
  metric("forward_passes_total", "counter", "Forward passes run.", m.forward_passes);
  metric("forward_tokens_total", "counter", "Tokens through forward passes.", m.forward_tokens);
  char latency[64];
  std::snprintf(latency, sizeof(latency), "%.6f",
                static_cast<double>(m.transfer_latency_us_sum) / 1e6);
  out +=
      "# HELP pdlib_scheduler_transfer_latency_seconds KV transfer time seen by the scheduler.\n"
      "# TYPE pdlib_scheduler_transfer_latency_seconds summary\n"
      "pdlib_scheduler_transfer_latency_seconds_sum" +
      l + " " + latency + "\n" + "pdlib_scheduler_transfer_latency_seconds_count" + l + " " +
      std::to_string(m.transfer_latency_count) + "\n";
  return out;
}

}  // namespace pdlib::sched
