// Scheduler metrics (SPEC R10.1) and their Prometheus text rendering.
//
// Names are prefixed "pdlib_scheduler_" so that they sit beside the KVManager's own "pdlib_"
// metrics (pdlib::RenderPrometheus) on one /metrics page without clashing: the manager counts
// rooms by transfer state, the scheduler counts requests by queue.
#ifndef PDLIB_EXAMPLES_SCHEDULER_METRICS_H_
#define PDLIB_EXAMPLES_SCHEDULER_METRICS_H_

#include <cstdint>
#include <map>
#include <string>

namespace pdlib::sched {

// A snapshot. Queue sizes and token counts are gauges, *_reqs and *_total are counters. A field
// that does not apply to a role stays 0 (e.g. prealloc_queue_size on prefill).
struct SchedulerMetrics {
  // Prefill queues.
  uint64_t bootstrap_queue_size = 0;  // senders waiting for decode's TransferInfo
  uint64_t waiting_queue_size = 0;    // prefill: bootstrapped, not fully prefilled; decode: KV
                                      // received (or resumed), not yet in the running batch
  uint64_t inflight_queue_size = 0;   // prefill: forward done, KV transfer in progress
  // Decode queues.
  uint64_t prealloc_queue_size = 0;   // receivers waiting for pages
  uint64_t transfer_queue_size = 0;   // pages pre-allocated, KV transfer in progress
  uint64_t running_requests = 0;      // in the running batch
  uint64_t retracted_queue_size = 0;  // KV offloaded to host memory, waiting to resume
  uint64_t prealloc_tokens = 0;       // tokens pre-allocated to requests in the transfer queue
  // Memory.
  uint64_t total_tokens = 0;  // KV capacity (pages x page_size)
  uint64_t free_tokens = 0;
  // Page reuse (page_reuse.h): failed requests whose pages, metadata slot and state slot are held
  // out of use until pdlib says it touches them no more (PagesReusable()), and their KV pages
  // (not counted in free_tokens).
  uint64_t quarantined_requests = 0;
  uint64_t quarantined_pages = 0;
  // Counters.
  uint64_t requests_total = 0;         // accepted by AddRequest
  uint64_t rejected_reqs = 0;          // refused by AddRequest (too long, bad arguments, ...)
  uint64_t finished_reqs = 0;          // finished OK
  uint64_t bootstrap_failed_reqs = 0;  // failed before their transfer began
  uint64_t transfer_failed_reqs = 0;   // failed afterwards (transfer, bad metadata, forward)
  uint64_t retracted_reqs = 0;         // retractions (decode)
  uint64_t resumed_reqs = 0;           // resumptions after a retraction (decode)
  uint64_t transferred_pages = 0;      // KV pages sent (prefill; pull: published) or received
  uint64_t transferred_bytes = 0;      // transferred_pages x the page bytes the host declared
  uint64_t forward_passes = 0;
  uint64_t forward_tokens = 0;  // tokens through forward passes
  // Prefill: last chunk sent -> Success; decode: pre-allocation (receiver Init) -> Success.
  uint64_t transfer_latency_us_sum = 0;
  uint64_t transfer_latency_count = 0;
};

// Prometheus text exposition format; every sample carries `labels` (e.g. {{"role", "decode"}}).
std::string RenderPrometheus(const SchedulerMetrics& m,
                             const std::map<std::string, std::string>& labels = {});

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_METRICS_H_
