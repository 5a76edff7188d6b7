// pdlib-chaos: requests between real prefill and decode processes while faults hit them at
// random moments: processes killed (SIGKILL, then restarted) and frozen (SIGSTOP/SIGCONT); with
// --netns, each process on a host (network namespace) of its own whose link is partitioned,
// loses packets, is capped or delayed; and the discovery restarted (the bootstrap server) or a
// member of it killed (etcd). Every request carries two state families (a mamba slot and swa
// window pages, --state-families) and a share of them a decode prefix (--prefix-share): decode
// hands over only the pages after the prefix and its prefix pages must never be written. Every
// request must end (no hang), every Success must carry the request's bytes (KV after the prefix,
// state and aux), every request no fault touched must succeed, and nothing may be left held at
// the end.
//
//   pdlib-chaos [--requests N] [--topology 1p1d|2p2d|both] [--seed S] [--rate R]
//       [--faults process,network | kill,stop,partition,loss,bandwidth,latency,
//                 bootstrap_restart,etcd_member,rail | none]
//       [--netns] [--rails N] [--discovery bootstrap|etcd] [--fault_interval_ms MS] [--stop_ms MS]
//       [--partition_ms MS] [--link_fault_ms MS] [--discovery_down_ms MS] [--settle_ms MS]
//       [--hang_bound_ms MS] [--backend ucx|fake] [--backend_option KEY=VALUE]...
//       [--prefix_share 0..1] [--state_families mamba,swa,c128_state | none]
//       [--direction push|pull] [--pull_lease_ms MS]
//       [--json] [--verbose] [--log_dir DIR] [--min_faults N] [...]  (--help lists all)
//
//   e.g.  UCX_TLS=shm pdlib-chaos --requests 1000 --json
//         pdlib-chaos --direction pull --requests 1000 --backend-option ucx.tls=shm
//         pdlib-chaos --netns --requests 1000 --faults network,process
//         pdlib-chaos --netns --discovery etcd --faults network,process --topology 2p2d
//         pdlib-chaos --netns --rails 2 --faults network,process,rail --topology 2p2d
//
// The driver hosts the bootstrap server (or starts 3 etcd members) and starts this binary again
// as each prefill and decode process (chaos_peer.h); 2p2d is two prefill DP ranks of one
// deployment and two decode processes, a request going to one of each (room % 2 picks the
// prefill). With --netns UCX runs over tcp on each host's eth0 (with --rails N, striped over
// eth0 ... eth<N-1>: ucx.rails). See chaos_driver.h for what is
// counted and chaos_report.h for the figures. Exit status: 0 when hung, bad_bytes,
// stale_writes, leaked, crashes, unclean exits, restart failures, failed probes, failed
// untouched requests and fault errors are all 0 (and faults >= --min-faults); 1 otherwise; 2 on
// bad usage; 3 when a process could not be started; 5 when this machine cannot give what was
// asked (--netns without root or network namespaces, --discovery etcd without etcd), with the
// reason on stderr.
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "pdlib/pdlib.h"
#include "tools/chaos/chaos_driver.h"
#include "tools/chaos/chaos_faults.h"
#include "tools/chaos/chaos_infra.h"
#include "tools/chaos/chaos_pattern.h"
#include "tools/chaos/chaos_peer.h"
#include "tools/chaos/chaos_report.h"
#include "tools/common/flags.h"
#include "tools/netns/netns_cluster.h"

// ThreadSanitizer builds: Debian's gRPC, protobuf and Abseil are not instrumented. Weak, so a
// definition elsewhere wins; TSAN_OPTIONS from the environment still applies on top.
#if defined(__SANITIZE_THREAD__)
extern "C" __attribute__((weak, visibility("default"))) const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1:suppressions=" PDLIB_TSAN_SUPPRESSIONS;
}
#endif

ABSL_FLAG(uint64_t, requests, 1000, "requests in all (split between topologies)");
ABSL_FLAG(std::string, topology, "both", "1p1d, 2p2d or both");
ABSL_FLAG(uint64_t, seed, 1, "seeds the fault schedule and the routing");
ABSL_FLAG(uint64_t, rate, 50, "requests started per second, 0: unpaced");
ABSL_FLAG(uint64_t, concurrency, 16, "requests in flight per process at most");
ABSL_FLAG(int64_t, fault_interval_ms, 700,
          "mean time between faults, each uniform in [MS/2, 3MS/2]; >= 10");
ABSL_FLAG(std::string, faults, "",
          "what to inject, a comma list: process (= kill,stop), network (= partition,loss,"
          "bandwidth,latency and bootstrap_restart or, with --discovery etcd, etcd_member), or "
          "single kinds; none: no faults (\"\": process, or --fault_kinds)");
ABSL_FLAG(std::string, fault_kinds, "",
          "the older name of --faults (kill,stop | kill | stop | none); give one of the two");
ABSL_FLAG(int32_t, rails, 1,
          "with --netns: N links (rails) between each pair of hosts, eth0 ... eth<N-1>, each a "
          "subnet of its own; the ucx backend stripes over them (ucx.rails) and the rail fault "
          "(--faults rail) partitions or caps one of them (1 to 8)");
ABSL_FLAG(bool, netns, false,
          "each prefill and decode process on a host (network namespace) of its own, UCX over "
          "tcp on eth0; needs root (exit 5 with the reason where it cannot run); link faults "
          "need it");
ABSL_FLAG(std::string, discovery, "bootstrap",
          "bootstrap (a bootstrap server in the driver) or etcd (3 etcd members)");
ABSL_FLAG(int64_t, stop_ms, 1500, "mean freeze, each uniform in [MS/2, 3MS/2]");
ABSL_FLAG(int64_t, partition_ms, 2000, "mean partition until its heal, uniform in [MS/2, 3MS/2]");
ABSL_FLAG(int64_t, link_fault_ms, 2000,
          "mean loss (1-10%), bandwidth cap (50-500 Mbit/s) or latency (1-50 ms, jitter up to "
          "half) on a link, uniform in [MS/2, 3MS/2]");
ABSL_FLAG(int64_t, discovery_down_ms, 1000,
          "mean time the bootstrap server or a killed etcd member stays down");
ABSL_FLAG(int64_t, settle_ms, 0,
          "a fault that ended less than this long before a request started still counts as "
          "touching it (after-effects); requests no fault touched must succeed (0: the liveness "
          "timeout)");
ABSL_FLAG(int64_t, hang_bound_ms, 0,
          "a room must be terminal this long after its start or the last fault event (start or "
          "end) of its processes, their hosts or the discovery (0: bootstrap + waiting + "
          "transfer + liveness timeouts (+ the pull lease in pull) + 2000)");
ABSL_FLAG(std::string, backend, "ucx", "ucx or fake (moves no bytes: bytes are not checked)");
ABSL_FLAG(pdlib_tools::Repeated, backend_option, {},
          "a KVManagerOptions::backend_options entry K=V, repeatable, e.g. ucx.tls=shm");
ABSL_FLAG(std::string, direction, "push",
          "which way KV moves (KVManagerOptions::direction on every process): push (prefill "
          "writes into decode's pages) or pull (decode reads prefill's: prefill publishes every "
          "page of the prompt as it is computed, before decode's TransferInfo in the rooms "
          "whose decode waits (half of them, up to 2 x prefill_ms), decode reads those after "
          "its prefix; a read that lands after decode took its memory back is a "
          "stale write, and a failed room's pages that InvalidPages() leaves out must hold their "
          "bytes). pull needs a backend that can read");
ABSL_FLAG(int64_t, pull_lease_ms, 3000,
          "KVManagerOptions::pull_lease (pull): published pages no decode reads are freed after "
          "this long; >= 1000. Adds to the derived hang bound in pull");
ABSL_FLAG(int64_t, liveness_ms, 1000, "KVManagerOptions::liveness_timeout; >= 1000");
ABSL_FLAG(int64_t, connect_timeout_ms, 2000, "KVManagerOptions::connect_timeout");
ABSL_FLAG(int64_t, bootstrap_timeout_ms, 3000, "KVManagerOptions::bootstrap_timeout");
ABSL_FLAG(int64_t, waiting_timeout_ms, 3000, "KVManagerOptions::waiting_timeout");
ABSL_FLAG(int64_t, transfer_timeout_ms, 3000, "KVManagerOptions::transfer_timeout");
ABSL_FLAG(uint64_t, layers, 2, "layers, a K and a V buffer each");
ABSL_FLAG(uint64_t, item_bytes, 4096, "bytes per KV page and buffer; >= 8");
ABSL_FLAG(uint64_t, max_pages, 8, "pages per request, each request 1..P");
ABSL_FLAG(uint64_t, max_chunks, 3, "Send() calls per request, 1..C");
ABSL_FLAG(int64_t, prefill_ms, 100,
          "mean simulated forward pass per request before its chunks go, uniform in [0, 2MS]");
ABSL_FLAG(bool, json, false, "print one JSON object on stdout (the summary goes to stderr)");
ABSL_FLAG(bool, verbose, false, "print every fault, restart and failed room on stderr");
ABSL_FLAG(std::string, log_dir, "",
          "keep the processes' stderr here (\"\": a temporary directory, removed after a clean "
          "run)");
ABSL_FLAG(uint64_t, min_faults, 0, "exit 1 when fewer than N faults were injected");
ABSL_FLAG(uint64_t, corrupt_kv_one_in, 0,
          "negative control: prefill spoils one KV byte of about one request in N, which must "
          "show up as bad_bytes");
ABSL_FLAG(uint64_t, corrupt_aux_one_in, 0,
          "negative control: prefill spoils one aux value of about one request in N, which must "
          "show up as bad_bytes");
ABSL_FLAG(std::string, checksum, "off",
          "off|sampled|all: KVManagerOptions::checksum on every process (KV integrity)");
ABSL_FLAG(uint64_t, corrupt_in_flight_one_in, 0,
          "pdlib's failure injection stage `corrupt` on every process: about one KV batch in N "
          "lands its bytes shifted (prefill's writes in push, decode's reads in pull), at most "
          "once a room; with --checksum every such room must fail with a KV checksum mismatch "
          "(corruptions_injected == corruptions_caught when no other fault runs), without one it "
          "shows up as bad_bytes");
ABSL_FLAG(uint64_t, corrupt_free_one_in, 0,
          "negative control: decode overwrites a byte of a page it took back from about one "
          "request in N: must show up as stale_writes");
ABSL_FLAG(double, prefix_share, 0.5,
          "decode prefix reuse: the share of requests, in [0, 1], whose decode holds the first "
          "1..all pages of the prompt in its own cache; it hands over only the pages after them, "
          "prefill sends only those (the whole prompt: one empty last chunk with aux and state), "
          "and a write into a prefix page is a stale write");
ABSL_FLAG(std::string, state_families, "mamba,swa",
          "state families every request carries, a comma list of mamba and c128_state (one slot "
          "each) and swa (the window's 1-3 pages, decode's window one page longer or shorter at "
          "times), each a buffer per layer in a pool of its own; none: no state");
ABSL_FLAG(uint64_t, corrupt_state_one_in, 0,
          "negative control: prefill spoils one state byte of about one request in N, which must "
          "show up as bad_bytes");
ABSL_FLAG(uint64_t, corrupt_prefix_one_in, 0,
          "negative control: decode overwrites a byte of its own prefix pages of about one "
          "request in N that has a prefix: must show up as stale_writes");
ABSL_FLAG(uint64_t, ignore_prefix_one_in, 0,
          "negative control: prefill ignores decode's prefix in about one request in N, sending "
          "as many pages from the start of the prompt (pull: publishing position i - prefix in "
          "page i, what a decode that ignored its prefix would read): bad_bytes where the "
          "request has a prefix");
ABSL_FLAG(bool, no_verify, false, "internal: decode does not check bytes");
ABSL_FLAG(std::string, role, "", "internal: prefill or decode, in a process the driver started");
ABSL_FLAG(uint64_t, bootstrap_port, 0, "internal: the driver's bootstrap port");
ABSL_FLAG(std::string, bootstrap_host, "127.0.0.1", "internal: the driver's bootstrap host");
ABSL_FLAG(std::string, listen_host, "127.0.0.1", "internal: where this process listens");
ABSL_FLAG(std::string, etcd_endpoints, "", "internal: etcd's client endpoints, host:port,...");
ABSL_FLAG(uint64_t, dp_size, 1, "internal: the prefill deployment's DP size");
ABSL_FLAG(uint64_t, dp_rank, 0, "internal: this prefill process's DP rank");
ABSL_FLAG(int64_t, max_seconds, 900, "internal: a process exits after this long");

namespace pdlib_chaos {
namespace {

constexpr char kUsage[] =
    "usage: pdlib-chaos [flags]\n"
    "\n"
    "Runs requests between prefill and decode processes while faults hit them at random\n"
    "moments: kills (SIGKILL, then a restart) and freezes (SIGSTOP/SIGCONT) of processes\n"
    "(--faults process); with --netns each process runs on a host (network namespace) of its\n"
    "own, and --faults network partitions a host, makes it lose 1-10% of its packets, caps its\n"
    "bandwidth at 50-500 Mbit/s or delays it by 1-50 ms (where the kernel has sch_netem; else\n"
    "skipped with the reason), each for a while and then heals it, and restarts the bootstrap\n"
    "server (or, with --discovery etcd, kills an etcd member and starts it again). Every\n"
    "request carries the state families of --state-families (default a mamba slot and swa\n"
    "window pages, each in a pool of its own) and, with probability --prefix-share (default\n"
    "0.5), a decode prefix: decode holds the first pages of the prompt and hands over only the\n"
    "pages after them, which prefill alone sends (--direction pull: decode reads instead;\n"
    "prefill publishes every page, decode reads those after its prefix). Checks that every\n"
    "request ends within the hang bound, that every Success carries the request's bytes (KV after "
    "the prefix, state,\n"
    "aux), that nothing writes into decode's free pages, state items and slots or into its\n"
    "prefix pages, that every request no fault touched succeeds (those after a heal), and that\n"
    "nothing is left held; prints RESULT: CLEAN or RESULT: NOT CLEAN.\n"
    "\n"
    "  e.g. pdlib-chaos --netns --requests 1000 --faults network,process\n"
    "\n"
    "Exit status: 0 clean; 1 not clean; 2 bad usage; 3 a process could not be started; 5 this\n"
    "machine cannot run what was asked (--netns without root or network namespaces, etcd not\n"
    "installed), with the reason. Flags marked internal are the driver's to the processes it\n"
    "starts.\n";

// Exit status when this machine cannot give what the flags ask (see kUsage).
constexpr int kExitCannotRunHere = 5;

struct Flags {
  uint64_t requests = 1000;
  std::string topology = "both";
  bool json = false;
  uint64_t min_faults = 0;
  std::string role;  // internal: "prefill" or "decode" in the child processes
  ChaosOptions chaos;
};

// Parses and checks the flags; prints why (naming the flag) and returns false on bad input.
bool ParseFlags(int argc, char** argv, Flags* f) {
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage, {}, {"backend_option"});
  auto bad = [](const char* flag, const std::string& value) {
    std::fprintf(stderr, "pdlib-chaos: bad value '%s' for --%s (see --help)\n", value.c_str(),
                 flag);
    return false;
  };
  ChaosOptions& c = f->chaos;
  PeerConfig& p = c.peer;
  f->role = absl::GetFlag(FLAGS_role);
  if (!f->role.empty() && f->role != "prefill" && f->role != "decode") return bad("role", f->role);
  f->json = absl::GetFlag(FLAGS_json);
  c.verbose = absl::GetFlag(FLAGS_verbose);
  p.verify = !absl::GetFlag(FLAGS_no_verify);
  f->requests = absl::GetFlag(FLAGS_requests);
  if (f->requests == 0) return bad("requests", "0");
  f->topology = absl::GetFlag(FLAGS_topology);
  if (f->topology != "1p1d" && f->topology != "2p2d" && f->topology != "both") {
    return bad("topology", f->topology);
  }
  c.seed = absl::GetFlag(FLAGS_seed);
  c.rate = double(absl::GetFlag(FLAGS_rate));
  c.netns = absl::GetFlag(FLAGS_netns);
  c.rails = absl::GetFlag(FLAGS_rails);
  if (c.rails < 1 || c.rails > 8) return bad("rails", std::to_string(c.rails));
  if (c.rails > 1 && !c.netns && f->role.empty()) {
    std::fprintf(stderr, "pdlib-chaos: --rails %d needs --netns (rails are links between hosts)\n",
                 c.rails);
    return false;
  }
  const std::string discovery = absl::GetFlag(FLAGS_discovery);
  if (discovery != "bootstrap" && discovery != "etcd") return bad("discovery", discovery);
  c.etcd = discovery == "etcd";
  const std::string faults = absl::GetFlag(FLAGS_faults);
  const std::string fault_kinds = absl::GetFlag(FLAGS_fault_kinds);
  if (!faults.empty() && !fault_kinds.empty()) {
    std::fprintf(stderr, "pdlib-chaos: give --faults or its older name --fault_kinds, not both\n");
    return false;
  }
  const std::string kinds = !faults.empty()       ? faults
                            : fault_kinds.empty() ? "process"
                                                  : fault_kinds;
  if (std::string why; !ParseFaultKinds(kinds, c.etcd, &c.faults, &why)) {
    std::fprintf(stderr, "pdlib-chaos: --faults %s: %s\n", kinds.c_str(), why.c_str());
    return false;
  }
  if (!c.netns && f->role.empty()) {
    for (FaultKind k : c.faults) {
      if (!IsLinkFault(k)) continue;
      std::fprintf(stderr,
                   "pdlib-chaos: --faults %s: %s needs --netns (hosts in network namespaces)\n",
                   kinds.c_str(), std::string(FaultKindName(k)).c_str());
      return false;
    }
  }
  if (f->role.empty() && c.rails < 2 &&
      std::find(c.faults.begin(), c.faults.end(), FaultKind::kRail) != c.faults.end()) {
    std::fprintf(stderr, "pdlib-chaos: --faults %s: rail needs --rails 2 or more\n", kinds.c_str());
    return false;
  }
  p.backend = absl::GetFlag(FLAGS_backend);
  if (p.backend.empty()) return bad("backend", "");
  const std::string direction = absl::GetFlag(FLAGS_direction);
  if (direction != "push" && direction != "pull") return bad("direction", direction);
  p.direction =
      direction == "pull" ? pdlib::TransferDirection::kPull : pdlib::TransferDirection::kPush;
  for (const std::string& kv : absl::GetFlag(FLAGS_backend_option).values) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) return bad("backend_option", kv);
    p.backend_options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  c.log_dir = absl::GetFlag(FLAGS_log_dir);
  f->min_faults = absl::GetFlag(FLAGS_min_faults);
  p.corrupt_kv_one_in = absl::GetFlag(FLAGS_corrupt_kv_one_in);
  p.corrupt_aux_one_in = absl::GetFlag(FLAGS_corrupt_aux_one_in);
  p.corrupt_free_one_in = absl::GetFlag(FLAGS_corrupt_free_one_in);
  p.corrupt_in_flight_one_in = absl::GetFlag(FLAGS_corrupt_in_flight_one_in);
  {
    const std::string checksum = absl::GetFlag(FLAGS_checksum);
    if (checksum == "off") {
      p.checksum = pdlib::KvChecksum::kOff;
    } else if (checksum == "sampled") {
      p.checksum = pdlib::KvChecksum::kSampled;
    } else if (checksum == "all") {
      p.checksum = pdlib::KvChecksum::kAll;
    } else {
      return bad("checksum", checksum);
    }
  }
  p.corrupt_state_one_in = absl::GetFlag(FLAGS_corrupt_state_one_in);
  p.corrupt_prefix_one_in = absl::GetFlag(FLAGS_corrupt_prefix_one_in);
  p.ignore_prefix_one_in = absl::GetFlag(FLAGS_ignore_prefix_one_in);
  p.prefix_share = absl::GetFlag(FLAGS_prefix_share);
  if (!(p.prefix_share >= 0 && p.prefix_share <= 1)) {  // NaN too
    return bad("prefix_share", std::to_string(p.prefix_share));
  }
  const std::string families = absl::GetFlag(FLAGS_state_families);
  if (std::string why; !ParseStateFamilies(families, &p.state_families, &why)) {
    std::fprintf(stderr, "pdlib-chaos: --state-families %s: %s\n", families.c_str(), why.c_str());
    return false;
  }
  if (p.corrupt_state_one_in > 0 && p.state_families.empty()) {
    std::fprintf(stderr, "pdlib-chaos: --corrupt-state-one-in needs a state family\n");
    return false;
  }
  // Durations and sizes, each with its lower bound.
  struct Ms {
    const char* name;
    int64_t value, min;
    int64_t* to;
  };
  for (const Ms& m :
       {Ms{"fault_interval_ms", absl::GetFlag(FLAGS_fault_interval_ms), 10, &c.fault_interval_ms},
        Ms{"stop_ms", absl::GetFlag(FLAGS_stop_ms), 1, &c.times.stop_ms},
        Ms{"partition_ms", absl::GetFlag(FLAGS_partition_ms), 1, &c.times.partition_ms},
        Ms{"link_fault_ms", absl::GetFlag(FLAGS_link_fault_ms), 1, &c.times.link_ms},
        Ms{"discovery_down_ms", absl::GetFlag(FLAGS_discovery_down_ms), 1,
           &c.times.discovery_down_ms},
        Ms{"settle_ms", absl::GetFlag(FLAGS_settle_ms), 0, &c.settle_ms},
        Ms{"hang_bound_ms", absl::GetFlag(FLAGS_hang_bound_ms), 0, &c.hang_bound_ms},
        Ms{"liveness_ms", absl::GetFlag(FLAGS_liveness_ms), 1000, &p.liveness_ms},
        Ms{"pull_lease_ms", absl::GetFlag(FLAGS_pull_lease_ms), 1000, &p.pull_lease_ms},
        Ms{"connect_timeout_ms", absl::GetFlag(FLAGS_connect_timeout_ms), 1, &p.connect_ms},
        Ms{"bootstrap_timeout_ms", absl::GetFlag(FLAGS_bootstrap_timeout_ms), 1, &p.bootstrap_ms},
        Ms{"waiting_timeout_ms", absl::GetFlag(FLAGS_waiting_timeout_ms), 1, &p.waiting_ms},
        Ms{"transfer_timeout_ms", absl::GetFlag(FLAGS_transfer_timeout_ms), 1, &p.transfer_ms},
        Ms{"prefill_ms", absl::GetFlag(FLAGS_prefill_ms), 0, &p.prefill_ms},
        Ms{"max_seconds", absl::GetFlag(FLAGS_max_seconds), 1, &p.max_seconds}}) {
    if (m.value < m.min) return bad(m.name, std::to_string(m.value));
    *m.to = m.value;
  }
  struct Size {
    const char* name;
    uint64_t value, min;
    size_t* to;
  };
  for (const Size& z : {Size{"concurrency", absl::GetFlag(FLAGS_concurrency), 1, &p.concurrency},
                        Size{"layers", absl::GetFlag(FLAGS_layers), 1, &p.layers},
                        Size{"item_bytes", absl::GetFlag(FLAGS_item_bytes), 8, &p.item_bytes},
                        Size{"max_pages", absl::GetFlag(FLAGS_max_pages), 1, &p.max_pages},
                        Size{"max_chunks", absl::GetFlag(FLAGS_max_chunks), 1, &p.max_chunks}}) {
    if (z.value < z.min || z.value > (uint64_t{1} << 30)) {
      return bad(z.name, std::to_string(z.value));
    }
    *z.to = size_t(z.value);
  }
  p.mode = f->role == "prefill" ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
  const uint64_t port = absl::GetFlag(FLAGS_bootstrap_port);
  if (!f->role.empty() && (port == 0 || port > 65535))
    return bad("bootstrap_port", std::to_string(port));
  p.bootstrap_port = uint16_t(port);
  p.bootstrap_host = absl::GetFlag(FLAGS_bootstrap_host);
  p.listen_host = absl::GetFlag(FLAGS_listen_host);
  if (p.bootstrap_host.empty()) return bad("bootstrap_host", "");
  if (p.listen_host.empty()) return bad("listen_host", "");
  p.etcd_endpoints.clear();
  if (const std::string e = absl::GetFlag(FLAGS_etcd_endpoints); !e.empty()) {
    for (size_t at = 0; at <= e.size();) {
      const size_t comma = std::min(e.find(',', at), e.size());
      if (comma == at) return bad("etcd_endpoints", e);
      p.etcd_endpoints.push_back(e.substr(at, comma - at));
      at = comma + 1;
    }
  }
  if (!f->role.empty() && c.etcd && p.etcd_endpoints.empty()) return bad("etcd_endpoints", "");
  const uint64_t dp_size = absl::GetFlag(FLAGS_dp_size), dp_rank = absl::GetFlag(FLAGS_dp_rank);
  if (dp_size >= 1024) return bad("dp_size", std::to_string(dp_size));
  if (dp_rank >= 1024) return bad("dp_rank", std::to_string(dp_rank));
  p.dp_size = int32_t(dp_size);
  p.dp_rank = int32_t(dp_rank);
  return true;
}

std::string TransportOf(const PeerConfig& p) {
  if (p.backend != "ucx") return p.backend;
  if (auto it = p.backend_options.find("ucx.tls"); it != p.backend_options.end()) {
    return "ucx.tls=" + it->second;
  }
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr ? std::string("UCX_TLS=") + env : "UCX's choice";
}

int RunDriver(Flags f) {
  ChaosOptions& c = f.chaos;
  const auto known = pdlib::ListBackends();
  if (std::find(known.begin(), known.end(), c.peer.backend) == known.end()) {
    std::string names;
    for (const auto& k : known) names += " " + k;
    std::fprintf(stderr, "pdlib-chaos: backend '%s' is not in this build (known:%s)\n",
                 c.peer.backend.c_str(), names.c_str());
    return 2;
  }
  // The fake backend moves no bytes: there is nothing on decode to check.
  if (c.peer.backend == "fake") c.peer.verify = false;
  InfraOptions io;
  io.netns = c.netns;
  io.etcd = c.etcd;
  io.rails = c.rails;
  if (const std::string why = ChaosInfra::Missing(io, c.faults); !why.empty()) {
    std::fprintf(stderr, "pdlib-chaos: cannot run here: %s\n", why.c_str());
    return kExitCannotRunHere;
  }
  std::map<std::string, std::string> skipped;
  if (c.netns) {
    // Hosts are separate machines to UCX: tcp over their one link, never shm between them.
    if (c.peer.backend == "ucx") {
      c.peer.backend_options["ucx.tls"] = "tcp";
      if (c.rails > 1) {
        std::string rails;
        for (int r = 0; r < c.rails; ++r) {
          rails += (r == 0 ? "" : ",") + pdlib_tools::RailInterface(r);
        }
        c.peer.backend_options["ucx.rails"] = rails;
      } else {
        c.peer.backend_options["ucx.net_devices"] = "eth0";
      }
    }
    // What crashed runs left behind (only theirs: names carry the dead pid).
    if (auto removed = pdlib_tools::NetnsCluster::CleanupStale(); !removed.ok()) {
      std::fprintf(stderr, "pdlib-chaos: cleaning up after earlier runs: %s\n",
                   removed.status().ToString().c_str());
    }
    if (std::find(c.faults.begin(), c.faults.end(), FaultKind::kLatency) != c.faults.end()) {
      c.latency_skipped = ChaosInfra::LatencyMissing();
      if (!c.latency_skipped.empty()) {
        std::fprintf(stderr, "pdlib-chaos: skipping latency faults: %s\n",
                     c.latency_skipped.c_str());
        skipped["latency"] = c.latency_skipped;
      }
    }
  }
  const double paced_s = c.rate > 0 ? double(f.requests) / c.rate : double(f.requests) * 0.05;
  c.peer.max_seconds = int64_t(paced_s * 4) + 600;

  const bool own_log_dir = c.log_dir.empty();
  if (own_log_dir) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != 0 ? tmp : "/tmp") + "/pdlib-chaos-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("pdlib-chaos: mkdtemp");
      return 3;
    }
    c.log_dir = pattern;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(c.log_dir, ec);
  }

  struct Plan {
    std::string name;
    int prefills, decodes;
    uint64_t requests;
  };
  std::vector<Plan> plans;
  if (f.topology == "1p1d") plans.push_back({"1p1d", 1, 1, f.requests});
  if (f.topology == "2p2d") plans.push_back({"2p2d", 2, 2, f.requests});
  if (f.topology == "both") {
    plans.push_back({"1p1d", 1, 1, f.requests / 2});
    plans.push_back({"2p2d", 2, 2, f.requests - f.requests / 2});
  }

  Report report;
  report.backend = c.peer.backend;
  report.transport = TransportOf(c.peer);
  report.bytes_checked = c.peer.verify;
  report.seed = c.seed;
  report.netns = c.netns;
  report.rails = c.rails;
  report.discovery = c.etcd ? "etcd" : "bootstrap";
  report.direction = std::string(pdlib::TransferDirectionName(c.peer.direction));
  report.skipped_faults = skipped;
  for (size_t k = 0; k < plans.size(); ++k) {
    const Plan& plan = plans[k];
    if (plan.requests == 0) continue;
    // Rooms random-looking and unique across topologies; even, so room % 2 is the DP rank.
    const uint64_t base = (Mix(c.seed * 31 + k) >> 3) & ~uint64_t{0xfffff};
    std::string error;
    Tally t = RunTopology(c, plan.name, plan.prefills, plan.decodes, plan.requests, base, &error);
    if (!error.empty()) {
      std::fprintf(stderr, "pdlib-chaos: %s: %s\nlogs kept in %s\n", plan.name.c_str(),
                   error.c_str(), c.log_dir.c_str());
      return 3;
    }
    report.total.Add(t);
    report.by_topology[plan.name] = std::move(t);
  }

  const Tally& t = report.total;
  const bool clean = t.Clean() && t.faults >= f.min_faults;
  std::fputs(RenderSummary(report).c_str(), f.json ? stderr : stdout);
  if (t.faults < f.min_faults) {
    std::fprintf(stderr, "pdlib-chaos: %llu faults, fewer than --min-faults %llu\n",
                 static_cast<unsigned long long>(t.faults),
                 static_cast<unsigned long long>(f.min_faults));
  }
  if (f.json) std::printf("%s\n", RenderJson(report).c_str());
  std::fflush(stdout);
  if (clean && own_log_dir) {
    std::error_code ec;
    std::filesystem::remove_all(c.log_dir, ec);
  } else {
    std::fprintf(stderr, "pdlib-chaos: the processes' logs are in %s\n", c.log_dir.c_str());
  }
  return clean ? 0 : 1;
}

}  // namespace
}  // namespace pdlib_chaos

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a dead child's stdin must not kill the driver
  pdlib_chaos::Flags flags;
  if (!pdlib_chaos::ParseFlags(argc, argv, &flags)) return 2;
  if (flags.role.empty()) return pdlib_chaos::RunDriver(std::move(flags));
  // A peer process: die with the driver, even when the driver is killed itself.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 4;
  return pdlib_chaos::RunPeer(flags.chaos.peer);
}
