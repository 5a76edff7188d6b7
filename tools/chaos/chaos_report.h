// The figures of a pdlib-chaos run (one Tally per topology, and their sum), rendered as one JSON
// object or a human summary. Pure data and formatting; no I/O.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_REPORT_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib_chaos {

struct Tally {
  uint64_t requests = 0;   // requests started (probes excluded)
  uint64_t succeeded = 0;  // decode reached Success with the right bytes, prefill did not fail
  uint64_t failed = 0;     // everything else, by cause in failure_reasons
  // Rooms not terminal on a live side within hang_bound_ms of their start or of the last fault
  // event (kill, freeze, thaw, restart) of their prefill or decode process.
  uint64_t hung = 0;
  // decode Success with bytes that are not the request's (KV after the prefix, state, aux), or a
  // prefill told another decode prefix than the one decode holds
  uint64_t bad_bytes = 0;
  // Writes into decode pages, state items or metadata slots after their request was over (the
  // engine had taken them back): found by a canary the decode process keeps in its free memory;
  // and writes into the pages of a request's decode prefix (decode's own cache, never handed to
  // pdlib): found by the bytes decode keeps there.
  uint64_t stale_writes = 0;
  // Rooms, handles, metadata slots, pages, state items and connections still held by the
  // processes at the end, once everything was quiesced (see leaked_by_kind).
  uint64_t leaked = 0;
  uint64_t faults = 0;  // faults injected (faults_by_kind)
  uint64_t restarts = 0;
  uint64_t succeeded_after_restart = 0;  // succeeded on a restarted process (probes too)
  uint64_t crashes = 0;                  // children that died without being killed by the driver
  // Children that aborted on UCX 1.13's wireup assertion (IsKnownUcxAbort): a peer killed while
  // connecting over tcp; UCX bug fixed upstream (openucx/ucx#8175). Counted apart from crashes,
  // named in the summary, and not a reason for NOT CLEAN: the process is lost like a killed one.
  uint64_t ucx_known_aborts = 0;
  uint64_t unclean_exits = 0;     // children that did not exit 0 within the bound after QUIT
  uint64_t restart_failures = 0;  // restarted children not READY in time (killed, started again)
  uint64_t probes = 0;            // one request per (prefill, decode) pair after the faults
  uint64_t probes_failed = 0;
  // Requests no fault touched: none of their processes or hosts, nor the discovery, had a fault
  // in effect from settle_ms before their start to their end. They must all succeed:
  // failed_untouched counts those that did not. requests_after_heal: those of them that started
  // after a link fault on one of their hosts (or a discovery outage) had ended.
  uint64_t untouched_requests = 0;
  uint64_t failed_untouched = 0;
  uint64_t requests_after_heal = 0;
  int64_t settle_ms = 0;
  uint64_t fault_errors = 0;       // faults that could not be injected or ended (nft, tc, etcd)
  uint64_t verified_requests = 0;  // Success requests whose bytes decode checked
  uint64_t verified_bytes = 0;
  // Of verified_requests, those whose decode held a prefix of the prompt (only the pages after
  // it moved; the prefix pages kept decode's own bytes).
  uint64_t verified_prefix_requests = 0;
  // Pull: pages of failed requests that KVReceiver::InvalidPages() left out (every read of them
  // completed: an engine may keep them), each checked to hold its tokens' bytes (a wrong one is
  // bad_bytes).
  uint64_t verified_kept_pages = 0;
  uint64_t harness_errors = 0;  // ERROR lines from the peers (API calls refused)
  // Page reuse: failed requests whose pages decode's engine held aside until pdlib said no late
  // write could land (QUARANTINE lines), the pages they held, the most held at once by one
  // decode process, and the longest hold.
  // KV integrity (--checksum, --corrupt_in_flight_one_in): rooms pdlib's failure injection
  // corrupted in flight (stage `corrupt`, counted by the processes: a killed process's last
  // count), and rooms decode failed with a KV checksum mismatch. With no other fault the two
  // must be equal; a corrupted room never reaches Success with its bytes (bad_bytes).
  uint64_t corruptions_injected = 0;
  uint64_t corruptions_caught = 0;
  uint64_t quarantined_requests = 0;
  uint64_t quarantined_pages = 0;
  uint64_t quarantine_peak_pages = 0;
  int64_t quarantine_max_hold_ms = 0;
  // The slowest room hit by a fault: from the first kill, freeze or crash of its prefill or
  // decode process during its life to the moment both sides were terminal.
  int64_t max_fault_to_terminal_ms = 0;
  int64_t hang_bound_ms = 0;
  double seconds = 0;
  std::map<std::string, uint64_t> failure_reasons;  // status code name or what happened
  // "kill_prefill", "stop_decode", "partition_decode", "loss_prefill", "bandwidth_decode",
  // "latency_prefill", "bootstrap_restart", "etcd_member"
  std::map<std::string, uint64_t> faults_by_kind;
  std::map<std::string, uint64_t> leaked_by_kind;  // "rooms", "handles", "connections", ...
  std::vector<std::string> problems;               // one line per hung room, crash, leak...

  void Add(const Tally& other);
  // True when nothing the run must never see happened.
  bool Clean() const;
};

struct Report {
  std::string backend;
  std::string transport;  // ucx.tls / UCX_TLS, or the backend name
  bool bytes_checked = false;
  uint64_t seed = 0;
  bool netns = false;                   // each process on a host (network namespace) of its own
  int rails = 1;                        // with netns: links between each pair of hosts
  std::string discovery = "bootstrap";  // or "etcd"
  std::string direction = "push";       // or "pull" (KVManagerOptions::direction)
  // Fault kinds asked for but not injected here, with the reason (latency: no sch_netem).
  std::map<std::string, std::string> skipped_faults;
  Tally total;
  std::map<std::string, Tally> by_topology;  // "1p1d", "2p2d"
};

// True when a child's log shows the abort of UCX 1.13.x in ucp_request_send_state_ff: a wireup
// message (REQ/REP) still pending on a tcp endpoint that fails because its peer died mid-connect
// trips an assertion that upstream removed (openucx/ucx#8175, UCX 1.14).
bool IsKnownUcxAbort(std::string_view log);

// One JSON object on one line.
std::string RenderJson(const Report& report);
// A few lines for people.
std::string RenderSummary(const Report& report);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_REPORT_H_
