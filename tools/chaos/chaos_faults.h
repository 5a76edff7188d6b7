// The faults pdlib-chaos injects, as pure functions: which kinds a --faults list names, the
// random parameters of one fault, and whether a fault touched a request (the requests no fault
// touched must all succeed). No I/O, no clocks of its own: the driver passes time points in.
//
// Kinds, by what they hit:
// - a process slot: kill (SIGKILL, restarted after 50..500 ms), stop (SIGSTOP, SIGCONT later);
// - a host's link (needs --netns): partition (every packet dropped, then healed), loss (1-10%
//   of packets each way), bandwidth (a 50-500 Mbit/s cap), latency (1-50 ms with jitter; needs
//   the kernel's sch_netem, skipped with the reason where it is missing);
// - discovery, every process at once: bootstrap_restart (the bootstrap server is destroyed and
//   started again on the same port: it has forgotten every registration), etcd_member (one of
//   the etcd members is killed, then started again with its data);
// - one rail of a host's links (needs --netns and --rails 2 or more, issue #31): rail, that
//   rail partitioned (two in three) or capped at 50-500 Mbit/s, the host's other rails left
//   alone.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_FAULTS_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_FAULTS_H_

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib_chaos {

enum class FaultKind {
  kKill,
  kStop,
  kPartition,
  kLoss,
  kBandwidth,
  kLatency,
  kBootstrapRestart,
  kEtcdMember,
  kRail,
};

// "kill", "stop", "partition", "loss", "bandwidth", "latency", "bootstrap_restart",
// "etcd_member", "rail".
std::string_view FaultKindName(FaultKind kind);

// What a kind hits.
bool IsProcessFault(FaultKind kind);    // kill, stop
bool IsLinkFault(FaultKind kind);       // partition, loss, bandwidth, latency, rail: --netns
bool IsDiscoveryFault(FaultKind kind);  // bootstrap_restart, etcd_member

// The kinds a --faults value names, in the order above without repeats. A comma list of
//   process   = kill,stop
//   network   = partition,loss,bandwidth,latency and the discovery's own fault:
//               bootstrap_restart (bootstrap server) or etcd_member (etcd)
//   rail      = rail (not part of network: it needs --rails)
//   a kind's name, or none (nothing: only requests).
// `etcd` says which discovery runs. On bad input, returns false with `*error` naming the word
// and what is accepted: an unknown word, none beside another word, bootstrap_restart with etcd,
// etcd_member without it.
bool ParseFaultKinds(std::string_view text, bool etcd, std::vector<FaultKind>* kinds,
                     std::string* error);

// Means of the random durations (each drawn uniform in [0.5, 1.5] x its mean), in ms.
struct FaultTimes {
  int64_t stop_ms = 1500;            // a freeze
  int64_t partition_ms = 2000;       // a partition, until the heal
  int64_t link_ms = 2000;            // loss, bandwidth cap or latency, until cleared
  int64_t discovery_down_ms = 1000;  // the bootstrap server or an etcd member down
};

// One fault's random parameters, drawn for its kind (fields the kind does not use stay 0).
struct FaultParams {
  int64_t duration_ms = 0;  // until SIGCONT, heal, clear or restart; kill: the restart delay
  int loss_percent = 0;     // loss: 1..10
  int rate_mbit = 0;        // bandwidth: 50..500
  int delay_ms = 0;         // latency: 1..50
  int jitter_ms = 0;        // latency: 0..delay_ms / 2
  int rail = 0;             // rail: which one (0 .. rails - 1)
};

// Draws the parameters of a fault of `kind` from `rng`; `rails`: the links between hosts.
FaultParams DrawFaultParams(FaultKind kind, const FaultTimes& times, std::mt19937_64& rng,
                            int rails = 1);

// "partition 1830 ms", "loss 7% for 2100 ms", "latency 23+-9 ms for 1500 ms",
// "rail 1 partition for 900 ms", "rail 0 200 Mbit/s for 2000 ms", ...
std::string DescribeFault(FaultKind kind, const FaultParams& params);

// When a fault was in effect: from its injection to its end (heal, SIGCONT, the READY of the
// restarted process, the discovery back). `end` is max() while it lasts.
struct FaultWindow {
  std::chrono::steady_clock::time_point begin{};
  std::chrono::steady_clock::time_point end = std::chrono::steady_clock::time_point::max();
  std::string what;  // "partition of decode0", for messages
};

// True when `window`, widened by `settle` after its end (the fault's after-effects: a stream
// whose keepalive was lost during a partition breaks up to a liveness timeout after the heal),
// overlaps a request that lived from `start` to `finish`.
bool Touches(const FaultWindow& window, std::chrono::steady_clock::time_point start,
             std::chrono::steady_clock::time_point finish,
             std::chrono::steady_clock::duration settle);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_FAULTS_H_
