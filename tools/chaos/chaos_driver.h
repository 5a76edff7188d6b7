// The pdlib-chaos driver: runs one topology (1P1D or 2P2D) of prefill and decode processes
// against a bootstrap server it hosts, starts requests on them, kills (SIGKILL) and freezes
// (SIGSTOP, later SIGCONT) them at random moments, restarts the killed ones, and accounts for
// every request: its outcome on both sides, whether it ended within the hang bound, and whether
// the bytes decode received are the request's. At the end it quiesces the processes, runs one
// probe request per (prefill, decode) pair, and reads every process's metrics for leftovers.
//
// Never blocks on a child: one poll() loop over every pipe, with timeouts on every wait.
// Threads: RunTopology runs on the calling thread (gRPC's own threads serve the bootstrap).
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_

#include <cstdint>
#include <string>

#include "tools/chaos/chaos_peer.h"
#include "tools/chaos/chaos_report.h"

namespace pdlib_chaos {

struct ChaosOptions {
  uint64_t requests = 1000;  // per topology, as split by the caller
  uint64_t seed = 1;
  int64_t fault_interval_ms = 700;  // mean time between faults (each uniform in [0.5, 1.5] x)
  bool kill_faults = true;          // SIGKILL, then a restart after 50..500 ms
  bool stop_faults = true;          // SIGSTOP for a uniform [0.5, 1.5] x stop_ms, then SIGCONT
  int64_t stop_ms = 1500;
  int64_t hang_bound_ms = 0;  // 0: DerivedHangBound(peer)
  double rate = 50;           // requests started per second; 0: as fast as the window allows
  bool verbose = false;
  std::string log_dir;  // where the children's stderr goes (one file per process generation)
  // Shape, backend and timeouts of every peer; mode, bootstrap port and DP rank are set here.
  PeerConfig peer;
};

// The longest a room may take to become terminal after its start or a fault event, by the
// timeouts pdlib promises: bootstrap + waiting + transfer (a room can pass through all three
// states) + liveness (detection of a frozen peer) + 2 s of scheduling slack.
int64_t DerivedHangBound(const PeerConfig& peer);

// Runs `requests` requests over `prefills` prefill (DP ranks of one deployment) and `decodes`
// decode processes. `name` ("1p1d") labels the output; `room_base` keeps rooms unique across
// topologies. Setup errors (a child that never starts) are returned in `*error`.
Tally RunTopology(const ChaosOptions& options, const std::string& name, int prefills, int decodes,
                  uint64_t requests, uint64_t room_base, std::string* error);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_DRIVER_H_
