#include "tools/chaos/chaos_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace pdlib_chaos {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string Map(const std::map<std::string, uint64_t>& m) {
  std::string out = "{";
  for (const auto& [k, v] : m) {
    if (out.size() > 1) out += ",";
    out += Quote(k) + ":" + std::to_string(v);
  }
  return out + "}";
}

std::string TallyFields(const Tally& t) {
  std::ostringstream o;
  o << "\"requests\":" << t.requests << ",\"faults\":" << t.faults
    << ",\"succeeded\":" << t.succeeded << ",\"failed\":" << t.failed << ",\"hung\":" << t.hung
    << ",\"bad_bytes\":" << t.bad_bytes << ",\"leaked\":" << t.leaked
    << ",\"stale_writes\":" << t.stale_writes << ",\"failure_reasons\":" << Map(t.failure_reasons)
    << ",\"faults_by_kind\":" << Map(t.faults_by_kind) << ",\"restarts\":" << t.restarts
    << ",\"succeeded_after_restart\":" << t.succeeded_after_restart << ",\"crashes\":" << t.crashes
    << ",\"ucx_known_aborts\":" << t.ucx_known_aborts << ",\"unclean_exits\":" << t.unclean_exits
    << ",\"restart_failures\":" << t.restart_failures << ",\"probes\":" << t.probes
    << ",\"probes_failed\":" << t.probes_failed << ",\"leaked_by_kind\":" << Map(t.leaked_by_kind)
    << ",\"verified_requests\":" << t.verified_requests
    << ",\"verified_bytes\":" << t.verified_bytes << ",\"harness_errors\":" << t.harness_errors
    << ",\"max_fault_to_terminal_ms\":" << t.max_fault_to_terminal_ms
    << ",\"hang_bound_ms\":" << t.hang_bound_ms
    << ",\"quarantined_requests\":" << t.quarantined_requests
    << ",\"quarantined_pages\":" << t.quarantined_pages
    << ",\"quarantine_peak_pages\":" << t.quarantine_peak_pages
    << ",\"quarantine_max_hold_ms\":" << t.quarantine_max_hold_ms;
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.2f", t.seconds);
  o << ",\"seconds\":" << seconds;
  return o.str();
}

}  // namespace

void Tally::Add(const Tally& o) {
  requests += o.requests;
  succeeded += o.succeeded;
  failed += o.failed;
  hung += o.hung;
  bad_bytes += o.bad_bytes;
  stale_writes += o.stale_writes;
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
  verified_requests += o.verified_requests;
  verified_bytes += o.verified_bytes;
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
         unclean_exits == 0 && restart_failures == 0 && probes_failed == 0;
}

std::string RenderJson(const Report& r) {
  std::ostringstream o;
  o << "{" << TallyFields(r.total) << ",\"backend\":" << Quote(r.backend)
    << ",\"transport\":" << Quote(r.transport)
    << ",\"bytes_checked\":" << (r.bytes_checked ? "true" : "false") << ",\"seed\":" << r.seed
    << ",\"topologies\":{";
  bool first = true;
  for (const auto& [name, t] : r.by_topology) {
    o << (first ? "" : ",") << Quote(name) << ":{" << TallyFields(t) << "}";
    first = false;
  }
  o << "}}";
  return o.str();
}

std::string RenderSummary(const Report& r) {
  std::ostringstream o;
  const Tally& t = r.total;
  o << "pdlib-chaos: backend " << r.backend << " (" << r.transport << "), seed " << r.seed
    << ", bytes " << (r.bytes_checked ? "checked" : "not checked (backend moves none)") << "\n";
  for (const auto& [name, x] : r.by_topology) {
    o << "  " << name << ": " << x.requests << " requests, " << x.faults << " faults, "
      << x.succeeded << " succeeded, " << x.failed << " failed, " << x.hung << " hung, "
      << x.bad_bytes << " bad bytes, " << x.stale_writes << " stale writes, " << x.leaked
      << " leaked (" << x.seconds << " s)\n";
  }
  o << "  faults:";
  for (const auto& [k, v] : t.faults_by_kind) o << " " << k << "=" << v;
  o << "; restarts " << t.restarts << ", succeeded after a restart " << t.succeeded_after_restart
    << "\n  failures:";
  for (const auto& [k, v] : t.failure_reasons) o << " " << k << "=" << v;
  o << "\n  slowest room hit by a fault: terminal " << t.max_fault_to_terminal_ms
    << " ms after the first fault (hang bound " << t.hang_bound_ms << " ms); probes "
    << t.probes - t.probes_failed << "/" << t.probes << " ok; crashes " << t.crashes
    << ", unclean exits " << t.unclean_exits << "\n  verified " << t.verified_requests
    << " requests, " << t.verified_bytes << " bytes\n";
  if (t.ucx_known_aborts > 0) {
    o << "  NOTE: " << t.ucx_known_aborts
      << " process(es) aborted inside UCX 1.13 (a wireup message pending on a tcp endpoint "
         "whose peer was killed mid-connect; fixed upstream in openucx/ucx#8175): lost like a "
         "killed process\n";
  }
  for (const auto& p : t.problems) o << "  PROBLEM: " << p << "\n";
  o << (t.Clean() ? "  RESULT: clean\n" : "  RESULT: NOT CLEAN\n");
  return o.str();
}

}  // namespace pdlib_chaos
