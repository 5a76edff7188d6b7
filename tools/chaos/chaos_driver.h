// The pdlib-chaos driver: runs one topology (1P1D or 2P2D) of prefill and decode processes
// that find each other through a bootstrap server the driver hosts or through etcd
// (chaos_infra.h), each on a host (network namespace) of its own with --netns; starts requests
// on them and injects faults at random moments (chaos_faults.h): kills (SIGKILL, then a
// restart) and freezes (SIGSTOP, later SIGCONT) of processes, partitions, packet loss,
// bandwidth caps and latency on a host's link, and outages of the discovery (the bootstrap
// server restarted, an etcd member killed and restarted). It accounts for every request: its
// outcome on both sides, whether it ended within the hang bound, whether the bytes decode
// received are the request's, and whether a request that no fault touched failed. At the end
// it ends every fault, quiesces the processes, runs one probe request per (prefill, decode)
// pair, and reads every process's metrics for leftovers.
//
// Never blocks on a child: one poll() loop over every pipe, with timeouts on every wait.
// Threads: RunTopology runs on the calling thread (gRPC's own threads serve the bootstrap).
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tools/chaos/chaos_faults.h"
#include "tools/chaos/chaos_peer.h"
#include "tools/chaos/chaos_report.h"

namespace pdlib_chaos {

struct ChaosOptions {
  uint64_t requests = 1000;  // per topology, as split by the caller
  uint64_t seed = 1;
  int64_t fault_interval_ms = 700;  // mean time between faults (each uniform in [0.5, 1.5] x)
  // What to inject, one kind per fault, drawn uniformly among those that have a target then
  // (chaos_faults.h). Link faults need `netns`.
  std::vector<FaultKind> faults = {FaultKind::kKill, FaultKind::kStop};
  FaultTimes times;  // mean durations of freezes, partitions, link faults, discovery outages
  // Latency faults are skipped here, for this reason (the kernel has no sch_netem); "" : not.
  std::string latency_skipped;
  bool netns = false;  // every process slot on a host (network namespace) of its own
  int rails = 1;       // with netns: links between each pair of hosts (ucx.rails over them)
  bool etcd = false;   // discovery through 3 etcd members instead of the bootstrap server
  // A request counts as touched by a fault that ended less than this long before it started
  // (the fault's after-effects); 0: DerivedSettle(peer).
  int64_t settle_ms = 0;
  int64_t hang_bound_ms = 0;  // 0: DerivedHangBound(peer)
  double rate = 50;           // requests started per second; 0: as fast as the window allows
  bool verbose = false;
  std::string log_dir;  // where the children's stderr goes (one file per process generation)
  // Shape, backend and timeouts of every peer; mode, addresses and DP rank are set here.
  PeerConfig peer;
};

// The longest a room may take to become terminal after its start or a fault event, by the
// timeouts pdlib promises: bootstrap + waiting + transfer (a room can pass through all three
// states) + liveness (detection of a frozen peer) + in pull the lease (a published room no
// decode reads) + 2 s of scheduling slack.
int64_t DerivedHangBound(const PeerConfig& peer);

// How long after a fault ended its after-effects may still fail a request that started then:
// a stream whose keepalive went unanswered during the fault breaks up to a liveness timeout
// later. (Runs with 1 ms instead, seeds 1-5 with every fault kind, failed no untouched
// request: this is a margin, not a need.)
int64_t DerivedSettle(const PeerConfig& peer);

// Runs `requests` requests over `prefills` prefill (DP ranks of one deployment) and `decodes`
// decode processes. `name` ("1p1d") labels the output; `room_base` keeps rooms unique across
// topologies. Setup errors (a child that never starts) are returned in `*error`.
Tally RunTopology(const ChaosOptions& options, const std::string& name, int prefills, int decodes,
                  uint64_t requests, uint64_t room_base, std::string* error);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_
