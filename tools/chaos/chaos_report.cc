#include "tools/chaos/chaos_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace pdlib_chaos {
namespace {

// The figures of one Tally, in the order the report has always had (the one JSON writer is
// nlohmann-json; ordered_json keeps insertion order).
nlohmann::ordered_json TallyFields(const Tally& t) {
  return {{"requests", t.requests},
          {"faults", t.faults},
          {"succeeded", t.succeeded},
          {"failed", t.failed},
          {"hung", t.hung},
          {"bad_bytes", t.bad_bytes},
          {"leaked", t.leaked},
          {"stale_writes", t.stale_writes},
          {"failure_reasons", t.failure_reasons},
          {"faults_by_kind", t.faults_by_kind},
          {"restarts", t.restarts},
          {"succeeded_after_restart", t.succeeded_after_restart},
          {"crashes", t.crashes},
          {"ucx_known_aborts", t.ucx_known_aborts},
          {"unclean_exits", t.unclean_exits},
          {"restart_failures", t.restart_failures},
          {"probes", t.probes},
          {"probes_failed", t.probes_failed},
          {"untouched_requests", t.untouched_requests},
          {"failed_untouched", t.failed_untouched},
          {"requests_after_heal", t.requests_after_heal},
          {"settle_ms", t.settle_ms},
          {"fault_errors", t.fault_errors},
          {"leaked_by_kind", t.leaked_by_kind},
          {"verified_requests", t.verified_requests},
          {"verified_bytes", t.verified_bytes},
          {"verified_prefix_requests", t.verified_prefix_requests},
          {"verified_kept_pages", t.verified_kept_pages},
          {"harness_errors", t.harness_errors},
          {"max_fault_to_terminal_ms", t.max_fault_to_terminal_ms},
          {"hang_bound_ms", t.hang_bound_ms},
          {"corruptions_injected", t.corruptions_injected},
          {"corruptions_caught", t.corruptions_caught},
          {"quarantined_requests", t.quarantined_requests},
          {"quarantined_pages", t.quarantined_pages},
          {"quarantine_peak_pages", t.quarantine_peak_pages},
          {"quarantine_max_hold_ms", t.quarantine_max_hold_ms},
          {"seconds", std::round(t.seconds * 100) / 100}};  // to the hundredth
}

}  // namespace

void Tally::Add(const Tally& o) {
  requests += o.requests;
  succeeded += o.succeeded;
  failed += o.failed;
  hung += o.hung;
  bad_bytes += o.bad_bytes;
  stale_writes += o.stale_writes;
  corruptions_injected += o.corruptions_injected;
  corruptions_caught += o.corruptions_caught;
  quarantined_requests += o.quarantined_requests;
  quarantined_pages += o.quarantined_pages;
  quarantine_peak_pages = std::max(quarantine_peak_pages, o.quarantine_peak_pages);
  quarantine_max_hold_ms = std::max(quarantine_max_hold_ms, o.quarantine_max_hold_ms);
  leaked += o.leaked;
  faults += o.faults;
  restarts += o.restarts;
  succeeded_after_restart += o.succeeded_after_restart;
  crashes += o.crashes;
  ucx_known_aborts += o.ucx_known_aborts;
  unclean_exits += o.unclean_exits;
  restart_failures += o.restart_failures;
  probes += o.probes;
  probes_failed += o.probes_failed;
  untouched_requests += o.untouched_requests;
  failed_untouched += o.failed_untouched;
  requests_after_heal += o.requests_after_heal;
  settle_ms = std::max(settle_ms, o.settle_ms);
  fault_errors += o.fault_errors;
  verified_requests += o.verified_requests;
  verified_bytes += o.verified_bytes;
  verified_prefix_requests += o.verified_prefix_requests;
  verified_kept_pages += o.verified_kept_pages;
  harness_errors += o.harness_errors;
  max_fault_to_terminal_ms = std::max(max_fault_to_terminal_ms, o.max_fault_to_terminal_ms);
  hang_bound_ms = std::max(hang_bound_ms, o.hang_bound_ms);
  seconds += o.seconds;
  for (const auto& [k, v] : o.failure_reasons) failure_reasons[k] += v;
  for (const auto& [k, v] : o.faults_by_kind) faults_by_kind[k] += v;
  for (const auto& [k, v] : o.leaked_by_kind) leaked_by_kind[k] += v;
  problems.insert(problems.end(), o.problems.begin(), o.problems.end());
}

bool IsKnownUcxAbort(std::string_view log) {
  // "ucp_request.c:684  Assertion `(req->send.wireup.type == UCP_WIREUP_MSG_EP_REMOVED) || ...'
  // failed: req 0x... ep 0x...: got REP message", then UCX's backtrace through the purge.
  return log.find("Assertion `(req->send.wireup.type == UCP_WIREUP_MSG_EP_REMOVED)") !=
             std::string_view::npos &&
         log.find("ucp_request_send_state_ff") != std::string_view::npos;
}

bool Tally::Clean() const {
  return hung == 0 && bad_bytes == 0 && leaked == 0 && stale_writes == 0 && crashes == 0 &&
         unclean_exits == 0 && restart_failures == 0 && probes_failed == 0 &&
         failed_untouched == 0 && fault_errors == 0 &&
         (faults > 0 || corruptions_caught == corruptions_injected);
}

std::string RenderJson(const Report& r) {
  nlohmann::ordered_json j = TallyFields(r.total);
  j["backend"] = r.backend;
  j["transport"] = r.transport;
  j["bytes_checked"] = r.bytes_checked;
  j["seed"] = r.seed;
  j["netns"] = r.netns;
  j["rails"] = r.rails;
  j["discovery"] = r.discovery;
  j["direction"] = r.direction;
  j["skipped_faults"] = r.skipped_faults;
  j["topologies"] = nlohmann::ordered_json::object();
  for (const auto& [name, t] : r.by_topology) j["topologies"][name] = TallyFields(t);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string RenderSummary(const Report& r) {
  std::ostringstream o;
  const Tally& t = r.total;
  o << "pdlib-chaos: backend " << r.backend << " (" << r.transport << "), seed " << r.seed
    << ", bytes " << (r.bytes_checked ? "checked" : "not checked (backend moves none)")
    << ", discovery " << r.discovery << ", " << r.direction
    << (r.netns ? ", hosts in network namespaces" : "")
    << (r.rails > 1 ? ", " + std::to_string(r.rails) + " rails (ucx.rails)" : std::string())
    << "\n";
  for (const auto& [name, x] : r.by_topology) {
    o << "  " << name << ": " << x.requests << " requests, " << x.faults << " faults, "
      << x.succeeded << " succeeded, " << x.failed << " failed, " << x.hung << " hung, "
      << x.bad_bytes << " bad bytes, " << x.stale_writes << " stale writes, " << x.leaked
      << " leaked (" << x.seconds << " s)\n";
  }
  o << "  faults:";
  for (const auto& [k, v] : t.faults_by_kind) o << " " << k << "=" << v;
  o << "; restarts " << t.restarts << ", succeeded after a restart " << t.succeeded_after_restart
    << "\n";
  for (const auto& [k, why] : r.skipped_faults) o << "  skipped: " << k << " (" << why << ")\n";
  if (t.fault_errors > 0)
    o << "  faults that could not be injected or ended: " << t.fault_errors << "\n";
  o << "  untouched by any fault (settle " << t.settle_ms << " ms): " << t.untouched_requests
    << " requests, " << t.requests_after_heal << " of them after a heal; " << t.failed_untouched
    << " failed\n  failures:";
  for (const auto& [k, v] : t.failure_reasons) o << " " << k << "=" << v;
  o << "\n  slowest room hit by a fault: terminal " << t.max_fault_to_terminal_ms
    << " ms after the first fault (hang bound " << t.hang_bound_ms << " ms); probes "
    << t.probes - t.probes_failed << "/" << t.probes << " ok; crashes " << t.crashes
    << ", unclean exits " << t.unclean_exits << "\n  verified " << t.verified_requests
    << " requests (" << t.verified_prefix_requests << " with a decode prefix), " << t.verified_bytes
    << " bytes";
  if (r.direction == "pull") {
    o << "; " << t.verified_kept_pages << " pages of failed requests that InvalidPages() left out";
  }
  o << "\n";
  if (t.corruptions_injected > 0 || t.corruptions_caught > 0) {
    o << "  corrupted in flight: " << t.corruptions_injected << " rooms, caught by the KV checksum "
      << t.corruptions_caught << "\n";
  }
  if (t.ucx_known_aborts > 0) {
    o << "  NOTE: " << t.ucx_known_aborts
      << " process(es) aborted inside UCX 1.13 (a wireup message pending on a tcp endpoint "
         "whose peer was killed mid-connect; fixed upstream in openucx/ucx#8175): lost like a "
         "killed process\n";
  }
  for (const auto& p : t.problems) o << "  PROBLEM: " << p << "\n";
  o << (t.Clean() ? "  RESULT: CLEAN\n" : "  RESULT: NOT CLEAN\n");
  return o.str();
}

}  // namespace pdlib_chaos
